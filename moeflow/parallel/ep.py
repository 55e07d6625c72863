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

Refused by name: gradients (EP is inference-only), a placement whose world size is not
the group's, an unknown mode, a non-finite timeout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..config import ACTIVATIONS, LAYOUTS, ExpertWeights, MoEConfig
from ..experts.source import ResidentExperts
from ..routing.spec import SCORE_FNS
from .all_reduce import AllReduceDispatcher
from .all_to_all import AllToAllDispatcher
from .dist_utils import check_same_across_ranks, check_timeout, dtype_code, group_size
from .plan import Placement, as_placement, contiguous_ranges

__all__ = [
    "EP_MODES",
    "EPMoELayer",
    "shard_layer",
    "resolve_placement",
    "make_dispatcher",
    "local_source",
    "check_ep_fingerprint",
    "Placement",
    "contiguous_ranges",
]

EP_MODES: tuple[str, ...] = ("all_to_all", "all_reduce")

PlacementLike = Placement | Sequence | torch.Tensor | Mapping | None


def resolve_placement(placement: PlacementLike, num_experts: int, world_size: int) -> Placement:
    """The placement to use: contiguous equal ranges when None (ValueError if W does not
    divide E, saying to pass a map), else `as_placement(placement)` checked against E and W."""
    if placement is None:
        try:
            return Placement.contiguous(num_experts, world_size)
        except ValueError as exc:
            raise ValueError(
                f"expert parallelism over {world_size} ranks: {exc}. E={num_experts} experts do not split "
                f"evenly; pass placement= (a list of (start, end) per rank or an expert->rank map)"
            ) from exc
    p = as_placement(placement, num_experts=num_experts)
    if p.world_size != world_size:
        raise ValueError(
            f"placement: built for world_size={p.world_size}, but the process group has {world_size} ranks"
        )
    return p


def make_dispatcher(config: MoEConfig, *, group: dist.ProcessGroup, mode: str = "all_to_all",
                    placement: PlacementLike = None, static_tokens: int | None = None,
                    timeout_s: float | None = None, reduce_dtype: torch.dtype = torch.float32,
                    check_inputs: bool = True) -> AllToAllDispatcher | AllReduceDispatcher:
    """The expert-parallel Dispatcher of `mode` over `group` (not collective).

    static_tokens: all_to_all: the decode mode's token budget Tm (None: dynamic);
        all_reduce: any int selects the fixed-shape (host-read free) row selection.
    reduce_dtype / check_inputs: all_reduce only (see AllReduceDispatcher).
    The dispatcher carries `placement`, `rank`, `world_size` and `local_ids` (this rank's
    experts in local order).
    """
    if mode not in EP_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {EP_MODES}")
    timeout_s = check_timeout(timeout_s)
    W = group_size(group)
    p = resolve_placement(placement, config.num_experts, W)
    if mode == "all_to_all":
        d: AllToAllDispatcher | AllReduceDispatcher = AllToAllDispatcher(
            p, group, timeout_s=timeout_s, static_tokens=static_tokens)
    else:
        d = AllReduceDispatcher(p, group, timeout_s=timeout_s, static=static_tokens is not None,
                                reduce_dtype=reduce_dtype, num_zero_experts=config.router.num_zero_experts,
                                check_inputs=check_inputs)
    d.local_ids = p.experts_of(d.rank)
    d.static_tokens = static_tokens
    return d


def _with_zero_expert(w: ExpertWeights) -> ExpertWeights:
    """w plus one all-zero expert at the end (a copy: only for the static modes' junk rows)."""

    def cat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t.new_zeros((1, *t.shape[1:]))])

    # every per-expert tensor (quantization scales too: zero scales dequantize to zero)
    return ExpertWeights(**{n: cat(getattr(w, n)) for n in ExpertWeights.TENSOR_FIELDS}, layout=w.layout,
                         interleaved=w.interleaved, quant=w.quant)


def local_source(placement: Placement, rank: int, *, static: bool, full: ExpertWeights | None = None,
                 local: ExpertWeights | None = None) -> ResidentExperts:
    """This rank's experts as a ResidentExperts source (local id j = placement.experts_of(rank)[j]).

    full:  all E experts (views of a contiguous range are taken, else one index copy), or
    local: the rank's experts already loaded (by reference).
    static: the fixed-shape modes also need one spare expert that junk rows run through on
        their own, so that every real expert sees exactly its real rows (a GEMM's bits can
        depend on its row count): the next (or previous) rank's neighbouring expert when a
        view allows it, else a zero expert (one copy).
    """
    mine = list(placement.experts_of(rank))
    L = len(mine)
    E = placement.num_experts
    if local is not None:
        if not isinstance(local, ExpertWeights):
            raise TypeError(f"local_experts: expected ExpertWeights, got {type(local).__name__}")
        if local.num_experts != L:
            raise ValueError(
                f"local_experts: {local.num_experts} experts, but rank {rank} owns {L} "
                f"({mine[:8]}{'...' if L > 8 else ''})"
            )
        if static and L:
            return ResidentExperts(_with_zero_expert(local), num_experts=L, spare_expert=L, persistent=False)
        return ResidentExperts(local, num_experts=L, persistent=False)
    if not L:
        return ResidentExperts(None, num_experts=0, persistent=False)
    if full is None:
        raise ValueError("local_source: give the layer's full ExpertWeights or the rank's local_experts")
    rng = placement.range_of(rank)
    if rng is not None and not static:
        return ResidentExperts(full.subset(range(*rng)), num_experts=L, persistent=False)
    if rng is not None and rng[1] < E:  # the next rank's first expert is the spare
        return ResidentExperts(full.subset(range(rng[0], rng[1] + 1)), num_experts=L, spare_expert=L,
                               persistent=False)
    if rng is not None and rng[0] > 0:  # the previous rank's last expert, held before ours
        return ResidentExperts(full.subset(range(rng[0] - 1, rng[1])), num_experts=L, spare_expert=0,
                               expert_shift=1, persistent=False)
    if not static:
        return ResidentExperts(full.subset(mine), num_experts=L, persistent=False)
    others = [e for e in range(E) if e not in set(mine)]
    if others:
        return ResidentExperts(full.subset([*mine, others[0]]), num_experts=L, spare_expert=L, persistent=False)
    # this rank owns every expert: a zero spare (one copy)
    return ResidentExperts(_with_zero_expert(full.subset(mine)), num_experts=L, spare_expert=L, persistent=False)


def check_ep_fingerprint(layer, *, timeout_s: float | None = None) -> None:
    """All-gather the sharded layer's fingerprint and raise EPConfigMismatch naming the fields that
    differ across ranks (collective). `layer` is a MoELayer with an expert-parallel dispatcher."""
    d = layer.dispatcher
    c, s = layer.config, layer.config.router
    e_p, w_p, h_p = d.placement.fingerprint()
    static = getattr(d, "static_tokens", None)
    fields = {
        "layer_idx": layer.layer_idx,
        "num_experts(E)": s.num_experts,
        "top_k(K)": s.top_k,
        "num_zero_experts(Z)": s.num_zero_experts,
        "hidden_size(H)": c.hidden_size,
        "intermediate_size(I)": c.intermediate_size,
        "dtype": dtype_code(layer.experts_dtype or layer.router_weights.weight_EH.dtype),
        "activation": ACTIVATIONS.index(c.activation),
        "layout": LAYOUTS.index(c.layout),
        "interleaved": int(c.interleaved),
        "expert_bias": int(c.expert_bias),
        "score_fn": SCORE_FNS.index(s.score_fn),
        "weight_on_input": int(s.weight_on_input),
        "hash_routing": int(s.hash_routing),
        "shared_expert": int(layer.shared_expert is not None),
        "shared_gated": int(c.shared_gated),
        "mode": EP_MODES.index(d.name),
        "static_tokens": -1 if static is None else int(static),
        "placement_world_size": w_p,
        "placement_hash": h_p,
        "placement_experts": e_p,
    }
    check_same_across_ranks(fields, group=d.group, timeout_s=d.timeout_s if timeout_s is None else timeout_s,
                            what=f"EP layer {layer.layer_idx}")


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
    reduce_dtype: torch.dtype = torch.float32,
    check_inputs: bool = True,
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
        reduce_dtype: all_reduce mode's partial-sum dtype on the wire.
        check_inputs: all_reduce mode: check each call that the ranks hold the same tokens.

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
                        timeout_s=timeout_s, reduce_dtype=reduce_dtype, check_inputs=check_inputs)
    full = None if local_experts is not None else layer.expert_weights
    source = local_source(d.placement, d.rank, static=static_tokens is not None, full=full, local=local_experts)
    ep = layer.replace(source=source, dispatcher=d, experts_impl=experts_impl)
    if check_config:
        check_ep_fingerprint(ep)
    return ep


def EPMoELayer(layer, *, group: dist.ProcessGroup, **kwargs: Any):  # noqa: N802 - the first landing's class name
    """`shard_layer(layer, group=..., **kwargs)` (the first landing's name for a sharded layer)."""
    return shard_layer(layer, group=group, **kwargs)


def __getattr__(name: str):
    # load_ep_layer builds a layer from a checkpoint: it lives with the checkpoint builders
    # (moeflow.checkpoint.build), resolved lazily so this lower stage imports no builder.
    if name == "load_ep_layer":
        from ..checkpoint.build import load_ep_layer

        return load_ep_layer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
