"""Typed results passed between the MoE pipeline stages.

Legend: T tokens, H hidden size, E routed experts, K experts per token,
N (token, slot) rows after dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class RoutingResult:
    """The router's selection for T tokens.

    ids_TK:     int32 [T, K]. Distinct within a row, ordered by selection key
                descending, ties toward the lower expert index. An id >= E names a
                LongCat zero expert (identity, no compute).
    weights_TK: float32 [T, K]. The combine weight of each pick, after renorm
                and scaling (llama4: the weight multiplies the expert *input*).
    """

    ids_TK: torch.Tensor
    weights_TK: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.ids_TK.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids_TK.shape[1])


# ----------------------------------------------------------------------------- stage protocols
#
# One MoE forward (moeflow.layer.MoELayer.forward) strings the stages together:
#
#     routing = router(x_TH)
#     handle  = dispatcher.dispatch(x_TH, routing, spec, fused=...)   # Local | AllToAll | AllReduce
#     y       = source.run(impl, handle.batch, config, step_input=x_TH)   # Resident | Offloaded
#     out_TH  = dispatcher.combine(y, handle)  (+ shared expert)
#
# Lower stages (parallel/, offload/, experts/) know these protocols, never layer.py.


@dataclass(frozen=True, eq=False)
class PairBatch:
    """(token, slot) rows for the experts: row n runs through expert expert_N[n] of the source.

    x_NH:     [N, H] rows in the activations' dtype (llama4: not yet scaled by the weight).
    expert_N: int [N] expert ids of the source (0 <= id < source.num_experts; under expert
              parallelism the rank's local ids).
    valid_N:  bool [N] False for the junk rows of the fixed-shape (static) modes, whose
              outputs are masked by combine; None: every row is real.
    weight_N: float32 [N] each row's routing weight (llama4 scales the input by it), or None.
    num_tokens: T the rows came from (what the experts impl is tuned by: about N / K).
    """

    x_NH: torch.Tensor
    expert_N: torch.Tensor
    valid_N: torch.Tensor | None = None
    weight_N: torch.Tensor | None = None
    num_tokens: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.x_NH.shape[0])


@dataclass(frozen=True, eq=False)
class TokenBatch:
    """The fused form (one device, no zero experts): the experts impl dispatches and combines itself.

    x_TH:       [T, H] tokens.
    ids_TK:     int [T, K] expert ids of the source.
    weights_TK: float32 [T, K] combine weights.
    """

    x_TH: torch.Tensor
    ids_TK: torch.Tensor
    weights_TK: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.x_TH.shape[0])


ExpertBatch = PairBatch | TokenBatch


@runtime_checkable
class DispatchHandle(Protocol):
    """What `Dispatcher.dispatch` returns: the experts' batch plus what `combine` needs (frozen)."""

    @property
    def batch(self) -> ExpertBatch: ...


@runtime_checkable
class Dispatcher(Protocol):
    """Moves token rows to the experts and the results back (local, all_to_all, all_reduce).

    name:   "local" | "all_to_all" | "all_reduce".
    fuses:  True when dispatch can hand out a TokenBatch (one device, the impl fuses).
    dispatch(x_TH [T, H], routing, spec, *, fused) -> handle (handle.batch: the rows).
    combine(y, handle) -> out_TH [T, H] in x's dtype: the routed sum in slot order,
        zero experts (w * x) included, shared expert not.
    """

    name: str
    fuses: bool

    def dispatch(self, x_TH: torch.Tensor, routing: RoutingResult, spec: Any, *, fused: bool = False
                 ) -> DispatchHandle: ...

    def combine(self, y: torch.Tensor, handle: Any) -> torch.Tensor: ...


@runtime_checkable
class ExpertSource(Protocol):
    """Hands the experts impl its tensors: resident weights, or an offload slot cache.

    num_experts: ids a batch may use, [0, num_experts) (a rank's local count under EP).
    dtype, device: of the expert tensors (None device: nothing held, e.g. a rank with no experts).
    run(impl, batch, config, *, step_input) -> y: y_NH [N, H] for a PairBatch (unweighted,
        rows in input order), out_TH [T, H] for a TokenBatch (combined by the impl).
        step_input is the layer's x_TH (offload predicts the next layer's experts from it).
    """

    num_experts: int

    def run(self, impl: Any, batch: ExpertBatch, config: Any, *, step_input: torch.Tensor | None = None
            ) -> torch.Tensor: ...
