"""Model families for routing: a Hugging Face config -> RouterSpec, read from the one family table.

The rules live in `moeflow.routing.rules`; which model type uses which rule is one
record each in `moeflow.families` (the only module that knows model names).
"""

from __future__ import annotations

from typing import Any

from ..families import ROUTER_MODEL_TYPES, family_for
from .rules import text_config
from .spec import RouterSpec

__all__ = ["SUPPORTED_FAMILIES", "family_of", "router_spec_from_hf", "text_config"]

SUPPORTED_FAMILIES: tuple[str, ...] = ROUTER_MODEL_TYPES


def family_of(config: Any) -> str:
    """The HF model_type, unwrapping kimi_k25 (a DeepSeek-V3 text model inside)."""
    model_type = getattr(config, "model_type", None)
    if model_type == "kimi_k25":
        text = text_config(config)
        if text is config:
            raise ValueError("config.text_config=None: a kimi_k25 config wraps its MoE text model in text_config")
        return family_of(text)
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"config.model_type={model_type!r} is not a supported MoE family; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return model_type


def router_spec_from_hf(config: Any, layer_idx: int = 0) -> RouterSpec:
    """The RouterSpec of MoE layer `layer_idx` of a Hugging Face config.

    Raises ValueError for an unsupported model_type, listing the supported ones.
    """
    family = family_of(config)
    if family == "kimi_k2" or getattr(config, "model_type", None) == "kimi_k25":
        config = text_config(config)
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or layer_idx < 0:
        raise ValueError(f"layer_idx={layer_idx!r}: expected an int >= 0")
    n_layers = getattr(text_config(config), "num_hidden_layers", None)
    if isinstance(n_layers, int) and not isinstance(n_layers, bool) and layer_idx >= n_layers:
        # Past the last layer a per-layer rule (DeepSeek-V4's hash layers) would silently
        # fall back to its default.
        raise ValueError(f"layer_idx={layer_idx}: expected < config.num_hidden_layers={n_layers} ({family})")
    return family_for(family).router(config, layer_idx)
