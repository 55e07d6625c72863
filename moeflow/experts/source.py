"""Expert sources: where the experts impl gets its tensors (the `ExpertSource` protocol).

Legend: T tokens, K picks per token, H hidden, E experts the source serves (a rank's
local count under expert parallelism), N (token, slot) rows.

    ResidentExperts(weights)      the weights are on the device already (the model's own
                                  Parameters by reference, or a rank's local subset).
    moeflow.offload.OffloadedExperts   a device slot cache fed from host memory.

Both run a batch the same way (`run_impl`): the same rows in the same order reach the
same kernels, so a source choice never changes bits. llama4's weight-on-input scaling
is applied here, once, for every dispatcher.
"""

from __future__ import annotations

import torch

from ..config import ExpertWeights, MoEConfig
from ..refs import TensorRefs
from ..types import ExpertBatch, PairBatch, TokenBatch

__all__ = ["ResidentExperts", "run_impl", "scaled_rows"]

# Every per-expert tensor an ExpertWeights may hold (weights, biases, quantization scales).
_EXPERT_TENSORS = ExpertWeights.TENSOR_FIELDS


def scaled_rows(batch: PairBatch, config: MoEConfig) -> torch.Tensor:
    """The rows the experts see: x_NH, or llama4's w * x rounded to x's dtype (weight on input)."""
    if not config.router.weight_on_input:
        return batch.x_NH
    if batch.weight_N is None:
        raise ValueError("batch.weight_N: None, but config.router.weight_on_input needs each row's weight")
    return batch.x_NH * batch.weight_N.to(batch.x_NH.dtype).unsqueeze(1)


def run_impl(impl, batch: ExpertBatch, w: ExpertWeights, config: MoEConfig, *,
             expert_N: torch.Tensor | None = None, ids_TK: torch.Tensor | None = None) -> torch.Tensor:
    """Run `impl` on `batch` with tensors `w` (ids optionally replaced: offload's slot ids).

    PairBatch -> y_NH [N, H] (unweighted); TokenBatch -> out_TH [T, H] (impl.forward_tokens).
    """
    if isinstance(batch, TokenBatch):
        return impl.forward_tokens(batch.x_TH, batch.ids_TK if ids_TK is None else ids_TK, batch.weights_TK,
                                   w, config)
    x_NH = scaled_rows(batch, config)
    return impl.forward_pairs(x_NH, batch.expert_N if expert_N is None else expert_N, w, config)


class ResidentExperts(TensorRefs):
    """Experts whose tensors are on the device: the ExpertSource of a resident layer.

    weights:       ExpertWeights of the E experts served (registered by reference).
    spare_expert:  static (fixed-shape) dispatch modes: junk rows (valid_N False) run as
                   this expert, an extra one held past the served ones (so that no real
                   expert's GEMM changes row count, which could change its bits); None: none.
    expert_shift:  real expert j is held at j + expert_shift (the spare sits before them).
    num_experts:   experts served (ids the batches use), without the spare.
    persistent:    register non-Parameter tensors as persistent buffers (a standalone layer
                   saves them; False for a rank's subset views).
    """

    def __init__(self, weights: ExpertWeights | None, *, num_experts: int | None = None,
                 spare_expert: int | None = None, expert_shift: int = 0, persistent: bool = True) -> None:
        super().__init__(persistent=persistent)
        if weights is not None and not isinstance(weights, ExpertWeights):
            raise TypeError(f"weights: expected ExpertWeights or None, got {type(weights).__name__}")
        held = weights.num_experts if weights is not None else 0
        extra = (1 if spare_expert is not None else 0)
        self.num_experts = int(num_experts) if num_experts is not None else held - extra
        if weights is not None and self.num_experts + extra != held:
            raise ValueError(f"weights: {held} experts held, expected num_experts={self.num_experts}"
                             f"{' + 1 spare' if extra else ''}")
        self.spare_expert = spare_expert
        self.expert_shift = int(expert_shift)
        self._has_weights = weights is not None
        self._layout = weights.layout if weights is not None else "linear"
        self._interleaved = weights.interleaved if weights is not None else False
        self.quant = weights.quant if weights is not None else None
        for n in _EXPERT_TENSORS:
            self.set_ref(n, getattr(weights, n) if weights is not None else None)

    # ---- tensors ------------------------------------------------------------------------
    @property
    def weights(self) -> ExpertWeights | None:
        """The held experts' tensors now (`.to()`, rebinding and swapped `.data` are seen).

        Built once and reused while nothing changed: building and validating an ExpertWeights
        was ~15 us of host time per layer step. The cache is dropped by set_ref / release_ref /
        `_apply` (`.to()`, `.cuda()`), and kept only while gate_up and down still start at
        the same addresses (a `.data` swap moves them).
        """
        if not self._has_weights:
            return None
        gu, dn = self.ref("gate_up"), self.ref("down")
        key = (gu.data_ptr(), dn.data_ptr())
        cached = self.__dict__.get("_weights_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        w = ExpertWeights(**{n: self.ref(n) for n in _EXPERT_TENSORS}, layout=self._layout,
                          interleaved=self._interleaved, quant=self.quant)
        self.__dict__["_weights_cache"] = (key, w)
        return w

    def set_ref(self, name: str, t: torch.Tensor | None) -> None:
        self.__dict__.pop("_weights_cache", None)
        super().set_ref(name, t)

    def release_ref(self, name: str) -> None:
        self.__dict__.pop("_weights_cache", None)
        super().release_ref(name)

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_weights_cache", None)
        return super()._apply(fn, *args, **kwargs)

    @property
    def dtype(self) -> torch.dtype | None:
        """The activations' dtype these experts take: the weights' dtype (None for quantized weights,
        whose storage dtype is not the activations' one)."""
        t = self.ref("gate_up")
        return None if t is None or self.quant is not None else t.dtype

    @property
    def device(self) -> torch.device | None:
        t = self.ref("gate_up")
        return None if t is None else t.device

    def rebind(self, **tensors: torch.Tensor | None) -> None:
        """Point the named expert tensors (ExpertWeights.TENSOR_FIELDS) at new ones."""
        for name, t in tensors.items():
            if name not in _EXPERT_TENSORS:
                raise ValueError(f"rebind: unknown expert tensor {name!r}, expected one of {_EXPERT_TENSORS}")
            if t is not None:
                self.set_ref(name, t)

    def release(self) -> None:
        """Give the held tensors empty storage (offload keeps its own host copy)."""
        for n in _EXPERT_TENSORS:
            self.release_ref(n)

    # ---- ExpertSource -------------------------------------------------------------------
    def run(self, impl, batch: ExpertBatch, config: MoEConfig, *, step_input: torch.Tensor | None = None
            ) -> torch.Tensor:
        w = self.weights
        if isinstance(batch, TokenBatch):
            if w is None:
                raise ValueError("ResidentExperts: a TokenBatch needs expert weights, none are held")
            return run_impl(impl, batch, w, config)
        N = batch.num_rows
        if w is None or N == 0:
            return batch.x_NH.new_zeros((N, config.hidden_size))
        expert_N = None
        if batch.valid_N is not None and self.spare_expert is not None:
            expert_N = torch.where(batch.valid_N, batch.expert_N + self.expert_shift,
                                   torch.full_like(batch.expert_N, self.spare_expert))
        elif self.expert_shift:
            expert_N = batch.expert_N + self.expert_shift
        return run_impl(impl, batch, w, config, expert_N=expert_N)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, spare={self.spare_expert}, shift={self.expert_shift}, "
                f"layout={self._layout!r}")
