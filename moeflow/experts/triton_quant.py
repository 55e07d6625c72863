"""`triton_quant` experts: fused GPU kernels that run quantized expert weights from their stored bytes.

Legend: T tokens, K slots per token, N = T*K (token, slot) pairs (pair n = t*K + k), H hidden,
I intermediate per expert, E experts held, P padded positions, S split-K parts of the down GEMM,
G the quantization group along a GEMM's reduction axis (fp8_block: the weight block's bk, 128 in
released checkpoints; mxfp4 32; nvfp4 16).

Formats (`w.quant.format`; storage rules in moeflow.quant.experts):
    fp8_block  W8A8: activations quantized per token per G channels at run time (s = max|x| / 448,
               exactly moeflow.quant.formats.quantize_fp8_activations), the weight and activation
               block scales applied per K tile into f32 sums (fp8 x fp8 dots). The intermediate
               activation is quantized the same way in gate_up's epilogue.
    mxfp4      W4A16: weights dequantized in the GEMM's load path to the activations' dtype,
    nvfp4      bf16 / fp16 dots with f32 accumulation (Hopper has no FP4 MMA). Biases and
               interleaved gate/up (gpt-oss) supported. NVFP4 input scales (static activation
               scales) are not read: activations stay bf16 / fp16. The E2M1 codes are decoded by
               inline PTX on CUDA (FP4_DECODE_ASM; the same bits as the Triton decode, which the
               interpreter runs). Triton's tl.dot_scaled was tried for MXFP4 and dropped: not the
               same bits, slower at prefill (benchmarks/RESULTS.md, 2026-12-03).

Pipeline of one call (no host sync: capturable in a CUDA graph, replayable):
    align    ids -> sorted_P, block_expert_B               moeflow.kernels.moe_align (shared)
    [fp8]    xq_MH, xs_MG = quantize(x rows)               one small pass
    gate_up  act = act(x @ W_gu[e] (+ b_gu))               fp8: act quantized -> aq_PI, as_PG
    down     y_SNH = act @ W_d[e] (+ b_d)                  split-K partials for decode shapes
    combine  out_TH = sum_k w[t,k] * sum_s y[s, t*K+k]     moe_gemm's combine, slot order
FP4 decode (N <= _GEMV_MAX_PAIRS pairs, default mode): no align; GEMV kernels, one program per
(pair, BN outputs), gate_up -> act_NI, down -> y_1NH, then the same combine. An MMA tile has
16 rows, so at 1..2 pairs per expert it computed 8-16x the products and decoded every weight
tile per 16-row block; the GEMV decodes each weight byte once per pair, a packed int32 word
(8 values) per inline-PTX block that also runs the word's fma chain against the activations,
which each thread holds in registers (moe_gemm_quant._w4_gemv_rows).
Kernels: moeflow/kernels/moe_gemm_quant.py (and the shared align / combine kernels); the fp8 GEMMs of
BM >= 64 tiles (prefill) run moeflow/kernels/moe_gemm_fp8_tma.py's TMA forms on Hopper (`tma`), the same
bits as the pointer kernels at the same tiles.

Modes:
    TritonQuantExperts()                      tiles chosen per T (heuristics, `quant_tile_config`);
                                              FP4 with few pairs: the GEMV path (`uses_gemv`).
    TritonQuantExperts(batch_invariant=True)  name "triton_quant_bi": one fixed tile configuration
                                              for every T, no split-K, never the GEMV path: a token's
                                              output bits do not depend on the batch (activation
                                              quantization is per token, so it never mixes rows either).
                                              Its fp8 dots restart the wgmma's reduced-precision
                                              accumulation every FP8_BI_IMPRECISE_ACC products.
Both are deterministic run to run. fp8=False: FP4 formats only (fp8_block layers then run the
reference experts when "auto" chooses).

Numerics against the reference (`reference` runs w.dequantize(float32) on f32 rows):
    fp8_block  differs by the activation quantization (W8A8); against a reference that quantizes
               the activations the same way, by f32 sum order and an fp8 rounding of an
               intermediate value that lands on the other side of a rounding boundary.
    mxfp4/nvfp4  the bf16 weights are exact; differences are the bf16 intermediate activation
               (act_PI, as the bf16 pipeline of moeflow.experts.triton) and the sum order.

Triton is imported only inside the launch functions: importing this module needs neither
Triton nor CUDA, and `supports` says why it refuses when either is missing. Ids are expected in
[0, E): a pair with an id outside is never computed and turns its token's row to NaN.
"""

from __future__ import annotations

import math

import torch

from .._triton import INTERPRETED, triton_available
from ..config import ExpertWeights, MoEConfig
from ..tuning import GemmTile, MoETileConfig
from .base import check_token_devices, check_tokens, flat_pairs, tiling_experts
from .triton import (
    _ACT_CODES,
    _launch_tma,
    _sm_count,
    _tma_weights_ok,
    combine_launch,
    fused_gate_up_ok,
    gate_up_descriptor,
    max_blocks_for,
    tma_gemm_programs,
    tma_wanted,
)

_FORMAT_CODES = {"fp8_block": 0, "mxfp4": 1, "nvfp4": 2}
_ACT_DTYPES = (torch.bfloat16, torch.float16)
# FP8 activation quantization: groups per program of the row-quantization pass, and its warps. H100,
# 2026-12-06 (benchmarks/RESULTS.md; do_bench, L2 flushed): 8 groups on 2 warps against 4 on 4 took
# 23.8 / 29.1 us at 8192 x 2048, 66.6 / 86.3 at 8192 x 7168, 21.6 / 27.1 at 2048 x 7168 (same bits:
# each group's numbers do not depend on the split).
_QUANT_GROUPS_PER_PROGRAM = 8
_QUANT_WARPS = 2
# The fp8 down GEMM as a warp-specialised Gluon kernel (moeflow/kernels/moe_gemm_fp8_ws.py: a TMA producer
# warp, two consumer warp groups sharing each tile by columns, mbarriers only, so one's per-K-step scaling
# overlaps the other's wgmmas) where fp8_ws_down_tiles serves the plan (BM 64, f32 weight scales, one split,
# default accumulation). Off: the same bits as the Triton kernel on the H100 (2026-12-06), but slower:
# deepseek-v3 T = 8192 10341 against 9361 us, qwen3-30b-a3b-fp8 1228 against 1158 (benchmarks/RESULTS.md,
# fourteenth session; ncu: it reads its weights from DRAM about twice, as the bf16 Gluon kernels do).
FP8_WS_DOWN = False
# The fp8 gate_up the same way (moe_gemm_fp8_ws.moe_gate_up_fp8_ws_kernel: 64-row tiles of one 128-column
# quantization group, its columns split between the consumers). True / False: always / never where it serves;
# None (default): where the K loop is long, H >= FP8_WS_GATE_UP_MIN_H. The same bits as the Triton kernel. One
# CTA a tile (triton_ws.WS_TILE_GRID), H100, T = 8192 (benchmarks/RESULTS.md, fifteenth session): deepseek-v3
# (H = 7168, 56 K steps) 9226 against 9867 us for the whole fp8 layer (2-7% in three runs); qwen3-235b-a22b-fp8
# (H = 4096) and glm-4.5-fp8 (H = 5120) level with the Triton kernel (within the rotation's 1.4-2.8% noise);
# qwen3-30b-a3b-fp8 (H = 2048, 16 K steps) 1181 against 1143, where the per-tile prologue and epilogue weigh
# more against the shorter loop.
FP8_WS_GATE_UP: bool | None = None
FP8_WS_GATE_UP_MIN_H = 4096
# FP4 GEMV path (decode): at most this many (token, slot) pairs (gpt-oss K=4: T <= 32). gpt-oss-120b
# on the H200 (benchmarks/RESULTS.md, 2026-12-03, seventh session): the GEMV
# beat the MMA tiles 1.7x at T = 16 and 1.3x at T = 32 (N = 64, 128); its cost grows with pairs,
# the MMA tiles' with distinct experts, which stop growing near E.
_GEMV_MAX_PAIRS = 128
# fp8_block K blocks the kernels compile (BK = bk: one weight scale a K tile).
_FP8_BK = (32, 64, 128, 256)
# GEMV tiles: BN outputs per program (x2 rows for interleaved gate/up), BK reduction elements a step
# (BK/8 packed int32 words of each row), warps. From a hidden size of _GEMV_LONG_H the narrow tile with a
# long K step (16 rows x 512 bytes in flight a step); else up to _GEMV_FEW_PAIRS pairs the narrow tile
# (more programs), above it the wider one (more rows per thread share its activations).
# H100, sixteenth session (benchmarks/diag_gemv_tiles.py against the earlier tiles in the same run; ncu: the
# NVFP4 gate_up at deepseek-v3 T = 1 stalled on its loads, no unit above 53%): deepseek-v3-nvfp4 (H 7168)
# T = 1 / 2 / 8: 106.2 / 186.3 / 628.5 us against 119.1 / 210.9 / 664.0. gpt-oss-120b (H 2880) gained
# nothing from BK 1024 (T = 1 46.3 against 46.1 us, T = 2 73.0 against 70.3, T = 8 216 against 200).
_GEMV_FEW_PAIRS = 8
_GEMV_LONG_H = 4096
_GEMV_TILES_LONG_K = dict(block_n=16, block_k=1024, num_warps=4)
_GEMV_TILES_FEW = dict(block_n=16, block_k=512, num_warps=4)
_GEMV_TILES = dict(block_n=32, block_k=256, num_warps=4)
_GEMV_TILES_SMALL = dict(block_n=16, block_k=64, num_warps=4)  # interpreter / CPU
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
# FP4 kernels decode E2M1 bytes with inline PTX (moe_gemm_quant._FP4_DECODE_PTX: two values per
# few integer ops) on CUDA; the same numbers as the Triton decode, which the interpreter runs
# (it has no inline asm) and which False selects everywhere (A/B, tests).
FP4_DECODE_ASM = True
# FP8 tiles whose BN output columns lie in one weight-scale block (BN divides the block's bn, as in
# every released checkpoint's 128 x 128) take one weight scale a K step: acc + dot * (sa * sw), the
# next step's scales loaded ahead (moe_gemm_quant.SCALAR_WS). The H200 compile of deepseek-v3's
# prefill gate_up tile (BM 64, BN 128, 8 warps) went from 255 registers and a spill, 359 loop
# instructions (a pointer and a load per column scale), to 180 registers and 208 (benchmarks/
# sass_mix.py). False keeps the per-column scales everywhere (A/B, benchmarks/diag_fp8_prefill.py).
FP8_SCALAR_WS = True
# The batch-invariant mode's fp8 dots take max_num_imprecise_acc = this (None: Triton's default). The fp8
# wgmma accumulates a K tile's k32 steps at ~13 bits (benchmarks/fp8_mma_model.py), which flips the
# requantized activation's e4m3 code where it sits at a rounding tie (FP8_BI_MISS: 2.6e-2 at T = 1).
# 64 restarts that accumulation every two k32 steps with an f32 sum in between: the model puts
# FP8_BI_MISS's cases at <= 6.4e-3 (32: the same, at 192 instead of 64 extra FADDs a K step and a
# wait per k32; sm_90a compile of the BM 64 gate_up: 253 registers, no spill, 2 waits a K step).
FP8_BI_IMPRECISE_ACC: int | None = 64


def _gemv_asm(t: torch.Tensor) -> bool:
    """The FP4 kernels' inline PTX for tensors on t's device (module flag FP4_DECODE_ASM; CUDA, not the
    interpreter). The GEMV's asm block takes one packed word: no tile constraint."""
    return FP4_DECODE_ASM and t.device.type == "cuda" and not INTERPRETED


def _fp4_asm(t: torch.Tensor, rows: int, block_k: int, num_warps: int) -> bool:
    """The MMA tiles' ASM constexpr (_gemv_asm) for a packed weight tile of rows x block_k/2 bytes:
    their asm block takes 4 bytes of one thread, so the tile must give every thread a multiple of 4
    (narrower tiles keep the Triton decode)."""
    return _gemv_asm(t) and rows * (block_k // 2) % (4 * 32 * num_warps) == 0


def _pairs_aligned(t: torch.Tensor) -> bool:
    """Rows of t (16-bit elements, unit stride) start on 4 bytes: the GEMV reads them as int32 pairs."""
    return t.data_ptr() % 4 == 0 and t.stride(0) % 2 == 0


def _gemv_weights_ok(w: ExpertWeights) -> bool:
    """The GEMV reads each packed weight row as int32 words: unit stride along K, rows and base on 4 bytes."""
    return all(t.stride(-1) == 1 and t.stride(1) % 4 == 0 and t.stride(0) % 4 == 0 and t.data_ptr() % 4 == 0
               for t in (w.gate_up, w.down))


def quant_group(spec) -> int:
    """G: the scale group along the reduction axis (fp8_block: bk; mxfp4 32; nvfp4 16)."""
    return spec.block[1] if spec.format == "fp8_block" else {"mxfp4": 32, "nvfp4": 16}[spec.format]


def _split_for(active_blocks: int, n_tiles: int, k_tiles: int, sm_count: int) -> int:
    """Smallest split of the down GEMM giving >= 2 programs per SM, keeping >= 2 K tiles per split."""
    split = 1
    while active_blocks * n_tiles * split < 2 * sm_count and split < 8 and k_tiles // (split * 2) >= 2:
        split *= 2
    return split


def quant_tile_config(fmt: str, group: int, num_experts: int, hidden_size: int, intermediate_size: int,
                      top_k: int, num_tokens: int, *, batch_invariant: bool = False, sm_count: int = 132,
                      small: bool = False) -> MoETileConfig:
    """The tile configuration of the quantized kernels (pure Python: heuristics, no tuned tables yet).

    fp8_block: BK = G for both GEMMs (one scale a tile) and gate_up BN = G (the epilogue
    quantizes whole groups of I), or a divisor of G at decode when G-wide tiles give too few
    programs (a separate pass then quantizes the activation). FP4: BK a multiple of G and >= 32
    (16-byte packed loads).
    Regimes follow rows per used expert ~ T*K / min(T*K, E), as moeflow.tuning.default_config:
    decode tiles (BM = 16, split-K down GEMM so the weight stream covers every SM), then wider
    tiles. batch_invariant: one configuration whatever T, no split-K. small: the interpreter /
    CPU path (one stage, narrow tiles).
    """
    E, H, I, K = num_experts, hidden_size, intermediate_size, top_k
    fp8 = fmt == "fp8_block"
    if small:
        bk = group if fp8 else max(32, group)
        gu = GemmTile(block_n=group if fp8 else 16, block_k=bk, num_warps=4, num_stages=1)
        dn = GemmTile(block_n=16, block_k=bk, num_warps=4, num_stages=1, split_k=1 if batch_invariant else 2)
        return MoETileConfig(block_m=16, gate_up=gu, down=dn)
    if batch_invariant:
        if fp8:
            gu = GemmTile(block_n=group, block_k=group, num_warps=8, num_stages=3)
            dn = GemmTile(block_n=128, block_k=group, num_warps=8, num_stages=4)
        else:
            gu = GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=3)
            dn = GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=3)
        return MoETileConfig(block_m=64, gate_up=gu, down=dn)
    n_pairs = max(1, num_tokens) * K
    used = min(n_pairs, E)
    rows = n_pairs / used
    if rows <= 16:
        bk = group if fp8 else 128
        if fp8:
            # Narrower than a group only when whole groups give less than one program per SM (the
            # activation is then quantized by a separate pass). deepseek-v3 on the H200
            # (benchmarks/diag_quant_tiles.py, 2026-12-03): T = 1 (8 experts x 16 tiles of 128 = 128
            # programs) BN 64 127 us, BN 32 136, BN 128 135; T = 2 (256 programs) BN 128 214 us, 64 229.
            widths = [bn for bn in (group, 64, 32) if bn <= group and group % bn == 0]
            bn_gu = next((bn for bn in widths if used * math.ceil(I / bn) >= sm_count), widths[-1])
            gu = GemmTile(block_n=bn_gu, block_k=bk, num_warps=4, num_stages=4)
        else:
            bn_gu = 64 if used * math.ceil(I / 64) >= 2 * sm_count else 32
            gu = GemmTile(block_n=bn_gu, block_k=bk, num_warps=4, num_stages=4)
        bn_d = 64 if used * math.ceil(H / 64) >= sm_count else 32
        split = _split_for(used, math.ceil(H / bn_d), math.ceil(I / bk), sm_count)
        if fp8 and split == 1 and math.ceil(I / bk) >= 8:
            # Two K halves even with enough programs: deepseek-v3 T = 1 (896 programs of BN 64)
            # 119 us at S = 2 against 136 at S = 1; T = 2 224 vs 229, T = 4 equal (same run as above).
            split = 2
        dn = GemmTile(block_n=bn_d, block_k=bk, num_warps=4, num_stages=4, split_k=split)
        return MoETileConfig(block_m=16, gate_up=gu, down=dn)
    if fp8:
        # gate_up holds two f32 accumulators (gate, up) and a fresh per-tile dot result of each:
        # BM = 128 spills at any warp count (sm_90 compile, 255 registers); BM = 64 with 8 warps
        # (two warpgroups splitting N) is the widest tile that nearly fits (48 B of stack).
        if rows <= 32:
            gu = GemmTile(block_n=group, block_k=group, num_warps=4, num_stages=3)
            dn = GemmTile(block_n=64, block_k=group, num_warps=4, num_stages=4)
            return MoETileConfig(block_m=32, gate_up=gu, down=dn)
        # BM 64 (the TMA kernels on Hopper, moeflow.kernels.moe_gemm_fp8_tma). Round-robin on the H200
        # (benchmarks/diag_fp8_prefill.py, 2026-12-04): gate_up 4 stages, GROUP_M 16 and a 4-warp
        # down (BN 128) against 3 stages, GROUP_M 8 and 8 warps: deepseek-v3 T = 2048 3722 vs 4135 us,
        # T = 8192 9751 vs 11363; qwen3-30b-a3b-fp8 T = 2048 382 vs 406, T = 8192 1208 vs 1231.
        gu = GemmTile(block_n=group, block_k=group, num_warps=8, num_stages=4, group_m=16)
        dn = GemmTile(block_n=128, block_k=group, num_warps=4, num_stages=4, group_m=16)
        return MoETileConfig(block_m=64, gate_up=gu, down=dn)
    if rows <= 64:
        bm = 32 if rows <= 32 else 64
        gu = GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=3)
        dn = GemmTile(block_n=64, block_k=64, num_warps=4, num_stages=3)
        return MoETileConfig(block_m=bm, gate_up=gu, down=dn)
    bm = 128 if rows >= 128 else 64
    gu = GemmTile(block_n=64, block_k=64, num_warps=8 if bm == 128 else 4, num_stages=3)
    dn = GemmTile(block_n=128, block_k=64, num_warps=8, num_stages=3)
    return MoETileConfig(block_m=bm, gate_up=gu, down=dn)


def check_tile_config(cfg: MoETileConfig, fmt: str, group: int) -> None:
    """ValueError naming the field when a tile configuration cannot run format `fmt` (group G)."""
    if cfg.half_tail:
        raise ValueError("MoETileConfig.half_tail=True: the quantized kernels have no half-height tiles "
                         "(expected False)")
    if fmt == "fp8_block":
        for name, t in (("gate_up", cfg.gate_up), ("down", cfg.down)):
            if t.block_k != group:
                raise ValueError(f"MoETileConfig.{name}.block_k={t.block_k}: fp8_block needs block_k == the "
                                 f"scale block bk = {group} (one scale a K tile)")
        bn = cfg.gate_up.block_n
        if bn % group and group % bn:
            raise ValueError(f"MoETileConfig.gate_up.block_n={bn}: fp8_block needs a multiple of bk = {group} "
                             f"(the epilogue quantizes whole groups of I) or a divisor of it (a separate pass "
                             f"quantizes)")
        return
    for name, t in (("gate_up", cfg.gate_up), ("down", cfg.down)):
        if t.block_k % group or t.block_k < 32:
            raise ValueError(f"MoETileConfig.{name}.block_k={t.block_k}: {fmt} needs a multiple of its group "
                             f"{group} and >= 32")


class TritonQuantExperts:
    """Fused Triton experts for quantized weights. See the module docstring for the pipeline and modes.

    batch_invariant: one fixed tile configuration for every T (bitwise batch invariance).
    tile_config:     force this MoETileConfig for every call (tests); checked per format.
    allow_cpu:       accept CPU tensors (only meaningful under TRITON_INTERPRET=1).
    tma:             fp8_block GEMMs of BM >= 64 (prefill) with TMA weight tiles
                     (moeflow.kernels.moe_gemm_fp8_tma) where the shapes allow: None (default) as
                     TritonExperts (Hopper or newer unless MOEFLOW_TMA=0), True wherever the shapes
                     allow (the interpreter runs them too), False never.
    """

    name = "triton_quant"
    graph_capturable = True  # no host sync; the GPU tests replay it from CUDA graphs
    device_types = ("cuda",)
    # Every format runs here by default. FP8 W8A8 was opt-in while it missed its accuracy bound
    # against the W8A8 reference on the H200 (rel-L2 1.0e-2 .. 2.6e-2, bound 1e-2); the cause was
    # the reference: on CUDA its `amax / 448` multiplied by fl(1/448), so exact ties of bf16
    # activations rounded otherwise than in the kernels (fixed 2026-12-03:
    # moeflow.quant.formats.div_by_const). The GPU tests then passed for the default mode
    # (rel-L2 1.6e-3 .. 2.4e-3), but the batch-invariant tiles (BM = 64, fp8 wgmma) gave 2.6e-2 for
    # one token of an E=8 H=256 I=256 layer where BM = 16 tiles gave 1.7e-3 (T = 7, 64: 2e-3 .. 4e-3;
    # benchmarks/diag_fp8_stages.py --woi; the Triton interpreter runs those BM = 64 tiles within
    # 1.7e-3). Cause (benchmarks/fp8_mma_model.py, which reproduces the H200's numbers): the fp8
    # wgmma's ~13-bit accumulation flips the e4m3 code of a large activation sitting at a rounding
    # tie. Fix: the batch-invariant mode's fp8 dots restart that accumulation every
    # FP8_BI_IMPRECISE_ACC products with f32 sums in between (H100, 2026-12-05: the case within 1e-2,
    # bitwise batch invariant, and +10% time over the default mode at deepseek-v3 T = 8192), so FP8 is
    # on in both modes. fp8=False leaves fp8_block checkpoints to the reference experts (weight-only
    # dequantization).
    quant_formats = ("fp8_block", "mxfp4", "nvfp4")

    def __init__(self, *, batch_invariant: bool = False, tile_config: MoETileConfig | None = None,
                 allow_cpu: bool = False, fp8: bool | None = None, tma: bool | None = None) -> None:
        if fp8 is None:
            fp8 = True  # both modes (see quant_formats' comment)
        if not isinstance(fp8, bool):
            raise TypeError(f"TritonQuantExperts.fp8={fp8!r}: expected a bool or None")
        if not fp8:
            self.quant_formats = ("mxfp4", "nvfp4")
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"TritonQuantExperts.batch_invariant={batch_invariant!r}: expected a bool")
        if tile_config is not None and not isinstance(tile_config, MoETileConfig):
            raise TypeError(
                f"TritonQuantExperts.tile_config: expected a MoETileConfig, got {type(tile_config).__name__}")
        if tma is not None and not isinstance(tma, bool):
            raise TypeError(f"TritonQuantExperts.tma={tma!r}: expected None or a bool")
        self.tma = tma
        self.batch_invariant = batch_invariant
        self.name = "triton_quant_bi" if batch_invariant else "triton_quant"
        self.tile_config = tile_config
        self.allow_cpu = allow_cpu
        if allow_cpu:
            self.device_types = ("cuda", "cpu")
        self._cfg_cache: dict[tuple, MoETileConfig] = {}
        self.tiling_experts: int | None = None  # see TritonExperts.__init__ and experts.base.tiled_as

    def __repr__(self) -> str:
        return f"TritonQuantExperts(batch_invariant={self.batch_invariant})"

    # ------------------------------------------------------------------ selection
    def supports(self, config: MoEConfig) -> tuple[bool, str]:
        if not isinstance(config, MoEConfig):
            return False, f"config: expected MoEConfig, got {type(config).__name__}"
        if not triton_available():
            return False, "the triton package is not installed"
        if not self.allow_cpu and not torch.cuda.is_available():
            return False, "needs a CUDA device (torch.cuda.is_available() is False)"
        if config.activation not in _ACT_CODES:
            return False, f"activation {config.activation!r} has no fused kernel (have {tuple(_ACT_CODES)})"
        return True, ("fused Triton kernels for quantized weights: fp8_block W8A8, mxfp4 / nvfp4 W4A16; "
                      "bf16 / fp16 activations")

    def supports_quant(self, spec) -> tuple[bool, str]:
        """(ok, why not) for weights quantized as `spec` (a QuantSpec; None = plain weights).

        The fp8_block kernels take one weight scale a K tile, so bk must be a tile width they
        compile: 32, 64, 128 or 256 (released checkpoints use 128).
        """
        if spec is None:
            return False, "plain weights: use 'triton'"
        if spec.format not in self.quant_formats:
            return False, f"format {spec.format!r} not in {self.quant_formats}"
        if spec.format == "fp8_block" and spec.block[1] not in _FP8_BK:
            return False, (f"QuantSpec.block={spec.block}: the fp8_block kernels need bk (the K block, one "
                           f"scale a tile) in {_FP8_BK}")
        return True, ""

    def uses_gemv(self, w: ExpertWeights, num_pairs: int) -> bool:
        """Whether a call of num_pairs (token, slot) pairs runs the FP4 GEMV path (module docstring):
        FP4 weights stored with unit-stride, 4-byte-aligned rows (read as int32 words), at most
        _GEMV_MAX_PAIRS pairs, default mode, no forced tile_config."""
        return (w.quant is not None and w.quant.format in ("mxfp4", "nvfp4") and not self.batch_invariant
                and self.tile_config is None and 0 < num_pairs <= _GEMV_MAX_PAIRS and _gemv_weights_ok(w))

    def tile_config_for(self, w: ExpertWeights, top_k: int, num_tokens: int) -> MoETileConfig:
        """The MoETileConfig a call of num_tokens tokens runs with (cached per (shape, T))."""
        spec = w.quant
        group = quant_group(spec)
        if self.tile_config is not None:
            check_tile_config(self.tile_config, spec.format, group)
            return self.tile_config
        dev = w.device
        E = tiling_experts(self, w)
        ck = (spec.format, group, E, w.hidden_size, w.intermediate_size, top_k, str(dev),
              num_tokens, self.batch_invariant)
        cfg = self._cfg_cache.get(ck)
        if cfg is None:
            sms = _sm_count(dev) if dev.type == "cuda" else 132
            cfg = quant_tile_config(spec.format, group, E, w.hidden_size, w.intermediate_size, top_k,
                                    max(1, num_tokens), batch_invariant=self.batch_invariant, sm_count=sms,
                                    small=dev.type == "cpu")
            self._cfg_cache[ck] = cfg
        return cfg

    # ------------------------------------------------------------------ entry points
    def forward_tokens(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                       w: ExpertWeights, config: MoEConfig) -> torch.Tensor:
        """out_TH [T, H] (x's dtype) = sum over k in slot order of weights[t,k] * expert_{ids[t,k]}(x[t]).

        With config.router.weight_on_input (llama4) the weight scales the expert's input
        instead (rounded to x's dtype) and the combine weight is 1.

        Args:
            x_TH: [T, H] bf16 or fp16 on the weights' device, unit stride along H.
            ids_TK: int [T, K], every id in [0, E) (an id outside gives a NaN row).
            weights_TK: float [T, K] combine weights (f32 in moeflow's routing).
            w: quantized experts (w.quant one of `quant_formats`), stored [E, out, in].
            config: the layer's MoEConfig.
        """
        self._check_common(w, config)
        T, K = check_tokens(x_TH, ids_TK, weights_TK, w.hidden_size)
        self._check_x(x_TH, w, "x_TH")
        check_token_devices(x_TH, ids_TK, weights_TK)
        if T == 0 or K == 0:
            return torch.zeros_like(x_TH)
        ids_N, wts_N = flat_pairs(ids_TK, weights_TK)
        on_input = bool(getattr(config.router, "weight_on_input", False))
        if self.uses_gemv(w, T * K):
            return _run_gemv(x_TH, ids_N, wts_N, T, K, w, config, weight_on_input=on_input,
                             combine_weights=not on_input)
        cfg = self.tile_config_for(w, K, T)
        return _run(x_TH, ids_N, wts_N, T, K, w, config, cfg,
                    weight_on_input=on_input, combine_weights=not on_input, tma=tma_wanted(self.tma, w.device),
                    imprecise=self._imprecise())

    def forward_pairs(self, x_NH: torch.Tensor, expert_N: torch.Tensor, w: ExpertWeights,
                      config: MoEConfig) -> torch.Tensor:
        """y_NH [N, H] (x's dtype): row n through expert expert_N[n], unweighted, rows in input order.

        x_NH: bf16 / fp16 [N, H]. Bits of a row depend on the tile configuration, which follows
        N unless batch_invariant=True (then they depend on the row alone).
        """
        self._check_common(w, config)
        if not isinstance(x_NH, torch.Tensor):
            raise TypeError(f"x_NH: expected a torch.Tensor, got {type(x_NH).__name__}")
        self._check_x(x_NH, w, "x_NH")
        # Not base.check_pairs: that one wants x in the weights' dtype, here the storage dtype.
        if x_NH.shape[1] != w.hidden_size:
            raise ValueError(f"x_NH: shape {tuple(x_NH.shape)}, expected (N, H={w.hidden_size})")
        if not isinstance(expert_N, torch.Tensor) or expert_N.dim() != 1 or expert_N.shape[0] != x_NH.shape[0]:
            raise ValueError(f"expert_N: shape {tuple(getattr(expert_N, 'shape', ()))}, expected "
                             f"({x_NH.shape[0]},) (one id per row)")
        if expert_N.dtype.is_floating_point or expert_N.dtype == torch.bool:
            raise TypeError(f"expert_N: dtype {expert_N.dtype}, expected an integer dtype")
        if expert_N.device != x_NH.device:
            raise ValueError(f"expert_N: on {expert_N.device}, expected x_NH's device {x_NH.device}")
        N = int(x_NH.shape[0])
        if N == 0:
            return torch.empty_like(x_NH)
        ids_N = expert_N.to(torch.int32).contiguous()
        if self.uses_gemv(w, N):
            return _run_gemv(x_NH, ids_N, None, N, 1, w, config, weight_on_input=False, combine_weights=False)
        cfg = self.tile_config_for(w, config.top_k, max(1, N // config.top_k))
        return _run(x_NH, ids_N, None, N, 1, w, config, cfg, weight_on_input=False, combine_weights=False,
                    tma=tma_wanted(self.tma, w.device), imprecise=self._imprecise())

    def _imprecise(self) -> int | None:
        """The fp8 dots' max_num_imprecise_acc for this mode (FP8_BI_IMPRECISE_ACC when batch-invariant)."""
        return FP8_BI_IMPRECISE_ACC if self.batch_invariant else None

    # ------------------------------------------------------------------ checks
    def _check_common(self, w: ExpertWeights, config: MoEConfig) -> None:
        if not isinstance(w, ExpertWeights):
            raise TypeError(f"w: expected ExpertWeights, got {type(w).__name__}")
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected MoEConfig, got {type(config).__name__}")
        ok, reason = self.supports(config)
        if not ok:
            raise ValueError(f"experts impl {self.name!r} refuses this config: {reason}")
        spec = w.quant
        if spec is None or spec.format not in self.quant_formats:
            got = None if spec is None else spec.format
            raise ValueError(f"ExpertWeights.quant format {got!r}: experts impl {self.name!r} runs "
                             f"{self.quant_formats} (plain weights: 'triton')")
        ok, why = self.supports_quant(spec)
        if not ok:
            raise ValueError(f"experts impl {self.name!r} refuses these weights: {why}")
        w.check_config(config)
        if w.device.type not in self.device_types:
            raise ValueError(f"ExpertWeights on {w.device}: experts impl {self.name!r} runs on {self.device_types}")

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


# ------------------------------------------------------------------------------ launch plan
class _Plan:
    """Sizes and buffers of one call (every size from shapes alone: no host sync)."""

    def __init__(self, x_MH: torch.Tensor, T: int, K: int, w: ExpertWeights, cfg: MoETileConfig) -> None:
        dev = x_MH.device
        spec = w.quant
        self.fmt, self.G = spec.format, quant_group(spec)
        self.T, self.K, self.N = T, K, T * K
        self.E, self.H, self.I = w.num_experts, w.hidden_size, w.intermediate_size
        self.cfg = cfg
        self.max_blocks = max_blocks_for(self.N, self.E, cfg.block_m)
        self.P = self.max_blocks * cfg.block_m
        self.sorted_P = torch.empty(self.P, dtype=torch.int32, device=dev)
        self.block_expert_B = torch.empty(self.max_blocks, dtype=torch.int32, device=dev)
        if self.fmt == "fp8_block":
            # The intermediate activation goes from gate_up to down already quantized; a gate_up
            # tile narrower than a group leaves it in f32 for the row-quantization pass first.
            self.aq_PI = torch.empty(self.P, self.I, dtype=torch.float8_e4m3fn, device=dev)
            self.as_PG = torch.empty(self.P, -(-self.I // self.G), dtype=torch.float32, device=dev)
            self.quant_out = cfg.gate_up.block_n % self.G == 0
            self.act_PI = None if self.quant_out else torch.empty(self.P, self.I, dtype=torch.float32, device=dev)
        else:
            self.act_PI = torch.empty(self.P, self.I, dtype=x_MH.dtype, device=dev)
        S = cfg.down.split_k
        # One part is the expert's output itself, in x's dtype; split-K partials stay f32.
        self.y_SNH = torch.empty(S, self.N, self.H, dtype=x_MH.dtype if S == 1 else torch.float32, device=dev)
        self.out_TH = torch.empty(T, self.H, dtype=x_MH.dtype, device=dev)
        from ..kernels.pdl import gemm_mode, pdl_for

        # programmatic dependent launch (moeflow/kernels/pdl.py): launch attribute, and the GEMMs' mode
        self.pdl = pdl_for(dev)
        self.pdl_gemm = gemm_mode(self.pdl)
        self.tma = False  # set by _run: the fp8 GEMMs may take TMA tiles
        self.imprecise: int | None = None  # set by _run: the fp8 dots' max_num_imprecise_acc


def _u8(t: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as bytes (Triton reads float8_e8m0fnu storage as uint8)."""
    return t.view(torch.uint8) if (_E8M0 is not None and t.dtype == _E8M0) else t


def _launch_fp8_quant(x_MH: torch.Tensor, G: int, out: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                      pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq_MH float8_e4m3fn, xs_MG f32) of x rows, per row per G channels (quantize_fp8_activations).

    x_MH: bf16 / fp16 / f32 rows; out: the two buffers to fill (allocated if None); pdl: launched
    with programmatic dependent launch (moeflow/kernels/pdl.py).
    """
    from ..kernels.moe_gemm_quant import fp8_quant_rows_kernel

    M, H = x_MH.shape
    ng = -(-H // G)
    if out is not None:
        xq, xs = out
    else:
        xq = torch.empty(M, H, dtype=torch.float8_e4m3fn, device=x_MH.device)
        xs = torch.empty(M, ng, dtype=torch.float32, device=x_MH.device)
    gpp = _QUANT_GROUPS_PER_PROGRAM
    fp8_quant_rows_kernel[(M, -(-ng // gpp))](x_MH, xq, xs, M, H, x_MH.stride(0), xq.stride(0), xs.stride(0),
                                              G=G, GPP=gpp, num_warps=_QUANT_WARPS, PDL=pdl, launch_pdl=pdl)
    return xq, xs


def _launch_gate_up(plan: _Plan, x_rows: torch.Tensor, top_k_div: int, w: ExpertWeights,
                    config: MoEConfig) -> None:
    """The intermediate activation of every placed pair (row of pair n = x_rows[n // top_k_div])."""
    from ..kernels import moe_gemm_quant as kq

    t = plan.cfg.gate_up
    has_bias = w.gate_up_bias is not None
    gu = w.gate_up
    gub = w.gate_up_bias if has_bias else gu  # dummy pointer when no bias
    grid = (plan.max_blocks * math.ceil(plan.I / t.block_n),)
    limit, alpha = float(config.swiglu_limit or 0.0), float(config.gptoss_alpha)
    common = dict(ACT=_ACT_CODES[config.activation], HAS_BIAS=has_bias, BLOCK_M=plan.cfg.block_m,
                  BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, num_warps=t.num_warps,
                  num_stages=t.num_stages, PDL=plan.pdl_gemm, launch_pdl=plan.pdl)
    if plan.fmt == "fp8_block":
        xq, xs = _launch_fp8_quant(x_rows, plan.G, pdl=plan.pdl)
        ws = _u8(w.gate_up_scale)
        sbn = w.quant.block[0]
        if not has_bias and _launch_fp8_gate_up_ws(plan, xq, xs, top_k_div, w, ws, t, sbn, limit, alpha, config):
            return
        if (_fp8_tma_ok(plan, t, sbn) and plan.quant_out and not w.interleaved
                and _tma_weights_ok(t, gu, plan.I, plan.H, w.gate_up_bias)
                and _launch_tma("fp8_gate_up", (plan.cfg.block_m, t), lambda: _launch_fp8_gate_up_tma(
                    plan, xq, xs, top_k_div, w, ws, limit, alpha, config))):
            return
        act = plan.act_PI if plan.act_PI is not None else plan.aq_PI  # dummy pointer when quantized in place
        kq.moe_gate_up_fp8_kernel[grid](
            xq, xs, gu, ws, gub, plan.aq_PI, plan.as_PG, act, plan.sorted_P, plan.block_expert_B,
            plan.N, plan.H, plan.I, top_k_div, plan.max_blocks, sbn, -(-plan.I // sbn),
            xq.stride(0), xs.stride(0), *gu.stride(), *ws.stride(), gub.stride(0),
            plan.aq_PI.stride(0), plan.as_PG.stride(0), act.stride(0), limit, alpha,
            SCALE_E8M0=ws.dtype == torch.uint8, EVEN_K=plan.H % t.block_k == 0, QUANT_OUT=plan.quant_out,
            SCALAR_WS=_fp8_scalar_ws(t, sbn), IMPRECISE=_imprecise_acc(plan, t), **common,
        )
        if not plan.quant_out:
            # Every placed row, padding rows included (their values are never stored by down).
            _launch_fp8_quant(plan.act_PI, plan.G, out=(plan.aq_PI, plan.as_PG), pdl=plan.pdl)
        return
    s = w.gate_up_scale.view(torch.uint8)  # E8M0 / e4m3 bytes, decoded in the kernel
    s2 = w.gate_up_scale_2 if w.gate_up_scale_2 is not None else s  # dummy pointer for mxfp4
    kq.moe_gate_up_w4_kernel[grid](
        x_rows, gu, s, s2, gub, plan.act_PI, plan.sorted_P, plan.block_expert_B,
        plan.N, plan.H, plan.I, top_k_div, plan.max_blocks,
        x_rows.stride(0), *gu.stride(), *s.stride(), s2.stride(0), s2.stride(1) if s2.dim() > 1 else 0,
        gub.stride(0),
        plan.act_PI.stride(0), limit, alpha,
        FMT=_FORMAT_CODES[plan.fmt], G=plan.G, INTERLEAVED=bool(w.interleaved),
        EVEN_K=plan.H % t.block_k == 0,
        ASM=_fp4_asm(gu, t.block_n * (2 if w.interleaved else 1), t.block_k, t.num_warps), **common,
    )


def _launch_down(plan: _Plan, w: ExpertWeights) -> None:
    """y_SNH from the intermediate activation (split-K parts over I)."""
    from ..kernels import moe_gemm_quant as kq

    t = plan.cfg.down
    has_bias = w.down_bias is not None
    dn = w.down
    db = w.down_bias if has_bias else dn  # dummy pointer when no bias
    S = t.split_k
    k_tiles_per_split = math.ceil(math.ceil(plan.I / t.block_k) / S)
    grid = (plan.max_blocks * math.ceil(plan.H / t.block_n), S)
    y = plan.y_SNH
    common = dict(HAS_BIAS=has_bias, EVEN_K=plan.I % t.block_k == 0, BLOCK_M=plan.cfg.block_m,
                  BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, num_warps=t.num_warps,
                  num_stages=t.num_stages, PDL=plan.pdl_gemm, launch_pdl=plan.pdl)
    if plan.fmt == "fp8_block":
        ws = _u8(w.down_scale)
        sbn = w.quant.block[0]
        if S == 1 and not has_bias and _launch_fp8_down_ws(plan, w, ws, t, sbn):
            return
        if (_fp8_tma_ok(plan, t, sbn) and S == 1 and _tma_weights_ok(t, dn, plan.H, plan.I, w.down_bias)
                and _launch_tma("fp8_down", (plan.cfg.block_m, t), lambda: _launch_fp8_down_tma(plan, w, ws))):
            return
        kq.moe_down_fp8_kernel[grid](
            plan.aq_PI, plan.as_PG, dn, ws, db, y, plan.sorted_P, plan.block_expert_B,
            plan.N, plan.H, plan.I, plan.max_blocks, k_tiles_per_split, sbn,
            plan.aq_PI.stride(0), plan.as_PG.stride(0), *dn.stride(), *ws.stride(),
            db.stride(0), y.stride(0), y.stride(1),
            SCALE_E8M0=ws.dtype == torch.uint8, SCALAR_WS=_fp8_scalar_ws(t, sbn),
            IMPRECISE=_imprecise_acc(plan, t), **common,
        )
        return
    s = w.down_scale.view(torch.uint8)
    s2 = w.down_scale_2 if w.down_scale_2 is not None else s  # dummy pointer for mxfp4
    kq.moe_down_w4_kernel[grid](
        plan.act_PI, dn, s, s2, db, y, plan.sorted_P, plan.block_expert_B,
        plan.N, plan.H, plan.I, plan.max_blocks, k_tiles_per_split,
        plan.act_PI.stride(0), *dn.stride(), *s.stride(), s2.stride(0), db.stride(0),
        y.stride(0), y.stride(1),
        FMT=_FORMAT_CODES[plan.fmt], G=plan.G, ASM=_fp4_asm(dn, t.block_n, t.block_k, t.num_warps), **common,
    )


def _imprecise_acc(plan: _Plan, t: GemmTile) -> int | None:
    """The fp8 dots' max_num_imprecise_acc for tile t: plan.imprecise where it is below the dot's K
    (BK); None (Triton's default) else, which then means the same: one restart a K tile, at the scale."""
    return plan.imprecise if plan.imprecise is not None and plan.imprecise < t.block_k else None


def _fp8_scalar_ws(t: GemmTile, sbn: int) -> bool:
    """The fp8 kernels' SCALAR_WS: a tile's BN columns lie in one weight-scale block (FP8_SCALAR_WS)."""
    return FP8_SCALAR_WS and sbn % t.block_n == 0


def _fp8_tma_ok(plan: _Plan, t: GemmTile, sbn: int) -> bool:
    """An fp8 GEMM of this plan may take the TMA kernels (moe_gemm_fp8_tma): allowed on the device, MMA tiles
    of BM >= 64 (the decode tiles, BM 16, keep the pointer kernels they were tuned with), scalar weight scales."""
    return plan.tma and plan.cfg.block_m >= 64 and _fp8_scalar_ws(t, sbn)


def _launch_fp8_gate_up_tma(plan: _Plan, xq: torch.Tensor, xs: torch.Tensor, top_k_div: int, w: ExpertWeights,
                            ws: torch.Tensor, limit: float, alpha: float, config: MoEConfig) -> None:
    """The fp8 gate_up with TMA weight tiles (the caller checked the shapes): aq_PI / as_PG."""
    from ..kernels.moe_gemm_fp8_tma import moe_gate_up_fp8_tma_kernel

    t = plan.cfg.gate_up
    H, I = plan.H, plan.I
    sbn = w.quant.block[0]
    fused = fused_gate_up_ok(I, t.block_n)
    wd = gate_up_descriptor(w.gate_up, t.block_n, t.block_k, fused)
    tiles = plan.max_blocks * (I // t.block_n)
    progs, flat = tma_gemm_programs(t, plan.aq_PI.device, gate_up=True)
    moe_gate_up_fp8_tma_kernel[(progs or tiles,)](
        xq, xs, wd, ws, plan.aq_PI, plan.as_PG, plan.sorted_P, plan.block_expert_B,
        plan.N, H, I, top_k_div, plan.max_blocks, tiles, sbn, -(-I // sbn),
        xq.stride(0), xs.stride(0), *ws.stride(), plan.aq_PI.stride(0), plan.as_PG.stride(0), limit, alpha,
        ACT=_ACT_CODES[config.activation], SCALE_E8M0=ws.dtype == torch.uint8, PERSISTENT=progs > 0,
        NUM_PROGS=max(1, progs), BLOCK_M=plan.cfg.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUP_M=t.group_m, num_warps=t.num_warps, num_stages=t.num_stages, PDL=plan.pdl_gemm, FUSED=fused,
        IMPRECISE=_imprecise_acc(plan, t), FLAT=flat, launch_pdl=plan.pdl,
    )


def _launch_fp8_gate_up_ws(plan: _Plan, xq: torch.Tensor, xs: torch.Tensor, top_k_div: int, w: ExpertWeights,
                           ws: torch.Tensor, t: GemmTile, sbn: int, limit: float, alpha: float,
                           config: MoEConfig) -> bool:
    """The fp8 gate_up by the Gluon kernel (FP8_WS_GATE_UP, its rule) where it serves the plan; False leaves it to the
    Triton kernels. Default accumulation only (plan.imprecise unset), f32 scales, the linear layout."""
    on = plan.H >= FP8_WS_GATE_UP_MIN_H if FP8_WS_GATE_UP is None else FP8_WS_GATE_UP
    if (not on or ws.dtype != torch.float32 or plan.imprecise or not plan.quant_out or w.interleaved
            or w.layout != "linear" or _imprecise_acc(plan, t) is not None):
        return False
    from .triton_ws import fp8_ws_gate_up_stages, launch_gate_up_fp8_ws, ws_device_ok, ws_rows_ok

    stages = fp8_ws_gate_up_stages(plan.cfg.block_m, t.block_n, t.block_k, plan.H, plan.I, sbn,
                                   config.activation)
    if (stages is None or not ws_device_ok(plan.aq_PI) or not w.gate_up.is_contiguous()
            or not ws_rows_ok(xq, xq.dtype)):
        return False
    sms = _sm_count(plan.aq_PI.device)
    return _launch_tma("fp8_ws_gate_up", (plan.cfg.block_m, t.block_k, stages, config.activation),
                       lambda: launch_gate_up_fp8_ws(
                           xq, xs, w.gate_up, ws, plan.aq_PI, plan.as_PG, plan.sorted_P, plan.block_expert_B, plan.N,
                           top_k_div, plan.max_blocks, sbn, t.block_k, stages, config.activation, limit, alpha,
                           t.group_m, sms))


def _launch_fp8_down_ws(plan: _Plan, w: ExpertWeights, ws: torch.Tensor, t: GemmTile, sbn: int) -> bool:
    """The fp8 down GEMM by the Gluon kernel (FP8_WS_DOWN) where it serves the plan; False leaves it to the
    Triton kernels. Its bits are those of the default accumulation (plan.imprecise unset)."""
    if not FP8_WS_DOWN or ws.dtype != torch.float32 or _imprecise_acc(plan, t) is not None or plan.imprecise:
        return False
    from .triton_ws import fp8_ws_down_tiles, launch_down_fp8_ws, ws_device_ok

    tiles = fp8_ws_down_tiles(plan.cfg.block_m, t.block_n, t.block_k, plan.H, plan.I, sbn)
    if tiles is None or not ws_device_ok(plan.aq_PI) or not w.down.is_contiguous():
        return False
    y = plan.y_SNH[0]
    sms = _sm_count(plan.aq_PI.device)
    return _launch_tma("fp8_ws_down", (plan.cfg.block_m, tiles), lambda: launch_down_fp8_ws(
        plan.aq_PI, plan.as_PG, w.down, ws, y, plan.sorted_P, plan.block_expert_B, plan.N, plan.max_blocks, sbn,
        tiles, t.group_m, sms))


def _launch_fp8_down_tma(plan: _Plan, w: ExpertWeights, ws: torch.Tensor) -> None:
    """The fp8 down GEMM with TMA activation and weight tiles (one split; the caller checked the shapes)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ..kernels.moe_gemm_fp8_tma import moe_down_fp8_tma_kernel

    t = plan.cfg.down
    E, H, I, BM = w.down.shape[0], plan.H, plan.I, plan.cfg.block_m
    ad = TensorDescriptor(plan.aq_PI, shape=[plan.P, I], strides=[I, 1], block_shape=[BM, t.block_k])
    wd = TensorDescriptor(w.down, shape=[E * H, I], strides=[I, 1], block_shape=[t.block_n, t.block_k])
    tiles = plan.max_blocks * (H // t.block_n)
    progs, flat = tma_gemm_programs(t, plan.aq_PI.device, cfg_flat=plan.cfg.flat_down)
    y = plan.y_SNH
    moe_down_fp8_tma_kernel[(progs or tiles,)](
        ad, plan.as_PG, wd, ws, y, plan.sorted_P, plan.block_expert_B, plan.N, H, I, plan.max_blocks, tiles,
        w.quant.block[0], plan.as_PG.stride(0), *ws.stride(), y.stride(1),
        SCALE_E8M0=ws.dtype == torch.uint8, PERSISTENT=progs > 0, NUM_PROGS=max(1, progs), BLOCK_M=BM,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, num_warps=t.num_warps,
        num_stages=t.num_stages, PDL=plan.pdl_gemm, IMPRECISE=_imprecise_acc(plan, t), FLAT=flat,
        launch_pdl=plan.pdl,
    )


def _run(x_MH, ids_N, wts_N, T, K, w: ExpertWeights, config: MoEConfig, cfg: MoETileConfig, *,
         weight_on_input: bool, combine_weights: bool, tma: bool = False, imprecise: int | None = None
         ) -> torch.Tensor:
    """Launch the pipeline for T rows of x with K slots each (K=1 for forward_pairs); tma: the fp8
    GEMMs may take TMA tiles (TritonQuantExperts.tma resolved); imprecise: the fp8 dots'
    max_num_imprecise_acc (FP8_BI_IMPRECISE_ACC in the batch-invariant mode)."""
    from ..kernels.moe_align import align_launch

    check_tile_config(cfg, w.quant.format, quant_group(w.quant))
    plan = _Plan(x_MH, T, K, w, cfg)
    plan.tma = tma
    plan.imprecise = imprecise
    align_launch(ids_N, plan.E, cfg.block_m, plan.sorted_P, plan.block_expert_B, pdl=plan.pdl)
    if weight_on_input:
        # llama4: the expert's input is (w * x) rounded to x's dtype, made once before the GEMMs.
        x_rows = (x_MH.unsqueeze(1) * wts_N.view(T, K, 1).to(x_MH.dtype)).reshape(plan.N, plan.H)
        _launch_gate_up(plan, x_rows, 1, w, config)
    else:
        _launch_gate_up(plan, x_MH, K, w, config)
    _launch_down(plan, w)
    combine_launch(plan.y_SNH, wts_N if combine_weights else None, ids_N, plan.out_TH, K, plan.E, pdl=plan.pdl)
    return plan.out_TH


IMPL = TritonQuantExperts()


# ------------------------------------------------------------------------------ FP4 GEMV path
def _run_gemv(x_MH, ids_N, wts_N, T, K, w: ExpertWeights, config: MoEConfig, *, weight_on_input: bool,
              combine_weights: bool) -> torch.Tensor:
    """FP4 decode: T rows of x with K slots (K=1 for forward_pairs) through the GEMV kernels, no align.

    act_NI [N, I] and y_1NH [1, N, H] in x's dtype (rows by pair), then moe_gemm's combine.
    """
    from ..kernels import moe_gemm_quant as kq

    dev, dt = x_MH.device, x_MH.dtype
    N, H, I, E = T * K, w.hidden_size, w.intermediate_size, w.num_experts
    G, FMT = quant_group(w.quant), _FORMAT_CODES[w.quant.format]
    if dev.type == "cpu":
        tiles = _GEMV_TILES_SMALL
    else:
        tiles = (_GEMV_TILES_LONG_K if H >= _GEMV_LONG_H else _GEMV_TILES_FEW if N <= _GEMV_FEW_PAIRS
                 else _GEMV_TILES)
    bn, bk, nw = tiles["block_n"], tiles["block_k"], tiles["num_warps"]
    if weight_on_input:
        # llama4: the expert's input is (w * x) rounded to x's dtype, one row per pair (as _run).
        x_rows, top_k_div = (x_MH.unsqueeze(1) * wts_N.view(T, K, 1).to(dt)).reshape(N, H), 1
    else:
        x_rows, top_k_div = x_MH, K
    if not _pairs_aligned(x_rows):  # an odd row stride or storage offset: a fresh copy starts aligned
        x_rows = torch.empty_like(x_rows, memory_format=torch.contiguous_format).copy_(x_rows)
    act = torch.empty(N, I, dtype=dt, device=dev)
    y = torch.empty(1, N, H, dtype=dt, device=dev)
    out = torch.empty(T, H, dtype=dt, device=dev)
    limit, alpha = float(config.swiglu_limit or 0.0), float(config.gptoss_alpha)
    from ..kernels.pdl import gemm_mode, pdl_for

    pdl = pdl_for(dev)  # programmatic dependent launch (moeflow/kernels/pdl.py)
    gemv_pdl = gemm_mode(pdl)

    gu, s = w.gate_up, w.gate_up_scale.view(torch.uint8)  # E8M0 / e4m3 bytes, decoded in the kernel
    s2 = w.gate_up_scale_2 if w.gate_up_scale_2 is not None else s  # dummy pointer for mxfp4
    gub = w.gate_up_bias if w.gate_up_bias is not None else gu      # dummy pointer without bias
    asm = _gemv_asm(gu)
    kq.moe_gate_up_w4_gemv_kernel[(N, math.ceil(I / bn))](
        x_rows, gu, s, s2, gub, act, ids_N, H, I, E, top_k_div,
        x_rows.stride(0), gu.stride(0), gu.stride(1), *s.stride(), s2.stride(0),
        s2.stride(1) if s2.dim() > 1 else 0, gub.stride(0), act.stride(0), limit, alpha,
        FMT=FMT, G=G, ACT=_ACT_CODES[config.activation], INTERLEAVED=bool(w.interleaved),
        HAS_BIAS=w.gate_up_bias is not None, BLOCK_N=bn, BLOCK_K=bk, ASM=asm, num_warps=nw,
        PDL=gemv_pdl, launch_pdl=pdl,
    )
    dn, s = w.down, w.down_scale.view(torch.uint8)
    s2 = w.down_scale_2 if w.down_scale_2 is not None else s
    db = w.down_bias if w.down_bias is not None else dn
    kq.moe_down_w4_gemv_kernel[(N, math.ceil(H / bn))](
        act, dn, s, s2, db, y, ids_N, H, I, E,
        act.stride(0), dn.stride(0), dn.stride(1), *s.stride(), s2.stride(0), db.stride(0), y.stride(1),
        FMT=FMT, G=G, HAS_BIAS=w.down_bias is not None, BLOCK_N=bn, BLOCK_K=bk, ASM=asm, num_warps=nw,
        PDL=gemv_pdl, launch_pdl=pdl,
    )
    combine_launch(y, wts_N if combine_weights else None, ids_N, out, K, E, pdl=pdl)
    return out
