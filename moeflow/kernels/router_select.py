"""Triton kernel of the router selection (private; launchers in moeflow.routing.gpu).

Legend: T tokens, S logit columns of the layer (E routed + Z zero experts),
K picks per row (the prediction width W in predict mode), G groups of P = S / G
experts, C columns of the partial buffer (see router_logits.py), SPLIT its splits.

One program per token row; the whole row sits in registers as a [NGP, PP] tile
(group g, member j -> expert g * P + j; NGP, PP powers of two >= G, P; without
groups G = 1 and P = S), so a row's result depends on that row only.

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
def _load_row(src_ptr, row, stride_row, stride_split, col0, cols, ok, SPLIT: tl.constexpr):
    """Logits of one row at `cols`: a plain load, or the SPLIT partials added in split order."""
    base = src_ptr + row.to(tl.int64) * stride_row + col0
    l = tl.load(base + cols, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        l = l + tl.load(base + s * stride_split + cols, mask=ok, other=0.0)
    return l


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
    """Grid (T,). Writes ids [T, K] int32, status [T] int32, and weights [T, K] f32
    (WEIGHTS) or prediction keys [T, K, 2] int32 = (layer, expert) (KEYS).

    HASH: the first KT ids come from hash_table[input_ids[t]]; SELECT: the ids from
    KT (0 without HASH) to K come from the key (a wide hash-layer prediction has both).
    """
    t = tl.program_id(0)
    g = tl.arange(0, NGP)[:, None]
    j = tl.arange(0, PP)[None, :]
    e = g * P + j  # [NGP, PP] expert index
    valid = (g < G) & (j < P)

    l = _load_row(src_ptr, t, stride_row, stride_split, col0, e, valid, SPLIT)
    if HAS_RBIAS:
        l = l + tl.load(rbias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    if WRITE_LOGITS:
        tl.store(logits_out_ptr + t.to(tl.int64) * stride_lo + e, l, mask=valid)
    nan_logit = tl.max(tl.max(tl.where(valid & (l != l), 1, 0), 1), 0) > 0

    m = 0.0
    z = 1.0
    n_max = 1.0
    if SCORE == 0:
        m = tl.max(tl.max(tl.where(valid, l, float("-inf")), 1), 0)
        z = tl.sum(tl.sum(tl.where(valid, _exp(l - m, PRECISE), 0.0), 1), 0)
        n_max = tl.sum(tl.sum(tl.where(valid & (l == m), 1.0, 0.0), 1), 0)
    kk = tl.arange(0, KP)
    kmask = kk < K
    ids_k = tl.zeros((KP,), dtype=tl.int32)
    code = tl.where(nan_logit, 1, 0)

    if HASH:
        # The first KT picks are the table's row for this token's id, in table order.
        iid = tl.load(input_ids_ptr + t).to(tl.int64)
        bad_iid = (iid < 0) | (iid >= V)
        iid = tl.where(bad_iid, 0, iid)
        tmask = kk < KT
        tab = tl.load(table_ptr + iid * stride_tv + kk, mask=tmask, other=0).to(tl.int64)
        bad_tab = tl.max(tl.where(tmask & ((tab < 0) | (tab >= S)), 1, 0), 0) > 0
        ids_k = tl.where(tmask & (tab >= 0) & (tab < S), tab, 0).to(tl.int32)
        code = tl.where(code == 0, tl.where(bad_iid, 2, tl.where(bad_tab, 3, 0)), code)
    if SELECT:
        s = _score(l, m, z, n_max, SCORE, PRECISE)
        key = s
        if HAS_BIAS:
            key = key + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        if G > 1:
            packed = _pack(key, e, valid)
            top1 = tl.max(packed, 1)  # [NGP]
            gscore = _unpack_key(top1)
            if GROUP_TOP2:
                rest = tl.where(packed == top1[:, None], _REMOVED, packed)
                gscore = gscore + _unpack_key(tl.max(rest, 1))
            gi = tl.arange(0, NGP)
            gpacked = _pack(gscore, gi, gi < G)
            kept = gi < 0
            for _ in range(TOPK_GROUP):
                best = tl.max(gpacked, 0)
                kept = kept | (gpacked == best)
                gpacked = tl.where(gpacked == best, _REMOVED, gpacked)
            # -inf, as the reference: a masked expert ties with a kept -inf key by index.
            key = tl.where(kept[:, None], key, float("-inf"))
        if HASH:
            # A prediction wider than the table: the table's picks rank last (-inf).
            for i in tl.static_range(KT):
                ti = tl.sum(tl.where(kk == i, ids_k, 0), 0)
                key = tl.where(e == ti, float("-inf"), key)
        if MASK_ZERO:
            key = tl.where(e >= E, float("-inf"), key)
        packed = _pack(key, e, valid)
        for i in range(START, K):
            best = tl.max(tl.max(packed, 1), 0)
            pick = (-(best & 0xFFFFFFFF) + _BIG).to(tl.int32)
            ids_k = tl.where(kk == i, pick, ids_k)
            packed = tl.where(packed == best, _REMOVED, packed)

    bad = code != 0
    ids_k = tl.where(bad, kk, ids_k)
    out_k = t.to(tl.int64) * K + kk
    tl.store(ids_ptr + out_k, ids_k, mask=kmask)
    tl.store(status_ptr + t, code)
    if KEYS:
        tl.store(keys_ptr + out_k * 2, tl.zeros((KP,), dtype=tl.int32) + layer, mask=kmask)
        tl.store(keys_ptr + out_k * 2 + 1, ids_k, mask=kmask)
    if WEIGHTS:
        # Weights from the picked logits, recomputed elementwise (same ops as the row's s).
        lp = _load_row(src_ptr, t, stride_row, stride_split, col0, ids_k, kmask, SPLIT)
        if HAS_RBIAS:
            lp = lp + tl.load(rbias_ptr + ids_k, mask=kmask, other=0.0).to(tl.float32)
        if SCORE == 3:
            mp = tl.max(tl.where(kmask, lp, float("-inf")), 0)
            zp = tl.sum(tl.where(kmask, _exp(lp - mp, PRECISE), 0.0), 0)
            np_max = tl.sum(tl.where(kmask & (lp == mp), 1.0, 0.0), 0)
            w = _softmax_given(lp, mp, zp, np_max, PRECISE)
        elif SCORE == 4:
            w = tl.div_rn(1.0, 1.0 + _exp(-lp, PRECISE))
        else:
            w = _score(lp, m, z, n_max, SCORE, PRECISE)
        if RENORM:
            renormed = tl.div_rn(w, tl.sum(tl.where(kmask, w, 0.0), 0) + eps)
            # inf / inf: the infinite picks share the weight (the reference's limit).
            inf_k = kmask & ((w == float("inf")) | (w == float("-inf")))
            n_inf = tl.sum(tl.where(inf_k, 1.0, 0.0), 0)
            limit = tl.div_rn(tl.where(inf_k, 1.0, 0.0), tl.maximum(n_inf, 1.0))
            w = tl.where(n_inf > 0, limit, renormed)
        if HAS_SCALE:
            w = w * tl.load(scale_ptr + ids_k, mask=kmask, other=1.0).to(tl.float32)
        if HAS_SCALING:
            w = w * scaling
        w = tl.where(bad, float("nan"), w)
        tl.store(weights_ptr + out_k, w, mask=kmask)
