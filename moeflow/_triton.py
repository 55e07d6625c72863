"""The one check of whether Triton is usable here (installed); the GPU paths ask this, nothing else.

Importing moeflow and the CPU suite must work without Triton (a GPU extra), so no module
imports `triton` at its top level; each fast path asks `triton_available()` first and
falls back to (or refuses with) the torch reference when it says no.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

__all__ = ["triton_available", "INTERPRETED"]

# Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1): read once, as Triton reads it when
# the kernels are decorated (not on every launch: the launch paths are hot).
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the triton package is installed (the kernels import it lazily, at launch)."""
    return importlib.util.find_spec("triton") is not None
