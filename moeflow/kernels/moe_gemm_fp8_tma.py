"""Triton kernels: the FP8 block-scaled (W8A8) gate_up / down GEMMs with TMA tiles (Hopper).

The same computation as moe_gemm_quant's moe_gate_up_fp8_kernel / moe_down_fp8_kernel with
SCALAR_WS (so the same bits, checked by tests/test_experts_triton_quant.py on the GPU):
    gate_up  g, u += dot_fp8(xq tile, Wq tile) * (xs[row, kt] * ws[blk, kt]), act, quantized per
             group of G columns in the epilogue (BN a multiple of G)
    down     y = sum_kt dot_fp8(aq tile, Wq tile) * (as[row, kt] * ws[blk, kt])
but the weight tiles ([BN, BK] boxes of one expert's rows: [E, N, K] viewed [E*N, K], K contiguous,
one byte a value) come by TMA, as in moe_gemm_tma.py; gate_up's activation rows are gathered by token
(pointer loads), down's are contiguous in aq_PI (TMA too).

Why: the pointer kernels spend address registers and LSU issue slots on every weight tile; at
deepseek-v3 T = 8192 their gate_up and down run the tensor pipe at 28% (H200:
`bash tools/ncu_profile.sh OUT quant_fp8_prefill_t8192_deepseek_v3` with the case's experts built
with tma=False).

Constraints (the host checks): BN divides the scale block sbn (one weight scale a tile and K step),
BK = G, BN | I and BK | H (gate_up), BN | H and BK | I (down), no bias, one split.
PERSISTENT: one program per SM walking the (block, column-tile) work in moe_gemm._tile_ids's order.
Legend as in moe_gemm_quant.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe_gemm import _activate, _tile_ids, pair_tokens, tile_pairs
from .moe_gemm_quant import _fp8_gate_up_scales, _fp8_quant_store, _fp8_row_scale
from .moe_gemm_tma import _down_store, split_gate_up8
from .pdl import pdl_trigger, pdl_wait


@triton.jit
def _fp8_gate_up_tile(xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, sorted_ptr, block_expert_ptr, tile,
                      num_pairs, H, I, top_k, num_m, sbn, g_rows,
                      stride_xq, stride_xs, stride_wse, stride_wsn, stride_wsk, stride_aq, stride_as, limit, alpha,
                      ACT: tl.constexpr, SCALE_E8M0: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      FUSED: tl.constexpr = False, IMPRECISE: tl.constexpr = None):
    """aq_PI / as_PG of work tile `tile` (an empty block, expert < 0, does nothing).

    FUSED: one [BM, 2BN] dot per K step over the gate and up rows interleaved 8 by 8 (moe_gemm_tma.py's
    docstring says why); each column's product is scaled by its own half's (sa * sw), so the same
    FFMA per element as the two-dot form.
    """
    pid_m, pid_n = _tile_ids(tile, num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        _fp8_gate_up_rows(xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, sorted_ptr, e, pid_m, pid_n, num_pairs, H, I,
                          top_k, sbn, g_rows, stride_xq, stride_xs, stride_wse, stride_wsn, stride_wsk, stride_aq,
                          stride_as, limit, alpha, ACT, SCALE_E8M0, BLOCK_M, BLOCK_N, BLOCK_K, FUSED, IMPRECISE)


@triton.jit
def _fp8_gate_up_rows(xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, sorted_ptr, e, pid_m, pid_n, num_pairs, H, I,
                      top_k, sbn, g_rows, stride_xq, stride_xs, stride_wse, stride_wsn, stride_wsk, stride_aq,
                      stride_as, limit, alpha, ACT: tl.constexpr, SCALE_E8M0: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FUSED: tl.constexpr, IMPRECISE: tl.constexpr):
    """aq_PI / as_PG of block pid_m (expert e >= 0), columns pid_n*BN.. of I (_fp8_gate_up_tile's body)."""
    offs_p, pair, row_ok = tile_pairs(sorted_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M)
    tok = pair_tokens(pair, row_ok, top_k)
    a_ptrs = xq_ptr + tok[:, None] * stride_xq + tl.arange(0, BLOCK_K)[None, :]
    xs_ptrs = xs_ptr + tok * stride_xs
    row_g = e * (2 * I) + pid_n * BLOCK_N
    blk = (pid_n * BLOCK_N) // sbn
    sg_ptr = ws_ptr + e.to(tl.int64) * stride_wse + blk * stride_wsn
    su_ptr = sg_ptr + g_rows * stride_wsn
    cg, cu = _fp8_gate_up_scales(xs_ptrs, sg_ptr, su_ptr, 0, stride_wsk, row_ok, SCALE_E8M0)
    n_kt = H // BLOCK_K
    if FUSED:
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        is_g = ((tl.arange(0, 2 * BLOCK_N) // 8) % 2 == 0)[None, :]  # static per register: no select left
        for kt in range(0, n_kt):
            # the next step's scales, loaded ahead (in bounds)
            cg_next, cu_next = _fp8_gate_up_scales(xs_ptrs, sg_ptr, su_ptr, tl.minimum(kt + 1, n_kt - 1), stride_wsk,
                                                   row_ok, SCALE_E8M0)
            a = tl.load(a_ptrs + kt * BLOCK_K, mask=row_ok[:, None], other=0.0)
            w = tl.reshape(wd.load([e, pid_n * (BLOCK_N // 8), 0, 0, kt * BLOCK_K]), (2 * BLOCK_N, BLOCK_K))
            acc += tl.dot(a, w.T, max_num_imprecise_acc=IMPRECISE) * tl.where(is_g, cg[:, None], cu[:, None])
            cg = cg_next
            cu = cu_next
        g, u = split_gate_up8(acc, BLOCK_M, BLOCK_N)
    else:
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kt in range(0, n_kt):
            # the next step's scales, loaded ahead (in bounds)
            cg_next, cu_next = _fp8_gate_up_scales(xs_ptrs, sg_ptr, su_ptr, tl.minimum(kt + 1, n_kt - 1), stride_wsk,
                                                   row_ok, SCALE_E8M0)
            a = tl.load(a_ptrs + kt * BLOCK_K, mask=row_ok[:, None], other=0.0)
            wg = wd.load([row_g, kt * BLOCK_K])
            wu = wd.load([row_g + I, kt * BLOCK_K])
            g += tl.dot(a, wg.T, max_num_imprecise_acc=IMPRECISE) * cg[:, None]
            u += tl.dot(a, wu.T, max_num_imprecise_acc=IMPRECISE) * cu[:, None]
            cg = cg_next
            cu = cu_next
    out = _activate(g, u, limit, alpha, ACT)
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _fp8_quant_store(out, offs_p.to(tl.int64), row_ok, offs_j, offs_j < I, pid_n, aq_ptr, as_ptr, stride_aq,
                     stride_as, I, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit(do_not_specialize=["num_pairs", "num_m", "num_tiles"])
def moe_gate_up_fp8_tma_kernel(
    xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, H, I, top_k, num_m, num_tiles, sbn, g_rows,
    stride_xq, stride_xs, stride_wse, stride_wsn, stride_wsk, stride_aq, stride_as, limit, alpha,
    ACT: tl.constexpr, SCALE_E8M0: tl.constexpr, PERSISTENT: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False, FUSED: tl.constexpr = False, IMPRECISE: tl.constexpr = None,
):
    """aq_PI / as_PG like moe_gemm_quant.moe_gate_up_fp8_kernel (QUANT_OUT, SCALAR_WS).

    wd: TensorDescriptor over the e4m3 gate_up viewed [E * 2I, H], block [BN, BK]; FUSED: over the
    5D view [E, I/8, 2, 8, H] (moe_gemm_tma.py's docstring), block [1, BN/8, 2, 8, BK].
    Grid: (num_tiles,) or (NUM_PROGS,) when PERSISTENT; num_tiles = max_blocks * I / BN.
    """
    pdl_wait(PDL)  # moeflow/kernels/pdl.py: first, before any read
    pdl_trigger(PDL)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS):
            _fp8_gate_up_tile(xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, sorted_ptr, block_expert_ptr, tile,
                              num_pairs, H, I, top_k, num_m, sbn, g_rows, stride_xq, stride_xs, stride_wse,
                              stride_wsn, stride_wsk, stride_aq, stride_as, limit, alpha, ACT, SCALE_E8M0,
                              BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, FUSED, IMPRECISE)
    else:
        _fp8_gate_up_tile(xq_ptr, xs_ptr, wd, ws_ptr, aq_ptr, as_ptr, sorted_ptr, block_expert_ptr,
                          tl.program_id(0), num_pairs, H, I, top_k, num_m, sbn, g_rows, stride_xq, stride_xs,
                          stride_wse, stride_wsn, stride_wsk, stride_aq, stride_as, limit, alpha, ACT, SCALE_E8M0,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, FUSED, IMPRECISE)


@triton.jit
def _fp8_down_tile(ad, as_ptr, wd, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, tile, num_pairs, H, I, num_m, sbn,
                   stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, SCALE_E8M0: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   IMPRECISE: tl.constexpr = None):
    """y_NH of work tile `tile` (an empty block does nothing)."""
    pid_m, pid_n = _tile_ids(tile, num_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        _fp8_down_rows(ad, as_ptr, wd, ws_ptr, y_ptr, sorted_ptr, e, pid_m * BLOCK_M, pid_n, num_pairs, H, I, sbn,
                       stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, SCALE_E8M0, BLOCK_M, BLOCK_N,
                       BLOCK_K, IMPRECISE)


@triton.jit
def _fp8_down_rows(ad, as_ptr, wd, ws_ptr, y_ptr, sorted_ptr, e, p0, pid_n, num_pairs, H, I, sbn,
                   stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, SCALE_E8M0: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IMPRECISE: tl.constexpr):
    """y_NH of the pairs at rows p0 .. p0+BM-1 (expert e >= 0), columns pid_n*BN.. of H."""
    offs_p, pair, row_ok = tile_pairs(sorted_ptr, p0, num_pairs, BLOCK_M)
    as_ptrs = as_ptr + offs_p.to(tl.int64) * stride_as
    row_w = e * H + pid_n * BLOCK_N
    sw_ptr = ws_ptr + e.to(tl.int64) * stride_wse + ((pid_n * BLOCK_N) // sbn) * stride_wsn
    c = _fp8_row_scale(as_ptrs, sw_ptr, 0, stride_wsk, row_ok, SCALE_E8M0)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_kt = I // BLOCK_K
    for kt in range(0, n_kt):
        c_next = _fp8_row_scale(as_ptrs, sw_ptr, tl.minimum(kt + 1, n_kt - 1), stride_wsk, row_ok, SCALE_E8M0)
        a = ad.load([p0, kt * BLOCK_K])
        w = wd.load([row_w, kt * BLOCK_K])
        acc += tl.dot(a, w.T, max_num_imprecise_acc=IMPRECISE) * c[:, None]
        c = c_next
    _down_store(acc, y_ptr, pair, row_ok, pid_n, H, stride_yn, BLOCK_N)


@triton.jit(do_not_specialize=["num_pairs", "num_m", "num_tiles"])
def moe_down_fp8_tma_kernel(
    ad, as_ptr, wd, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, H, I, num_m, num_tiles, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn,
    SCALE_E8M0: tl.constexpr, PERSISTENT: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False, IMPRECISE: tl.constexpr = None,
):
    """y_NH[pair] like moe_gemm_quant.moe_down_fp8_kernel with one split (SCALAR_WS).

    ad: TensorDescriptor over aq_PI [P, I] e4m3, block [BM, BK]; wd: over down viewed [E * H, I],
    block [BN, BK]. Grid: (num_tiles,) or (NUM_PROGS,) when PERSISTENT; num_tiles = max_blocks * H / BN.
    """
    pdl_wait(PDL)  # moeflow/kernels/pdl.py: first, before any read
    pdl_trigger(PDL)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS):
            _fp8_down_tile(ad, as_ptr, wd, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, tile, num_pairs, H, I, num_m,
                           sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, SCALE_E8M0,
                           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, IMPRECISE)
    else:
        _fp8_down_tile(ad, as_ptr, wd, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, tl.program_id(0), num_pairs, H,
                       I, num_m, sbn, stride_as, stride_wse, stride_wsn, stride_wsk, stride_yn, SCALE_E8M0,
                       BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, IMPRECISE)
