"""Triton kernel of the router selection (private; launchers in moeflow.routing.gpu).

Legend: T tokens, S logit columns of the layer (E routed + Z zero experts),
K picks per row (the prediction width W in predict mode), G groups of P = S / G
experts, C columns of the partial buffer (see router_logits.py), SPLIT its splits.

The selection of R rows at once (`_select_rows`, a @triton.jit helper shared by the
selection kernel below and the fused router kernel in router_fused.py): the rows sit
in registers as an [R, NGP, PP] tile (row r, group g, member j -> expert g * P + j;
NGP, PP powers of two >= G, P; without groups G = 1 and P = S), so a row's result
depends on that row only.

Bits do not depend on R, on the warp count or on which kernel runs the helper: every
reduction is exact, so the reduction tree Triton picks for a register layout (which
differs between kernels) cannot change a result. Maxima and counts are integer or
exact by nature; the softmax denominators are sums of terms in [0, 1] added in 2^-50
fixed point as int64 (`_fixed`, exact and associative; one rounding to f32 at the
end, more accurate than an f32 sum); the renormalisation sum over the K picks is a
left-to-right f32 sum in pick order. The fused kernel relies on this to give the
bits of the two-kernel path (logits kernel + selection kernel) for the same rows.

Selection is exact and tie-stable with one integer max per pick: each key is
turned into an int64 `(sortable_bits(key) << 32) | (BIG - expert)`, where
sortable_bits is the order-preserving int32 image of the f32 key. The max of
the packed values is the largest key, and among equal keys the lowest expert
index: the stable-sort order of the CPU reference (moeflow.routing.topk).
Before packing, -0.0 becomes +0.0 (torch treats them as equal) and a NaN key
(only a NaN or infinite bias can make one from non-NaN logits: softmax takes
its limit on infinite rows, see _softmax_given) ranks as +inf. A NaN *logit* is reported, never
picked silently: status[t] = 1, ids 0..K-1 (in range, so nothing downstream
indexes out of bounds) and NaN weights.

status[t] codes: 0 ok, 1 NaN logit, 2 input id outside [0, V), 3 hash-table
entry outside [0, S). Every row writes its code, so the buffer needs no
initialisation and the kernel no atomics (CUDA-graph friendly, batch-invariant).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import fast_kernel

try:  # the CUDA libdevice gives ~1-ulp exp/log1p; tl.exp is ex2.approx(x * log2 e)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older Triton layouts
    from triton.language.extra.cuda import libdevice

# score functions (the constexpr SCORE)
SOFTMAX = 0
SIGMOID = 1
SQRTSOFTPLUS = 2
TOPK_SOFTMAX = 3
TOPK_SIGMOID = 4

# fixed point of the exact sums of terms in [0, 1]: 2^50 (<= 4096 terms stay below 2^62)
_FIX = tl.constexpr(1125899906842624.0)
_UNFIX = tl.constexpr(1.0 / 1125899906842624.0)
# packed value below every real key: sortable(-inf) << 32 with a zero index part
_REMOVED = tl.constexpr(-2139095041 * 4294967296)
_BIG = tl.constexpr(1 << 20)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log1p(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log1p(x)
    else:
        # Goldberg's trick, exact to a few ulp with an accurate log (interpreter path).
        u = 1.0 + x
        d = tl.where(u == 1.0, 1.0, u - 1.0)
        return tl.where(u == 1.0, x, tl.log(u) * (x / d))


@triton.jit
def _softmax_given(l, m, z, n_max, PRECISE: tl.constexpr):
    """softmax(l) from the row's max m, z = sum exp(l - m) and n_max = #{l == m}.

    An infinite max takes softmax's limit, as moeflow.routing.scores.softmax_rows:
    the entries equal to the max share the probability (1 / n_max each), the rest 0.
    """
    limit = tl.where(l == m, tl.div_rn(1.0, n_max), 0.0)
    regular = tl.div_rn(_exp(l - m, PRECISE), z)
    return tl.where((m == float("inf")) | (m == float("-inf")), limit, regular)


@triton.jit
def _score(l, m, z, n_max, SCORE: tl.constexpr, PRECISE: tl.constexpr):
    """The family score s of logits l (softmax needs the row's m, z, n_max: see _softmax_given)."""
    if SCORE == 0:
        return _softmax_given(l, m, z, n_max, PRECISE)
    elif SCORE == 1:
        return tl.div_rn(1.0, 1.0 + _exp(-l, PRECISE))
    elif SCORE == 2:
        # torch.nn.functional.softplus(beta=1, threshold=20): x above 20, else log1p(exp(x))
        sp = tl.where(l > 20.0, l, _log1p(_exp(tl.minimum(l, 20.0), PRECISE), PRECISE))
        return tl.sqrt_rn(sp)
    else:
        return l


@triton.jit
def _pack(key, idx, ok):
    """int64 (sortable(key) << 32) | (BIG - idx); `ok` false -> below every real entry."""
    k = key + 0.0  # -0.0 -> +0.0
    k = tl.where(k != k, float("inf"), k)
    bits = k.to(tl.int32, bitcast=True)
    sortable = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = (sortable.to(tl.int64) << 32) | (-idx + _BIG).to(tl.int64)
    return tl.where(ok, packed, _REMOVED)


@triton.jit
def _unpack_key(packed):
    """The f32 key of a packed value (inverse of the sortable map)."""
    hi = (packed >> 32).to(tl.int32)
    bits = hi ^ ((hi >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fixed(v, ok):
    """int64 2^50 fixed point of terms v in [0, 1] (anything else, NaN included, and `ok` false -> 0).

    Truncation loses < 2^-50 per term (< 2^-38 over 4096 terms, against a sum >= 1 whose
    f32 ulp is >= 2^-23); int64 sums of these are exact in any order (see the module doc).
    """
    q = tl.where(ok & (v >= 0.0) & (v <= 1.0), v, 0.0)
    return (q * _FIX).to(tl.int64)


@triton.jit
def _unfixed(total):
    """f32 of an int64 fixed-point sum (one rounding)."""
    return total.to(tl.float32) * _UNFIX


@triton.jit
def _load_rows(src_ptr, rows, stride_row, stride_split, col0, cols, ok, SPLIT: tl.constexpr, CACHE: tl.constexpr):
    """Logits at (rows, cols) (broadcast shapes): a plain load, or the SPLIT partials added in split order.

    CACHE: the load's cache modifier ("" or ".cg": the fused kernel reads partials other
    programs wrote in the same launch through L2, never a possibly stale L1 line).
    """
    base = src_ptr + rows.to(tl.int64) * stride_row + col0
    l = tl.load(base + cols, mask=ok, other=0.0, cache_modifier=CACHE)
    for s in tl.static_range(1, SPLIT):
        l = l + tl.load(base + s * stride_split + cols, mask=ok, other=0.0, cache_modifier=CACHE)
    return l


@triton.jit
def _select_rows(
    src_ptr,
    rbias_ptr,
    logits_out_ptr,
    bias_ptr,
    scale_ptr,
    input_ids_ptr,
    table_ptr,
    ids_ptr,
    weights_ptr,
    keys_ptr,
    status_ptr,
    rows,
    row_ok,
    S,
    E,
    V,
    stride_row,
    stride_split,
    col0,
    stride_lo,
    stride_tv,
    layer,
    eps,
    scaling,
    ROWS: tl.constexpr,
    SPLIT: tl.constexpr,
    SCORE: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    G: tl.constexpr,
    P: tl.constexpr,
    NGP: tl.constexpr,
    PP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_TOP2: tl.constexpr,
    HAS_RBIAS: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HASH: tl.constexpr,
    KT: tl.constexpr,
    SELECT: tl.constexpr,
    START: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    MASK_ZERO: tl.constexpr,
    WEIGHTS: tl.constexpr,
    KEYS: tl.constexpr,
    PRECISE: tl.constexpr,
    CACHE: tl.constexpr,
):
    """Select rows `rows` (int32 [ROWS]; `row_ok` bool [ROWS] masks rows past the batch).

    Writes ids [T, K] int32, status [T] int32, and weights [T, K] f32 (WEIGHTS) or
    prediction keys [T, K, 2] int32 = (layer, expert) (KEYS); WRITE_LOGITS stores the
    summed logits (+ router bias) [T, S] f32 with row stride stride_lo.
    HASH: the first KT ids come from hash_table[input_ids[t]]; SELECT: the ids from
    KT (0 without HASH) to K come from the key (a wide hash-layer prediction has both).
    """
    r3 = rows[:, None, None]
    ok3 = row_ok[:, None, None]
    g = tl.arange(0, NGP)[None, :, None]
    j = tl.arange(0, PP)[None, None, :]
    e = g * P + j  # [1, NGP, PP] expert index
    valid = (g < G) & (j < P)
    lmask = ok3 & valid

    l = _load_rows(src_ptr, r3, stride_row, stride_split, col0, e, lmask, SPLIT, CACHE)  # [ROWS, NGP, PP]
    if HAS_RBIAS:
        l = l + tl.load(rbias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    if WRITE_LOGITS:
        tl.store(logits_out_ptr + r3.to(tl.int64) * stride_lo + e, l, mask=lmask)
    nan_logit = tl.max(tl.max(tl.where(valid & (l != l), 1, 0), 2), 1) > 0  # [ROWS]

    m = tl.zeros((ROWS,), dtype=tl.float32)
    z = tl.zeros((ROWS,), dtype=tl.float32) + 1.0
    n_max = tl.zeros((ROWS,), dtype=tl.float32) + 1.0
    if SCORE == 0:
        m = tl.max(tl.max(tl.where(valid, l, float("-inf")), 2), 1)
        z = _unfixed(tl.sum(tl.sum(_fixed(_exp(l - m[:, None, None], PRECISE), valid), 2), 1))
        n_max = tl.sum(tl.sum(tl.where(valid & (l == m[:, None, None]), 1, 0), 2), 1).to(tl.float32)
    kk = tl.arange(0, KP)[None, :]  # [1, KP]
    kmask = kk < K
    omask = row_ok[:, None] & kmask  # [ROWS, KP]
    ids_k = tl.zeros((ROWS, KP), dtype=tl.int32)
    code = tl.where(nan_logit, 1, 0)

    if HASH:
        # The first KT picks are the table's row for this token's id, in table order.
        iid = tl.load(input_ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        bad_iid = (iid < 0) | (iid >= V)
        iid = tl.where(bad_iid, 0, iid)
        tmask = row_ok[:, None] & (kk < KT)
        tab = tl.load(table_ptr + iid[:, None] * stride_tv + kk, mask=tmask, other=0).to(tl.int64)
        bad_tab = tl.max(tl.where(tmask & ((tab < 0) | (tab >= S)), 1, 0), 1) > 0
        ids_k = tl.where(tmask & (tab >= 0) & (tab < S), tab, 0).to(tl.int32)
        code = tl.where(code == 0, tl.where(bad_iid, 2, tl.where(bad_tab, 3, 0)), code)
    if SELECT:
        s = _score(l, m[:, None, None], z[:, None, None], n_max[:, None, None], SCORE, PRECISE)
        key = s
        if HAS_BIAS:
            key = key + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        if G > 1:
            packed = _pack(key, e, valid)
            top1 = tl.max(packed, 2)  # [ROWS, NGP]
            gscore = _unpack_key(top1)
            if GROUP_TOP2:
                rest = tl.where(packed == top1[:, :, None], _REMOVED, packed)
                gscore = gscore + _unpack_key(tl.max(rest, 2))
            gi = tl.arange(0, NGP)[None, :]
            gpacked = _pack(gscore, gi, gi < G)  # [ROWS, NGP]
            kept = tl.zeros((ROWS, NGP), dtype=tl.int32)
            for _ in range(TOPK_GROUP):
                best = tl.max(gpacked, 1)[:, None]
                kept = tl.where(gpacked == best, 1, kept)
                gpacked = tl.where(gpacked == best, _REMOVED, gpacked)
            # -inf, as the reference: a masked expert ties with a kept -inf key by index.
            key = tl.where(kept[:, :, None] != 0, key, float("-inf"))
        if HASH:
            # A prediction wider than the table: the table's picks rank last (-inf).
            for i in tl.static_range(KT):
                ti = tl.sum(tl.where(kk == i, ids_k, 0), 1)
                key = tl.where(e == ti[:, None, None], float("-inf"), key)
        if MASK_ZERO:
            key = tl.where(e >= E, float("-inf"), key)
        packed = _pack(key, e, valid)
        for i in range(START, K):
            best = tl.max(tl.max(packed, 2), 1)  # [ROWS]
            pick = (-(best & 0xFFFFFFFF) + _BIG).to(tl.int32)
            ids_k = tl.where(kk == i, pick[:, None], ids_k)
            packed = tl.where(packed == best[:, None, None], _REMOVED, packed)

    bad = (code != 0)[:, None]
    ids_k = tl.where(bad, kk, ids_k)
    out_k = rows.to(tl.int64)[:, None] * K + kk
    tl.store(ids_ptr + out_k, ids_k, mask=omask)
    tl.store(status_ptr + rows, code, mask=row_ok)
    if KEYS:
        tl.store(keys_ptr + out_k * 2, tl.zeros((ROWS, KP), dtype=tl.int32) + layer, mask=omask)
        tl.store(keys_ptr + out_k * 2 + 1, ids_k, mask=omask)
    if WEIGHTS:
        # Weights from the picked logits, recomputed elementwise (same ops as the row's s).
        lp = _load_rows(src_ptr, rows[:, None], stride_row, stride_split, col0, ids_k, omask, SPLIT, CACHE)
        if HAS_RBIAS:
            lp = lp + tl.load(rbias_ptr + ids_k, mask=omask, other=0.0).to(tl.float32)
        if SCORE == 3:
            mp = tl.max(tl.where(kmask, lp, float("-inf")), 1)[:, None]
            zp = _unfixed(tl.sum(_fixed(_exp(lp - mp, PRECISE), kmask), 1))[:, None]
            np_max = tl.sum(tl.where(kmask & (lp == mp), 1, 0), 1).to(tl.float32)[:, None]
            w = _softmax_given(lp, mp, zp, np_max, PRECISE)
        elif SCORE == 4:
            w = tl.div_rn(1.0, 1.0 + _exp(-lp, PRECISE))
        else:
            w = _score(lp, m[:, None], z[:, None], n_max[:, None], SCORE, PRECISE)
        if RENORM:
            # Left to right in pick order: an f32 sum whose bits no reduction tree decides.
            total = tl.zeros((ROWS,), dtype=tl.float32)
            for i in tl.static_range(K):
                total = total + tl.sum(tl.where(kk == i, w, 0.0), 1)  # one nonzero term: exact
            renormed = tl.div_rn(w, total[:, None] + eps)
            # inf / inf: the infinite picks share the weight (the reference's limit).
            inf_k = kmask & ((w == float("inf")) | (w == float("-inf")))
            n_inf = tl.sum(tl.where(inf_k, 1, 0), 1).to(tl.float32)[:, None]
            limit = tl.div_rn(tl.where(inf_k, 1.0, 0.0), tl.maximum(n_inf, 1.0))
            w = tl.where(n_inf > 0, limit, renormed)
        if HAS_SCALE:
            w = w * tl.load(scale_ptr + ids_k, mask=omask, other=1.0).to(tl.float32)
        if HAS_SCALING:
            w = w * scaling
        w = tl.where(bad, float("nan"), w)
        tl.store(weights_ptr + out_k, w, mask=omask)


@fast_kernel
@triton.jit
def _route_kernel(
    src_ptr,
    rbias_ptr,
    logits_out_ptr,
    bias_ptr,
    scale_ptr,
    input_ids_ptr,
    table_ptr,
    ids_ptr,
    weights_ptr,
    keys_ptr,
    status_ptr,
    T,
    S,
    E,
    V,
    stride_row,
    stride_split,
    col0,
    stride_lo,
    stride_tv,
    layer,
    eps,
    scaling,
    ROWS: tl.constexpr,
    SPLIT: tl.constexpr,
    SCORE: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    G: tl.constexpr,
    P: tl.constexpr,
    NGP: tl.constexpr,
    PP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    GROUP_TOP2: tl.constexpr,
    HAS_RBIAS: tl.constexpr,
    WRITE_LOGITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HASH: tl.constexpr,
    KT: tl.constexpr,
    SELECT: tl.constexpr,
    START: tl.constexpr,
    RENORM: tl.constexpr,
    HAS_SCALING: tl.constexpr,
    MASK_ZERO: tl.constexpr,
    WEIGHTS: tl.constexpr,
    KEYS: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """Grid (cdiv(T, ROWS),): program p selects rows p*ROWS .. p*ROWS + ROWS - 1 (see _select_rows)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    _select_rows(
        src_ptr, rbias_ptr, logits_out_ptr, bias_ptr, scale_ptr, input_ids_ptr, table_ptr,
        ids_ptr, weights_ptr, keys_ptr, status_ptr, rows, rows < T,
        S, E, V, stride_row, stride_split, col0, stride_lo, stride_tv, layer, eps, scaling,
        ROWS, SPLIT, SCORE, K, KP, G, P, NGP, PP, TOPK_GROUP, GROUP_TOP2, HAS_RBIAS, WRITE_LOGITS,
        HAS_BIAS, HAS_SCALE, HASH, KT, SELECT, START, RENORM, HAS_SCALING, MASK_ZERO, WEIGHTS, KEYS,
        PRECISE, "",
    )
