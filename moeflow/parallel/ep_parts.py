"""The parts an expert-parallel MoE layer is built from: its dispatcher, its local expert source,
and the collective check that every rank built the same layer.

Legend: E routed experts, W ranks, L experts on this rank.

    make_dispatcher       the AllToAllDispatcher | AllReduceDispatcher of a mode over a group
    local_source          this rank's experts as a ResidentExperts source (views when it can)
    check_ep_fingerprint  all-gather the layer's fingerprint, EPConfigMismatch naming the fields

Both builders of an EP layer use them: `moeflow.parallel.ep.shard_layer` (from a resident
layer) and `moeflow.checkpoint.build.load_ep_layer` (from a checkpoint, reading only this
rank's experts). They sit below both, so moeflow.parallel.ep can re-export load_ep_layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from ..config import ACTIVATIONS, LAYOUTS, ExpertWeights, MoEConfig
from ..experts.source import ResidentExperts
from ..routing.spec import SCORE_FNS
from .all_reduce import AllReduceDispatcher
from .all_to_all import AllToAllDispatcher
from .dist_utils import check_same_across_ranks, check_timeout, dtype_code, group_size
from .plan import EPPlacementError, Placement, as_placement

__all__ = ["EP_MODES", "PlacementLike", "check_ep_fingerprint", "local_source", "make_dispatcher",
           "resolve_placement"]

EP_MODES: tuple[str, ...] = ("all_to_all", "all_reduce")

PlacementLike = Placement | Sequence | torch.Tensor | Mapping | None


def resolve_placement(placement: PlacementLike, num_experts: int, world_size: int,
                      redundant_experts: int | None = None) -> Placement:
    """The placement to use: contiguous equal ranges when None (ValueError if W does not
    divide E, saying to pass a map), else `as_placement(placement)` checked against E and W.

    redundant_experts: R > 0 with no placement: `Placement.replicated(E, W, R)` (EPPlacementError
    unless W divides E + R); with a placement: checked against its redundant copies (EPPlacementError
    when they differ). None or 0 with no placement: one copy each.
    """
    if redundant_experts is not None and (not isinstance(redundant_experts, int) or isinstance(redundant_experts, bool)
                                          or redundant_experts < 0):
        raise EPPlacementError(f"redundant_experts={redundant_experts!r}: expected an int >= 0")
    if placement is None and redundant_experts:
        return Placement.replicated(num_experts, world_size, redundant_experts)
    if placement is not None and redundant_experts is not None:
        p = resolve_placement(placement, num_experts, world_size)
        if p.num_redundant != redundant_experts:
            raise EPPlacementError(f"redundant_experts={redundant_experts}: the placement given holds "
                                   f"{p.num_physical} physical experts for E={num_experts}, i.e. "
                                   f"R={p.num_redundant}; expected them to agree (or leave one out)")
        return p
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
                    timeout_s: float | None = None, reduce_dtype: torch.dtype | str | None = None,
                    check_inputs: bool | None = None, redundant_experts: int | None = None
                    ) -> AllToAllDispatcher | AllReduceDispatcher:
    """The expert-parallel Dispatcher of `mode` over `group` (not collective).

    static_tokens: all_to_all: the decode mode's token budget Tm (None: dynamic);
        all_reduce: any int selects the fixed-shape (host-read free) row selection.
    reduce_dtype / check_inputs: all_reduce only (see AllReduceDispatcher; None: float32 / True); given with
        mode "all_to_all" they are refused by name rather than ignored. reduce_dtype may be a torch dtype or its
        name ("float32", "bfloat16", "float16").
    redundant_experts: R physical copies beyond one per expert (see `resolve_placement`).
    The dispatcher carries `placement`, `rank`, `world_size` and `local_ids` (the logical ids
    of this rank's (physical) experts in local order).
    """
    if mode not in EP_MODES:
        raise ValueError(f"mode={mode!r}: expected one of {EP_MODES}")
    if mode == "all_to_all":
        for name, v in (("reduce_dtype", reduce_dtype), ("check_inputs", check_inputs)):
            if v is not None:
                raise ValueError(f"{name}={v!r}: an all_reduce option; mode='all_to_all' has no use for it "
                                 f"(pass mode='all_reduce', or leave it out)")
    reduce_dtype = _reduce_dtype(reduce_dtype)
    if check_inputs is not None and not isinstance(check_inputs, bool):
        raise TypeError(f"check_inputs={check_inputs!r}: expected True or False")
    timeout_s = check_timeout(timeout_s)
    W = group_size(group)
    p = resolve_placement(placement, config.num_experts, W, redundant_experts)
    if mode == "all_to_all":
        d: AllToAllDispatcher | AllReduceDispatcher = AllToAllDispatcher(
            p, group, timeout_s=timeout_s, static_tokens=static_tokens)
    else:
        d = AllReduceDispatcher(p, group, timeout_s=timeout_s, static=static_tokens is not None,
                                reduce_dtype=reduce_dtype, num_zero_experts=config.router.num_zero_experts,
                                check_inputs=True if check_inputs is None else check_inputs)
    d.local_ids = p.experts_of(d.rank)
    d.static_tokens = static_tokens
    return d


_REDUCE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _reduce_dtype(v: torch.dtype | str | None) -> torch.dtype:
    """all_reduce's wire dtype from a torch dtype or its name (None: float32); TypeError naming the field else."""
    if v is None:
        return torch.float32
    if isinstance(v, str) and v.removeprefix("torch.") in _REDUCE_DTYPES:
        return _REDUCE_DTYPES[v.removeprefix("torch.")]
    if isinstance(v, torch.dtype) and v in _REDUCE_DTYPES.values():
        return v
    raise TypeError(f"reduce_dtype={v!r}: expected one of {sorted(_REDUCE_DTYPES)} (a torch dtype or its name)")


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
        "placement_physical": d.placement.num_physical,
    }
    check_same_across_ranks(fields, group=d.group, timeout_s=d.timeout_s if timeout_s is None else timeout_s,
                            what=f"EP layer {layer.layer_idx}")
