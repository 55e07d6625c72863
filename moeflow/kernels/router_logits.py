"""Triton kernels of the batch-invariant router GEMM (private; launchers in moeflow.routing.gpu).

Legend: T tokens, H hidden size, E router outputs of the first weight (routed +
zero experts), F outputs of the optional second weight (the next layer's
router), C = E + F columns of the partial buffer, S fixed split of H.

Reduction order of one logit out[t, e] (the whole batch-invariance argument):

    for s in 0 .. S-1 (S = cdiv(H, CHUNK), fixed by H and the config, never by T):
        p_s = 0
        for k0 in s*CHUNK, s*CHUNK + BLOCK_K, ... (CHUNK / BLOCK_K steps, in order):
            p_s = tl.dot(x[t, k0:k0+BLOCK_K], w[e, k0:k0+BLOCK_K]) + p_s
    out[t, e] = ((p_0 + p_1) + p_2) + ... + p_{S-1}      (left to right, f32)

Each program owns one fixed tile of BLOCK_E columns for one fixed group of
BLOCK_M rows and one split s; the tile shape, BLOCK_K, CHUNK, num_warps and
num_stages are chosen from (E, F, H, dtypes) only, so the same instructions
produce every logit whatever T is. Inside tl.dot each output element is formed
by the same MMA (or, for fp32 operands, FMA) sequence wherever its row sits in
the tile; rows past T are loaded as zeros and never stored. The second pass
(`_reduce_splits_kernel`, or the selection reading the partials directly, in the
selection kernel or in the last program of the fused router kernel) adds the S
partials in the fixed order above. The fused kernel (router_fused.py) runs the same
`_logits_program` with the same config, hence the same instructions per partial.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import fast_kernel


@triton.jit
def _dot_tile(
    x_ptr,
    w_ptr,
    rows,
    cols,
    T,
    NCOL,
    H,
    stride_xt,
    stride_wc,
    k_begin,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AS_F32: tl.constexpr,
):
    """f32 [BLOCK_M, BLOCK_E]: sum over k in [k_begin, k_begin + CHUNK) of x[rows, k] * w[cols, k]."""
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < T
    col_ok = cols < NCOL
    x_row = x_ptr + rows.to(tl.int64)[:, None] * stride_xt
    w_row = w_ptr + cols.to(tl.int64)[:, None] * stride_wc
    for k0 in range(0, CHUNK, BLOCK_K):  # a constant trip count: one loop shape for every split
        k = k_begin + k0 + ks
        k_ok = k < H
        a = tl.load(x_row + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_row + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if AS_F32:
            # Mixed or fp32 operands: exact f32 products, FMA accumulation in k order
            # ("ieee": no tf32 rounding of the operands).
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
    return acc


@triton.jit
def _logits_program(
    x_ptr,
    w_ptr,
    w2_ptr,
    out_ptr,
    out2_ptr,
    part_ptr,
    T,
    E,
    F,
    H,
    stride_xt,
    stride_we,
    stride_w2e,
    stride_ot,
    stride_o2t,
    stride_ps,
    pid_e,
    pid_m,
    pid_s,
    CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AS_F32: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    """The work of program (pid_e, pid_m, pid_s) of the router GEMM (grid as _router_logits_kernel).

    PARTIAL false: writes out [T, E] (and out2 [T, F]) directly (one split only).
    PARTIAL true:  writes partial p_s into part [SPLIT, T, E + F] (columns E.. hold the
                   second weight). Shared by this file's kernel and the fused router
                   kernel (router_fused.py), so both compute every partial with the same code.
    """
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    lanes = tl.arange(0, BLOCK_E)
    k_begin = pid_s * CHUNK
    n_first = tl.cdiv(E, BLOCK_E)
    # Without a second weight the grid has no program past n_first (F = 0).
    if pid_e >= n_first:
        cols = (pid_e - n_first) * BLOCK_E + lanes
        acc = _dot_tile(
            x_ptr, w2_ptr, rows, cols, T, F, H, stride_xt, stride_w2e, k_begin,
            CHUNK, BLOCK_M, BLOCK_E, BLOCK_K, AS_F32,
        )
        ok = (rows < T)[:, None] & (cols < F)[None, :]
        if PARTIAL:
            dst = part_ptr + pid_s.to(tl.int64) * stride_ps + rows.to(tl.int64)[:, None] * (E + F) + (E + cols)[None, :]
            tl.store(dst, acc, mask=ok)
        else:
            tl.store(out2_ptr + rows.to(tl.int64)[:, None] * stride_o2t + cols[None, :], acc, mask=ok)
    else:
        cols = pid_e * BLOCK_E + lanes
        acc = _dot_tile(
            x_ptr, w_ptr, rows, cols, T, E, H, stride_xt, stride_we, k_begin,
            CHUNK, BLOCK_M, BLOCK_E, BLOCK_K, AS_F32,
        )
        ok = (rows < T)[:, None] & (cols < E)[None, :]
        if PARTIAL:
            dst = part_ptr + pid_s.to(tl.int64) * stride_ps + rows.to(tl.int64)[:, None] * (E + F) + cols[None, :]
            tl.store(dst, acc, mask=ok)
        else:
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :], acc, mask=ok)


@fast_kernel
@triton.jit
def _router_logits_kernel(
    x_ptr,
    w_ptr,
    w2_ptr,
    out_ptr,
    out2_ptr,
    part_ptr,
    T,
    E,
    F,
    H,
    stride_xt,
    stride_we,
    stride_w2e,
    stride_ot,
    stride_o2t,
    stride_ps,
    CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AS_F32: tl.constexpr,
):
    """Grid (cdiv(E, BLOCK_E) [+ cdiv(F, BLOCK_E)], cdiv(T, BLOCK_M), SPLIT).

    SPLIT == 1: writes out [T, E] (and out2 [T, F]) directly.
    SPLIT > 1:  writes partial p_s into part [SPLIT, T, E + F] (columns E.. hold
                the second weight); a second pass adds the splits in order.
    """
    _logits_program(
        x_ptr, w_ptr, w2_ptr, out_ptr, out2_ptr, part_ptr, T, E, F, H,
        stride_xt, stride_we, stride_w2e, stride_ot, stride_o2t, stride_ps,
        tl.program_id(0), tl.program_id(1), tl.program_id(2),
        CHUNK, BLOCK_M, BLOCK_E, BLOCK_K, AS_F32, SPLIT > 1,
    )


@fast_kernel
@triton.jit
def _reduce_splits_kernel(
    part_ptr,
    out_ptr,
    out2_ptr,
    T,
    E,
    F,
    stride_ps,
    stride_ot,
    stride_o2t,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t, c] = ((p_0 + p_1) + p_2) + ... over the SPLIT partials [SPLIT, T, E + F]; 1-D grid."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    C = E + F
    ok = idx < T * C
    t = idx // C
    c = idx % C
    acc = tl.load(part_ptr + idx, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc = acc + tl.load(part_ptr + idx + s * stride_ps, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + c, acc, mask=ok & (c < E))
    tl.store(out2_ptr + t * stride_o2t + (c - E), acc, mask=ok & (c >= E))
