"""`triton_quant` experts: fused GPU kernels that run quantized expert weights from their stored bytes.

Legend: T tokens, K slots per token, N = T*K pairs, H hidden, I intermediate per expert, E experts,
G the quantization group along a GEMM's reduction axis (fp8_block: the weight block's bk, 128 in
released checkpoints; mxfp4 32; nvfp4 16).

Formats (`w.quant.format`; storage rules in moeflow.quant):
    fp8_block  W8A8: activations quantized per token per G channels at run time (s = max|x| / 448,
               exactly moeflow.quant.formats.quantize_fp8_activations), the weight and activation
               block scales applied per K tile into f32 sums (fp8 x fp8 dots). The intermediate
               activation is quantized the same way in gate_up's epilogue.
    mxfp4      W4A16: weights dequantized in the GEMM's load path to the activations' dtype, bf16 /
    nvfp4      fp16 dots with f32 accumulation (Hopper has no FP4 MMA). Biases and interleaved gate/up
               (gpt-oss) supported. NVFP4 input scales (static activation scales) are not read:
               activations stay bf16 / fp16. The E2M1 codes are decoded by inline PTX on CUDA (the
               same numbers as the Triton decode, which the interpreter runs).

The step and its kernels are the KernelPlan's (moeflow.experts.plan, `impl.plan(...).explain()`): the
aligned path (align, [fp8: quantize x], gate_up, down, combine) with the tiles of
moeflow.tuning.quant_tiles, or for FP4 with few pairs the GEMV path (one program per (pair, BN
outputs), each weight byte decoded once per pair; no alignment).

Modes:
    TritonQuantExperts()                      tiles chosen per T; FP4 with few pairs: the GEMV path.
    TritonQuantExperts(batch_invariant=True)  name "triton_quant_bi": one fixed tile configuration for
                                              every T, no split-K, never the GEMV path: a token's output
                                              bits do not depend on the batch (activation quantization is
                                              per token, so it never mixes rows either). Its fp8 dots
                                              restart the wgmma's reduced-precision accumulation every
                                              KernelRules.fp8_batch_invariant_imprecise_acc products.
Both are deterministic run to run. fp8=False: FP4 formats only (fp8_block layers then run the reference
experts when "auto" chooses).

Numerics against the reference (`reference` runs w.dequantize(float32) on f32 rows):
    fp8_block  differs by the activation quantization (W8A8); against a reference that quantizes the
               activations the same way, by f32 sum order and an fp8 rounding of an intermediate value
               that lands on the other side of a rounding boundary.
    mxfp4/nvfp4  the bf16 weights are exact; differences are the bf16 intermediate activation and the
               sum order.
"""

from __future__ import annotations

import torch

from ..config import ExpertWeights, MoEConfig
from ..tuning import MoETileConfig
from ..tuning.quant_tiles import check_tile_config, quant_group, quant_tile_config
from .fused import FusedExperts, combine_launch
from .options import KernelOptions

__all__ = ["TritonQuantExperts", "IMPL", "quant_group", "quant_tile_config", "check_tile_config", "combine_launch"]

_ACT_DTYPES = (torch.bfloat16, torch.float16)
# fp8_block K blocks the kernels compile (BK = bk: one weight scale a K tile).
_FP8_BK = (32, 64, 128, 256)


class TritonQuantExperts(FusedExperts):
    """Fused Triton experts for quantized weights. See the module docstring.

    batch_invariant, tile_config (checked per format), allow_cpu, options, tma: see
    moeflow.experts.fused.FusedExperts. fp8: run fp8_block weights (default True); False: FP4 only.
    """

    name = "triton_quant"
    _supports_what = ("fused Triton kernels for quantized weights: fp8_block W8A8, mxfp4 / nvfp4 W4A16; "
                      "bf16 / fp16 activations")
    # Every format runs here by default, in both modes. The batch-invariant fp8 tiles (BM 64, fp8 wgmma)
    # restart the wgmma's ~13-bit accumulation (KernelRules.fp8_batch_invariant_imprecise_acc) so a
    # requantized activation at an e4m3 rounding tie keeps its code: within the 1e-2 rel-L2 bound of the
    # W8A8 reference, bitwise batch invariant. fp8=False leaves fp8_block checkpoints to the reference
    # experts (weight-only dequantization).
    quant_formats = ("fp8_block", "mxfp4", "nvfp4")

    def __init__(self, *, batch_invariant: bool = False, tile_config: MoETileConfig | None = None,
                 allow_cpu: bool = False, fp8: bool | None = None, options: KernelOptions | None = None,
                 tma: bool | None = None) -> None:
        if fp8 is None:
            fp8 = True
        if not isinstance(fp8, bool):
            raise TypeError(f"TritonQuantExperts.fp8={fp8!r}: expected a bool or None")
        super().__init__(batch_invariant=batch_invariant, tile_config=tile_config, allow_cpu=allow_cpu,
                         options=options, tma=tma)
        if not fp8:
            self.quant_formats = ("mxfp4", "nvfp4")
        self.name = "triton_quant_bi" if batch_invariant else "triton_quant"

    def supports_quant(self, spec) -> tuple[bool, str]:
        """(ok, why not) for weights quantized as `spec` (a QuantSpec; None = plain weights).

        The fp8_block kernels take one weight scale a K tile, so bk must be a tile width they compile:
        32, 64, 128 or 256 (released checkpoints use 128).
        """
        if spec is None:
            return False, "plain weights: use 'triton'"
        if spec.format not in self.quant_formats:
            return False, f"format {spec.format!r} not in {self.quant_formats}"
        if spec.format == "fp8_block" and spec.block[1] not in _FP8_BK:
            return False, (f"QuantSpec.block={spec.block}: the fp8_block kernels need bk (the K block, one "
                           f"scale a tile) in {_FP8_BK}")
        return True, ""

    def uses_gemv(self, w: ExpertWeights, num_pairs: int, top_k: int = 1) -> bool:
        """Whether a call of num_pairs (token, slot) pairs runs the FP4 GEMV path (the plan's path)."""
        if w.quant is None or w.quant.format not in ("mxfp4", "nvfp4") or num_pairs < 1:
            return False
        return self.plan(w, max(1, num_pairs // top_k), top_k, pairs=num_pairs).path == "gemv"

    def tile_config_for(self, w: ExpertWeights, top_k: int, num_tokens: int) -> MoETileConfig:
        """The aligned path's MoETileConfig for a call of num_tokens tokens (quant_tile_config, or the forced one)."""
        if self.tile_config is not None:
            check_tile_config(self.tile_config, w.quant.format, quant_group(w.quant))
            return self.tile_config
        from .devices import device_facts

        d = device_facts(w.device)
        from .base import tiling_experts

        return quant_tile_config(w.quant.format, quant_group(w.quant), tiling_experts(self, w), w.hidden_size,
                                 w.intermediate_size, top_k, max(1, num_tokens), batch_invariant=self.batch_invariant,
                                 sm_count=d.sm_count, small=w.device.type == "cpu")

    # ------------------------------------------------------------------ checks
    def _check_weights(self, w: ExpertWeights) -> None:
        spec = w.quant
        if spec is None or spec.format not in self.quant_formats:
            got = None if spec is None else spec.format
            raise ValueError(f"ExpertWeights.quant format {got!r}: experts impl {self.name!r} runs "
                             f"{self.quant_formats} (plain weights: 'triton')")
        ok, why = self.supports_quant(spec)
        if not ok:
            raise ValueError(f"experts impl {self.name!r} refuses these weights: {why}")

    def _check_pairs(self, x_NH, expert_N, w: ExpertWeights, config: MoEConfig) -> None:
        # Not base.check_pairs: that one wants x in the weights' dtype, here the storage dtype.
        if not isinstance(x_NH, torch.Tensor):
            raise TypeError(f"x_NH: expected a torch.Tensor, got {type(x_NH).__name__}")
        self._check_x(x_NH, w, "x_NH")
        if x_NH.dim() != 2 or x_NH.shape[1] != w.hidden_size:
            raise ValueError(f"x_NH: shape {tuple(x_NH.shape)}, expected (N, H={w.hidden_size})")
        if not isinstance(expert_N, torch.Tensor) or expert_N.dim() != 1 or expert_N.shape[0] != x_NH.shape[0]:
            raise ValueError(f"expert_N: shape {tuple(getattr(expert_N, 'shape', ()))}, expected "
                             f"({x_NH.shape[0]},) (one id per row)")
        if expert_N.dtype.is_floating_point or expert_N.dtype == torch.bool:
            raise TypeError(f"expert_N: dtype {expert_N.dtype}, expected an integer dtype")
        if expert_N.device != x_NH.device:
            raise ValueError(f"expert_N: on {expert_N.device}, expected x_NH's device {x_NH.device}")

    @staticmethod
    def _check_x(x: torch.Tensor, w: ExpertWeights, name: str) -> None:
        if x.dim() != 2:
            raise ValueError(f"{name}: shape {tuple(x.shape)}, expected a 2-D tensor")
        if x.dtype not in _ACT_DTYPES:
            raise TypeError(f"{name}: dtype {x.dtype}, expected bfloat16 or float16 activations")
        if x.device != w.device:
            raise ValueError(f"{name}: on {x.device}, expected the experts' device {w.device}")
        if x.shape[1] > 1 and x.stride(1) != 1:
            raise ValueError(f"{name}: stride {x.stride()}, expected unit stride along H")


IMPL = TritonQuantExperts()
