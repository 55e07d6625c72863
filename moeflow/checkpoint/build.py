"""Layers built from a checkpoint: `build_moe_layer` (one device) and `load_ep_layer` (a rank's experts).

Legend: E routed experts, L experts on this rank, H hidden, I intermediate per expert.

Both go through the one `MoELayer` constructor; the shared expert is the loader's
`SharedSwiGLU` with the layer's activation (DeepSeek-V4's shared expert clamps like its
routed experts, so an activation "swiglu_clamp" layer gets a clamped shared expert).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..config import MoEConfig
from ..layer import MoELayer
from ..parallel.ep_parts import check_ep_fingerprint, local_source, make_dispatcher
from ..routing.router import RouterWeights
from .loader import LayerWeights, load_moe_layer

__all__ = ["build_moe_layer", "load_ep_layer", "shared_module"]


def shared_module(lw: LayerWeights, config: MoEConfig) -> nn.Module | None:
    """The loaded shared expert as a module with the layer's activation (None without one)."""
    if lw.shared is None:
        return None
    if config.activation == "swiglu_clamp":
        return lw.shared.module("swiglu_clamp", swiglu_limit=config.swiglu_limit)
    if config.activation != "silu":
        raise ValueError(f"shared expert: activation {config.activation!r} has no checkpoint shared-expert module "
                         f"(SiLU or DeepSeek-V4's clamped SiLU); pass shared_expert=")
    return lw.shared.module("silu")


def _router(lw: LayerWeights, config: MoEConfig) -> RouterWeights:
    return RouterWeights(weight_EH=lw.router_weight_EH, router_bias_E=lw.router_bias_E,
                         selection_bias_E=lw.selection_bias_E, expert_scale_E=lw.expert_scale_E,
                         prenorm_weight_H=lw.prenorm_weight_H, hash_table_VK=lw.hash_table_VK,
                         prenorm_eps=config.router_prenorm_eps)


def build_moe_layer(lw: LayerWeights, config: MoEConfig, *, experts_impl: str = "auto",
                    shared_expert: nn.Module | None = None) -> MoELayer:
    """A one-device MoELayer on loaded weights (every expert: `load_moe_layer(..., experts=None)`)."""
    if lw.num_experts != config.num_experts:
        raise ValueError(f"lw: {lw.num_experts} experts loaded, the layer needs all E={config.num_experts}")
    return MoELayer(config, router=_router(lw, config), experts=lw.experts,
                    shared_expert=shared_expert if shared_expert is not None else shared_module(lw, config),
                    shared_gate_weight_1H=lw.shared_gate_weight_1H, experts_impl=experts_impl,
                    layer_idx=lw.layer_idx)


def load_ep_layer(
    src: str | os.PathLike | Any,
    family_or_config: Any,
    layer_idx: int,
    *,
    config: MoEConfig,
    group,
    mode: str = "all_to_all",
    placement: Any = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    experts_impl: str = "auto",
    shared_expert: nn.Module | None = None,
    static_tokens: int | None = None,
    timeout_s: float | None = None,
    check_config: bool = True,
    reduce_dtype: torch.dtype | str | None = None,
    check_inputs: bool | None = None,
) -> MoELayer:
    """Build layer `layer_idx`'s expert-parallel MoELayer reading only this rank's experts.

    src / family_or_config / layer_idx / dtype: as `moeflow.checkpoint.loader.load_moe_layer`.
    config: the layer's MoEConfig (E, K, activation, ...). The router, its biases and the
    shared expert are read whole on every rank; of the routed experts only
    `placement.experts_of(rank)` are read, and the layer's source holds only those (no
    full-size placeholder). shared_expert: a module to use instead of the checkpoint's
    shared expert (families whose shared MLP is not SwiGLU). Collective (the fingerprint
    check), like `moeflow.parallel.ep.shard_layer`, whose other arguments it takes.
    """
    d = make_dispatcher(config, group=group, mode=mode, placement=placement, static_tokens=static_tokens,
                        timeout_s=timeout_s, reduce_dtype=reduce_dtype, check_inputs=check_inputs)
    mine = list(d.local_ids)
    # A rank with no experts still needs the router: read one expert (discarded) since the
    # loader refuses an empty selection.
    lw = load_moe_layer(src, family_or_config, layer_idx, experts=mine or [0], device=device, dtype=dtype)
    source = local_source(d.placement, d.rank, static=static_tokens is not None,
                          local=lw.experts if mine else None)
    layer = MoELayer(config, router=_router(lw, config), experts=source,
                     shared_expert=shared_expert if shared_expert is not None else shared_module(lw, config),
                     shared_gate_weight_1H=lw.shared_gate_weight_1H, dispatcher=d, experts_impl=experts_impl,
                     layer_idx=layer_idx)
    if check_config:
        check_ep_fingerprint(layer)
    return layer
