"""Small helpers of the transformers adapter."""

from __future__ import annotations

from typing import Any

__all__ = ["attr_path", "hf_families", "available_hf_families"]


def attr_path(obj: Any, path: str | None) -> Any:
    """obj.a.b.c for path "a.b.c" (None for a None path)."""
    if path is None:
        return None
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def hf_families():
    """The family records (moeflow.families) that have an HF block description."""
    from ..families import FAMILIES

    return tuple(f for f in FAMILIES if f.hf is not None)


def available_hf_families() -> list[str]:
    """Families whose block class the installed transformers has."""
    return [f.name for f in hf_families() if f.hf.block_type() is not None]
