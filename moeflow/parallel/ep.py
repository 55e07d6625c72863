"""Expert parallelism for one MoE layer: placement, loading only local experts, the EP layer.

Legend: B batch, S sequence, T tokens on this rank, H hidden, E routed experts, Z zero
experts, K picks, I intermediate per expert, W ranks, L experts on this rank, N rows
this rank's experts compute.

    ep = shard_layer(layer, group=dist.group.WORLD, mode="all_to_all")   # every rank
    y = ep(x)                     # x: this rank's tokens [B, S, H] or [T, H]

Modes (see all_to_all.py and all_reduce.py):
    "all_to_all"  each rank routes its own tokens; pairs travel to the experts' ranks and
                  back; the combine runs on the source rank in slot order, so with the
                  reference experts the output is bit-identical to one process running
                  MoELayer on all ranks' tokens concatenated in rank order.
                  `static_tokens=Tm` selects the decode mode (fixed buffers, no host read).
    "all_reduce"  every rank holds the same tokens; each computes its experts' pairs and
                  one all_reduce sums (within rounding of the single process).
Both modes run zero experts (w * x on the source / after the reduce) and the shared
expert (added once, after the routed sum, on every rank for its own tokens).

Set-up is collective: building an EPMoELayer all-gathers a small fingerprint of the
layer (E, K, Z, H, I, dtype, activation, layout, mode, placement, ...) and raises
EPConfigMismatch naming the fields the ranks disagree on. Every collective waits at
most `timeout_s` (EPCollectiveError naming the collective past it).

Refused by name: gradients (EP is inference-only: collectives here do not carry
autograd), a placement whose world size is not the group's, an unknown mode.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ACTIVATIONS, LAYOUTS, ExpertWeights, MoEConfig
from ..experts.select import select_experts_impl
from ..layer import MoELayer
from ..routing.spec import SCORE_FNS
from ..types import RoutingResult
from .all_reduce import AllReduceEP, ARHandle
from .all_to_all import A2AHandle, A2AStaticHandle, AllToAllDispatcher
from .dist_utils import check_same_across_ranks, dtype_code, group_rank, group_size
from .local import combine_TH
from .plan import Placement, as_placement, contiguous_ranges

__all__ = [
    "EP_MODES",
    "EPMoELayer",
    "shard_layer",
    "resolve_placement",
    "load_ep_layer",
    "Placement",
    "contiguous_ranges",
]

EP_MODES: tuple[str, ...] = ("all_to_all", "all_reduce")
_EXPERT_TENSORS = ("gate_up", "down", "gate_up_bias", "down_bias")

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


def _capture_tensor(module: nn.Module, name: str, t: torch.Tensor | None) -> None:
    """Register t on module by reference (a Parameter as itself, anything else as a buffer)."""
    if t is None:
        setattr(module, name, None)
    elif isinstance(t, nn.Parameter):
        module.register_parameter(name, t)
    else:
        module.register_buffer(name, t, persistent=False)


class EPMoELayer(nn.Module):
    """One MoE layer whose routed experts are spread over the ranks of `group`.

    Args:
        layer: the MoELayer to shard (its router, router tensors and shared expert are
            used as they are; its experts are used through views of the local subset).
            Its expert tensors may live on the meta device when `local_experts` is given
            (loaded from a checkpoint, see `load_ep_layer`).
        group: the expert-parallel process group (required; dist.group.WORLD is fine).
        mode: "all_to_all" or "all_reduce".
        placement: None (equal contiguous ranges), (start, end) per rank, an expert->rank
            map, or a Placement.
        local_experts: ExpertWeights of this rank's experts (placement.experts_of(rank), in
            that order). None: taken from `layer` (views for a contiguous range, one index
            copy otherwise).
        static_tokens: all_to_all: the decode mode's token budget Tm (None: dynamic);
            all_reduce: any int selects the fixed-shape (host-read free) row selection.
        timeout_s: seconds any collective may take (None: the process group's timeout).
        experts_impl: override the layer's experts implementation ("reference", "grouped",
            "auto", ...; or an implementation object with forward_pairs).
        check_config: all-gather a fingerprint at set-up and refuse mismatched ranks.
        reduce_dtype: all_reduce mode's partial-sum dtype on the wire.

    Attributes:
        rank, world_size, placement, mode.
        last_routing: RoutingResult of the latest forward (this rank's tokens).
        last_handle: the latest dispatch handle (A2AHandle / A2AStaticHandle / ARHandle).
        expert_shift, spare_expert: in the static modes the experts implementation sees
            real local expert j as j + expert_shift and junk rows as spare_expert (an extra
            expert, so that no real expert's GEMM changes shape); 0 / None otherwise.
    """

    def __init__(
        self,
        layer: MoELayer,
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
    ) -> None:
        super().__init__()
        if not isinstance(layer, MoELayer):
            raise TypeError(f"layer: expected a moeflow.MoELayer, got {type(layer).__name__}")
        if mode not in EP_MODES:
            raise ValueError(f"mode={mode!r}: expected one of {EP_MODES}")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r}: expected None or a number of seconds > 0")
        self.rank = group_rank(group)
        self.world_size = group_size(group)
        self.group = group
        self.mode = mode
        self.base = layer
        self.config: MoEConfig = layer.config
        E = self.config.num_experts
        self.placement = resolve_placement(placement, E, self.world_size)
        self.local_ids: tuple[int, ...] = self.placement.experts_of(self.rank)
        self.timeout_s = timeout_s
        self.static_tokens = static_tokens
        self.experts_impl = experts_impl if experts_impl is not None else layer.experts_impl
        self.last_routing: RoutingResult | None = None
        self.last_handle: A2AHandle | A2AStaticHandle | ARHandle | None = None

        # Local experts: given (by reference), views of the layer's range, or one index copy.
        # The fixed-shape (static) modes also need one spare expert that junk rows can
        # run through on their own, so that every real expert sees exactly its real rows
        # (a GEMM's bits can depend on its row count); real local id j runs as
        # j + self.expert_shift and junk rows as self.spare_expert.
        self._local_range: tuple[int, int] | None = None
        self._has_local_tensors = False
        self.expert_shift = 0
        self.spare_expert: int | None = None
        static = static_tokens is not None
        L = len(self.local_ids)
        if local_experts is not None:
            if not isinstance(local_experts, ExpertWeights):
                raise TypeError(f"local_experts: expected ExpertWeights, got {type(local_experts).__name__}")
            local_experts.check_config(self.config)
            if local_experts.num_experts != L:
                raise ValueError(
                    f"local_experts: {local_experts.num_experts} experts, but rank {self.rank} owns {L} "
                    f"({list(self.local_ids)[:8]}{'...' if L > 8 else ''})"
                )
            if static and L:
                local_experts, self.spare_expert = _with_zero_expert(local_experts), L
            self._set_local_tensors(local_experts)
        elif L:
            rng = self.placement.range_of(self.rank)
            others = [e for e in range(E) if e not in set(self.local_ids)]
            if rng is not None and not static:
                self._local_range = rng
            elif rng is not None and rng[1] < E:
                self._local_range, self.spare_expert = (rng[0], rng[1] + 1), L  # the next rank's first expert
            elif rng is not None and rng[0] > 0:
                self._local_range, self.expert_shift, self.spare_expert = (rng[0] - 1, rng[1]), 1, 0
            elif not static:
                self._set_local_tensors(layer.expert_weights.subset(list(self.local_ids)))
            elif others:
                self._set_local_tensors(layer.expert_weights.subset([*self.local_ids, others[0]]))
                self.spare_expert = L
            else:  # this rank owns every expert: a zero spare (one copy)
                self._set_local_tensors(_with_zero_expert(layer.expert_weights.subset(list(self.local_ids))))
                self.spare_expert = L
        w_probe = self._local_weights()
        dtype = w_probe.dtype if w_probe is not None else layer.expert_weights.dtype

        Z = self.config.router.num_zero_experts
        if mode == "all_to_all":
            self.dispatcher: AllToAllDispatcher | AllReduceEP = AllToAllDispatcher(
                self.placement, group, timeout_s=timeout_s, static_tokens=static_tokens
            )
        else:
            self.dispatcher = AllReduceEP(
                self.placement, group, timeout_s=timeout_s, static=static_tokens is not None,
                reduce_dtype=reduce_dtype, num_zero_experts=Z,
            )
        if check_config:
            check_same_across_ranks(self._fingerprint(dtype), group=group, timeout_s=timeout_s,
                                    what=f"EPMoELayer(layer {layer.layer_idx})")

    # ------------------------------------------------------------------ set-up helpers

    def _set_local_tensors(self, w: ExpertWeights) -> None:
        for n in _EXPERT_TENSORS:
            _capture_tensor(self, f"local_{n}", getattr(w, n))
        self._local_layout = w.layout
        self._local_interleaved = w.interleaved
        self._has_local_tensors = True

    def _local_weights(self) -> ExpertWeights | None:
        """This rank's experts now (rebuilt per call: survives .to() and reassigned Parameters)."""
        if self._has_local_tensors:
            return ExpertWeights(*(getattr(self, f"local_{n}") for n in _EXPERT_TENSORS),
                                 layout=self._local_layout, interleaved=self._local_interleaved)
        if self._local_range is not None:
            start, end = self._local_range
            return self.base.expert_weights.subset(range(start, end))
        return None

    def _fingerprint(self, dtype: torch.dtype) -> dict[str, int]:
        c, s = self.config, self.config.router
        e_p, w_p, h_p = self.placement.fingerprint()
        return {
            "layer_idx": self.base.layer_idx,
            "num_experts(E)": s.num_experts,
            "top_k(K)": s.top_k,
            "num_zero_experts(Z)": s.num_zero_experts,
            "hidden_size(H)": c.hidden_size,
            "intermediate_size(I)": c.intermediate_size,
            "dtype": dtype_code(dtype),
            "activation": ACTIVATIONS.index(c.activation),
            "layout": LAYOUTS.index(c.layout),
            "interleaved": int(c.interleaved),
            "expert_bias": int(c.expert_bias),
            "score_fn": SCORE_FNS.index(s.score_fn),
            "weight_on_input": int(s.weight_on_input),
            "hash_routing": int(s.hash_routing),
            "shared_expert": int(self.base.shared_expert is not None),
            "shared_gated": int(c.shared_gated),
            "mode": EP_MODES.index(self.mode),
            "static_tokens": -1 if self.static_tokens is None else int(self.static_tokens),
            "placement_world_size": w_p,
            "placement_hash": h_p,
            "placement_experts": e_p,
        }

    def _apply(self, fn, *args, **kwargs):
        # A layer loaded with local experts only keeps meta placeholders for the full
        # expert tensors; .to()/.cuda() must leave those alone (they cannot be copied).
        return super()._apply(lambda t: t if t.is_meta else fn(t), *args, **kwargs)

    # ------------------------------------------------------------------ forward

    def _impl(self, rows: int):
        if not isinstance(self.experts_impl, str):
            return self.experts_impl
        w = self._local_weights()
        device = w.device if w is not None else torch.device("cpu")
        K = self.config.top_k
        return select_experts_impl(self.config, device, max(1, rows // K), self.experts_impl)

    def _run_local_experts(self, handle) -> torch.Tensor:
        x_NH = handle.recv_x_NH
        expert_N = handle.recv_expert_N
        if self.spare_expert is not None:
            expert_N = torch.where(handle.recv_valid_N, expert_N + self.expert_shift,
                                   torch.full_like(expert_N, self.spare_expert))
        if self.config.router.weight_on_input:
            # llama4: the expert input is w * x in the activations' dtype, as MoELayer does it.
            x_NH = x_NH * handle.recv_weight_N.to(x_NH.dtype).unsqueeze(1)
        w = self._local_weights()
        N = int(x_NH.shape[0])
        if w is None or N == 0:
            return x_NH.new_zeros((N, self.config.hidden_size))
        impl = self._impl(N)
        return impl.forward_pairs(x_NH, expert_N, w, self.config)

    def _shared(self, x_TH: torch.Tensor) -> torch.Tensor | None:
        base = self.base
        if base.shared_expert is None:
            return None
        shared_TH = base.shared_expert(x_TH)
        gate_w = base._tensor("shared_gate_weight")
        if gate_w is not None:
            shared_TH = torch.sigmoid(F.linear(x_TH, gate_w)) * shared_TH
        return shared_TH

    def forward(
        self,
        x: torch.Tensor,
        *,
        input_ids: torch.Tensor | None = None,
        router_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's output for its tokens, same shape and dtype as x (see MoELayer.forward).

        Collective: every rank of the group must call it (all_to_all: with its own tokens,
        T may differ, even 0; all_reduce: with the same tokens).
        """
        H = self.config.hidden_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != H:
            raise ValueError(f"x: shape {tuple(x.shape)}, expected [B, S, {H}] or [T, {H}] (hidden_size={H})")
        if torch.is_grad_enabled() and x.requires_grad:
            raise NotImplementedError(
                "EPMoELayer is inference-only: its collectives carry no autograd; run under torch.no_grad() "
                "or torch.inference_mode()"
            )
        x_TH = x.reshape(-1, H)
        T = x_TH.shape[0]
        r_TH = x_TH
        if router_input is not None:
            if not isinstance(router_input, torch.Tensor) or router_input.numel() != T * H:
                shape = tuple(router_input.shape) if isinstance(router_input, torch.Tensor) else None
                raise ValueError(f"router_input: shape {shape}, expected {T} rows of H={H}")
            r_TH = router_input.reshape(-1, H)
        routing = self.base.route(r_TH, input_ids=input_ids)
        self.base.last_routing = routing
        self.last_routing = routing
        handle = self.dispatcher.dispatch(x_TH, routing.ids_TK, routing.weights_TK)
        self.last_handle = handle
        y_NH = self._run_local_experts(handle)
        spec = self.config.router
        if self.mode == "all_to_all":
            y_TKH = self.dispatcher.combine(y_NH, handle)
            out_TH = combine_TH(
                y_TKH,
                routing.weights_TK,
                x_TH=x_TH,
                zero_TK=handle.plan.is_zero_TK[:T] if spec.num_zero_experts else None,
                weight_on_input=spec.weight_on_input,
                out_dtype=x_TH.dtype,
            )
        else:
            out_TH = self.dispatcher.combine(y_NH, handle, weight_on_input=spec.weight_on_input)
        shared_TH = self._shared(x_TH)
        if shared_TH is not None:
            out_TH = out_TH + shared_TH
        return out_TH.view(x.shape)

    def token_stats(self) -> dict[str, int]:
        """Pair counts of the latest forward: local (computed here for this rank's own tokens),
        sent (this rank's pairs computed elsewhere), received (other ranks' pairs computed here),
        zero (zero-expert pairs kept home). One host read."""
        h = self.last_handle
        if h is None:
            raise ValueError("token_stats: no forward has run yet")
        zero = int(h.plan.is_zero_TK[: h.num_tokens].sum())
        if isinstance(h, A2AHandle):
            return {"local": h.local_pairs(), "sent": h.remote_pairs_out(), "received": h.remote_pairs_in(),
                    "zero": zero}
        if isinstance(h, A2AStaticHandle):
            valid = h.recv_valid_N
            local = int((valid & (h.recv_src_N == self.rank)).sum())
            dest = h.plan.dest_rank_TK[: h.num_tokens]
            return {"local": local, "sent": int(((dest >= 0) & (dest != self.rank)).sum()),
                    "received": int(valid.sum()) - local, "zero": zero}
        local = int(h.recv_valid_N.sum())
        return {"local": local, "sent": 0, "received": 0, "zero": zero}

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, rank={self.rank}/{self.world_size}, local_experts={len(self.local_ids)}, "
                f"static_tokens={self.static_tokens}, timeout_s={self.timeout_s}")


def _with_zero_expert(w: ExpertWeights) -> ExpertWeights:
    """w plus one all-zero expert at the end (a copy: only for the static modes' junk rows)."""

    def cat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t.new_zeros((1, *t.shape[1:]))])

    return ExpertWeights(cat(w.gate_up), cat(w.down), cat(w.gate_up_bias), cat(w.down_bias),
                         layout=w.layout, interleaved=w.interleaved)


def shard_layer(
    layer: MoELayer,
    *,
    group: dist.ProcessGroup,
    mode: str = "all_to_all",
    placement: PlacementLike = None,
    **kwargs: Any,
) -> EPMoELayer:
    """Shard `layer`'s routed experts over `group` (collective: call it on every rank, in the
    same layer order). kwargs go to EPMoELayer (static_tokens, timeout_s, experts_impl,
    local_experts, check_config, reduce_dtype). `moeflow.hf.patch_model(ep_group=..., ep_mode=...)`
    calls this for each MoE block."""
    return EPMoELayer(layer, group=group, mode=mode, placement=placement, **kwargs)


class _SwiGLU(nn.Module):
    """A shared expert from checkpoint tensors: down(silu(gate(x)) * up(x)), nn.Linear layout."""

    def __init__(self, gate_IH: torch.Tensor, up_IH: torch.Tensor, down_HI: torch.Tensor) -> None:
        super().__init__()
        self.gate_IH = nn.Parameter(gate_IH, requires_grad=False)
        self.up_IH = nn.Parameter(up_IH, requires_grad=False)
        self.down_HI = nn.Parameter(down_HI, requires_grad=False)

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x_TH, self.gate_IH)) * F.linear(x_TH, self.up_IH), self.down_HI)


def load_ep_layer(
    src: str | os.PathLike | Any,
    family_or_config: Any,
    layer_idx: int,
    *,
    config: MoEConfig,
    group: dist.ProcessGroup,
    mode: str = "all_to_all",
    placement: PlacementLike = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    experts_impl: str = "auto",
    shared_expert: nn.Module | None = None,
    **kwargs: Any,
) -> EPMoELayer:
    """Build layer `layer_idx`'s EP layer reading only this rank's experts from a checkpoint.

    src / family_or_config / layer_idx / dtype: as `moeflow.checkpoint.loader.load_moe_layer`.
    config: the layer's MoEConfig (E, K, activation, ...). The router, its biases and the
    shared expert are read whole on every rank; of the routed experts only
    `placement.experts_of(rank)` are read. The full expert tensors of the underlying
    MoELayer are meta placeholders (no memory). shared_expert: a module to use instead of
    the checkpoint's SwiGLU shared expert (families whose shared MLP is not SwiGLU).
    """
    from ..checkpoint.loader import load_moe_layer

    rank, W = group_rank(group), group_size(group)
    p = resolve_placement(placement, config.num_experts, W)
    mine = list(p.experts_of(rank))
    # A rank with no experts still needs the router: read one expert (discarded) since the
    # loader refuses an empty selection.
    lw = load_moe_layer(src, family_or_config, layer_idx, experts=mine or [0], device=device, dtype=dtype)
    w = lw.experts
    E = config.num_experts

    def meta_full(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.empty((E, *t.shape[1:]), dtype=t.dtype, device="meta")

    placeholder = ExpertWeights(meta_full(w.gate_up), meta_full(w.down), meta_full(w.gate_up_bias),
                                meta_full(w.down_bias), layout=w.layout, interleaved=w.interleaved)
    if shared_expert is None and lw.shared is not None:
        shared_expert = _SwiGLU(lw.shared.gate_IH, lw.shared.up_IH, lw.shared.down_HI)
    base = MoELayer(
        config,
        router_weight_EH=lw.router_weight_EH,
        experts=placeholder,
        router_bias_E=lw.router_bias_E,
        selection_bias_E=lw.selection_bias_E,
        expert_scale_E=lw.expert_scale_E,
        prenorm_weight_H=lw.prenorm_weight_H,
        hash_table_VK=lw.hash_table_VK,
        shared_expert=shared_expert,
        shared_gate_weight_1H=lw.shared_gate_weight_1H,
        experts_impl=experts_impl,
        layer_idx=layer_idx,
    )
    return EPMoELayer(base, group=group, mode=mode, placement=p, local_experts=w if mine else None, **kwargs)
