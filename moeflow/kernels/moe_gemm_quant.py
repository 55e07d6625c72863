"""Private Triton kernels of the quantized experts: FP8 block-scaled W8A8 and FP4 (MXFP4 / NVFP4) W4A16.

Legend: T tokens, K slots, N = T*K pairs (pair n = t*K + k), H hidden, I intermediate per
expert, E experts, P padded positions (= max_blocks * BM, see moe_align.py), S split-K parts
of the down GEMM, BM/BN/BK tile sizes, G the quantization group along the reduction axis
(fp8_block: bk of the weight block, 128 in every released checkpoint; mxfp4: 32; nvfp4: 16),
SBN the fp8_block scale block along the output axis (bn).

Weights are read as checkpoints store them, [E, out, in] (moeflow.quant.experts), addressed by strides
(Triton specializes a unit stride, so contiguous `in` rows load as wide vectors):
    fp8_block  W[e, n, k] = f32(Wq[e, n, k]) * ws[e, n // SBN, k // G]   Wq float8_e4m3fn, ws f32 or
                                                                          UE8M0 bytes (2^(b - 127))
               gate_up's scale grid is gate's (ceil(I / SBN) rows) then up's.
    mxfp4      W = e2m1 * 2^(b - 127), packed bytes [E, out, in/2] (low nibble = even element),
               E8M0 bytes [E, out, in/32]
    nvfp4      W = (e2m1 * f32(s8)) * s2, s8 float8_e4m3fn [E, out, in/16], s2 f32 per expert
               ([E, 2] gate/up for gate_up, [E] for down)

FP8 (W8A8), per the DeepSeek recipe and moeflow.quant.formats.quantize_fp8_activations:
    quant      xq[r], xs[r, g] = e4m3(x[r] / s), s = max|x[r, group g]| / 448 (1 for a zero group)
    gate_up    acc += dot_fp8(xq tile, Wq tile) * (xs[row, kt] * ws[blk, kt])   BK = G: one scale a tile
               (SCALAR_WS: BN divides the scale block, so the tile's weight scale is one number; else
               (dot * xs[row, kt]) * ws[col, kt] per column)
               act = act(acc_gate, acc_up) (+ bias), then quantized in the epilogue the same way
               (BN a multiple of G, so every group of I is whole inside one program)
    down       y = sum_kt dot_fp8(aq tile, Wq tile) * as[row, kt] * ws[col, kt]  (split-K parts)
Every dot is fp8 x fp8 with f32 accumulation over one K tile; the scaled tiles are summed in f32.
The scales' divisions are IEEE divisions (div_rn), as moeflow.quant.formats.div_by_const computes them on
every device. BM = 16 tiles compile the fp8 dots to fp16 mma.sync, BM >= 64 to fp8 wgmma.

FP4 (W4A16: Hopper has no FP4 MMA): each packed tile is dequantized in the load path to the
activations' dtype (bf16 / fp16) and fed to a bf16 / fp16 dot with f32 accumulation. MXFP4
values e2m1 * 2^(b - 127) and NVFP4 values e2m1 * s8 are exact in bf16 (at most 6 significant
bits, f32's exponent range); NVFP4's s2 multiplies the f32 accumulator once per output.
Decode (few pairs): GEMV kernels instead, one program per (pair, BN outputs), no alignment, no
MMA tile of 16 rows for one pair: each packed row is read as int32 words (8 values), each word
decoded and multiplied with the activations in one fma chain (element order), and the sums run in
a fixed order: words of a group (tl.sum), times 2^14 and the group's scale, into a per-(row, group
slot) partial kept across the K steps, then one sum over the slots:
    gemv gate_up  act_NI[n, j] = act(sum_slot sum_kt s[j, g] * sum_{words in g} dot8(w, x[t]) (+ b))
    gemv down     y_NH[n, h]   = (same over I of act_NI[n]) (* s2) (+ b_d)
E2M1 decode (both paths): the code's three magnitude bits placed at fp16 bits 9..11 and its sign
at bit 15 make the fp16 number e2m1 * 2^-14, exactly (0.5 becomes the fp16 subnormal 2^-15,
which the fp16 -> f32 conversion keeps); the 2^14 is multiplied back in f32 before the scale
(two exact multiplications by powers of two). Three integer operations per value instead of a
select chain. On CUDA the same bits come from inline PTX (`_FP4_DECODE_PTX`, ASM=True): four packed
bytes at once, two values per f16x2 word, so about half an integer operation per value plus the
conversion; 1.15-1.31x faster GEMV and 1.09-1.28x faster MMA tiles at gpt-oss-120b on the H200
(the same tiles timed with the Triton decode on the GPU), bit for bit the Triton decode, which now
serves the interpreter only.

Same schedule as moe_gemm.py: grid (max_blocks * column tiles[, S]), programs of padding blocks
(block_expert = -1) return at once, fixed sum orders, no atomics; the activation epilogue is
moe_gemm's `_activate` (ACT codes 0 silu, 1 gelu_tanh, 2 swiglu_clamp, 3 gptoss).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import fast_kernel
from .moe_gemm import (
    _activate,
    _tile_ids,
    add_gate_up_bias,
    load_k_cols,
    load_rows_k,
    pair_tokens,
    split_interleaved,
    split_k_range,
    store_act_rows,
    store_down_partial,
    tile_pairs,
)
from .pdl import pdl_trigger, pdl_wait

# A jit function reads module globals only as constexpr.
FP8_MAX = tl.constexpr(448.0)


# ------------------------------------------------------------------------------ element codecs
@triton.jit
def _e8m0_to_f32(b):
    """E8M0 exponent bytes -> f32 2^(b - 127), exact: built from the f32 bit pattern (b << 23);
    byte 0 is the subnormal 2^-127, byte 255 NaN (OCP MX), as moeflow.quant.formats.e8m0_to_f32."""
    b = b.to(tl.int32)
    bits = tl.where(b == 0, 0x00400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_scale(s, SCALE_E8M0: tl.constexpr):
    """A loaded fp8_block weight scale as f32 (UE8M0 bytes or f32)."""
    if SCALE_E8M0:
        return _e8m0_to_f32(s)
    return s.to(tl.float32)


# E2M1 values come out of _fp4_decode times 2^-14; this brings them back (exact in f32).
FP4_UNSCALE = tl.constexpr(16384.0)


@triton.jit
def _fp4_decode(p):
    """Packed bytes (int32 0..255; low nibble the even element) -> (lo, hi) f32 = e2m1 * 2^-14, exact.

    E2M1 code s e1 e0 m (bit 3 the sign): as fp16 bits (s << 15) | (e1 e0 m << 9) it reads
    2^(e - 15) * (1 + m / 2) for e >= 1 and m * 2^-15 for e == 0, i.e. e2m1 * 2^-14 for every
    code (+-{0, .5, 1, 1.5, 2, 3, 4, 6}; -0 stays -0). Shifts and masks only, no table lookup.
    """
    lo = ((p << 9) & 0x0E00) | ((p << 12) & 0x8000)
    hi = ((p << 5) & 0x0E00) | ((p << 8) & 0x8000)
    lo = lo.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = hi.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


# The same decode as inline PTX, four packed bytes (eight values) per block: each f16x2 word takes
# two shifts and a masked or for two values, where the Triton form above spends that per value
# (with the Triton decode, ASM off, the GEMV is ALU-bound at gpt-oss T = 1, 64% SM / 22% DRAM:
# `bash tools/ncu_profile.sh OUT quant_mxfp4_gemv_t1_gpt_oss`).
# From the input register W (bytes b0..b3, low byte first): f16x2 words a = (lo b0, lo b2),
# b = (hi b0, hi b2), c = (lo b1, lo b3), d = (hi b1, hi b3), i.e. elements (0, 4), (1, 5), (2, 6),
# (3, 7) of the word. Shared by the asm blocks below (W is their input operand).
_E2M1_WORD_PTX = """
.reg .b32 t<4>, s<3>, a, b, c, d;
.reg .b16 h<8>;
shl.b32 t0, W, 9;
and.b32 t0, t0, 0x0E000E00;
shl.b32 s0, W, 12;
and.b32 s0, s0, 0x80008000;
or.b32 a, t0, s0;
shl.b32 t1, W, 5;
and.b32 t1, t1, 0x0E000E00;
shl.b32 s1, W, 8;
and.b32 s1, s1, 0x80008000;
or.b32 b, t1, s1;
shl.b32 t2, W, 1;
and.b32 t2, t2, 0x0E000E00;
shl.b32 s2, W, 4;
and.b32 s2, s2, 0x80008000;
or.b32 c, t2, s2;
shr.b32 t3, W, 3;
and.b32 t3, t3, 0x0E000E00;
and.b32 d, W, 0x80008000;
or.b32 d, d, t3;
"""

# Outputs $0..$3 lo of b0..b3, $4..$7 hi; input $8.
_FP4_DECODE_PTX = tl.constexpr("{" + _E2M1_WORD_PTX.replace("W", "$8") + """mov.b32 {h0, h1}, a;
mov.b32 {h2, h3}, b;
mov.b32 {h4, h5}, c;
mov.b32 {h6, h7}, d;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h4;
cvt.f32.f16 $2, h1;
cvt.f32.f16 $3, h5;
cvt.f32.f16 $4, h2;
cvt.f32.f16 $5, h6;
cvt.f32.f16 $6, h3;
cvt.f32.f16 $7, h7;
}
""")


@triton.jit
def _fp4_decode_bytes(p, ASM: tl.constexpr):
    """Packed bytes p (uint8, any shape) -> (lo, hi) f32 = e2m1 * 2^-14 exactly, as _fp4_decode.

    ASM: the inline PTX above (CUDA only; the interpreter has no inline asm), else _fp4_decode.
    Both give the same numbers, so the kernels' bits do not depend on ASM.
    """
    if ASM:
        return tl.inline_asm_elementwise(_FP4_DECODE_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [p],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    return _fp4_decode(p.to(tl.int32))


@triton.jit
def _fp4_scale(s_raw, FMT: tl.constexpr):
    """A loaded FP4 group scale as f32: E8M0 bytes (FMT 1, mxfp4) or e4m3 bytes (FMT 2, nvfp4)."""
    if FMT == 1:
        return _e8m0_to_f32(s_raw)
    return s_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _w4_tile(w_ptrs, s_ptrs, w_mask, s_mask, FMT: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr,
             G: tl.constexpr, ASM: tl.constexpr):
    """f32 [ROWS, BK] weights of one K tile: packed uint8 [ROWS, BK/2] codes times [ROWS, BK/G] scales.

    Masked-off bytes load code 0 (value 0) whatever their scale, so edge tiles add nothing.
    """
    lo, hi = _fp4_decode_bytes(tl.load(w_ptrs, mask=w_mask, other=0), ASM)
    # join puts lo (the even element) before hi along a new last axis: [ROWS, BK/2, 2] is the
    # row's K order; viewed as [ROWS, BK/G, G] each group meets its own scale.
    v = tl.reshape(tl.join(lo, hi), (ROWS, BK // G, G))
    s = _fp4_scale(tl.load(s_ptrs, mask=s_mask, other=0), FMT)
    # (v * 2^14) is the e2m1 value exactly; times the scale as the reference dequantizer.
    return tl.reshape((v * FP4_UNSCALE) * s[:, :, None], (ROWS, BK))


@triton.jit
def _w4_k_masks(offs_k, offs_kb, offs_kg, rest, G: tl.constexpr):
    """(k_ok, kb_ok, kg_ok): which of a K step's elements (offs_k), packed bytes (offs_kb) and scale groups
    (offs_kg) lie before the end of the reduction, `rest` elements from the step's start."""
    return offs_k < rest, offs_kb < rest // 2, offs_kg < rest // G


@triton.jit
def _w4_tile_k(w_ptrs, s_ptrs, rows_ok, kb_ok, kg_ok, EVEN_K: tl.constexpr, FMT: tl.constexpr, ROWS: tl.constexpr,
               BK: tl.constexpr, G: tl.constexpr, ASM: tl.constexpr):
    """_w4_tile of one K step: zeros in the rows past the output (rows_ok false) and, unless EVEN_K, in the
    bytes and scale groups past the reduction (kb_ok, kg_ok false: _w4_k_masks)."""
    if EVEN_K:
        return _w4_tile(w_ptrs, s_ptrs, rows_ok[:, None], rows_ok[:, None], FMT, ROWS, BK, G, ASM)
    return _w4_tile(w_ptrs, s_ptrs, rows_ok[:, None] & kb_ok[None, :], rows_ok[:, None] & kg_ok[None, :], FMT,
                    ROWS, BK, G, ASM)


@triton.jit
def _nvfp4_scale_gate_up(g, u, s2_ptr, e, stride_s2e, stride_s2g, FMT: tl.constexpr):
    """NVFP4 (FMT 2): the gate and up sums times the expert's f32 scales s2[e, 0] and s2[e, 1]."""
    if FMT == 2:
        g = g * tl.load(s2_ptr + e * stride_s2e)
        u = u * tl.load(s2_ptr + e * stride_s2e + stride_s2g)
    return g, u


@triton.jit
def _fp8_quant_groups(v, AXIS: tl.constexpr):
    """(q float8e4nv like v, s f32 with AXIS reduced): per group along AXIS, s = max|v| / 448
    (1 for an all-zero group), q = e4m3(clamp(v / s, +-448)); IEEE divisions (div_rn), round to
    nearest even: the same numbers as moeflow.quant.formats.quantize_fp8_activations."""
    amax = tl.max(tl.abs(v), axis=AXIS)
    s = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32)), 1.0)
    q = tl.math.div_rn(v, tl.broadcast_to(tl.expand_dims(s, AXIS), v.shape))
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    return q.to(tl.float8e4nv), s


@triton.jit
def _fp8_row_scale(xs_row_ptrs, sw_ptr, kt, stride_wsk, row_ok, SCALE_E8M0: tl.constexpr):
    """[BM] f32: activation scale of each row times the tile's one weight scale, K tile kt.

    SCALAR_WS kernels: the tile's BN output columns lie in one weight-scale block (BN divides sbn),
    so the weight scale of K tile kt is one number and the dot needs one multiply-add per element:
    acc + dot * (sa * sw). The caller loads tile kt + 1's scales before tile kt's dot (their global
    latency then hides behind the MMA instead of stalling every K step).
    """
    sa = tl.load(xs_row_ptrs + kt, mask=row_ok, other=0.0)
    return sa * _fp8_scale(tl.load(sw_ptr + kt * stride_wsk), SCALE_E8M0)


@triton.jit
def _fp8_gate_up_scales(xs_row_ptrs, sg_ptr, su_ptr, kt, stride_wsk, row_ok, SCALE_E8M0: tl.constexpr):
    """(cg, cu) [BM] f32: _fp8_row_scale of K tile kt for the gate columns (weight scales at sg_ptr) and
    for the up columns (su_ptr)."""
    cg = _fp8_row_scale(xs_row_ptrs, sg_ptr, kt, stride_wsk, row_ok, SCALE_E8M0)
    cu = _fp8_row_scale(xs_row_ptrs, su_ptr, kt, stride_wsk, row_ok, SCALE_E8M0)
    return cg, cu


@triton.jit
def _fp8_quant_store(out, rows, row_ok, offs_j, j_ok, pid_n, aq_ptr, as_ptr, stride_aq, stride_as, I,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Quantize the f32 activation tile out [BM, BN] (BN a multiple of the group BK) per row per group
    into aq_PI (e4m3) / as_PG (f32 scales): gate_up's epilogue."""
    # Columns past I are zero so they never raise a group's max.
    out = tl.where(j_ok[None, :], out, 0.0)
    q, s = _fp8_quant_groups(tl.reshape(out, (BLOCK_M, BLOCK_N // BLOCK_K, BLOCK_K)), 2)
    tl.store(aq_ptr + rows[:, None] * stride_aq + offs_j[None, :], tl.reshape(q, (BLOCK_M, BLOCK_N)),
             mask=row_ok[:, None] & j_ok[None, :])
    offs_g = pid_n * (BLOCK_N // BLOCK_K) + tl.arange(0, BLOCK_N // BLOCK_K)
    tl.store(as_ptr + rows[:, None] * stride_as + offs_g[None, :], s,
             mask=row_ok[:, None] & (offs_g < tl.cdiv(I, BLOCK_K))[None, :])


# ------------------------------------------------------------------------------ FP8 W8A8
@fast_kernel
@triton.jit(do_not_specialize=["M"])
def fp8_quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, H, stride_x, stride_q, stride_s,
                          G: tl.constexpr, GPP: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (M, cdiv(cdiv(H, G), GPP)): xq [M, H] float8e4nv and xs [M, cdiv(H, G)] f32 of x [M, H].

    Each program quantizes GPP groups of one row (the activations of gate_up's input).
    """
    pdl_wait(PDL)  # moeflow/kernels/pdl.py: first, before any read
    pdl_trigger(PDL)
    r = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * GPP + tl.arange(0, GPP)
    offs_h = offs_g[:, None] * G + tl.arange(0, G)[None, :]
    ok = offs_h < H
    x = tl.load(x_ptr + r * stride_x + offs_h, mask=ok, other=0.0).to(tl.float32)
    q, s = _fp8_quant_groups(x, 1)
    tl.store(q_ptr + r * stride_q + offs_h, q, mask=ok)
    tl.store(s_ptr + r * stride_s + offs_g, s, mask=offs_g < tl.cdiv(H, G))


@fast_kernel
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def moe_gate_up_fp8_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, aq_ptr, as_ptr, act_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, H, I, top_k, num_m, sbn, g_rows,
    stride_xq, stride_xs, stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_be,
    stride_aq, stride_as, stride_act,
    limit, alpha,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_E8M0: tl.constexpr, EVEN_K: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False, SCALAR_WS: tl.constexpr = False, IMPRECISE: tl.constexpr = None,
):
    """Grid (max_blocks * cdiv(I, BN),). aq_PI / as_PG for the block's rows and BN columns of I.

    BLOCK_K == G (one activation scale per row and one weight scale per column a tile). Gate row
    j of expert e scales by ws[e, j // sbn, kt], up row j by ws[e, g_rows + j // sbn, kt]
    (g_rows = cdiv(I, sbn)). QUANT_OUT (BLOCK_N % G == 0): the epilogue quantizes whole groups
    into aq / as. Else (BLOCK_N a divisor of G: narrower tiles, more programs at decode) it
    stores the f32 activation into act_PI [P, I] and fp8_quant_rows_kernel quantizes it after:
    the same f32 values through the same _fp8_quant_groups, so the same bits.
    SCALAR_WS (BN divides sbn): one weight scale a tile and K step, acc + dot * (sa * sw) with the
    next step's scales loaded ahead (_fp8_row_scale); else (dot * sa) * sw per column.
    IMPRECISE: the dots' max_num_imprecise_acc (None: Triton's default, the fp8 wgmma accumulating a
    whole K tile at its reduced precision; 32: an f32 sum every k32 step, tools/fp8_mma_model.py).
    """
    pdl_wait(PDL)  # moeflow/kernels/pdl.py: first, before any read
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _tile_ids(pid, num_m, num_n, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    offs_p, pair, row_ok = tile_pairs(sorted_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M)
    tok = pair_tokens(pair, row_ok, top_k)
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = offs_j < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = xq_ptr + tok[:, None] * stride_xq + offs_k[None, :]
    xs_ptrs = xs_ptr + tok * stride_xs
    w_base = w_ptr + e * stride_we
    wg_ptrs = w_base + offs_j[None, :] * stride_wn + offs_k[:, None] * stride_wk
    wu_ptrs = wg_ptrs + I * stride_wn
    ws_base = ws_ptr + e * stride_wse
    g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_kt = tl.cdiv(H, BLOCK_K)
    if SCALAR_WS:
        blk = (pid_n * BLOCK_N) // sbn
        sg_ptrs = ws_base + blk * stride_wsn
        su_ptrs = ws_base + (g_rows + blk) * stride_wsn
        cg, cu = _fp8_gate_up_scales(xs_ptrs, sg_ptrs, su_ptrs, 0, stride_wsk, row_ok, SCALE_E8M0)
    else:
        sg_ptrs = ws_base + (offs_j // sbn) * stride_wsn
        su_ptrs = ws_base + (g_rows + offs_j // sbn) * stride_wsn
        cg = tl.zeros([BLOCK_M], dtype=tl.float32)  # unused: the loop reads per-column scales
        cu = cg
    for kt in range(0, n_kt):
        if SCALAR_WS:
            # the last step re-reads its own scales (in bounds)
            cg_next, cu_next = _fp8_gate_up_scales(xs_ptrs, sg_ptrs, su_ptrs, tl.minimum(kt + 1, n_kt - 1),
                                                   stride_wsk, row_ok, SCALE_E8M0)
        k_ok = offs_k < H - kt * BLOCK_K  # read only when not EVEN_K
        a = load_rows_k(a_ptrs, row_ok, k_ok, EVEN_K)
        wg = load_k_cols(wg_ptrs, j_ok, k_ok, EVEN_K)
        wu = load_k_cols(wu_ptrs, j_ok, k_ok, EVEN_K)
        # One K tile per dot, scaled into the f32 sum: the fp8 MMA's own accumulation never
        # runs past one scale block.
        if SCALAR_WS:
            g += tl.dot(a, wg, max_num_imprecise_acc=IMPRECISE) * cg[:, None]
            u += tl.dot(a, wu, max_num_imprecise_acc=IMPRECISE) * cu[:, None]
            cg = cg_next
            cu = cu_next
        else:
            sa = tl.load(xs_ptrs + kt, mask=row_ok, other=0.0)
            sg = _fp8_scale(tl.load(sg_ptrs + kt * stride_wsk, mask=j_ok, other=0), SCALE_E8M0)
            su = _fp8_scale(tl.load(su_ptrs + kt * stride_wsk, mask=j_ok, other=0), SCALE_E8M0)
            # (dot * row scale) * column scale: broadcasts, never a [BM, BN] tile of scales.
            g += (tl.dot(a, wg, max_num_imprecise_acc=IMPRECISE) * sa[:, None]) * sg[None, :]
            u += (tl.dot(a, wu, max_num_imprecise_acc=IMPRECISE) * sa[:, None]) * su[None, :]
        a_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K * stride_wk
        wu_ptrs += BLOCK_K * stride_wk
    g, u = add_gate_up_bias(g, u, b_ptr + e * stride_be, offs_j, j_ok, I, HAS_BIAS)
    out = _activate(g, u, limit, alpha, ACT)
    rows = offs_p.to(tl.int64)
    if QUANT_OUT:
        _fp8_quant_store(out, rows, row_ok, offs_j, j_ok, pid_n, aq_ptr, as_ptr, stride_aq, stride_as, I,
                         BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        tl.store(act_ptr + rows[:, None] * stride_act + offs_j[None, :], out, mask=row_ok[:, None] & j_ok[None, :])


@fast_kernel
@triton.jit(do_not_specialize=["num_pairs", "num_m", "k_tiles_per_split"])
def moe_down_fp8_kernel(
    aq_ptr, as_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, H, I, num_m, k_tiles_per_split, sbn,
    stride_aq, stride_as, stride_we, stride_wn, stride_wk, stride_wse, stride_wsn, stride_wsk, stride_be,
    stride_ys, stride_yn,
    HAS_BIAS: tl.constexpr, SCALE_E8M0: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False, SCALAR_WS: tl.constexpr = False, IMPRECISE: tl.constexpr = None,
):
    """Grid (max_blocks * cdiv(H, BN), S). y_SNH[s, pair, h] over the K tiles
    [s * k_tiles_per_split, (s + 1) * k_tiles_per_split) of I; BLOCK_K == G. SCALAR_WS and IMPRECISE
    as moe_gate_up_fp8_kernel."""
    pdl_wait(PDL)  # moeflow/kernels/pdl.py: first, before any read
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    s_id = tl.program_id(1)
    num_n = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = _tile_ids(pid, num_m, num_n, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    offs_p, pair, row_ok = tile_pairs(sorted_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M)
    rows = offs_p.to(tl.int64)
    offs_h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    kt_lo = s_id * k_tiles_per_split
    kt_hi = tl.minimum(kt_lo + k_tiles_per_split, tl.cdiv(I, BLOCK_K))
    offs_k = tl.arange(0, BLOCK_K)
    k_first = tl.multiple_of(kt_lo * BLOCK_K, BLOCK_K)
    a_ptrs = aq_ptr + rows[:, None] * stride_aq + (k_first + offs_k)[None, :]
    as_ptrs = as_ptr + rows * stride_as
    w_ptrs = w_ptr + e * stride_we + offs_h[None, :] * stride_wn + (k_first + offs_k)[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SCALAR_WS:
        ws_ptrs = ws_ptr + e * stride_wse + ((pid_n * BLOCK_N) // sbn) * stride_wsn
        # clamped: an empty last split part (kt_lo >= kt_hi) must not read past the scales
        c = _fp8_row_scale(as_ptrs, ws_ptrs, tl.minimum(kt_lo, tl.cdiv(I, BLOCK_K) - 1), stride_wsk, row_ok,
                           SCALE_E8M0)
    else:
        ws_ptrs = ws_ptr + e * stride_wse + (offs_h // sbn) * stride_wsn
        c = tl.zeros([BLOCK_M], dtype=tl.float32)  # unused: the loop reads per-column scales
    for kt in range(kt_lo, kt_hi):
        if SCALAR_WS:
            c_next = _fp8_row_scale(as_ptrs, ws_ptrs, tl.minimum(kt + 1, kt_hi - 1), stride_wsk, row_ok,
                                    SCALE_E8M0)
        k_ok = offs_k < I - kt * BLOCK_K  # read only when not EVEN_K
        a = load_rows_k(a_ptrs, row_ok, k_ok, EVEN_K)
        w = load_k_cols(w_ptrs, h_ok, k_ok, EVEN_K)
        if SCALAR_WS:
            acc += tl.dot(a, w, max_num_imprecise_acc=IMPRECISE) * c[:, None]
            c = c_next
        else:
            sa = tl.load(as_ptrs + kt, mask=row_ok, other=0.0)
            sw = _fp8_scale(tl.load(ws_ptrs + kt * stride_wsk, mask=h_ok, other=0), SCALE_E8M0)
            acc += (tl.dot(a, w, max_num_imprecise_acc=IMPRECISE) * sa[:, None]) * sw[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    store_down_partial(acc, y_ptr, b_ptr + e * stride_be, s_id, pair, row_ok, offs_h, h_ok, stride_ys, stride_yn,
                       HAS_BIAS)


# ------------------------------------------------------------------------------ FP4 W4A16
@fast_kernel
@triton.jit(do_not_specialize=["num_pairs", "num_m"])
def moe_gate_up_w4_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, b_ptr, act_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, H, I, top_k, num_m,
    stride_xt, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_s2e, stride_s2g,
    stride_be, stride_ap, limit, alpha,
    FMT: tl.constexpr, G: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid (max_blocks * cdiv(I, BN),). act_PI[p, j] (x's dtype) for the block's rows, BN columns of I.

    Packed weights [E, 2I, H/2] with scales [E, 2I, H/G]; BLOCK_K % G == 0 and H % G == 0
    (the formats' rule), so a tile never splits a scale group. Interleaved (gpt-oss): out row
    2j is gate j, 2j + 1 up j: one [2BN, BK] tile, accumulator split into even / odd columns.
    NVFP4 (never interleaved): s2[e, 0] multiplies gate's sums, s2[e, 1] up's.
    """
    pdl_wait(PDL)  # moeflow/kernels/pdl.py: first, before any read
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    num_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _tile_ids(pid, num_m, num_n, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    offs_p, pair, row_ok = tile_pairs(sorted_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M)
    tok = pair_tokens(pair, row_ok, top_k)
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_kg = tl.arange(0, BLOCK_K // G)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    if INTERLEAVED:
        offs_c = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        c_ok = offs_c < 2 * I
        w_ptrs = w_base + offs_c[:, None] * stride_wn + offs_kb[None, :] * stride_wk
        s_ptrs = s_base + offs_c[:, None] * stride_sn + offs_kg[None, :] * stride_sk
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok, kb_ok, kg_ok = _w4_k_masks(offs_k, offs_kb, offs_kg, H - k0, G)  # read only when not EVEN_K
            a = load_rows_k(a_ptrs, row_ok, k_ok, EVEN_K)
            wt = _w4_tile_k(w_ptrs, s_ptrs, c_ok, kb_ok, kg_ok, EVEN_K, FMT, 2 * BLOCK_N, BLOCK_K, G, ASM)
            acc = tl.dot(a, tl.trans(wt.to(a.dtype)), acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K // 2 * stride_wk
            s_ptrs += BLOCK_K // G * stride_sk
        g, u = split_interleaved(acc, b_ptr + e * stride_be, offs_c, c_ok, HAS_BIAS, BLOCK_M, BLOCK_N)
    else:
        j_ok = offs_j < I
        wg_ptrs = w_base + offs_j[:, None] * stride_wn + offs_kb[None, :] * stride_wk
        wu_ptrs = wg_ptrs + I * stride_wn
        sg_ptrs = s_base + offs_j[:, None] * stride_sn + offs_kg[None, :] * stride_sk
        su_ptrs = sg_ptrs + I * stride_sn
        g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok, kb_ok, kg_ok = _w4_k_masks(offs_k, offs_kb, offs_kg, H - k0, G)  # read only when not EVEN_K
            a = load_rows_k(a_ptrs, row_ok, k_ok, EVEN_K)
            wg = _w4_tile_k(wg_ptrs, sg_ptrs, j_ok, kb_ok, kg_ok, EVEN_K, FMT, BLOCK_N, BLOCK_K, G, ASM)
            wu = _w4_tile_k(wu_ptrs, su_ptrs, j_ok, kb_ok, kg_ok, EVEN_K, FMT, BLOCK_N, BLOCK_K, G, ASM)
            g = tl.dot(a, tl.trans(wg.to(a.dtype)), g)
            u = tl.dot(a, tl.trans(wu.to(a.dtype)), u)
            a_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K // 2 * stride_wk
            wu_ptrs += BLOCK_K // 2 * stride_wk
            sg_ptrs += BLOCK_K // G * stride_sk
            su_ptrs += BLOCK_K // G * stride_sk
        g, u = _nvfp4_scale_gate_up(g, u, s2_ptr, e, stride_s2e, stride_s2g, FMT)
        g, u = add_gate_up_bias(g, u, b_ptr + e * stride_be, offs_j, j_ok, I, HAS_BIAS)
    out = _activate(g, u, limit, alpha, ACT)
    store_act_rows(out, act_ptr, offs_p, offs_j, row_ok, I, stride_ap)


@fast_kernel
@triton.jit(do_not_specialize=["num_pairs", "num_m", "k_tiles_per_split"])
def moe_down_w4_kernel(
    act_ptr, w_ptr, s_ptr, s2_ptr, b_ptr, y_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, H, I, num_m, k_tiles_per_split,
    stride_ap, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_s2e, stride_be,
    stride_ys, stride_yn,
    FMT: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid (max_blocks * cdiv(H, BN), S). y_SNH[s, pair, h] = act_PI[p] @ W_d[e] over the I-range
    of split s (k_tiles_per_split * BK wide); packed down [E, H, I/2], scales [E, H, I/G]."""
    pdl_wait(PDL)  # moeflow/kernels/pdl.py: first, before any read
    pdl_trigger(PDL)
    pid = tl.program_id(0)
    s_id = tl.program_id(1)
    num_n = tl.cdiv(H, BLOCK_N)
    pid_m, pid_n = _tile_ids(pid, num_m, num_n, GROUP_M)
    e = tl.load(block_expert_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    offs_p, pair, row_ok = tile_pairs(sorted_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M)
    offs_h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    k_lo, k_hi = split_k_range(s_id, k_tiles_per_split, I, BLOCK_K)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_kg = tl.arange(0, BLOCK_K // G)
    a_ptrs = act_ptr + offs_p.to(tl.int64)[:, None] * stride_ap + (k_lo + offs_k)[None, :]
    w_ptrs = w_ptr + e * stride_we + offs_h[:, None] * stride_wn + (k_lo // 2 + offs_kb)[None, :] * stride_wk
    s_ptrs = s_ptr + e * stride_se + offs_h[:, None] * stride_sn + (k_lo // G + offs_kg)[None, :] * stride_sk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok, kb_ok, kg_ok = _w4_k_masks(offs_k, offs_kb, offs_kg, k_hi - k0, G)  # read only when not EVEN_K
        a = load_rows_k(a_ptrs, row_ok, k_ok, EVEN_K)
        wt = _w4_tile_k(w_ptrs, s_ptrs, h_ok, kb_ok, kg_ok, EVEN_K, FMT, BLOCK_N, BLOCK_K, G, ASM)
        acc = tl.dot(a, tl.trans(wt.to(a.dtype)), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2 * stride_wk
        s_ptrs += BLOCK_K // G * stride_sk
    if FMT == 2:
        acc = acc * tl.load(s2_ptr + e * stride_s2e)
    store_down_partial(acc, y_ptr, b_ptr + e * stride_be, s_id, pair, row_ok, offs_h, h_ok, stride_ys, stride_yn,
                       HAS_BIAS)


# ------------------------------------------------------------------------------ FP4 W4A16 GEMV (decode)
# One packed int32 word (bytes b0..b3 = E2M1 elements 0..7 of a row, low nibble first) dotted with
# eight f32 activations ($2..$9): decoded as _FP4_DECODE_PTX does (f16 words, then f32 = e2m1 *
# 2^-14), then $0 = e0 * x0 and fma(e_i, x_i, $0) for i = 1..7, one chain in element order. Why one
# asm block per word: a GEMV that decodes values one by one and moves x through shared memory,
# reducing across threads every K step, is issue-bound (ALU the busiest pipe, 3 of 4 issue slots) at
# 8.2 SASS instructions a weight value; a word a thread with its x in registers takes ~5 (the loop's
# opcode mix: tools/tests/test_sass_mix.py::test_gemv_loop_runs_the_dot8_asm_and_no_shuffles).
_FP4_DOT8_PTX = tl.constexpr("{\n.reg .f32 e<8>;" + _E2M1_WORD_PTX.replace("W", "$1") + """mov.b32 {h0, h4}, a;
mov.b32 {h1, h5}, b;
mov.b32 {h2, h6}, c;
mov.b32 {h3, h7}, d;
cvt.f32.f16 e0, h0;
cvt.f32.f16 e1, h1;
cvt.f32.f16 e2, h2;
cvt.f32.f16 e3, h3;
cvt.f32.f16 e4, h4;
cvt.f32.f16 e5, h5;
cvt.f32.f16 e6, h6;
cvt.f32.f16 e7, h7;
mul.rn.f32 $0, e0, $2;
fma.rn.f32 $0, e1, $3, $0;
fma.rn.f32 $0, e2, $4, $0;
fma.rn.f32 $0, e3, $5, $0;
fma.rn.f32 $0, e4, $6, $0;
fma.rn.f32 $0, e5, $7, $0;
fma.rn.f32 $0, e6, $8, $0;
fma.rn.f32 $0, e7, $9, $0;
}
""")


@triton.jit
def _fp4_dot8(wd, x0, x1, x2, x3, x4, x5, x6, x7, ASM: tl.constexpr):
    """f32 like wd (int32 packed words): sum of e2m1_i * 2^-14 * x_i over a word's 8 elements, as
    x0 * e0 then one fma per element in element order. ASM: _FP4_DOT8_PTX (CUDA only); else the
    same decode (_fp4_decode) and the same mul / fma chain in Triton: the same bits on the GPU."""
    if ASM:
        return tl.inline_asm_elementwise(_FP4_DOT8_PTX, "=r,r,r,r,r,r,r,r,r,r",
                                         [wd, x0, x1, x2, x3, x4, x5, x6, x7],
                                         dtype=tl.float32, is_pure=True, pack=1)
    e0, e1 = _fp4_decode(wd & 0xFF)
    e2, e3 = _fp4_decode((wd >> 8) & 0xFF)
    e4, e5 = _fp4_decode((wd >> 16) & 0xFF)
    e6, e7 = _fp4_decode((wd >> 24) & 0xFF)
    acc = e0 * x0
    acc = tl.fma(e1, x1, acc)
    acc = tl.fma(e2, x2, acc)
    acc = tl.fma(e3, x3, acc)
    acc = tl.fma(e4, x4, acc)
    acc = tl.fma(e5, x5, acc)
    acc = tl.fma(e6, x6, acc)
    return tl.fma(e7, x7, acc)


@triton.jit
def _x_pairs_f32(p, X_BF16: tl.constexpr):
    """(even, odd) f32 elements of 16-bit activation pairs p (int32 words: element 2i in the low half).
    bf16 -> f32 is the bits moved up (exact); fp16 through a conversion."""
    if X_BF16:
        return (p << 16).to(tl.float32, bitcast=True), (p & -65536).to(tl.float32, bitcast=True)
    lo = (p & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((p >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _w4_gemv_rows(x_row_ptr, w_rows, s_ptrs, row_ok, K, stride_sk,
                  FMT: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                  ASM: tl.constexpr):
    """f32 [ROWS]: sum over K of W[row, k] * x[k] for ROWS packed weight rows and one activation row.

    w_rows [ROWS]: byte pointers to the rows' packed K (unit stride, 4-byte aligned: read as int32
    words of 8 elements); s_ptrs [ROWS, BK/G] the rows' first scale tile; x_row_ptr the 16-bit
    activation row (4-byte aligned: read as element pairs). Per word: _fp4_dot8; per group of G:
    the words' sums (tree), times 2^14, times the group's scale, into a per-(row, group slot)
    f32 partial that stays in its thread across K steps; one sum over the slots at the end.
    K % 16 == 0 (the formats' rule), so a step's tail holds whole words and groups.
    """
    W: tl.constexpr = BLOCK_K // 8
    offs_w = tl.arange(0, W)
    offs_g = tl.arange(0, BLOCK_K // G)
    x32 = x_row_ptr.to(tl.pointer_type(tl.int32))
    w32 = w_rows.to(tl.pointer_type(tl.int32))[:, None] + offs_w[None, :]
    acc = tl.zeros([ROWS, BLOCK_K // G], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_ok = offs_w < (K - k0) // 8
        g_ok = offs_g < (K - k0) // G
        wd = tl.load(w32 + k0 // 8, mask=row_ok[:, None] & w_ok[None, :], other=0)
        s = _fp4_scale(tl.load(s_ptrs, mask=row_ok[:, None] & g_ok[None, :], other=0), FMT)
        xp = tl.load(x32 + k0 // 2 + 4 * offs_w[:, None] + tl.arange(0, 4)[None, :], mask=w_ok[:, None], other=0)
        # [W, 4]: elements 8w + 2p and 8w + 2p + 1 (bf16 or fp16 by the row pointer's type)
        xe, xo = _x_pairs_f32(xp, x_row_ptr.dtype.element_ty == tl.bfloat16)
        e02, e13 = tl.split(tl.reshape(xe, (W, 2, 2)))       # p = (0, 2) and (1, 3)
        x0, x4 = tl.split(e02)
        x2, x6 = tl.split(e13)
        o02, o13 = tl.split(tl.reshape(xo, (W, 2, 2)))
        x1, x5 = tl.split(o02)
        x3, x7 = tl.split(o13)
        d = _fp4_dot8(wd, x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :], x5[None, :],
                      x6[None, :], x7[None, :], ASM)         # [ROWS, W]
        grp = tl.sum(tl.reshape(d, (ROWS, BLOCK_K // G, G // 8)), axis=2)
        acc += (grp * FP4_UNSCALE) * s
        s_ptrs += BLOCK_K // G * stride_sk
    return tl.sum(acc, axis=1)


@fast_kernel
@triton.jit
def moe_gate_up_w4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, s2_ptr, b_ptr, act_ptr, ids_ptr,
    H, I, E, top_k,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_s2e, stride_s2g,
    stride_be, stride_an, limit, alpha,
    FMT: tl.constexpr, G: tl.constexpr, ACT: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid (N, cdiv(I, BN)). act_NI[n, j] (x's dtype) for pair n, BN columns of I; expert ids_N[n],
    input row x[n // top_k]. A pair whose id is outside [0, E) is skipped (the combine turns its
    token's row to NaN). Packed gate_up [E, 2I, H/2] (unit stride along H/2, rows 4-byte aligned),
    scales [E, 2I, H/G]; interleaved (gpt-oss): out row 2j is gate j, 2j + 1 up j (one [2BN] row
    block); NVFP4: s2[e, 0] / s2[e, 1] scale gate / up sums (as moe_gate_up_w4_kernel)."""
    pdl_wait(PDL)  # moeflow/kernels/pdl.py: first, before any read
    pdl_trigger(PDL)
    n = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + n)
    if (e < 0) | (e >= E):
        return
    e = e.to(tl.int64)
    x_row = x_ptr + (n // top_k).to(tl.int64) * stride_xt
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j_ok = offs_j < I
    offs_g = tl.arange(0, BLOCK_K // G)
    w_base = w_ptr + e * stride_we
    s_base = s_ptr + e * stride_se
    if INTERLEAVED:
        offs_c = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        c_ok = offs_c < 2 * I
        acc = _w4_gemv_rows(x_row, w_base + offs_c * stride_wn,
                            s_base + offs_c[:, None] * stride_sn + offs_g[None, :] * stride_sk, c_ok, H,
                            stride_sk, FMT, G, 2 * BLOCK_N, BLOCK_K, ASM)
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * stride_be + offs_c, mask=c_ok, other=0.0).to(tl.float32)
        g, u = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
    else:
        g = _w4_gemv_rows(x_row, w_base + offs_j * stride_wn,
                          s_base + offs_j[:, None] * stride_sn + offs_g[None, :] * stride_sk, j_ok, H,
                          stride_sk, FMT, G, BLOCK_N, BLOCK_K, ASM)
        u = _w4_gemv_rows(x_row, w_base + (I + offs_j) * stride_wn,
                          s_base + (I + offs_j)[:, None] * stride_sn + offs_g[None, :] * stride_sk, j_ok, H,
                          stride_sk, FMT, G, BLOCK_N, BLOCK_K, ASM)
        g, u = _nvfp4_scale_gate_up(g, u, s2_ptr, e, stride_s2e, stride_s2g, FMT)
        if HAS_BIAS:
            g += tl.load(b_ptr + e * stride_be + offs_j, mask=j_ok, other=0.0).to(tl.float32)
            u += tl.load(b_ptr + e * stride_be + I + offs_j, mask=j_ok, other=0.0).to(tl.float32)
    out = _activate(g, u, limit, alpha, ACT)
    tl.store(act_ptr + n.to(tl.int64) * stride_an + offs_j, out.to(act_ptr.dtype.element_ty), mask=j_ok)


@fast_kernel
@triton.jit
def moe_down_w4_gemv_kernel(
    act_ptr, w_ptr, s_ptr, s2_ptr, b_ptr, y_ptr, ids_ptr,
    H, I, E,
    stride_an, stride_we, stride_wn, stride_se, stride_sn, stride_sk, stride_s2e, stride_be,
    stride_yn,
    FMT: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid (N, cdiv(H, BN)). y_NH[n, h] (y's dtype) = act_NI[n] @ W_d[ids_N[n]] (* s2) (+ b_d) for
    BN rows h of the packed down [E, H, I/2] (unit stride along I/2, rows 4-byte aligned; scales
    [E, H, I/G]); pairs with an id outside [0, E) skipped."""
    pdl_wait(PDL)  # moeflow/kernels/pdl.py: first, before any read
    pdl_trigger(PDL)
    n = tl.program_id(0)
    pid_h = tl.program_id(1)
    e = tl.load(ids_ptr + n)
    if (e < 0) | (e >= E):
        return
    e = e.to(tl.int64)
    offs_h = pid_h * BLOCK_N + tl.arange(0, BLOCK_N)
    h_ok = offs_h < H
    offs_g = tl.arange(0, BLOCK_K // G)
    acc = _w4_gemv_rows(act_ptr + n.to(tl.int64) * stride_an, w_ptr + e * stride_we + offs_h * stride_wn,
                        s_ptr + e * stride_se + offs_h[:, None] * stride_sn + offs_g[None, :] * stride_sk, h_ok, I,
                        stride_sk, FMT, G, BLOCK_N, BLOCK_K, ASM)
    if FMT == 2:
        acc = acc * tl.load(s2_ptr + e * stride_s2e)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * stride_be + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n.to(tl.int64) * stride_yn + offs_h, acc.to(y_ptr.dtype.element_ty), mask=h_ok)
