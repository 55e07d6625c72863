"""Expert parallelism for one MoE layer: a dispatcher choice plus a source of the rank's experts.

Legend: B batch, S sequence, T tokens on this rank, H hidden, E routed experts, Z zero
experts, K picks, I intermediate per expert, W ranks, L experts on this rank.

    ep = shard_layer(layer, group=dist.group.WORLD, mode="all_to_all")   # every rank
    y = ep(x)                     # x: this rank's tokens [B, S, H] or [T, H]

`shard_layer` returns a plain `MoELayer` (`layer.replace(...)`) that shares the layer's
router tensors and shared expert, with
    dispatcher  AllToAllDispatcher | AllReduceDispatcher over `group`, and
    source      ResidentExperts holding this rank's experts (views of the layer's range,
                or one index copy), which offload can later swap for its slot cache.
Nothing here wraps or subclasses the layer, so the same forward runs with or without EP.

Modes (see all_to_all.py and all_reduce.py):
    "all_to_all"  each rank routes its own tokens; pairs travel to the experts' ranks and
                  back; the combine runs on the source rank in slot order, so with the
                  reference experts the output is bit-identical to one process running
                  MoELayer on all ranks' tokens concatenated in rank order.
                  `static_tokens=Tm` selects the decode mode (fixed buffers, no host read).
    "all_reduce"  every rank holds the same tokens (checked each call, see all_reduce.py);
                  each computes its experts' pairs and one all_reduce sums (within
                  rounding of the single process).
Both modes run zero experts (w * x on the source / after the reduce) and the shared
expert (added once, after the routed sum, on every rank for its own tokens).

Set-up is collective: sharding all-gathers a small fingerprint of the layer (E, K, Z, H,
I, dtype, activation, layout, mode, placement, ...) and raises EPConfigMismatch naming
the fields the ranks disagree on. Every collective waits at most `timeout_s`
(EPCollectiveError naming the collective past it; the group then refuses every later
call with EPGroupBroken).

Every sharded layer counts its routed pairs per expert on the device (moeflow.parallel.load:
`expert_load(layers)`), what `plan_placement` and `rebalance` (moeflow.parallel.eplb,
moeflow.parallel.rebalancing) place the experts by.

Refused by name: gradients (EP is inference-only), a placement whose world size is not
the group's, an unknown mode, a non-finite timeout.

The parts both EP builders share (make_dispatcher, local_source, check_ep_fingerprint) are
moeflow.parallel.ep_parts; `load_ep_layer` (a rank's layer straight from a checkpoint) is
moeflow.checkpoint.build's, re-exported here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint.build import load_ep_layer
from ..config import ExpertWeights
from .ep_parts import (
    EP_MODES,
    PlacementLike,
    check_ep_fingerprint,
    local_source,
    make_dispatcher,
    resolve_placement,
)
from .load import track_load
from .plan import Placement, contiguous_ranges

__all__ = [
    "EP_MODES",
    "EPMoELayer",
    "shard_layer",
    "load_ep_layer",
    "resolve_placement",
    "make_dispatcher",
    "local_source",
    "check_ep_fingerprint",
    "Placement",
    "contiguous_ranges",
]


def shard_layer(
    layer,
    *,
    group: dist.ProcessGroup,
    mode: str = "all_to_all",
    placement: PlacementLike = None,
    local_experts: ExpertWeights | None = None,
    static_tokens: int | None = None,
    timeout_s: float | None = None,
    experts_impl: Any = None,
    check_config: bool = True,
    reduce_dtype: torch.dtype | str | None = None,
    check_inputs: bool | None = None,
    redundant_experts: int | None = None,
):
    """Shard `layer`'s routed experts over `group`: a new MoELayer with an EP dispatcher.

    Collective: call it on every rank, in the same layer order.

    Args:
        layer: the MoELayer to shard (its router tensors and shared expert are shared; its
            experts are used through views of the local subset).
        group: the expert-parallel process group (required; dist.group.WORLD is fine).
        mode: "all_to_all" or "all_reduce".
        placement: None (equal contiguous ranges), (start, end) per rank, an expert->rank
            map, or a Placement.
        local_experts: ExpertWeights of this rank's experts (placement.experts_of(rank), in
            that order), instead of taking them from `layer`.
        static_tokens: all_to_all: the decode mode's token budget Tm (None: dynamic);
            all_reduce: any int selects the fixed-shape (host-read free) row selection.
        timeout_s: seconds any collective may take (None: the process group's timeout).
        experts_impl: override the layer's experts implementation (a name, or an object
            with forward_pairs).
        check_config: all-gather a fingerprint at set-up and refuse mismatched ranks.
        reduce_dtype: all_reduce mode's partial-sum dtype on the wire (None: float32; a dtype or its name).
        check_inputs: all_reduce mode: check each call that the ranks hold the same tokens (None: True).
            Either given with mode "all_to_all" is a ValueError (an option that mode would ignore).
        redundant_experts: R: hold E + R physical experts (copies of the logical ones); with no
            placement the default layout `Placement.replicated` (EPPlacementError unless W divides
            E + R), with one it must hold R copies. Each (token, expert) pair runs on one copy
            (moeflow.parallel.plan.physical_ids). None: one copy each (or the placement's).

    Returns:
        a MoELayer (layer.replace(...)): `dispatcher` (placement, rank, world_size,
        local_ids), `source` (ResidentExperts: expert_shift, spare_expert), `last_handle`,
        `token_stats()`.
    """
    if not hasattr(layer, "replace") or not hasattr(layer, "dispatcher"):
        raise TypeError(f"layer: expected a moeflow.MoELayer, got {type(layer).__name__}")
    if layer.dispatcher.name != "local":
        raise ValueError(f"layer {layer.layer_idx}: already expert-parallel ({layer.dispatcher.name})")
    d = make_dispatcher(layer.config, group=group, mode=mode, placement=placement, static_tokens=static_tokens,
                        timeout_s=timeout_s, reduce_dtype=reduce_dtype, check_inputs=check_inputs,
                        redundant_experts=redundant_experts)
    full = None if local_experts is not None else layer.expert_weights
    source = local_source(d.placement, d.rank, static=static_tokens is not None, full=full, local=local_experts)
    ep = layer.replace(source=source, dispatcher=d, experts_impl=experts_impl)
    if check_config:
        check_ep_fingerprint(ep)
    track_load([ep])
    return ep


def EPMoELayer(layer, *, group: dist.ProcessGroup, **kwargs: Any):  # noqa: N802 - a class-style public name
    """`shard_layer(layer, group=..., **kwargs)` under the class-style name callers may import."""
    return shard_layer(layer, group=group, **kwargs)
