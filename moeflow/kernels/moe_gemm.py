"""Private Triton kernels: the two grouped GEMMs of a MoE layer and the combine pass.

Legend: T tokens, K slots, N = T*K pairs (pair n = t*K + k), H hidden, I intermediate
per expert, E experts, P padded positions (= max_blocks * BM, see moe_align.py),
S split-K parts of the down GEMM, BM/BN/BK tile sizes.

Pipeline (all sync-free, grids sized on the host from shapes only):
    gate_up:  act_PI[p]   = act(x[tok(p)] @ W_gu[e(p)] (+ b_gu))      bf16/fp16, f32 accumulate
    down:     y_SNH[s, n] = act_PI[p(n)] @ W_d[e][split s] (+ b_d on s=0)  (split-K partials)
    combine:  out_TH[t]   = sum_{k=0..K-1} w[t,k] * sum_{s=0..S-1} y_SNH[s, t*K+k]
Every sum has a fixed order (K-loop order inside a tile, splits in order, slots in order) and
no atomics, so a result is a function of its inputs and the tile configuration only. With one
fixed configuration for every batch (batch-invariant mode) a token's bits do not depend on
which other tokens share its batch: rows of a tile never mix inside a dot.

Weight addressing is by strides, so both layouts run without copies:
    "linear": gate_up [E, 2I, H] (stride_wn = H, stride_wk = 1), down [E, H, I]
    "matmul": gate_up [E, H, 2I] (stride_wn = 1, stride_wk = 2I), down [E, I, H]
Halves: gate column j, up column I + j. Interleaved (gpt-oss): gate 2j, up 2j + 1; then one
contiguous [BK, 2*BN] tile is loaded and the accumulator is split into even/odd columns.

Activations (ACT): 0 silu(g)*u, 1 gelu_tanh(g)*u, 2 DeepSeek-V4 clamp (g <= L, -L <= u <= L,
silu(g)*u), 3 gpt-oss ((clamp u + 1) * g * sigmoid(alpha * g), g <= L).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import fast_kernel
from .pdl import pdl_trigger, pdl_wait

ACT_SILU = 0
ACT_GELU_TANH = 1
ACT_SWIGLU_CLAMP = 2
ACT_GPTOSS = 3


@triton.jit
def _tile_ids(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row-blocks share a weight column tile while it is in L2."""
    in_group = GROUP_M * num_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def tile_pairs(sorted_ptr, p0, num_pairs, BLOCK_M: tl.constexpr):
    """(offs_p, pair, row_ok) [BM]: the padded positions p0 .. p0+BM-1, the pair each holds (sorted_P) and
    whether it holds one (a padding slot holds num_pairs, moe_align.py)."""
    offs_p = p0 + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_p)
    return offs_p, pair, pair < num_pairs


@triton.jit
def pair_tokens(pair, row_ok, top_k):
    """int64 [BM]: the token row of each pair (pair // top_k), 0 for padding slots (their loads are masked)."""
    return tl.where(row_ok, pair // top_k, 0).to(tl.int64)


@triton.jit
def _activate(g, u, limit, alpha, ACT: tl.constexpr):
    if ACT == 2:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    if ACT == 3:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        out = (u + 1.0) * (g * tl.sigmoid(alpha * g))
    elif ACT == 1:
        # tanh(z) = 2 * sigmoid(2z) - 1: no libdevice call, same in the interpreter
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        out = 0.5 * g * (2.0 * tl.sigmoid(2.0 * z)) * u
    else:
        out = g * tl.sigmoid(g) * u
    return out


@triton.jit
def load_rows_k(ptrs, row_ok, k_ok, EVEN_K: tl.constexpr):
    """An activation tile [rows, BK]: zeros in the rows without a pair (row_ok false) and, unless EVEN_K
    (BK divides the reduction, so every K step is whole), in the columns past it (k_ok false)."""
    if EVEN_K:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    return tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def load_k_cols(ptrs, col_ok, k_ok, EVEN_K: tl.constexpr):
    """A weight tile [BK, cols]: zeros in the columns past the output (col_ok false) and, unless EVEN_K,
    in the rows past the reduction (k_ok false)."""
    if EVEN_K:
        return tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    return tl.load(ptrs, mask=col_ok[None, :] & k_ok[:, None], other=0.0)


@triton.jit
def split_interleaved(acc, b_base, offs_c, c_ok, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """(g, u) [BM, BN] from acc [BM, 2BN] f32 whose columns interleave gate and up (gpt-oss: gate 2j, up
    2j + 1); with HAS_BIAS the interleaved bias (b_base + offs_c, masked by c_ok) joins acc first."""
    if HAS_BIAS:
        bias = tl.load(b_base + offs_c, mask=c_ok, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    return tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))


@triton.jit
def add_gate_up_bias(g, u, b_base, offs_j, j_ok, I, HAS_BIAS: tl.constexpr):
    """(g, u) [BM, BN] f32 plus, with HAS_BIAS, the expert's gate bias b_base[j] and up bias b_base[I + j]
    for the columns offs_j (masked by j_ok)."""
    if HAS_BIAS:
        bg = tl.load(b_base + offs_j, mask=j_ok, other=0.0)
        bu = tl.load(b_base + I + offs_j, mask=j_ok, other=0.0)
        g += bg.to(tl.float32)[None, :]
        u += bu.to(tl.float32)[None, :]
    return g, u


@triton.jit
def store_act_rows(out, act_ptr, offs_p, offs_j, row_ok, I, stride_ap):
    """act_PI[p, j] = out [BM, BN] f32 in act's dtype, for the padded positions offs_p that hold a pair
    (row_ok) and the columns offs_j inside I."""
    act_ptrs = act_ptr + offs_p.to(tl.int64)[:, None] * stride_ap + offs_j[None, :]
    tl.store(act_ptrs, out.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_j < I)[None, :])


@triton.jit
def split_k_range(s, k_tiles_per_split, I, BLOCK_K: tl.constexpr):
    """[k_lo, k_hi): the reduction range of split s of the down GEMM, k_tiles_per_split K tiles from a
    multiple of BK the compiler can see (so the loads stay 16-byte wide)."""
    k_lo = tl.multiple_of(s * k_tiles_per_split * BLOCK_K, BLOCK_K)
    k_hi = tl.minimum(k_lo + k_tiles_per_split * BLOCK_K, I)
    return k_lo, k_hi


@triton.jit
def store_down_partial(acc, y_ptr, b_base, s, pair, row_ok, offs_h, h_ok, stride_ys, stride_yn,
                       HAS_BIAS: tl.constexpr):
    """y_SNH[s, pair, h] = acc [BM, BN] f32 in y's dtype, for the rows with a pair (row_ok) and the columns
    offs_h inside H (h_ok); with HAS_BIAS the expert's bias b_base[h] joins split 0's f32 sum before the
    rounding."""
    if HAS_BIAS:
        if s == 0:
            bias = tl.load(b_base + offs_h, mask=h_ok, other=0.0)
            acc += bias.to(tl.float32)[None, :]
    y_ptrs = y_ptr + s.to(tl.int64) * stride_ys + pair.to(tl.int64)[:, None] * stride_yn + offs_h[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & h_ok[None, :])


@triton.jit
def gate_up_rows(
    x_ptr, tok, row_ok, w_base, b_base, pid_n, H, I, stride_xt, stride_wn, stride_wk, limit, alpha,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """act [BM, BN] f32 = act(x[tok] @ W_gu (+ b_gu)) for columns pid_n*BN.. of I, rows masked by row_ok.

    tok: int64 [BM] token row of each tile row; w_base / b_base: this expert's gate_up and bias.
    """
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    if INTERLEAVED:
        offs_c = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        c_ok = offs_c < 2 * I
        w_ptrs = w_base + offs_c[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = offs_k + k0 < H  # read only when not EVEN_K
            a = load_rows_k(a_ptrs, row_ok, k_ok, EVEN_K)
            w = load_k_cols(w_ptrs, c_ok, k_ok, EVEN_K)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        g, u = split_interleaved(acc, b_base, offs_c, c_ok, HAS_BIAS, BLOCK_M, BLOCK_N)
    else:
        j_ok = offs_j < I
        wg_ptrs = w_base + offs_j[None, :] * stride_wn + offs_k[:, None] * stride_wk
        wu_ptrs = wg_ptrs + I * stride_wn
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = offs_k + k0 < H  # read only when not EVEN_K
            a = load_rows_k(a_ptrs, row_ok, k_ok, EVEN_K)
            wg = load_k_cols(wg_ptrs, j_ok, k_ok, EVEN_K)
            wu = load_k_cols(wu_ptrs, j_ok, k_ok, EVEN_K)
            g = tl.dot(a, wg, g, input_precision=PRECISION)
            u = tl.dot(a, wu, u, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_wk
        g, u = add_gate_up_bias(g, u, b_base, offs_j, j_ok, I, HAS_BIAS)
    return _activate(g, u, limit, alpha, ACT)


@triton.jit
def half_padded(sorted_ptr, p0, num_pairs, BLOCK_M: tl.constexpr):
    """Whether the block starting at padded position p0 can run as a BM/2-row tile (HALF_TAIL): its
    rows from BM/2 on are all padding. A block's pairs fill its first rows (moe_align.py), so
    its row BM/2 being a padding slot (pair index >= num_pairs) says it. Callers test HALF_TAIL
    first, as a constexpr, so kernels without half tiles never compile the half path."""
    return tl.load(sorted_ptr + p0 + BLOCK_M // 2) >= num_pairs


@triton.jit
def _gate_up_block(x_ptr, w_ptr, b_ptr, act_ptr, sorted_ptr, e, p0, pid_n, num_pairs, H, I, top_k,
                   stride_xt, stride_we, stride_wn, stride_wk, stride_be, stride_ap, limit, alpha,
                   ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act_PI rows p0 .. p0+BM-1 (expert e), columns pid_n*BN.. of I."""
    offs_p, pair, row_ok = tile_pairs(sorted_ptr, p0, num_pairs, BLOCK_M)
    tok = pair_tokens(pair, row_ok, top_k)
    out = gate_up_rows(x_ptr, tok, row_ok, w_ptr + e * stride_we, b_ptr + e * stride_be, pid_n, H, I,
                       stride_xt, stride_wn, stride_wk, limit, alpha, ACT, INTERLEAVED, HAS_BIAS, EVEN_K,
                       PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    store_act_rows(out, act_ptr, offs_p, pid_n * BLOCK_N + tl.arange(0, BLOCK_N), row_ok, I, stride_ap)


@fast_kernel
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def moe_gate_up_kernel(
    x_ptr, w_ptr, b_ptr, act_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, H, I, top_k, num_m,
    stride_xt, stride_we, stride_wn, stride_wk, stride_be, stride_ap,
    limit, alpha,
    ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HALF_TAIL: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Grid (max_blocks * cdiv(I, BN),). act_PI[p, j] for the block's rows and BN columns of I.

    HALF_TAIL: a block whose second half is padding computes BM/2 rows (half_padded); the same
    K steps per row, so the same bits.
    PDL (moeflow/kernels/pdl.py: OFF, EARLY, AT_EXIT): waits for the alignment, then (EARLY) lets the
    down GEMM start."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _tile_ids(pid, num_m, num_n, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    p0 = pid_m * BLOCK_M
    if HALF_TAIL and half_padded(sorted_ptr, p0, num_pairs, BLOCK_M):
        _gate_up_block(x_ptr, w_ptr, b_ptr, act_ptr, sorted_ptr, e, p0, pid_n, num_pairs, H, I, top_k,
                       stride_xt, stride_we, stride_wn, stride_wk, stride_be, stride_ap, limit, alpha,
                       ACT, INTERLEAVED, HAS_BIAS, EVEN_K, PRECISION, BLOCK_M // 2, BLOCK_N, BLOCK_K)
    else:
        _gate_up_block(x_ptr, w_ptr, b_ptr, act_ptr, sorted_ptr, e, p0, pid_n, num_pairs, H, I, top_k,
                       stride_xt, stride_we, stride_wn, stride_wk, stride_be, stride_ap, limit, alpha,
                       ACT, INTERLEAVED, HAS_BIAS, EVEN_K, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _down_block(act_ptr, w_ptr, b_ptr, y_ptr, sorted_ptr, e, p0, pid_n, s, num_pairs, H, I, k_tiles_per_split,
                stride_ap, stride_we, stride_wn, stride_wk, stride_be, stride_ys, stride_yn,
                HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y_SNH[s] of the pairs at rows p0 .. p0+BM-1 (expert e), columns pid_n*BN.. of H."""
    offs_p, pair, row_ok = tile_pairs(sorted_ptr, p0, num_pairs, BLOCK_M)
    offs_h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    k_lo, k_hi = split_k_range(s, k_tiles_per_split, I, BLOCK_K)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + offs_p.to(tl.int64)[:, None] * stride_ap + offs_k[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_h[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = offs_k + (k0 - k_lo) < k_hi  # read only when not EVEN_K
        a = load_rows_k(a_ptrs, row_ok, k_ok, EVEN_K)
        w = load_k_cols(w_ptrs, h_ok, k_ok, EVEN_K)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    store_down_partial(acc, y_ptr, b_ptr + e * stride_be, s, pair, row_ok, offs_h, h_ok, stride_ys, stride_yn,
                       HAS_BIAS)


@fast_kernel
@triton.jit(do_not_specialize=["num_pairs", "num_m", "k_tiles_per_split"])
def moe_down_kernel(
    act_ptr, w_ptr, b_ptr, y_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, H, I, num_m, k_tiles_per_split,
    stride_ap, stride_we, stride_wn, stride_wk, stride_be, stride_ys, stride_yn,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HALF_TAIL: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Grid (max_blocks * cdiv(H, BN), S). y_SNH[s, pair, h] over I-range [s*kps, (s+1)*kps), kps =
    k_tiles_per_split * BK (a multiple of BK the compiler can see, so the loads stay 16-byte wide).

    HALF_TAIL as moe_gate_up_kernel. PDL as moe_gate_up_kernel (waits for gate_up)."""
    pdl_wait(PDL)
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    s = tl.program_id(1)
    num_n = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = _tile_ids(pid, num_m, num_n, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    p0 = pid_m * BLOCK_M
    if HALF_TAIL and half_padded(sorted_ptr, p0, num_pairs, BLOCK_M):
        _down_block(act_ptr, w_ptr, b_ptr, y_ptr, sorted_ptr, e, p0, pid_n, s, num_pairs, H, I, k_tiles_per_split,
                    stride_ap, stride_we, stride_wn, stride_wk, stride_be, stride_ys, stride_yn,
                    HAS_BIAS, EVEN_K, PRECISION, BLOCK_M // 2, BLOCK_N, BLOCK_K)
    else:
        _down_block(act_ptr, w_ptr, b_ptr, y_ptr, sorted_ptr, e, p0, pid_n, s, num_pairs, H, I, k_tiles_per_split,
                    stride_ap, stride_we, stride_wn, stride_wk, stride_be, stride_ys, stride_yn,
                    HAS_BIAS, EVEN_K, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)


@fast_kernel
@triton.jit
def moe_combine_kernel(
    y_ptr, w_ptr, ids_ptr, out_ptr, H, E, stride_ys, stride_yn, stride_ot,
    K: tl.constexpr, SPLIT: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Grid (T, cdiv(H, BLOCK_H)). out[t] = sum_k w[t,k] * sum_s y[s, t*K+k], slot order, f32.

    A pair whose id is outside [0, E) was never computed: its row becomes NaN.
    """
    pdl_wait(PDL)
    pdl_trigger(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(K):
        n = t * K + k
        v = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            v += tl.load(y_ptr + s * stride_ys + n * stride_yn + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + n).to(tl.float32)
        eid = tl.load(ids_ptr + n)
        v = tl.where((eid >= 0) & (eid < E), v, float("nan"))
        acc += v
    tl.store(out_ptr + t * stride_ot + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)
