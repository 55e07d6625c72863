"""Triton kernels: the aligned gate_up / down GEMMs with TMA weight tiles (Hopper).

The same computation as moe_gemm.py's moe_gate_up_kernel / moe_down_kernel (same alignment, same
buffers, same activation: the same bits), 1.01-1.31x faster at prefill on the H200:
`python tools/diag_tma_gemm.py --shapes mixtral,qwen3,deepseek --tokens 2048,8192`.

Why TMA for the weights only: a weight tile is a dense box of one expert's rows (linear layout
W [E, N, K], K contiguous: viewed as [E*N, K]), which one TMA instruction copies into shared
memory without the address registers and LSU issue slots of pointer loads; the activation rows
of gate_up are gathered by token (Hopper's TMA has no gather), so they stay pointer loads, unless
A_TMA: then gather_rows_kernel has copied them into pair order first (x_PH, one row a padded pair
position, zeros at padding) and the gate_up reads [BM, BK] boxes of x_PH by TMA too. Why: at mixtral
T = 2048 the gate_up with pointer-loaded rows is L1/L2-bound (L1/L2 76%, tensor pipe 75%, top stall the
L1TEX scoreboard) while the down, both operands by TMA, runs its tensor pipe at 85-89%
(`bash tools/ncu_profile.sh OUT experts_prefill_t2048_mixtral`); the copy costs one read of the rows
and one write of P x H. The down GEMM's activation rows are contiguous
in act_PI, so both of its operands use TMA.

Variants (constexprs): PERSISTENT (one program per SM looping over (block, column-tile) work,
grouped as moe_gemm._tile_ids orders it; GemmTile.persistent) and WS (Triton's automatic warp
specialisation of the main loop: a producer warp group issues the copies while consumers run
the wgmma). WS is timed by tools/diag_tma_gemm.py only: Triton 3.6 aborts compiling it at
BM = 64 (an assertion in WSLowerToken.cpp) and it gains <= 2% elsewhere.

FUSED (gate_up): one dot per K step, [BM, BK] x [BK, 2BN], instead of a gate dot and an up dot. The
weight box is a 5D view of gate_up [E, 2I, H] as [E, I/8, 2, 8, H] (strides 2IH, 8H, IH, H, 1),
block [1, BN/8, 2, 8, BK]: one TMA copy brings BN gate rows and their BN up rows interleaved 8 by 8,
no repacking of the weights. Why: Triton splits a dot's N over the warp groups that M leaves
free, so two [64, BN] dots on 8 warps ran as 64x(BN/2) wgmmas, each re-reading the A tile from
shared memory; the fused dot issues half as many wgmmas, twice as wide (fp8 BM 64: QGMMA 64x128
instead of 64x64; bf16 BM 128: HGMMA 64x256 instead of 64x128; sm_90 offline compile,
tools/sass_mix.py), with one wait per K step instead of two, the same registers and no
spill. The 8-column interleave keeps each thread's gate and up columns in the same thread, so
the activation's split (split_gate_up8) moves no data. Each output element takes the same
products in the same K order as the two-dot form.

Legend as in moe_gemm.py: P padded pair positions (max_blocks * BM), I intermediate, H hidden.
Only the linear, non-interleaved layout without bias (mixtral, qwen3, deepseek families) and
BN | I, BK | H (gate_up) / BK | I (down): the host checks before a launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe_gemm import _activate, _tile_ids, half_padded, pair_tokens, tile_pairs
from .pdl import pdl_trigger, pdl_wait


@triton.jit
def gather_rows_kernel(x_ptr, xs_ptr, sorted_ptr, block_expert_ptr, num_pairs, H, top_k, stride_xt, stride_sp,
                       BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = 0):
    """x_PH[p] = x_rows[sorted_P[p] // top_k] for the rows of the used blocks, zeros at padding positions.

    Grid (max_blocks, cdiv(H, BLOCK_H)); a block with no expert (block_expert < 0) is skipped: no GEMM
    reads it. The A_TMA gate_up then loads x_PH by TMA boxes (module docstring: why); a padding row is
    zero as the pointer path's masked load makes it, so the products and their bits are the same.
    """
    pdl_wait(PDL)
    pdl_trigger(PDL)
    pid_m = tl.program_id(0)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        offs_p, pair, row_ok = tile_pairs(sorted_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M)
        tok = pair_tokens(pair, row_ok, top_k)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        v = tl.load(x_ptr + tok[:, None] * stride_xt + offs_h[None, :], mask=row_ok[:, None] & h_ok[None, :],
                    other=0.0)
        tl.store(xs_ptr + offs_p.to(tl.int64)[:, None] * stride_sp + offs_h[None, :], v, mask=h_ok[None, :])


@triton.jit
def _gate_up_rows(x_ptr, xd, wd, act_ptr, sorted_ptr, e, p0, pid_n, num_pairs, H, I, top_k, stride_xt, stride_ap,
                  limit, alpha, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, WS_K: tl.constexpr, FUSED: tl.constexpr = False,
                  A_TMA: tl.constexpr = False):
    """act_PI rows p0 .. p0+BM-1 (expert e >= 0), columns pid_n*BN.. of I.

    FUSED: one [BM, 2BN] dot per K step over gate and up rows interleaved 8 by 8 (wd: the 5D view
    of the module docstring, which says why), else a gate dot and an up dot. A_TMA: the activation
    rows from xd, a TensorDescriptor over x_PH [P, H] with block [BM, BK] (gather_rows_kernel's
    copy), else gathered from x_ptr by pointer loads.
    """
    # sorted_P has all P entries: a load past the used blocks is harmless
    offs_p, pair, row_ok = tile_pairs(sorted_ptr, p0, num_pairs, BLOCK_M)
    tok = pair_tokens(pair, row_ok, top_k)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    if FUSED:
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, warp_specialize=WS_K):
            a = _a_tile(xd, a_ptrs, row_ok, p0, k0, A_TMA)
            w = tl.reshape(wd.load([e, pid_n * (BLOCK_N // 8), 0, 0, k0]), (2 * BLOCK_N, BLOCK_K))
            acc = tl.dot(a, w.T, acc)
        g, u = split_gate_up8(acc, BLOCK_M, BLOCK_N)
    else:
        row_g = e * (2 * I) + pid_n * BLOCK_N
        row_u = row_g + I
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(0, H, BLOCK_K, warp_specialize=WS_K):
            a = _a_tile(xd, a_ptrs, row_ok, p0, k0, A_TMA)
            wg = wd.load([row_g, k0])
            wu = wd.load([row_u, k0])
            g = tl.dot(a, wg.T, g)
            u = tl.dot(a, wu.T, u)
    out = _activate(g, u, limit, alpha, ACT)
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    act_ptrs = act_ptr + offs_p.to(tl.int64)[:, None] * stride_ap + offs_j[None, :]
    tl.store(act_ptrs, out.to(act_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _a_tile(xd, a_ptrs, row_ok, p0, k0, A_TMA: tl.constexpr):
    """The gate_up's activation tile [BM, BK] at K offset k0: a TMA box of x_PH (A_TMA), else the token rows
    gathered by pointer (a_ptrs, zeros in the rows without a pair)."""
    if A_TMA:
        return xd.load([p0, k0])
    return tl.load(a_ptrs + k0, mask=row_ok[:, None], other=0.0)


@triton.jit
def split_gate_up8(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(g, u) [BM, BN] each from acc [BM, 2BN] whose columns are gate/up 8 by 8 (g0..7, u0..7, g8..15, ...).

    In the wgmma accumulator layout a thread holds the same 2 columns of every 8-column group, so
    with gate and up interleaved 8 by 8 it holds matching g and u columns and the split is a
    register renaming (no shared-memory round trip: tools/tests/test_sass_mix.py). The 32-row half tiles
    (mma.sync layout) take a shared-memory shuffle here, once a tile.
    """
    acc4 = tl.permute(tl.reshape(acc, (BLOCK_M, BLOCK_N // 8, 2, 8)), (0, 1, 3, 2))
    g, u = tl.split(acc4)
    return tl.reshape(g, (BLOCK_M, BLOCK_N)), tl.reshape(u, (BLOCK_M, BLOCK_N))


@triton.jit
def _gate_up_tile(x_ptr, xd, xd_half, wd, act_ptr, sorted_ptr, block_expert_ptr, tile, num_pairs, H, I, top_k, num_m,
                  stride_xt, stride_ap, limit, alpha, ACT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  WS_K: tl.constexpr, HALF_TAIL: tl.constexpr, FUSED: tl.constexpr = False,
                  A_TMA: tl.constexpr = False):
    """Work tile `tile` in moe_gemm._tile_ids's grouped order; an empty block (expert < 0) does nothing."""
    pid_m, pid_n = _tile_ids(tile, num_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        p0 = pid_m * BLOCK_M
        if HALF_TAIL and half_padded(sorted_ptr, p0, num_pairs, BLOCK_M):
            _gate_up_rows(x_ptr, xd_half, wd, act_ptr, sorted_ptr, e, p0, pid_n, num_pairs, H, I, top_k, stride_xt,
                          stride_ap, limit, alpha, ACT, BLOCK_M // 2, BLOCK_N, BLOCK_K, WS_K, FUSED, A_TMA)
        else:
            _gate_up_rows(x_ptr, xd, wd, act_ptr, sorted_ptr, e, p0, pid_n, num_pairs, H, I, top_k, stride_xt,
                          stride_ap, limit, alpha, ACT, BLOCK_M, BLOCK_N, BLOCK_K, WS_K, FUSED, A_TMA)


@triton.jit(do_not_specialize=["num_pairs", "num_m", "num_tiles"])
def moe_gate_up_tma_kernel(
    x_ptr, xd, xd_half, wd, act_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, H, I, top_k, num_m, num_tiles,
    stride_xt, stride_ap, limit, alpha,
    ACT: tl.constexpr, PERSISTENT: tl.constexpr, WS: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HALF_TAIL: tl.constexpr = False, PDL: tl.constexpr = False, FUSED: tl.constexpr = False,
    A_TMA: tl.constexpr = False,
):
    """act_PI[p, j] = act(x[tok(p)] @ W_gu[e(p)]) like moe_gemm.moe_gate_up_kernel.

    wd: TensorDescriptor over gate_up viewed [E * 2I, H], block [BN, BK]; FUSED: over the 5D view
    [E, I/8, 2, 8, H] (the module docstring), block [1, BN/8, 2, 8, BK].
    A_TMA: xd / xd_half TensorDescriptors over x_PH [P, H] (gather_rows_kernel) with blocks [BM, BK] /
    [BM/2, BK] (the half tiles'; xd when HALF_TAIL is off); else None and the rows come from x_ptr.
    Grid: (num_tiles,) or (NUM_PROGS,) when PERSISTENT; num_tiles = max_blocks * I / BN.
    HALF_TAIL and PDL as moe_gemm.moe_gate_up_kernel.
    """
    pdl_wait(PDL)
    pdl_trigger(PDL)
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, warp_specialize=WS):
            _gate_up_tile(x_ptr, xd, xd_half, wd, act_ptr, sorted_ptr, block_expert_ptr, tile, num_pairs, H, I, top_k,
                          num_m, stride_xt, stride_ap, limit, alpha, ACT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, False,
                          HALF_TAIL, FUSED, A_TMA)
    else:
        _gate_up_tile(x_ptr, xd, xd_half, wd, act_ptr, sorted_ptr, block_expert_ptr, tl.program_id(0), num_pairs, H,
                      I, top_k, num_m, stride_xt, stride_ap, limit, alpha, ACT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WS,
                      HALF_TAIL, FUSED, A_TMA)


@triton.jit
def _down_rows(ad, wd, y_ptr, sorted_ptr, e, p0, pid_n, num_pairs, H, I, stride_yn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WS_K: tl.constexpr):
    """y_NH of the pairs at rows p0 .. p0+BM-1 (expert e >= 0; ad's block is [BM, BK]), columns pid_n*BN.. of H."""
    offs_p, pair, row_ok = tile_pairs(sorted_ptr, p0, num_pairs, BLOCK_M)
    row_w = e * H + pid_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, I, BLOCK_K, warp_specialize=WS_K):
        a = ad.load([p0, k0])
        w = wd.load([row_w, k0])
        acc = tl.dot(a, w.T, acc)
    _down_store(acc, y_ptr, pair, row_ok, pid_n, H, stride_yn, BLOCK_N)


@triton.jit
def _down_store(acc, y_ptr, pair, row_ok, pid_n, H, stride_yn, BLOCK_N: tl.constexpr):
    """y_NH[pair, pid_n*BN ..] = acc [BM, BN] (rows with row_ok, columns < H)."""
    offs_h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_yn + offs_h[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_h < H)[None, :])


@triton.jit
def _used_blocks(block_expert_ptr, num_m, COUNT_BLOCK: tl.constexpr):
    """Blocks with an expert (block_expert >= 0). The aligner writes -1 past the last used block only,
    so they are the first `used` blocks."""
    used = 0
    for b0 in range(0, num_m, COUNT_BLOCK):
        offs = b0 + tl.arange(0, COUNT_BLOCK)
        e = tl.load(block_expert_ptr + offs, mask=offs < num_m, other=-1)
        used += tl.sum((e >= 0).to(tl.int32))
    return used


@triton.jit
def _down_flat(ad, wd, y_ptr, sorted_ptr, block_expert_ptr, num_pairs, H, I, num_m, stride_yn,
               NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr):
    """The persistent down GEMM as one flattened loop over (work tile, K step) (tl.range(flatten=True)).

    Why: at short K (qwen3's I = 768: 12 steps of BK 64) each tile's pipeline fill and epilogue are
    exposed in the tiled loop (tensor pipe 65%: `bash tools/ncu_profile.sh OUT
    experts_prefill_t8192_qwen3`), with one 8-warp CTA per SM to hide them. Triton's loop
    fusion (FuseNestedLoops) turns the tile loop and its K loop into one loop that the pipeliner
    can run across tile boundaries: the next tile's first copies are in flight during this tile's
    last steps and its store. Fusion needs the K loop's bounds invariant to the tile loop and no
    `if` around the K loop, so the walk covers only the used blocks (a prefix, _used_blocks) and
    there are no half tiles here. Each output element takes the same products in the same K order
    as _down_rows: the same bits.
    """
    used = _used_blocks(block_expert_ptr, num_m, 1024)
    n_n = tl.cdiv(H, BLOCK_N)
    k_tiles = tl.cdiv(I, BLOCK_K)
    for tile in tl.range(tl.program_id(0), used * n_n, NUM_PROGS, flatten=True):
        pid_m, pid_n = _tile_ids(tile, used, n_n, GROUP_M)
        e = tl.load(block_expert_ptr + pid_m)
        p0 = pid_m * BLOCK_M
        row_w = e * H + pid_n * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kt in range(0, k_tiles):
            a = ad.load([p0, kt * BLOCK_K])
            w = wd.load([row_w, kt * BLOCK_K])
            acc = tl.dot(a, w.T, acc)
        pair = tl.load(sorted_ptr + p0 + tl.arange(0, BLOCK_M))
        _down_store(acc, y_ptr, pair, pair < num_pairs, pid_n, H, stride_yn, BLOCK_N)


@triton.jit
def _down_tile(ad, ad_half, wd, y_ptr, sorted_ptr, block_expert_ptr, tile, num_pairs, H, I, num_m, stride_yn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               WS_K: tl.constexpr, HALF_TAIL: tl.constexpr):
    pid_m, pid_n = _tile_ids(tile, num_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e >= 0:
        p0 = pid_m * BLOCK_M
        if HALF_TAIL and half_padded(sorted_ptr, p0, num_pairs, BLOCK_M):
            _down_rows(ad_half, wd, y_ptr, sorted_ptr, e, p0, pid_n, num_pairs, H, I, stride_yn,
                       BLOCK_M // 2, BLOCK_N, BLOCK_K, WS_K)
        else:
            _down_rows(ad, wd, y_ptr, sorted_ptr, e, p0, pid_n, num_pairs, H, I, stride_yn,
                       BLOCK_M, BLOCK_N, BLOCK_K, WS_K)


@triton.jit(do_not_specialize=["num_pairs", "num_m", "num_tiles"])
def moe_down_tma_kernel(
    ad, ad_half, wd, y_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, H, I, num_m, num_tiles, stride_yn,
    PERSISTENT: tl.constexpr, WS: tl.constexpr, NUM_PROGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HALF_TAIL: tl.constexpr = False, PDL: tl.constexpr = False, FLAT: tl.constexpr = False,
):
    """y_NH[pair] = act_PI[p] @ W_d[e(p)] like moe_gemm.moe_down_kernel with one split.

    ad: TensorDescriptor over act_PI [P, I], block [BM, BK]; ad_half: the same with block [BM/2, BK]
    (the HALF_TAIL tiles; pass ad when HALF_TAIL is off); wd: over down viewed [E * H, I], block
    [BN, BK]. Grid: (num_tiles,) or (NUM_PROGS,) when PERSISTENT; num_tiles = max_blocks * H / BN.
    HALF_TAIL and PDL as moe_gemm.moe_gate_up_kernel. FLAT (with PERSISTENT; HALF_TAIL and WS ignored):
    _down_flat's one flattened loop.
    """
    pdl_wait(PDL)
    pdl_trigger(PDL)
    if FLAT:
        _down_flat(ad, wd, y_ptr, sorted_ptr, block_expert_ptr, num_pairs, H, I, num_m, stride_yn, NUM_PROGS,
                   BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    elif PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, warp_specialize=WS):
            _down_tile(ad, ad_half, wd, y_ptr, sorted_ptr, block_expert_ptr, tile, num_pairs, H, I, num_m, stride_yn,
                       BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, False, HALF_TAIL)
    else:
        _down_tile(ad, ad_half, wd, y_ptr, sorted_ptr, block_expert_ptr, tl.program_id(0), num_pairs, H, I, num_m,
                   stride_yn, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WS, HALF_TAIL)
