"""moeflow's own routing contract (CPU): batch invariance, the tie rule, infinite logits,
next-layer prediction and the refusal of bad input.

Legend: T tokens, H hidden size, E routed experts, Z zero experts, S = E + Z logit
columns, K picks per token, W predicted width, V vocabulary (hash layers).

Batch invariance is bit-for-bit (`assert_bitwise_equal`): every row routed alone
is the reference, and batches of T in 1..40 plus a spread up to 300, cut at the
front and at the back of the 300 rows (so each row sits at several positions),
must reproduce it. The tie rule is checked against a pure-Python oracle of the
spec (key descending, lower index on ties; lower group index on group ties).
"""

from __future__ import annotations

import math

import pytest
import torch

import moeflow
from moeflow import RouterSpec, route, router_logits
from moeflow.routing import logits as logits_mod
from moeflow.routing.predict import predict_next_ids
from moeflow.testing import assert_bitwise_equal, assert_close

T_MAX = 300
T_LIST = sorted(set(range(1, 41)) | {47, 63, 64, 65, 96, 127, 128, 129, 191, 200, 255, 256, 257, 299, 300})
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bias(S: int, seed: int, scale: float = 0.01) -> torch.Tensor:
    return scale * torch.randn(S, generator=_g(seed))


# One spec per routing feature. Biases are small (0.01) so that a +inf logit outranks
# every finite one whatever the family (the infinite-logit tests rely on it).
SPECS: dict[str, tuple[RouterSpec, dict]] = {
    "softmax": (RouterSpec(score_fn="softmax", num_experts=16, top_k=4), {}),
    "softmax_renorm": (RouterSpec(score_fn="softmax", num_experts=8, top_k=2, renorm=True), {}),
    "ds_v2_grouped": (
        RouterSpec(score_fn="softmax", num_experts=16, top_k=3, n_group=4, topk_group=2, group_score="max",
                   scaling_factor=1.5),
        {},
    ),
    "ds_v3": (
        RouterSpec(score_fn="sigmoid", num_experts=32, top_k=4, renorm=True, renorm_eps=1e-20, scaling_factor=2.5,
                   n_group=8, topk_group=3, use_bias=True),
        {"bias": _bias(32, 1)},
    ),
    "sigmoid_nobias": (RouterSpec(score_fn="sigmoid", num_experts=16, top_k=4, renorm=True, renorm_eps=1e-20), {}),
    "ds_v4": (
        RouterSpec(score_fn="sqrtsoftplus", num_experts=16, top_k=4, renorm=True, renorm_eps=1e-20,
                   scaling_factor=1.5, use_bias=True),
        {"bias": _bias(16, 2)},
    ),
    "gpt_oss": (RouterSpec(score_fn="topk_softmax", num_experts=16, top_k=4), {}),
    "llama4": (RouterSpec(score_fn="topk_sigmoid", num_experts=16, top_k=1, weight_on_input=True), {}),
    "longcat": (
        RouterSpec(score_fn="softmax", num_experts=16, num_zero_experts=8, top_k=4, scaling_factor=6.0,
                   use_bias=True),
        {"bias": _bias(24, 3)},
    ),
    "gemma4": (
        RouterSpec(score_fn="softmax", num_experts=16, top_k=4, renorm=True, expert_scale=True, router_prenorm=True),
        {"expert_scale": 0.5 + torch.rand(16, generator=_g(4))},
    ),
}
HASH_SPEC = RouterSpec(score_fn="sqrtsoftplus", num_experts=16, top_k=4, renorm=True, renorm_eps=1e-20,
                       scaling_factor=1.5, hash_routing=True)
HASH_TABLE_VK = torch.stack([torch.randperm(16, generator=_g(100 + v))[:4] for v in range(64)])


def _key(logits_TS: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> torch.Tensor:
    """The spec's selection key, written out here from the spec table (finite rows)."""
    fn = spec.score_fn
    if fn == "softmax":
        s = torch.softmax(logits_TS, dim=-1)
    elif fn == "sigmoid":
        s = torch.sigmoid(logits_TS)
    elif fn == "sqrtsoftplus":
        s = torch.nn.functional.softplus(logits_TS).sqrt()
    else:
        s = logits_TS
    return s if bias is None else s + bias


def spec_ids(key_TS: torch.Tensor, spec: RouterSpec) -> list[list[int]]:
    """Pure-Python selection: kept groups by (score desc, group index), then experts by (key desc, index)."""
    T, S = key_TS.shape
    groups = None
    if spec.n_group > 1:
        k_TGP = key_TS.view(T, spec.n_group, S // spec.n_group)
        g = k_TGP.topk(2, dim=-1)[0].sum(-1) if spec.group_score == "top2_sum" else k_TGP.max(-1).values
        groups = g.tolist()
    out = []
    for t, key in enumerate(key_TS.tolist()):
        cand = list(range(S))
        if groups is not None:
            P = S // spec.n_group
            kept = sorted(range(spec.n_group), key=lambda gi: (-groups[t][gi], gi))[: spec.topk_group]
            cand = [e for gi in sorted(kept) for e in range(gi * P, (gi + 1) * P)]
        out.append(sorted(cand, key=lambda e: (-key[e], e))[: spec.top_k])
    return out


def _mixed_logits(T: int, S: int, seed: int) -> torch.Tensor:
    """f32 [T, S]: normal rows, saturating rows (+-80, +-1e4) and rows of many exact ties."""
    g = _g(seed)
    x = torch.randn(T, S, generator=g) * 3
    kind = torch.arange(T) % 5
    x[kind == 1] *= 30  # +-80-ish: sigmoid saturates
    x[kind == 2] = (torch.rand(int((kind == 2).sum()), S, generator=g) * 2 - 1) * 1e4
    x[kind == 3] = torch.randint(-2, 3, (int((kind == 3).sum()), S), generator=g).float()  # exact ties
    return x.contiguous()


# ----------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("H", [33, 257])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_router_logits_batch_invariant(dtype: torch.dtype, H: int) -> None:
    E = 24
    g = _g(H)
    x_TH = (torch.randn(T_MAX, H, generator=g) * 2).to(dtype)
    w_EH = (torch.randn(E, H, generator=g) / math.sqrt(H)).to(dtype)
    alone_TE = torch.cat([router_logits(x_TH[t : t + 1], w_EH) for t in range(T_MAX)])
    assert alone_TE.dtype == torch.float32 and alone_TE.shape == (T_MAX, E)
    for T in T_LIST:
        for start in {0, T_MAX - T}:
            got = router_logits(x_TH[start : start + T], w_EH)
            assert_bitwise_equal(got, alone_TE[start : start + T], what=f"router_logits T={T} rows {start}..")
    # The same rows in another order: each row's bits do not depend on its neighbours.
    perm = torch.randperm(T_MAX, generator=g)
    assert_bitwise_equal(router_logits(x_TH[perm], w_EH), alone_TE[perm], what="router_logits permuted rows")
    # And they are the logits: close to an f64 product (f32 accumulation error only).
    ref = x_TH.double() @ w_EH.double().T
    assert_close(alone_TE, ref.float(), rtol=1e-5, atol=1e-5 * math.sqrt(H), what="router_logits vs f64")


def test_router_logits_chunking_and_wide_h(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk boundaries (7 rows a chunk here) and a wide H (threaded reductions) keep rows bitwise."""
    E, H = 8, 2049
    g = _g(5)
    x_TH = torch.randn(64, H, generator=g).to(torch.bfloat16)
    w_EH = torch.randn(E, H, generator=g).to(torch.bfloat16)
    alone = torch.cat([router_logits(x_TH[t : t + 1], w_EH) for t in range(64)])
    for T in (2, 7, 33, 64):
        assert_bitwise_equal(router_logits(x_TH[:T], w_EH), alone[:T], what=f"wide H, T={T}")
    monkeypatch.setattr(logits_mod, "_CHUNK_ELEMS", 7 * E * H)
    assert_bitwise_equal(router_logits(x_TH, w_EH), alone, what="7-row chunks")
    # Mixed input dtypes (bf16 activations, f32 weight) are accepted and stay invariant.
    w32 = w_EH.float()
    mixed = torch.cat([router_logits(x_TH[t : t + 1], w32) for t in range(8)])
    assert_bitwise_equal(router_logits(x_TH[:8], w32), mixed, what="bf16 x, f32 weight")


def _route_kwargs(name: str, T0: int, T: int) -> tuple[RouterSpec, dict]:
    if name == "ds_v4_hash":
        ids = torch.arange(T_MAX) * 7 % 64
        return HASH_SPEC, {"hash_table": HASH_TABLE_VK, "input_ids": ids[T0 : T0 + T]}
    spec, kw = SPECS[name]
    return spec, dict(kw)


@pytest.mark.parametrize("name", [*SPECS, "ds_v4_hash"])
def test_route_batch_invariant(name: str) -> None:
    spec, _ = _route_kwargs(name, 0, 1)
    logits_TS = _mixed_logits(T_MAX, spec.num_slots, seed=len(name))
    singles = [route(logits_TS[t : t + 1], spec, **_route_kwargs(name, t, 1)[1]) for t in range(T_MAX)]
    ids_alone = torch.cat([r.ids_TK for r in singles])
    w_alone = torch.cat([r.weights_TK for r in singles])
    for T in T_LIST:
        for start in {0, T_MAX - T}:
            r = route(logits_TS[start : start + T], spec, **_route_kwargs(name, start, T)[1])
            assert_bitwise_equal(r.ids_TK, ids_alone[start : start + T], what=f"{name} ids T={T} rows {start}..")
            assert_bitwise_equal(r.weights_TK, w_alone[start : start + T], what=f"{name} weights T={T} rows {start}..")
    assert ids_alone.dtype == torch.int32 and w_alone.dtype == torch.float32


@pytest.mark.parametrize("name", ["sigmoid_nobias", "ds_v4", "llama4"])
def test_route_batch_invariant_large_t(name: str) -> None:
    """Batches past one elementwise call (511 rows of 64 padded columns) and past torch's thread grain."""
    spec, kw = SPECS[name]
    logits_TS = _mixed_logits(1500, spec.num_slots, seed=99)
    full = route(logits_TS, spec, **kw)
    for t in [0, 1, 510, 511, 512, 1021, 1022, 1023, 1200, 1499]:
        alone = route(logits_TS[t : t + 1], spec, **kw)
        assert_bitwise_equal(full.ids_TK[t : t + 1], alone.ids_TK, what=f"{name} ids row {t}")
        assert_bitwise_equal(full.weights_TK[t : t + 1], alone.weights_TK, what=f"{name} weights row {t}")


def test_route_empty_batch() -> None:
    spec, kw = SPECS["ds_v3"]
    r = route(torch.empty(0, 32), spec, **kw)
    assert r.ids_TK.shape == (0, 4) and r.weights_TK.shape == (0, 4)
    assert r.ids_TK.dtype == torch.int32


# ----------------------------------------------------------------------------- tie rule


def test_tie_rule_examples() -> None:
    spec = RouterSpec(score_fn="softmax", num_experts=5, top_k=2)
    r = route(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]]), spec)
    assert r.ids_TK.tolist() == [[1, 2]]
    assert r.weights_TK[0, 0] == r.weights_TK[0, 1]
    # All equal: the lowest indices, in order.
    for name in ("softmax", "gpt_oss", "llama4", "sigmoid_nobias", "ds_v2_grouped"):
        spec, _ = SPECS[name]
        r = route(torch.zeros(3, spec.num_slots), spec)
        assert r.ids_TK.tolist() == [list(range(spec.top_k))] * 3, name
    # gpt-oss: equal picked logits share the weight equally.
    r = route(torch.zeros(1, 16), SPECS["gpt_oss"][0])
    assert r.weights_TK.tolist() == [[0.25] * 4]


def test_group_tie_keeps_lower_group() -> None:
    """Two groups with the same top-2 sum: the lower group index is kept."""
    spec = RouterSpec(score_fn="sigmoid", num_experts=8, top_k=2, n_group=4, topk_group=1, use_bias=True)
    bias = torch.zeros(8)
    logits = torch.full((1, 8), -5.0)
    logits[0, [2, 3, 6, 7]] = torch.tensor([1.0, 2.0, 2.0, 1.0])  # groups 1 and 3 tie
    r = route(logits, spec, bias=bias)
    assert r.ids_TK.tolist() == [[3, 2]]
    # The tie rule is positional, not an artefact of the values: swap the groups' contents.
    logits2 = logits.clone()
    logits2[0, [2, 3, 6, 7]] = torch.tensor([2.0, 1.0, 1.0, 2.0])
    assert route(logits2, spec, bias=bias).ids_TK.tolist() == [[2, 3]]


@pytest.mark.parametrize("name", list(SPECS))
def test_tie_rule_matches_oracle(name: str) -> None:
    """Rows of small integers (exact ties everywhere) pick what the Python oracle of the spec picks."""
    spec, kw = SPECS[name]
    logits = torch.randint(-2, 3, (200, spec.num_slots), generator=_g(7)).float()
    r = route(logits, spec, **kw)
    want = spec_ids(_key(logits, spec, kw.get("bias")), spec)
    assert r.ids_TK.tolist() == want


def test_predict_uses_the_tie_rule() -> None:
    """Experts 1 and 3 have the same router row: identical logits, the lower index first."""
    spec = RouterSpec(score_fn="softmax", num_experts=6, top_k=2)
    w_EH = torch.randn(6, 9, generator=_g(8))
    w_EH[3] = w_EH[1]
    w_EH[[0, 2, 4, 5]] *= 0.01
    x = torch.randn(4, 9, generator=_g(9)).abs()
    x = x * torch.sign(w_EH[1])  # makes experts 1 and 3 the largest logits
    keys = moeflow.predict_next(x, w_EH, spec, width=2, layer=0)
    assert [[e for _, e in row] for row in keys] == [[1, 3]] * 4
    assert route(router_logits(x, w_EH), spec).ids_TK.tolist() == [[1, 3]] * 4


# ----------------------------------------------------------------------------- infinite logits


@pytest.mark.parametrize("name", list(SPECS))
def test_plus_inf_is_picked_first(name: str) -> None:
    spec, kw = SPECS[name]
    S, K, E = spec.num_slots, spec.top_k, spec.num_experts
    logits = -5.0 + 0.5 * torch.randn(4, S, generator=_g(10))
    j = E - 1  # the last routed expert: no tie rule can put it first
    logits[:, j] = float("inf")
    r = route(logits, spec, **kw)
    assert r.ids_TK[:, 0].tolist() == [j] * 4
    assert not torch.isnan(r.weights_TK).any(), r.weights_TK
    w0 = r.weights_TK[:, 0]
    scale = kw["expert_scale"][j].item() if "expert_scale" in kw else 1.0
    expected_first = {
        # one +inf logit takes all of a softmax (the limit of softmax; IEEE would give NaN)
        "softmax": 1.0, "softmax_renorm": 1.0, "ds_v2_grouped": 1.5, "longcat": 6.0, "gemma4": scale,
        # an infinite sqrtsoftplus score takes all of the renormalised weight
        "ds_v4": 1.5,
        "gpt_oss": 1.0, "llama4": 1.0,  # softmax over the picks / sigmoid(+inf)
    }
    if name in expected_first:
        assert w0.tolist() == [expected_first[name]] * 4, (name, r.weights_TK)
        if K > 1:
            assert (r.weights_TK[:, 1:] == 0).all(), r.weights_TK
    else:  # sigmoid: sigmoid(+inf) = 1 among finite sigmoids, renormalised
        assert torch.isfinite(r.weights_TK).all() and (w0 > r.weights_TK[:, 1:].max(dim=1).values).all()


@pytest.mark.parametrize("name", [n for n, (spec, _) in SPECS.items() if spec.top_k >= 2])
def test_two_plus_inf_tie_to_lower_index(name: str) -> None:
    spec, kw = SPECS[name]
    logits = -5.0 + 0.5 * torch.randn(3, spec.num_slots, generator=_g(11))
    # Same group for the grouped specs (experts 1 and 2 of group 0), far apart otherwise.
    a, b = (1, 2) if spec.n_group > 1 else (3, spec.num_experts - 2)
    logits[:, [a, b]] = float("inf")
    r = route(logits, spec, **kw)
    assert not torch.isnan(r.weights_TK).any(), r.weights_TK
    if name == "sigmoid_nobias" or name == "ds_v3":
        # sigmoid(+inf) = 1 for both; with a bias the larger bias leads (keys 1 + b, finite).
        want = sorted([a, b], key=lambda e: (-(1.0 + (kw["bias"][e].item() if "bias" in kw else 0.0)), e))
        assert r.ids_TK[:, :2].tolist() == [want] * 3
        return
    assert r.ids_TK[:, :2].tolist() == [[a, b]] * 3
    w = r.weights_TK[:, :2]
    if "expert_scale" in kw:
        w = w / kw["expert_scale"][r.ids_TK[:, :2].long()]
    assert torch.equal(w[:, 0], w[:, 1]) and bool((w > 0).all()), r.weights_TK


@pytest.mark.parametrize("name", list(SPECS))
def test_all_minus_inf_row_is_defined(name: str) -> None:
    spec, kw = SPECS[name]
    S, K = spec.num_slots, spec.top_k
    logits = torch.full((2, S), float("-inf"))
    r = route(logits, spec, **kw)
    assert not torch.isnan(r.weights_TK).any(), r.weights_TK
    # Every score is equal (softmax: 1/S each, its limit; sigmoid/sqrtsoftplus: 0; logits: -inf),
    # so the bias decides, then the lower index.
    bias = kw.get("bias")
    key = torch.zeros(1, S) if bias is None else bias[None].clone()
    assert r.ids_TK.tolist() == spec_ids(key, spec) * 2
    expected = {
        "softmax": 1 / 16, "softmax_renorm": 0.5, "ds_v2_grouped": 1.5 / 16, "ds_v3": 0.0, "sigmoid_nobias": 0.0,
        "ds_v4": 0.0, "gpt_oss": 0.25, "llama4": 0.0, "longcat": 6.0 / 24,
    }
    if name in expected:
        assert_close(r.weights_TK, torch.full((2, K), expected[name]), rtol=1e-6, atol=0, what=name)
    else:  # gemma4: renormalised to 1/K, times the per-expert scale
        want = 0.25 * kw["expert_scale"][r.ids_TK.long()]
        assert_close(r.weights_TK, want, rtol=1e-6, atol=0, what=name)


@pytest.mark.parametrize("name", list(SPECS))
def test_minus_inf_is_picked_last(name: str) -> None:
    """-inf logits lose to every finite one; finite rows beside them route as without them."""
    spec, kw = SPECS[name]
    S, K = spec.num_slots, spec.top_k
    logits = torch.full((3, S), float("-inf"))
    spread = [e for e in (0, 5, 6, 9, 12, 13, 14, 15) if e < spec.num_experts][: max(K, 4)]
    keep = spread if spec.n_group == 1 else list(range(S // spec.n_group))  # grouped: all of group 0
    logits[:, keep] = torch.randn(3, len(keep), generator=_g(12))
    r = route(logits, spec, **kw)
    assert not torch.isnan(r.weights_TK).any()
    assert set(r.ids_TK.flatten().tolist()) <= set(keep), (name, r.ids_TK)
    if spec.score_fn in ("softmax", "topk_softmax") and not spec.use_bias:
        # exp(-inf) = 0: the same picks and weights as the finite logits alone would give.
        sub = RouterSpec(score_fn=spec.score_fn, num_experts=len(keep), top_k=K, renorm=spec.renorm,
                         scaling_factor=spec.scaling_factor)
        r_sub = route(logits[:, keep].contiguous(), sub)
        mapped = torch.tensor(keep)[r_sub.ids_TK.long()].to(torch.int32)
        assert torch.equal(r.ids_TK, mapped)
        if not spec.expert_scale:
            assert_close(r.weights_TK, r_sub.weights_TK, rtol=1e-6, atol=0, what=name)


def test_mixed_infinities_in_one_row() -> None:
    spec = RouterSpec(score_fn="softmax", num_experts=6, top_k=3, renorm=True)
    logits = torch.tensor([[float("-inf"), 0.0, float("inf"), float("-inf"), float("inf"), 1.0]])
    r = route(logits, spec)
    assert r.ids_TK.tolist() == [[2, 4, 0]] or r.ids_TK.tolist() == [[2, 4, 1]]
    # the two +inf share the weight; the third pick (probability 0) is the lowest-index zero
    assert r.ids_TK.tolist() == [[2, 4, 0]]
    assert r.weights_TK.tolist() == [[0.5, 0.5, 0.0]]


# ----------------------------------------------------------------------------- predict_next


def _predict_setup(name: str, seed: int = 20):
    spec, kw = SPECS[name]
    H = 33
    g = _g(seed)
    x_TH = torch.randn(24, H, generator=g).to(torch.bfloat16)
    w_SH = (torch.randn(spec.num_slots, H, generator=g) / 3).to(torch.bfloat16)
    return spec, kw, x_TH, w_SH


@pytest.mark.parametrize("name", [n for n in SPECS if n != "longcat"])
def test_predict_next_matches_route_and_extends(name: str) -> None:
    spec, kw, x_TH, w_SH = _predict_setup(name)
    bias = kw.get("bias")
    r = route(router_logits(x_TH, w_SH), spec, **kw)
    keys = moeflow.predict_next(x_TH, w_SH, spec, bias=bias, layer=7)
    assert keys == [[(7, e) for e in row] for row in r.ids_TK.tolist()]
    ids_K = predict_next_ids(x_TH, w_SH, spec, bias=bias, width=spec.top_k)
    assert ids_K.dtype == torch.int32 and torch.equal(ids_K, r.ids_TK)
    W = min(2 * spec.top_k, spec.num_experts)
    ids_W = predict_next_ids(x_TH, w_SH, spec, bias=bias, width=W)
    assert ids_W.shape == (24, W)
    assert all(len(set(row)) == W for row in ids_W.tolist()), "predicted ids repeat"
    if spec.n_group == 1 or W <= spec.topk_group * spec.num_slots // spec.n_group:
        assert torch.equal(ids_W[:, : spec.top_k], r.ids_TK), "the wider prediction must extend route's picks"
    # Best first by the key (s + bias), whatever the width.
    key = _key(router_logits(x_TH, w_SH), spec, bias)
    picked = key.gather(1, ids_W.long())
    if spec.n_group == 1:
        assert (picked[:, :-1] >= picked[:, 1:]).all()


def test_predict_next_skips_zero_experts() -> None:
    """LongCat: zero experts hold no weights; the prediction is route's routed picks, then the next best."""
    spec, kw, x_TH, w_SH = _predict_setup("longcat")
    E = spec.num_experts
    logits = router_logits(x_TH, w_SH)
    key = _key(logits, spec, kw["bias"])
    for W in (spec.top_k, 2 * spec.top_k):
        ids = predict_next_ids(x_TH, w_SH, spec, bias=kw["bias"], width=W)
        assert bool((ids < E).all())
        masked = key.clone()
        masked[:, E:] = float("-inf")
        assert ids.tolist() == [sorted(range(E), key=lambda e, k=k: (-k[e], e))[:W] for k in masked.tolist()]
    r = route(logits, spec, **kw)
    ids = predict_next_ids(x_TH, w_SH, spec, bias=kw["bias"], width=spec.top_k).tolist()
    for t, row in enumerate(r.ids_TK.tolist()):
        routed = [e for e in row if e < E]
        assert ids[t][: len(routed)] == routed


def test_predict_next_hash_layer() -> None:
    g = _g(21)
    x_TH = torch.randn(10, 17, generator=g)
    w_EH = torch.randn(16, 17, generator=g)
    input_ids = torch.randint(0, 64, (10,), generator=g)
    kw = dict(hash_table=HASH_TABLE_VK, input_ids=input_ids)
    ids_K = predict_next_ids(x_TH, w_EH, HASH_SPEC, **kw)
    assert torch.equal(ids_K, HASH_TABLE_VK[input_ids].to(torch.int32))
    r = route(router_logits(x_TH, w_EH), HASH_SPEC, **kw)
    assert torch.equal(ids_K, r.ids_TK)
    ids_W = predict_next_ids(x_TH, w_EH, HASH_SPEC, width=8, **kw)
    assert torch.equal(ids_W[:, :4], ids_K), "a wider hash prediction must keep the table's picks first"
    assert all(len(set(row)) == 8 for row in ids_W.tolist())
    score = torch.nn.functional.softplus(router_logits(x_TH, w_EH)).sqrt()
    for t in range(10):
        rest = [e for e in range(16) if e not in ids_K[t].tolist()]
        want = sorted(rest, key=lambda e: (-score[t, e].item(), e))[:4]
        assert ids_W[t, 4:].tolist() == want


def test_predict_next_router_bias() -> None:
    """gpt-oss: the router-linear bias is added to the predicted logits."""
    spec, _, x_TH, w_SH = _predict_setup("gpt_oss")
    rb = torch.randn(16, generator=_g(22)) * 3
    r = route(router_logits(x_TH, w_SH) + rb, spec)
    assert torch.equal(predict_next_ids(x_TH, w_SH, spec, router_bias_E=rb), r.ids_TK)


def test_predict_next_bad_input() -> None:
    spec, kw, x_TH, w_SH = _predict_setup("ds_v4")
    with pytest.raises(ValueError, match=r"width: 17, expected an int in \[1, 16\]"):
        predict_next_ids(x_TH, w_SH, spec, bias=kw["bias"], width=17)
    with pytest.raises(ValueError, match=r"width: 0"):
        predict_next_ids(x_TH, w_SH, spec, bias=kw["bias"], width=0)
    with pytest.raises(ValueError, match=r"layer: -1, expected an int >= 0"):
        moeflow.predict_next(x_TH, w_SH, spec, bias=kw["bias"], layer=-1)
    with pytest.raises(ValueError, match=r"bias: None, but spec.use_bias=True"):
        moeflow.predict_next(x_TH, w_SH, spec, layer=1)


# ----------------------------------------------------------------------------- bad input


def test_nan_logit_names_the_row_and_layer() -> None:
    spec, kw = SPECS["ds_v3"]
    logits = torch.randn(12, 32)
    logits[7, 3] = float("nan")
    logits[9, 0] = float("nan")
    with pytest.raises(ValueError, match=r"logits_TE: NaN logit in token row 7 \(2 rows hold NaN\)"):
        route(logits, spec, **kw)
    with pytest.raises(ValueError, match=r"token row 7 of layer 5"):
        route(logits, spec, layer=5, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32], ids=str)
def test_logits_dtype(dtype: torch.dtype) -> None:
    spec, _ = SPECS["softmax"]
    with pytest.raises(TypeError, match=rf"logits_TE: dtype {dtype}, expected torch.float32"):
        route(torch.zeros(2, 16, dtype=dtype), spec)


def test_logits_shape_and_type() -> None:
    spec, _ = SPECS["longcat"]
    with pytest.raises(ValueError, match=r"logits_TE: shape \(2, 16\), expected \(T, 24\) \(num_experts=16 \+ num_zero_experts=8\)"):
        route(torch.zeros(2, 16), spec, bias=torch.zeros(24))
    with pytest.raises(TypeError, match=r"logits_TE: expected a torch.Tensor, got list"):
        route([[0.0] * 24], spec, bias=torch.zeros(24))
    with pytest.raises(TypeError, match=r"spec: expected RouterSpec, got dict"):
        route(torch.zeros(2, 24), {"score_fn": "softmax"})


def test_k_and_groups_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"RouterSpec.top_k=9 exceeds the 8 experts"):
        RouterSpec(score_fn="softmax", num_experts=8, top_k=9)
    with pytest.raises(ValueError, match=r"RouterSpec.top_k=0: expected an int >= 1"):
        RouterSpec(score_fn="softmax", num_experts=8, top_k=0)
    with pytest.raises(ValueError, match=r"RouterSpec.num_experts=0: expected an int >= 1"):
        RouterSpec(score_fn="softmax", num_experts=0, top_k=1)
    with pytest.raises(ValueError, match=r"RouterSpec.n_group=3 does not divide the 16 experts"):
        RouterSpec(score_fn="sigmoid", num_experts=16, top_k=2, n_group=3, topk_group=1, use_bias=True)
    with pytest.raises(ValueError, match=r"RouterSpec.topk_group=5 exceeds n_group=4"):
        RouterSpec(score_fn="sigmoid", num_experts=16, top_k=2, n_group=4, topk_group=5, use_bias=True)
    with pytest.raises(ValueError, match=r"RouterSpec.top_k=5 exceeds the 4 experts in topk_group=1 groups of 4"):
        RouterSpec(score_fn="sigmoid", num_experts=16, top_k=5, n_group=4, topk_group=1, use_bias=True)
    with pytest.raises(ValueError, match=r"RouterSpec.score_fn='relu': expected one of"):
        RouterSpec(score_fn="relu", num_experts=8, top_k=2)
    with pytest.raises(ValueError, match=r"RouterSpec.num_zero_experts=-1"):
        RouterSpec(score_fn="softmax", num_experts=8, top_k=2, num_zero_experts=-1)
    with pytest.raises(ValueError, match=r"score_fn='topk_softmax' selects on logits: no bias or groups"):
        RouterSpec(score_fn="topk_softmax", num_experts=8, top_k=2, use_bias=True)
    # replace() validates again
    with pytest.raises(ValueError, match=r"RouterSpec.top_k=17 exceeds the 16 experts"):
        SPECS["softmax"][0].replace(top_k=17)


def test_bias_and_expert_scale_are_checked() -> None:
    spec, kw = SPECS["ds_v3"]
    logits = torch.randn(3, 32)
    with pytest.raises(ValueError, match=r"bias: shape \(31,\), expected \(32,\)"):
        route(logits, spec, bias=torch.zeros(31))
    with pytest.raises(ValueError, match=r"bias: shape \(1, 32\), expected \(32,\)"):
        route(logits, spec, bias=torch.zeros(1, 32))
    with pytest.raises(TypeError, match=r"bias: dtype torch.int64, expected a floating dtype"):
        route(logits, spec, bias=torch.zeros(32, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"bias: None, but spec.use_bias=True"):
        route(logits, spec)
    with pytest.raises(ValueError, match=r"bias: given, but spec.use_bias=False"):
        route(torch.randn(3, 16), SPECS["softmax"][0], bias=torch.zeros(16))
    nan_bias = torch.zeros(32)
    nan_bias[3] = float("nan")
    with pytest.raises(ValueError, match=r"bias: NaN at expert 3"):
        route(logits, spec, bias=nan_bias)
    gspec, gkw = SPECS["gemma4"]
    with pytest.raises(ValueError, match=r"expert_scale: None, but spec.expert_scale=True"):
        route(torch.randn(2, 16), gspec)
    with pytest.raises(ValueError, match=r"expert_scale: shape \(8,\), expected \(16,\)"):
        route(torch.randn(2, 16), gspec, expert_scale=torch.ones(8))
    with pytest.raises(ValueError, match=r"expert_scale: given, but spec.expert_scale=False"):
        route(torch.randn(2, 16), SPECS["softmax"][0], expert_scale=torch.ones(16))


def test_hash_inputs_are_checked() -> None:
    logits = torch.randn(4, 16)
    ids = torch.tensor([0, 5, 63, 2])
    ok = route(logits, HASH_SPEC, hash_table=HASH_TABLE_VK, input_ids=ids)
    assert torch.equal(ok.ids_TK, HASH_TABLE_VK[ids].to(torch.int32))
    with pytest.raises(ValueError, match=r"hash_table/input_ids: spec.hash_routing=True needs both, got hash_table=None"):
        route(logits, HASH_SPEC, input_ids=ids)
    with pytest.raises(ValueError, match=r"hash_table: shape \(64, 5\), expected \(vocab, K=4\)"):
        route(logits, HASH_SPEC, hash_table=torch.zeros(64, 5, dtype=torch.long), input_ids=ids)
    with pytest.raises(ValueError, match=r"hash_table: shape \(256,\), expected \(vocab, K=4\)"):
        route(logits, HASH_SPEC, hash_table=torch.zeros(256, dtype=torch.long), input_ids=ids)
    with pytest.raises(TypeError, match=r"hash_table: dtype torch.float32, expected an integer dtype"):
        route(logits, HASH_SPEC, hash_table=HASH_TABLE_VK.float(), input_ids=ids)
    with pytest.raises(TypeError, match=r"input_ids: dtype torch.float32, expected an integer dtype"):
        route(logits, HASH_SPEC, hash_table=HASH_TABLE_VK, input_ids=ids.float())
    with pytest.raises(ValueError, match=r"input_ids: id 64 out of the hash table's vocabulary \[0, 64\)"):
        route(logits, HASH_SPEC, hash_table=HASH_TABLE_VK, input_ids=torch.tensor([0, 64, 1, 2]))
    with pytest.raises(ValueError, match=r"input_ids: id -1 out of the hash table's vocabulary"):
        route(logits, HASH_SPEC, hash_table=HASH_TABLE_VK, input_ids=torch.tensor([0, -1, 1, 2]))
    with pytest.raises(ValueError, match=r"input_ids: 3 ids for T=4 logit rows"):
        route(logits, HASH_SPEC, hash_table=HASH_TABLE_VK, input_ids=ids[:3])
    bad_table = HASH_TABLE_VK.clone()
    bad_table[5, 2] = 16
    with pytest.raises(ValueError, match=r"hash_table: expert id 16 outside \[0, 16\)"):
        route(logits, HASH_SPEC, hash_table=bad_table, input_ids=ids)
    with pytest.raises(TypeError, match=r"hash_table: expected a torch.Tensor, got list"):
        route(logits, HASH_SPEC, hash_table=HASH_TABLE_VK.tolist(), input_ids=ids)


def test_router_logits_refuses_bad_input() -> None:
    w = torch.randn(8, 33)
    with pytest.raises(TypeError, match=r"x_TH: dtype torch.int32, expected one of bf16/fp16/fp32"):
        router_logits(torch.zeros(2, 33, dtype=torch.int32), w)
    with pytest.raises(TypeError, match=r"weight_EH: dtype torch.float64, expected one of bf16/fp16/fp32"):
        router_logits(torch.zeros(2, 33), w.double())
    with pytest.raises(ValueError, match=r"weight_EH: shape \(8, 33\) does not match x_TH hidden size 32"):
        router_logits(torch.zeros(2, 32), w)
    with pytest.raises(ValueError, match=r"x_TH: shape \(33,\), expected 2-D"):
        router_logits(torch.zeros(33), w)
    with pytest.raises(TypeError, match=r"x_TH: expected a torch.Tensor, got list"):
        router_logits([[0.0] * 33], w)


# ---- renormalising picks that all underflowed, non-finite biases ---------------------------------


@pytest.mark.parametrize("score_fn", ["sigmoid", "sqrtsoftplus", "topk_sigmoid", "softmax"])
def test_renorm_of_picks_that_underflowed_to_zero_is_their_exact_ratio(score_fn: str) -> None:
    """Far below -88.7 every sigmoid is 0: renorm without eps divided 0 by 0 (NaN weights).

    The weights are the exact s_i / sum s_j instead (the softmax of the picked log-scores): an
    equal share for equal logits, e^-1 : 1 for logits one apart, 1/K for an all -inf row.
    """
    spec = RouterSpec(score_fn=score_fn, num_experts=8, top_k=2, renorm=True)
    logits = torch.full((3, 8), -200.0)
    logits[1, :2] = torch.tensor([-200.0, -201.0])
    logits[1, 2:] = -300.0  # every softmax / sigmoid pick is 0 in f32, the ranking still by logit
    logits[2] = float("-inf")
    r = route(logits, spec)
    assert torch.isfinite(r.weights_TK).all(), r.weights_TK
    assert r.ids_TK[:, :2].tolist()[0] == [0, 1]
    assert r.weights_TK[0].tolist() == [0.5, 0.5] and r.weights_TK[2].tolist() == [0.5, 0.5]
    picked = logits[1, r.ids_TK[1].long()]
    if score_fn == "sqrtsoftplus":  # s = sqrt(softplus(x)) = e^(x / 2) down here
        picked = picked / 2
    assert_close(r.weights_TK[1], torch.softmax(picked.double(), 0).float(), rtol=1e-6, atol=0, what=score_fn)
    # A row's weights still do not depend on the batch around it.
    for t in range(3):
        assert_bitwise_equal(route(logits[t : t + 1], spec).weights_TK, r.weights_TK[t : t + 1], what=f"row {t}")


def test_renorm_with_eps_keeps_the_hf_zero_weights() -> None:
    """DeepSeek-V3 / GLM / dots1 divide by (sum + 1e-20): HF's weights are 0 there and stay 0."""
    spec = RouterSpec(score_fn="sigmoid", num_experts=8, top_k=2, renorm=True, renorm_eps=1e-20)
    logits = torch.full((1, 8), -200.0)
    s = torch.sigmoid(logits).topk(2, dim=-1).values
    hf = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    assert route(logits, spec).weights_TK.tolist() == hf.tolist() == [[0.0, 0.0]]


def test_non_finite_selection_bias_is_refused_by_expert() -> None:
    """+inf and -inf biases in one group made its top-2 sum NaN, and the group ranking put it first."""
    from moeflow.routing.router import RouterWeights

    spec = RouterSpec(score_fn="sigmoid", num_experts=8, top_k=2, renorm=True, renorm_eps=1e-20, n_group=4,
                      topk_group=2, use_bias=True)
    bias = torch.zeros(8)
    bias[2], bias[3] = float("inf"), float("-inf")
    with pytest.raises(ValueError, match=r"bias: inf at expert 2, expected finite values \(2 of 8 are not\)"):
        route(torch.randn(2, 8), spec, bias=bias)
    with pytest.raises(ValueError, match=r"selection_bias_E: inf at expert 2"):
        RouterWeights(weight_EH=torch.randn(8, 4), selection_bias_E=bias).check(spec, hidden_size=4)
    gspec, gkw = SPECS["gemma4"]
    scale = gkw["expert_scale"].clone()
    scale[5] = float("-inf")
    with pytest.raises(ValueError, match=r"expert_scale: -inf at expert 5"):
        route(torch.randn(2, 16), gspec, expert_scale=scale)
