"""Host side of the warp-specialised gate_up and down GEMMs (moeflow/kernels/moe_gemm_ws.py, Gluon, Hopper).

Legend as in moeflow/experts/triton.py: P padded pair positions, N pairs, H hidden, I intermediate,
BM / BN / BK tile sizes.

`moeflow.experts.triton.WS_DOWN` / `WS_GATE_UP` (off by default) route the bf16 / fp16 down / gate_up
GEMM here where `ws_down_tiles` / `ws_gate_up_tiles` accept the shape: the linear layout (mixtral,
qwen3, deepseek; in place of the Triton TMA kernels) and gpt-oss's matmul layout with interleaved
gate/up columns and biases (in place of the pointer kernels). The kernels give the Triton kernels'
bits: every output element sums the same products in the same K order (k16 wgmma steps, one split),
whatever BM / BN / BK and however the tiles are scheduled. So this module picks its own tiles from the
plan's:
    BM  the alignment's block (act_PI is padded per expert to BM rows), 64 or 128. A consumer
        takes 64 rows a tile (a warp group's wgmma M). coop (BM 128 only): both consumers share a
        128-row tile, 64 rows each; else ping-pong: alternate 64-row tiles, BM / 64 a block. Rows of
        padding only (the second half of a block with <= 64 pairs) are skipped either way
    BN  a power of two (Triton's block shapes) at most 256 for down and 128 for gate_up (one wgmma's
        N: 2BN for gate_up; one consumer's f32 accumulator is then 64 * N / 128 <= ACC_REGS registers
        a thread): the plan's where it fits, else the widest of COLUMN_TILES that does. The linear
        layout needs BN to divide the output width (the weight view [E * N, K] runs on into the next
        expert); in the matmul layout the columns are the view's inner dimension, so the last tile may
        run past them (TMA fills zeros, the stores are masked): gpt-oss's 2880 takes 256 / 128 tiles.
    BK  the plan's, else 64 (where the plan's does not divide the reduction or, for gate_up, leaves
        fewer than GU_MIN_STAGES stages)
    STAGES as many ring stages as fit SMEM_BYTES, at most MAX_STAGES (a stage holds the tile's act
        rows, 128 coop / 64 ping-pong, and the weight box).

The fp8 block-scaled (W8A8) GEMMs of moeflow/kernels/moe_gemm_fp8_ws.py are launched here too
(fp8_ws_down_tiles / launch_down_fp8_ws, fp8_ws_gate_up_stages / launch_gate_up_fp8_ws) where
`moeflow.experts.triton_quant.FP8_WS_DOWN` (off) / `FP8_WS_GATE_UP` (on from H >= 4096) ask for them: BM 64
plans, 64-row tiles whose columns the two consumers split.

Importing this module imports neither Triton nor Gluon (they load at the first launch).
"""

from __future__ import annotations

from functools import lru_cache

import torch

# One consumer warp group's accumulator: at most this many f32 registers a thread (of its 224-232).
ACC_REGS = 128
# Rows of a consumer tile (moe_gemm_ws.TILE_M).
TILE_M = 64
# Shared memory the ring may take (Hopper: 227 KB a block; the rest holds the barriers and the
# compiler's own scratch) and the deepest ring worth having.
SMEM_BYTES = 200 * 1024
MAX_STAGES = 6
# Column tiles tried, widest first, where the plan's BN does not fit.
COLUMN_TILES = (256, 128, 64, 32)
# gate_up: at least GU_MIN_STAGES stages (moe_gemm_ws.GU_COPY_DEPTH stages of row copies in flight, plus
# the one the wgmmas read, plus one).
GU_MIN_STAGES = 4
_WS_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "swiglu_clamp": 2, "gptoss": 3}
# The Gluon kernels' grid: True, one CTA a tile (every tile the used blocks could have, the ones past them exit at
# once), so the hardware hands tiles out in order as CTAs finish, as for the Triton non-persistent kernels; False,
# one persistent CTA an SM walking the tiles p, p + SMs, ... (the grouped order). Why a tile grid (benchmarks/
# RESULTS.md, fourteenth and fifteenth sessions, H100): the persistent Gluon kernels read their weights from DRAM
# about twice as often as the Triton kernels of the same tiles and order (ncu: the bf16 down 18 GB against 9.8,
# the fp8 gate_up 27 GB against 11): statically assigned CTAs drift apart by whole rounds, so the CTAs that share
# a weight box no longer run together. One CTA a tile, deepseek-v3 T = 8192: bf16 Gluon pair 14560 against 17880
# us at Zipf routing (the Triton table 14419), fp8 gate_up 9226 against 9867 for the Triton kernel (persistent:
# 11567, fourteenth session). At qwen3-30b-a3b-fp8 (H = 2048) persistent was the faster of the two, but there the
# Triton kernels run (FP8_WS_GATE_UP's rule).
WS_TILE_GRID = True


# The fp8 down GEMM with its tiles claimed at run time from a global counter (moe_gemm_fp8_ws.
# moe_down_fp8_ws_dyn_kernel): persistent CTAs that stay one contiguous window of the grouped order, however
# they drift. On, it wins over WS_TILE_GRID. Off: level with the Triton down, no faster (deepseek-v3 T = 8192,
# H100, fifteenth session: 9913 against 9867 us for the whole fp8 layer; the tile grid 10372, persistent 11120).
WS_DYNAMIC_TILES = False


@lru_cache(maxsize=8)
def _tile_counter(index: int) -> torch.Tensor:
    """The int32 [1] tile counter of CUDA device index (zeroed before each launch that uses it)."""
    return torch.zeros(1, dtype=torch.int32, device=f"cuda:{index}")


def _programs(num_programs: int, max_tiles: int) -> int:
    """The grid of a Gluon launch: max_tiles (WS_TILE_GRID) or num_programs (persistent, one CTA an SM)."""
    return max(1, max_tiles) if WS_TILE_GRID else num_programs


def _column_tile(want: int, n: int, cap: int, exact: bool) -> int | None:
    """BN, a power of two in [16, cap]: `want` if it fits (divides n when exact), else the widest such of
    COLUMN_TILES; None when none does."""
    for bn in (want, *COLUMN_TILES):
        if 16 <= bn <= cap and bn & (bn - 1) == 0 and (not exact or n % bn == 0):
            return bn
    return None


def _wgmma_dtype(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def ws_down_tiles(block_m: int, block_n: int, block_k: int, H: int, I: int, dtype: torch.dtype,
                  layout: str = "linear", coop: bool = False) -> tuple[int, int, int, int] | None:
    """(BM, BN, BK, STAGES) of the warp-specialised down GEMM for the plan's tiles, or None when it
    does not serve the shape (BM not 64 / 128, or not 128 when coop; no column tile for H, neither the
    plan's BK nor 64 dividing I, a dtype without a bf16 / fp16 wgmma). coop: the cooperative schedule
    (a stage holds 128 act rows, one 64-row half for each consumer), else ping-pong (64)."""
    if not _wgmma_dtype(dtype) or block_m not in ((128,) if coop else (64, 128)):
        return None
    rows = 2 * TILE_M if coop else TILE_M
    bn = _column_tile(block_n, H, min(256, ACC_REGS * 128 // TILE_M), exact=layout == "linear")
    if bn is None:
        return None
    # the plan's BK, else 64 (BK changes no bits: every BK sums the same k16 steps in order; gpt-oss's
    # I 2880 is 22.5 blocks of 128)
    for bk in dict.fromkeys((block_k, 64)):
        stages = min(MAX_STAGES, SMEM_BYTES // ((rows + bn) * bk * 2))
        if I % bk == 0 and bk % 16 == 0 and stages >= 2:
            return block_m, bn, bk, stages
    return None


def ws_gate_up_tiles(block_m: int, block_n: int, block_k: int, H: int, I: int, dtype: torch.dtype,
                     activation: str, layout: str = "linear", interleaved: bool = False, coop: bool = False
                     ) -> tuple[int, int, int, int] | None:
    """(BM, BN, BK, STAGES) of the warp-specialised gate_up, or None where it does not serve: the linear
    layout with gate rows then up rows, or the matmul layout with interleaved columns (gpt-oss); an
    activation with a Gluon form (moe_gemm_ws._ws_activate); a column tile dividing I (2BN <= 256);
    coop as ws_down_tiles."""
    if (not _wgmma_dtype(dtype) or block_m not in ((128,) if coop else (64, 128))
            or activation not in _WS_ACTIVATIONS
            or (layout, bool(interleaved)) not in (("linear", False), ("matmul", True))):
        return None
    bn = _column_tile(block_n, I, min(128, ACC_REGS), exact=layout == "linear")
    if bn is None:
        return None
    rows = 2 * TILE_M if coop else TILE_M
    for bk in dict.fromkeys((block_k, 64)):
        stages = min(MAX_STAGES, SMEM_BYTES // ((rows + 2 * bn) * bk * 2))
        if H % bk == 0 and bk % 16 == 0 and 32 % (bk // 8) == 0 and stages >= GU_MIN_STAGES:
            return block_m, bn, bk, stages
    return None


@lru_cache(maxsize=8)
def _device_ok(index: int) -> bool:
    """Hopper or newer, and this Triton ships Gluon's Hopper warp specialisation."""
    if torch.cuda.get_device_capability(index)[0] < 9:
        return False
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return True


def ws_device_ok(t: torch.Tensor) -> bool:
    """Whether t's device runs the Gluon kernels (CUDA, sm_90+, Gluon importable)."""
    dev = t.device
    return dev.type == "cuda" and _device_ok(dev.index if dev.index is not None else torch.cuda.current_device())


def ws_rows_ok(x_rows: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the gate_up's cp.async row copies can read x_rows: the weights' dtype, unit column
    stride, 16-byte aligned rows."""
    el = x_rows.element_size()
    return (x_rows.dtype == dtype and x_rows.stride(1) == 1 and (x_rows.stride(0) * el) % 16 == 0
            and x_rows.data_ptr() % 16 == 0)


def _descriptor(t2d: torch.Tensor, block: list[int]):
    """A Gluon TensorDescriptor over a 2-D view with unit column stride, its block in the default NVMMA
    shared layout."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    if t2d.stride(1) != 1:
        raise ValueError(f"TMA view: expected a unit column stride, got strides {tuple(t2d.stride())}")
    el = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[t2d.dtype]
    return TensorDescriptor(t2d, list(t2d.shape), [t2d.stride(0), 1], block,
                            gl.NVMMASharedLayout.get_default_for(block, el))


def launch_down_ws(act_PI: torch.Tensor, W: torch.Tensor, bias_EH: torch.Tensor | None, y_NH: torch.Tensor,
                   sorted_P: torch.Tensor, block_expert_B: torch.Tensor, num_pairs: int, max_blocks: int,
                   tiles: tuple[int, int, int, int], layout: str, group_m: int, num_programs: int,
                   coop: bool = False, pace: bool = False) -> None:
    """y_NH[pair] = act_PI[p] @ W_d[e(p)] (+ bias_EH[e(p)]) for every placed pair (moe_gemm_ws.moe_down_ws_kernel).

    act_PI [P, I] and W (contiguous: linear [E, H, I], matmul [E, I, H]) in bf16 / fp16; y_NH [N, H]
    (row stride y_NH.stride(0), unit column stride); sorted_P / block_expert_B the alignment's int32
    buffers; tiles from ws_down_tiles (with the same coop); num_programs the device's SM count (one CTA
    an SM); pace (with coop): padding second halves computed, not skipped (moe_gemm_ws.py, PACE).
    """
    if pace and not coop:
        raise ValueError("launch_down_ws: pace=True needs coop=True (the ping-pong schedule has no halves)")
    from ..kernels.moe_gemm_ws import CONSUMER_WARPS, moe_down_ws_kernel

    BM, BN, BK, stages = tiles
    matmul = layout == "matmul"
    E = W.shape[0]
    H, I = (W.shape[2], W.shape[1]) if matmul else (W.shape[1], W.shape[2])
    ad = _descriptor(act_PI, [2 * TILE_M if coop else TILE_M, BK])  # the act box: a tile's rows
    wd = _descriptor(W.view(E * I, H), [BK, BN]) if matmul else _descriptor(W.view(E * H, I), [BN, BK])
    b = bias_EH if bias_EH is not None else y_NH  # any pointer when there is no bias
    progs = _programs(num_programs, max_blocks * (1 if coop else BM // TILE_M) * -(-H // BN))
    moe_down_ws_kernel[(progs,)](
        ad, wd, y_NH, b, sorted_P, block_expert_B, num_pairs, H, I, max_blocks, y_NH.stride(0), b.stride(0),
        BLOCK_M=BM, MATMUL=matmul, HAS_BIAS=bias_EH is not None, NUM_PROGS=progs, GROUP_M=group_m,
        STAGES=stages, PACE=pace, num_warps=CONSUMER_WARPS.value,
    )


def launch_gate_up_ws(x_rows: torch.Tensor, W: torch.Tensor, bias_E2I: torch.Tensor | None, act_PI: torch.Tensor,
                      sorted_P: torch.Tensor, block_expert_B: torch.Tensor, num_pairs: int, top_k_div: int,
                      max_blocks: int, tiles: tuple[int, int, int, int], layout: str, activation: str, limit: float,
                      alpha: float, group_m: int, num_programs: int, coop: bool = False,
                      pace: bool = False) -> None:
    """act_PI[p] = act(x_rows[pair(p) // top_k_div] @ W_gu[e(p)] (+ bias)) for every placed pair
    (moe_gemm_ws.moe_gate_up_ws_kernel).

    x_rows [M, H] (unit column stride, 16-byte aligned rows); W contiguous, linear [E, 2I, H] (gate rows
    then up rows) or matmul [E, H, 2I] (gate / up columns interleaved, with bias_E2I [E, 2I] or None);
    act_PI [P, I]; all in one dtype (bf16 / fp16); tiles from ws_gate_up_tiles; coop / pace as launch_down_ws.
    """
    if pace and not coop:
        raise ValueError("launch_gate_up_ws: pace=True needs coop=True (the ping-pong schedule has no halves)")
    from ..kernels.moe_gemm_ws import CONSUMER_WARPS, moe_gate_up_ws_kernel

    BM, BN, BK, stages = tiles
    matmul = layout == "matmul"
    E = W.shape[0]
    H, I2 = (W.shape[1], W.shape[2]) if matmul else (W.shape[2], W.shape[1])
    wd = _descriptor(W.view(E * H, I2), [BK, 2 * BN]) if matmul else _descriptor(W.view(E * I2, H), [BN, BK])
    b = bias_E2I if bias_E2I is not None else act_PI  # any pointer when there is no bias
    progs = _programs(num_programs, max_blocks * (1 if coop else BM // TILE_M) * -(-(I2 // 2) // BN))
    moe_gate_up_ws_kernel[(progs,)](
        x_rows, wd, act_PI, b, sorted_P, block_expert_B, num_pairs, H, I2 // 2, top_k_div, max_blocks,
        x_rows.stride(0), act_PI.stride(0), b.stride(0), float(limit), float(alpha),
        ACT=_WS_ACTIVATIONS[activation], BLOCK_M=BM, MATMUL=matmul, HAS_BIAS=bias_E2I is not None,
        NUM_PROGS=progs, GROUP_M=group_m, STAGES=stages, COOP=coop, PACE=pace, num_warps=CONSUMER_WARPS.value,
    )


def fp8_ws_down_tiles(block_m: int, block_n: int, block_k: int, H: int, I: int, sbn: int
                      ) -> tuple[int, int, int] | None:
    """(BN, BK, STAGES) of the warp-specialised fp8 down GEMM (moe_gemm_fp8_ws) for the plan's tiles, or None
    where it does not serve: BM 64 plans only (64-row tiles), BK = the plan's (one scale group a K step)
    dividing I. BN is one consumer's columns: the plan's, at most 128 (the sum and one product in registers),
    dividing the weight-scale block sbn; a tile is 64 x 2BN (both consumers), so 2BN divides H."""
    if block_m != TILE_M or I % block_k or block_k % 32:
        return None
    bn = next((b for b in (min(block_n, 128), 64, 32, 16) if H % (2 * b) == 0 and sbn % b == 0), None)
    if bn is None:
        return None
    stages = min(MAX_STAGES, SMEM_BYTES // ((TILE_M + 2 * bn) * block_k))  # e4m3: one byte a value
    return (bn, block_k, stages) if stages >= 2 else None


def launch_down_fp8_ws(aq_PI: torch.Tensor, as_PG: torch.Tensor, W: torch.Tensor, ws: torch.Tensor,
                       y_NH: torch.Tensor, sorted_P: torch.Tensor, block_expert_B: torch.Tensor, num_pairs: int,
                       max_blocks: int, sbn: int, tiles: tuple[int, int, int], group_m: int,
                       num_programs: int) -> None:
    """y_NH[pair] = sum_kt (aq_PI[p, kt] @ W[e(p)][:, kt]^T) * as_PG[p, kt] * ws[e(p), n // sbn, kt] for every
    placed pair (moe_gemm_fp8_ws.moe_down_fp8_ws_kernel).

    aq_PI [P, I] e4m3 and as_PG [P, I / BK] f32 (gate_up's quantized output), W [E, H, I] e4m3 contiguous, ws
    [E, ceil(H / sbn), I / BK] f32 (UE8M0 scales: TypeError, the Triton kernel serves them), y_NH [N, H];
    tiles from fp8_ws_down_tiles.
    """
    if ws.dtype != torch.float32:
        raise TypeError(f"launch_down_fp8_ws: ws dtype {ws.dtype}; expected float32 (UE8M0 runs the Triton kernel)")
    from ..kernels.moe_gemm_fp8_ws import moe_down_fp8_ws_kernel
    from ..kernels.moe_gemm_ws import CONSUMER_WARPS

    BN, BK, stages = tiles
    E, H, I = W.shape
    ad = _descriptor(aq_PI, [TILE_M, BK])
    wd = _descriptor(W.view(E * H, I), [2 * BN, BK])  # both consumers' columns
    if WS_DYNAMIC_TILES:
        from ..kernels.moe_gemm_fp8_ws import moe_down_fp8_ws_dyn_kernel

        dev = y_NH.device
        counter = _tile_counter(dev.index if dev.index is not None else torch.cuda.current_device())
        counter.zero_()  # a memset on the stream (captured into a CUDA graph as one)
        moe_down_fp8_ws_dyn_kernel[(num_programs,)](
            ad, wd, counter, as_PG, ws, y_NH, sorted_P, block_expert_B, num_pairs, H, I, max_blocks, sbn,
            as_PG.stride(0), *ws.stride(), y_NH.stride(0), GROUP_M=group_m, STAGES=stages,
            num_warps=CONSUMER_WARPS.value,
        )
        return
    progs = _programs(num_programs, max_blocks * (H // (2 * BN)))
    moe_down_fp8_ws_kernel[(progs,)](
        ad, wd, as_PG, ws, y_NH, sorted_P, block_expert_B, num_pairs, H, I, max_blocks, sbn, as_PG.stride(0),
        *ws.stride(), y_NH.stride(0), NUM_PROGS=progs, GROUP_M=group_m, STAGES=stages,
        num_warps=CONSUMER_WARPS.value,
    )


def fp8_ws_gate_up_stages(block_m: int, block_n: int, block_k: int, H: int, I: int, sbn: int,
                          activation: str) -> int | None:
    """STAGES of the warp-specialised fp8 gate_up (moe_gemm_fp8_ws) for the plan's tiles, or None where it does
    not serve: BM 64 plans, the plan's BN = BK = 128 (one quantization group a tile, one scale a K step),
    128 | I and H, 128 | sbn, an activation with a Gluon form."""
    if (block_m != TILE_M or block_n != 128 or block_k != 128 or I % 128 or H % block_k or sbn % 128
            or activation not in _WS_ACTIVATIONS):
        return None
    # a stage: the tile's 64 rows and both consumers' gate and up rows (4 x 64)
    stages = min(MAX_STAGES, SMEM_BYTES // ((TILE_M + 256) * block_k))  # e4m3: a byte a value
    return stages if stages >= GU_MIN_STAGES else None


def launch_gate_up_fp8_ws(xq: torch.Tensor, xs: torch.Tensor, W: torch.Tensor, ws: torch.Tensor, aq_PI: torch.Tensor,
                          as_PG: torch.Tensor, sorted_P: torch.Tensor, block_expert_B: torch.Tensor, num_pairs: int,
                          top_k_div: int, max_blocks: int, sbn: int, block_k: int, stages: int, activation: str,
                          limit: float, alpha: float, group_m: int, num_programs: int) -> None:
    """aq_PI / as_PG = quant(act(xq[pair(p) // top_k_div] @ W[e(p)]^T, scaled)) for every placed pair
    (moe_gemm_fp8_ws.moe_gate_up_fp8_ws_kernel).

    xq [M, H] e4m3 (16-byte aligned rows) and xs [M, H / BK] f32: the tokens' quantized rows; W [E, 2I, H] e4m3
    contiguous (gate rows, then up rows); ws [E, ceil(2I / sbn), H / BK] f32; aq_PI [P, I] e4m3, as_PG
    [P, I / 128] f32; stages from fp8_ws_gate_up_stages.
    """
    if ws.dtype != torch.float32:
        raise TypeError(f"launch_gate_up_fp8_ws: ws dtype {ws.dtype}; expected float32")
    from ..kernels.moe_gemm_fp8_ws import moe_gate_up_fp8_ws_kernel
    from ..kernels.moe_gemm_ws import CONSUMER_WARPS

    E, I2, H = W.shape
    wd = _descriptor(W.view(E * I2, H), [TILE_M, block_k])  # 64 gate (or up) rows: a stage holds four
    progs = _programs(num_programs, max_blocks * -(-(I2 // 2) // 128))
    moe_gate_up_fp8_ws_kernel[(progs,)](
        xq, xs, wd, ws, aq_PI, as_PG, sorted_P, block_expert_B, num_pairs, H, I2 // 2, top_k_div, max_blocks, sbn,
        -(-(I2 // 2) // sbn), xq.stride(0), xs.stride(0), *ws.stride(), aq_PI.stride(0), as_PG.stride(0),
        float(limit), float(alpha), ACT=_WS_ACTIVATIONS[activation], NUM_PROGS=progs, GROUP_M=group_m,
        STAGES=stages, num_warps=CONSUMER_WARPS.value,
    )
