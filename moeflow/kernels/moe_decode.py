"""Private Triton kernels: the small-T ("decode") experts path, two launches and no alignment pass.

Legend: T tokens, K slots, N = T*K pairs (pair n = t*K + k), H hidden, I intermediate per
expert, E experts, MP = a power of two >= N (>= 16: the smallest dot), BN/BK tile sizes.

Pipeline (sync-free, grids sized on the host from shapes only, capturable in a CUDA graph):
    gate_up:  act_NI[n] = act(x[n // K] @ W_gu[ids[n]] (+ b_gu))     grid (N, cdiv(I, BN))
    down:     out_TH[t] = sum_{k=0..K-1} w[t,k] * (act_NI[t*K+k] @ W_d[ids[t*K+k]] (+ b_d))
                                                                     grid (T, cdiv(H, BN))
Why no alignment pass: with N <= 64 pairs, a gate_up program can find the other pairs of its
expert by comparing N ids (one 64-wide vector compare). The program of the *first* pair of an
expert (its leader) computes every pair of that expert in one MP-row dot, so each distinct
expert's gate_up weights are read once; the other programs of that expert return at once.
The down kernel folds the combine into its epilogue: one program per (token, H tile) walks
its K slots in slot order (k = 0..K-1), I tiles in order inside a slot, so the sum order is
fixed and the result deterministic (no atomics). A token-major down reads an expert once per
token that uses it (L2 catches the repeats of programs running side by side): which is why
the path is chosen only while pairs per expert stay about one (moeflow/experts/triton.py).

The down product of one pair is a [16, BK] x [BK, BN] dot with one live row (row 0), not a
vector reduction: the dot's operand loads go through Triton's multi-stage copy pipeline,
which keeps the weight stream in flight; the 15 zero rows cost tensor-core time only, which a
weight-read-bound shape has to spare. The slot and I-tile loops are one flat loop so that
pipeline never drains between slots; each step's partial dot is weighted and added to an f32
accumulator (bias and the NaN of an out-of-range id are added after the loop, slot order).

Numerics: gate_up as the aligned kernel (shared body `gate_up_rows`), act rounded to the
weights' dtype; the down sum stays f32 to the end (one rounding, at the store).
Ids outside [0, E): gate_up computes nothing for the pair, down never reads its weights and
adds NaN to its token's row (loud, never a silent clamp), like the aligned path.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import fast_kernel
from .moe_gemm import gate_up_rows

# Rows of the down dot: the smallest tl.dot M. Only row 0 holds the pair's activations.
DOWN_DOT_ROWS = 16


@fast_kernel
@triton.jit(do_not_specialize=["num_pairs"])
def moe_decode_gate_up_kernel(
    x_ptr, w_ptr, b_ptr, wt_ptr, ids_ptr, act_ptr,
    num_pairs, E, H, I, top_k,
    stride_xt, stride_we, stride_wn, stride_wk, stride_be, stride_an,
    limit, alpha,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (N, cdiv(I, BN)). act_NI[m, j] for every pair m of pair n's expert, if n is its first pair.

    BLOCK_M = MP >= num_pairs: one tile row per pair. WEIGHT_ON_INPUT (llama4): the expert's
    input is x[t] * w[n] rounded to x's dtype (wt_ptr: f32 [N]); else wt_ptr is not read.
    """
    n = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + n)
    if (e < 0) | (e >= E):
        return
    offs_m = tl.arange(0, BLOCK_M)
    ids = tl.load(ids_ptr + offs_m, mask=offs_m < num_pairs, other=-1)
    match = ids == e
    first = tl.min(tl.where(match, offs_m, BLOCK_M), 0)
    if first != n:
        return  # the expert's leader (its first pair) computes this pair's row
    tok = tl.where(match, offs_m // top_k, 0).to(tl.int64)
    scale = 0.0
    if WEIGHT_ON_INPUT:
        wt = tl.load(wt_ptr + offs_m, mask=match, other=0.0)
        # the HF module multiplies in x's dtype: round the weight to it first
        scale = wt.to(x_ptr.dtype.element_ty).to(tl.float32)
    e64 = e.to(tl.int64)
    out = gate_up_rows(x_ptr, tok, match, scale, w_ptr + e64 * stride_we, b_ptr + e64 * stride_be, pid_n, H, I,
                       stride_xt, stride_wn, stride_wk, limit, alpha, ACT, INTERLEAVED, HAS_BIAS, WEIGHT_ON_INPUT,
                       EVEN_K, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    act_ptrs = act_ptr + offs_m.to(tl.int64)[:, None] * stride_an + offs_j[None, :]
    tl.store(act_ptrs, out.to(act_ptr.dtype.element_ty), mask=match[:, None] & (offs_j < I)[None, :])


@fast_kernel
@triton.jit
def moe_decode_down_kernel(
    act_ptr, w_ptr, b_ptr, wt_ptr, ids_ptr, out_ptr,
    E, H, I,
    stride_an, stride_we, stride_wn, stride_wk, stride_be, stride_ot,
    K: tl.constexpr, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (T, cdiv(H, BN)). out_TH[t, h-tile] = sum_k w[t,k] * (act[t*K+k] @ W_d[e] (+ b_d)), slot order, f32.

    HAS_W False (llama4, or unweighted): every weight is 1 and wt_ptr is not read.
    """
    t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    offs_h = pid_h * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    offs_r = tl.arange(0, ROWS)
    row0 = offs_r == 0
    offs_k = tl.arange(0, BLOCK_K)
    n_kt = tl.cdiv(I, BLOCK_K)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    # One flat loop over (slot, I tile): the copy pipeline runs across slot boundaries.
    for it in range(0, K * n_kt):
        k = it // n_kt
        k0 = (it - k * n_kt) * BLOCK_K
        pair = t * K + k
        e = tl.load(ids_ptr + pair)
        ok = (e >= 0) & (e < E)
        e64 = tl.where(ok, e, 0).to(tl.int64)
        a_ptrs = act_ptr + pair * stride_an + k0 + offs_k[None, :] + 0 * offs_r[:, None]
        w_ptrs = w_ptr + e64 * stride_we + offs_h[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row0[:, None] & ok, other=0.0)
            w = tl.load(w_ptrs, mask=h_ok[None, :] & ok, other=0.0)
        else:
            k_ok = k0 + offs_k < I
            a = tl.load(a_ptrs, mask=row0[:, None] & k_ok[None, :] & ok, other=0.0)
            w = tl.load(w_ptrs, mask=h_ok[None, :] & k_ok[:, None] & ok, other=0.0)
        part = tl.dot(a, w, input_precision=PRECISION)
        if HAS_W:
            part = part * tl.load(wt_ptr + pair).to(tl.float32)
        acc += part
    y = tl.sum(acc, 0)  # rows 1.. are exact zeros: this is row 0
    for k in tl.static_range(K):
        pair = t * K + k
        e = tl.load(ids_ptr + pair)
        ok = (e >= 0) & (e < E)
        if HAS_BIAS:
            bias = tl.load(b_ptr + tl.where(ok, e, 0).to(tl.int64) * stride_be + offs_h, mask=h_ok & ok, other=0.0)
            bias = bias.to(tl.float32)
            if HAS_W:
                bias = bias * tl.load(wt_ptr + pair).to(tl.float32)
            y += bias
        y = tl.where(ok, y, float("nan"))
    tl.store(out_ptr + t * stride_ot + offs_h, y.to(out_ptr.dtype.element_ty), mask=h_ok)

