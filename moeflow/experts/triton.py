"""`triton` experts: fused GPU kernels for bf16 / fp16 (fp32: exact, for the interpreter) expert weights.

Legend: T tokens, K slots per token, N = T*K pairs, H hidden, I intermediate per expert, E experts.

One step is align -> gate_up (+ activation) -> down -> combine (moeflow.experts.fused); which kernel
runs each stage, with which tile, is the KernelPlan's (`impl.plan(w, T, K).explain()`), from the
registry in moeflow.experts.plan, the tuned tables in moeflow.tuning (JSON written by
benchmarks/tune_experts.py, nearest T) or their heuristics, and the measured rules
(moeflow/tuning/rules.json). A caller chooses through `KernelOptions` (tma / pdl / pinned variants).

Modes:
    TritonExperts()                       tiles chosen per T (fastest).
    TritonExperts(batch_invariant=True)   a token's output bits do not depend on the batch: no split-K
                                          and one K-step (BK) per GEMM for every T. Tuned tables may let
                                          BM/BN/warps follow T inside that family ("batch_invariant_by_T",
                                          checked bit for bit on the device by the tuner); without one, a
                                          single configuration.
Both are deterministic run to run (fixed sum orders, integer-only counting). The TMA and pointer
kernels of a GEMM give the same bits at the same tiles (same K order), so the plan's choice between
them changes speed, never numbers.
"""

from __future__ import annotations

import torch

from ..config import ExpertWeights
from ..tuning import MoETileConfig
from .base import check_pairs
from .fused import ACT_CODES, FusedExperts, combine_launch, gate_up_descriptor
from .options import KernelOptions
from .plan import max_blocks_for

__all__ = ["TritonExperts", "IMPL", "combine_launch", "gate_up_descriptor", "max_blocks_for", "ACT_CODES"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class TritonExperts(FusedExperts):
    """Fused Triton experts for plain (bf16 / fp16 / fp32) weights. See the module docstring.

    batch_invariant, tile_config, allow_cpu, options, tma: see moeflow.experts.fused.FusedExperts.
    """

    name = "triton"
    _supports_what = "fused Triton kernels: bf16/fp16 (fp32 exact) weights, every layout, activation and bias"

    def __init__(self, *, batch_invariant: bool = False, tile_config: MoETileConfig | None = None,
                 allow_cpu: bool = False, options: KernelOptions | None = None, tma: bool | None = None) -> None:
        super().__init__(batch_invariant=batch_invariant, tile_config=tile_config, allow_cpu=allow_cpu,
                         options=options, tma=tma)
        self.name = "triton_bi" if batch_invariant else "triton"

    def tile_config_for(self, w: ExpertWeights, top_k: int, num_tokens: int) -> MoETileConfig:
        """The MoETileConfig a call of num_tokens tokens runs with (the plan's)."""
        return self.plan(w, num_tokens, top_k).tiles

    def _check_weights(self, w: ExpertWeights) -> None:
        if w.quant is not None:
            raise ValueError(f"ExpertWeights.quant format {w.quant.format!r}: experts impl {self.name!r} runs "
                             "plain weights (quantized: 'triton_quant')")
        if w.dtype not in _DTYPES:
            raise TypeError(f"ExpertWeights dtype {w.dtype}: expected bfloat16, float16 or float32")

    def _check_pairs(self, x_NH, expert_N, w, config) -> None:
        check_pairs(x_NH, expert_N, w, config)
        self._check_x(x_NH, w, "x_NH")

    @staticmethod
    def _check_x(x: torch.Tensor, w: ExpertWeights, name: str) -> None:
        if x.dtype != w.dtype:
            raise TypeError(f"{name}: dtype {x.dtype}, expected the experts' dtype {w.dtype}")
        if x.device != w.device:
            raise ValueError(f"{name}: on {x.device}, expected the experts' device {w.device}")
        if x.shape[1] > 1 and x.stride(1) != 1:
            raise ValueError(f"{name}: stride {x.stride()}, expected unit stride along H")


IMPL = TritonExperts()
