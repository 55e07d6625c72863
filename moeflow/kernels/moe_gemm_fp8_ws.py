"""Gluon kernel (Hopper): the FP8 block-scaled (W8A8) down GEMM, warp-specialised (issue 15 item 6).

Why: the Triton fp8 GEMMs (moe_gemm_fp8_tma.py) leave the tensor pipe 33-43% busy at prefill (ncu, H100,
benchmarks/RESULTS.md 2026-12-06 thirteenth session). Each K step of 128 (one scale group) is a fresh wgmma
chain whose product is scaled into the f32 sum: the warps wait for the wgmmas, pass a CTA barrier, then
scale with FFMAs, all warp groups in lock step, so the tensor pipe idles while they scale. DeepGEMM's cure
is this schedule: a producer warp feeds a TMA ring, two consumer warp groups run out of phase on their own
tiles (moe_gemm_ws.py's ping-pong), so one consumer's scaling overlaps the other's wgmmas; mbarriers only.

    y_NH[pair(p)] = sum_kt (aq_PI[p, kt] @ Wq[e(p)][:, kt]^T) * (as_PG[p, kt] * ws[e(p), n // sbn, kt])

the same products, scaled and summed in the same K order, as moe_gemm_fp8_tma._fp8_down_rows
(acc + dot * (sa * sw), one fused multiply-add an element): the same bits is the goal, checked on the GPU by
tests/test_experts_triton_quant.py::test_gpu_fp8_ws_down_equals_the_tma_kernel_bitwise.

Tiles: 64 rows (one warp group's wgmma M) x BN columns (<= 128: the product and the sum take 2 x BN / 2
registers a thread) x BK = the scale group (128). BLOCK_M 64 plans only (the fp8 prefill tiles). f32 weight
scales only (UE8M0 bytes: the host keeps the Triton kernel).

Status: compiled offline for sm_90a (tests/test_gluon_ws.py); not yet run on a GPU, so nothing launches it
(experts.triton_quant.FP8_WS_DOWN, off).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .moe_gemm_ws import (
    CONSUMER_REGS,
    CONSUMER_WARPS,
    PRODUCER_REGS,
    PRODUCER_WARPS,
    TILE_M,
    _ws_down_load,
    _ws_init_barriers,
    _ws_live,
    _ws_tile_ids,
    _ws_used_blocks,
)


@gluon.jit
def _fp8_ws_consume_tile(a_bufs, b_bufs, ready, empty, order, i, j, k_tiles, sa_ptrs, sw_ptr, stride_wsk, row_ok,
                         WHICH: gl.constexpr):
    """Consumer WHICH's i-th tile, the CTA's j-th live tile: its f32 sum [64, N] (ping-pong turns as
    moe_gemm_ws._ws_consume_tile). Per K step: the step's scales loaded before the stage's wait (their
    latency hides behind it), one fresh m64 x N x k32 wgmma chain, its wait, the stage freed, then
    sum + product * (sa * sw)."""
    STAGES: gl.constexpr = a_bufs.type.shape[0]
    N: gl.constexpr = b_bufs.type.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, N, 32])
    if (WHICH == 1) | (i > 0):
        mbarrier.wait(order.index(1 - WHICH), (i + WHICH - 1) & 1)
    acc = gl.zeros([TILE_M, N], gl.float32, layout=mma_layout)
    zero = gl.zeros([TILE_M, N], gl.float32, layout=mma_layout)
    c = j * k_tiles
    for kt in range(k_tiles):
        s = c % STAGES
        sc = gl.load(sa_ptrs + kt, mask=row_ok, other=0.0) * gl.load(sw_ptr + kt * stride_wsk)
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        prod = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
        mbarrier.arrive(empty.index(s), count=1)
        acc = acc + prod * gl.expand_dims(sc, 1)
        c += 1
    mbarrier.arrive(order.index(WHICH), count=1)
    return acc


@gluon.jit
def _fp8_ws_down_mma(a_bufs, b_bufs, ready, empty, order, as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, used,
                     num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn,
                     NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr, WHICH: gl.constexpr):
    """Consumer WHICH (0 or 1): the live 64-row tiles j with j % 2 == WHICH, their wgmmas, scaling and rows
    stored by pair."""
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[CONSUMER_WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    n_n = gl.cdiv(H, BLOCK_N)
    k_tiles = gl.cdiv(I, BLOCK_K)
    i = 0  # this consumer's tiles so far
    j = 0  # the CTA's live tiles so far (both consumers'): the producer's order
    for tile in range(gl.program_id(0), used * n_n, NUM_PROGS):
        pid_r, pid_n = _ws_tile_ids(tile, used, n_n, GROUP_M)
        if _ws_live(sorted_ptr, pid_r * TILE_M, num_pairs):
            if j % 2 == WHICH:
                offs_p = pid_r * TILE_M + gl.arange(0, TILE_M, layout=row_layout)
                pair = gl.load(sorted_ptr + offs_p)
                row_ok = pair < num_pairs
                e = gl.load(block_expert_ptr + pid_r).to(gl.int64)
                sa_ptrs = as_ptr + offs_p.to(gl.int64) * stride_as
                sw_ptr = ws_ptr + e * stride_wse + ((pid_n * BLOCK_N) // sbn) * stride_wsn
                acc = _fp8_ws_consume_tile(a_bufs, b_bufs, ready, empty, order, i, j, k_tiles, sa_ptrs, sw_ptr,
                                           stride_wsk, row_ok, WHICH)
                i += 1
                offs_h = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
                y_ptrs = y_ptr + gl.expand_dims(pair.to(gl.int64) * stride_yn, 1) + gl.expand_dims(offs_h, 0)
                mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_h < H, 0)
                gl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
            j += 1


@gluon.jit
def _fp8_ws_down_mma_worker(ad, wd, a_bufs, b_bufs, ready, empty, order, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                            block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn,
                            stride_wsk, stride_yn, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr):
    """Consumer 1 (a worker partition: the odd live tiles)."""
    _fp8_ws_down_mma(a_bufs, b_bufs, ready, empty, order, as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, used,
                     num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, NUM_PROGS,
                     GROUP_M, 1)


@gluon.jit
def _fp8_ws_down_load_worker(ad, wd, a_bufs, b_bufs, ready, empty, order, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                             block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn,
                             stride_wsk, stride_yn, NUM_PROGS: gl.constexpr, GROUP_M: gl.constexpr):
    """The producer (a worker partition): moe_gemm_ws._ws_down_load's TMA ring, 64-row tiles."""
    _ws_down_load(ad, wd, a_bufs, b_bufs, ready, empty, sorted_ptr, block_expert_ptr, used, num_pairs, H, I, 1,
                  NUM_PROGS, GROUP_M, False)


@gluon.jit
def moe_down_fp8_ws_kernel(ad, wd, as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_pairs, H, I, num_m, sbn,
                           stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, NUM_PROGS: gl.constexpr,
                           GROUP_M: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """y_NH[pair] like moe_gemm_fp8_tma.moe_down_fp8_tma_kernel (one split, BLOCK_M 64, f32 weight scales).

    ad: Gluon TensorDescriptor over aq_PI [P, I] e4m3, block [64, BK]; wd: over the e4m3 down weights viewed
    [E * H, I], block [BN, BK] (BN <= 128, BN | H, BN | sbn, BK = the scale group, BK | I); as_ptr: as_PG
    [P, I / BK] f32; ws_ptr: ws [E, ceil(H / sbn), I / BK] f32; y_ptr: y_NH [N, H] rows by pair. Grid
    (NUM_PROGS,), num_warps = CONSUMER_WARPS (the default partition).
    """
    gl.static_assert(num_warps == CONSUMER_WARPS, "the default partition is one consumer warp group")
    gl.static_assert(ad.block_type.shape[0] == TILE_M, "64-row tiles (ping-pong)")
    BLOCK_K: gl.constexpr = ad.block_type.shape[1]
    BLOCK_N: gl.constexpr = wd.block_type.shape[0]
    gl.static_assert(wd.block_type.shape[1] == BLOCK_K, "act and weight boxes share BK")
    gl.static_assert(BLOCK_N <= 128 and BLOCK_N % 16 == 0, "the sum and one product fit the registers")
    gl.static_assert(BLOCK_K % 32 == 0, "fp8 wgmma steps of k32")
    a_bufs = gl.allocate_shared_memory(ad.dtype, [STAGES, TILE_M, BLOCK_K], ad.layout)
    b_bufs = gl.allocate_shared_memory(wd.dtype, [STAGES, BLOCK_N, BLOCK_K], wd.layout)
    ready, empty, order = _ws_init_barriers(STAGES, 1, 1)
    used = _ws_used_blocks(block_expert_ptr, num_m, num_warps)
    gl.warp_specialize([
        (_fp8_ws_down_mma, (a_bufs, b_bufs, ready, empty, order, as_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr,
                            used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn,
                            NUM_PROGS, GROUP_M, 0)),
        (_fp8_ws_down_mma_worker, (ad, wd, a_bufs, b_bufs, ready, empty, order, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                                   block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn,
                                   stride_wsk, stride_yn, NUM_PROGS, GROUP_M)),
        (_fp8_ws_down_load_worker, (ad, wd, a_bufs, b_bufs, ready, empty, order, as_ptr, ws_ptr, y_ptr, sorted_ptr,
                                    block_expert_ptr, used, num_pairs, H, I, sbn, stride_as, stride_wse, stride_wsn,
                                    stride_wsk, stride_yn, NUM_PROGS, GROUP_M)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
