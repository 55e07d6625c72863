"""Per-family checkpoint key adapters, read from the one family table (`moeflow.families`).

The types (Dims, Names, KeyAdapter) are in `moeflow.checkpoint.keys`; each family's
adapter is the `checkpoint` field of its record.
"""

from __future__ import annotations

from ..families import FAMILIES, family_for
from .keys import Dims, KeyAdapter, Names

__all__ = ["CHECKPOINT_FAMILIES", "Dims", "KeyAdapter", "Names", "adapter_for"]

CHECKPOINT_FAMILIES: tuple[str, ...] = tuple(f.name for f in FAMILIES if f.checkpoint is not None)


def adapter_for(family_or_model_type: str) -> KeyAdapter:
    """The KeyAdapter of a family name or HF model_type, or a ValueError listing the known ones."""
    fam = family_for(family_or_model_type, missing_ok=True)
    if fam is None or fam.checkpoint is None:
        known = sorted({n for f in FAMILIES if f.checkpoint is not None for n in (f.name, *f.model_types)})
        raise ValueError(f"family={family_or_model_type!r}: no checkpoint key adapter; known: {', '.join(known)}")
    return fam.checkpoint
