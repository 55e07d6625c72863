"""The one check of whether Triton is usable here (installed); the GPU paths ask this, nothing else.

Importing moeflow and the CPU suite must work without Triton (a GPU extra), so no module
imports `triton` at its top level; each fast path asks `triton_available()` first and
falls back to (or refuses with) the torch reference when it says no.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

__all__ = ["triton_available", "interpreted"]


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the triton package is installed (the kernels import it lazily, at launch)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton runs its CPU interpreter (Triton's own knob, `triton.knobs.runtime.interpret`, which
    TRITON_INTERPRET=1 sets); False without Triton."""
    if not triton_available():
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)

