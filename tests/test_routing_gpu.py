"""GPU router: batch-invariant logits, selection = CPU reference, prediction, CUDA graphs, NaN status.

Legend: T tokens, H hidden size, E routed experts, Z zero experts, S = E + Z logit
columns, K picks per token, W prediction width, V hash vocabulary.

Everything here needs CUDA and Triton (`-m gpu`); without them the module is skipped.
Tolerances (stated once):
  * logits vs a float64 reference on the same (rounded) operands:
    |out - ref| <= 2e-5 * (|x| @ |w|.T) + 1e-6 (tensor-core f32 accumulation);
  * ids: exact (integers), against moeflow.routing.select.route_reference on the same
    f32 logits. GPU and CPU compute the scores s with different (correct to ~1 ulp)
    exp/sigmoid/softmax roundings, so a row whose float64 keys hold a *near* tie
    (0 < gap < 1e-6 relative, ~8 ulp, at a pick boundary) can legitimately differ: such rows are
    excluded, and the test asserts they are fewer than 1% and that every planted exact
    tie row is kept (exact ties are bitwise ties on both sides and must match);
  * weights: relative 1e-6 (absolute 1e-30 for underflowed picks);
  * bit-identity: moeflow.testing.assert_bitwise_equal.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from moeflow.routing.spec import RouterSpec
from moeflow.testing import assert_bitwise_equal, assert_close

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs CUDA and triton"),
]

DEV = "cuda"
NEAR_TIE = 1e-6


def _gpu():
    from moeflow.routing import gpu

    return gpu


# --------------------------------------------------------------------------- families


def family_spec(family: str, E: int) -> RouterSpec:
    """A RouterSpec with the selection rule of `family` (routing.md's table) for E experts."""
    if family == "mixtral":
        return RouterSpec(score_fn="softmax", num_experts=E, top_k=2, renorm=True)
    if family == "qwen3_moe":
        return RouterSpec(score_fn="softmax", num_experts=E, top_k=8, renorm=True)
    if family == "olmoe":
        return RouterSpec(score_fn="softmax", num_experts=E, top_k=8)
    if family == "deepseek_v3":
        return RouterSpec(score_fn="sigmoid", num_experts=E, top_k=8, renorm=True, renorm_eps=1e-20,
                          scaling_factor=2.5, n_group=8, topk_group=4, group_score="top2_sum", use_bias=True)
    if family == "glm4_moe":  # sigmoid + bias, no groups
        return RouterSpec(score_fn="sigmoid", num_experts=E, top_k=8, renorm=True, renorm_eps=1e-20,
                          scaling_factor=1.8, use_bias=True)
    if family == "deepseek_v2":
        return RouterSpec(score_fn="softmax", num_experts=E, top_k=6, scaling_factor=16.0, n_group=8,
                          topk_group=3, group_score="max")
    if family == "deepseek_v4":
        return RouterSpec(score_fn="sqrtsoftplus", num_experts=E, top_k=6, renorm=True, renorm_eps=1e-20,
                          scaling_factor=1.5, use_bias=True)
    if family == "deepseek_v4_hash":
        return RouterSpec(score_fn="sqrtsoftplus", num_experts=E, top_k=6, renorm=True, renorm_eps=1e-20,
                          scaling_factor=1.5, hash_routing=True)
    if family == "gpt_oss":
        return RouterSpec(score_fn="topk_softmax", num_experts=E, top_k=4)
    if family == "llama4":
        return RouterSpec(score_fn="topk_sigmoid", num_experts=E, top_k=1, weight_on_input=True)
    if family == "longcat_flash":
        return RouterSpec(score_fn="softmax", num_experts=E, top_k=12, scaling_factor=6.0,
                          num_zero_experts=E // 2, use_bias=True)
    if family == "gemma4":
        return RouterSpec(score_fn="softmax", num_experts=E, top_k=8, renorm=True, expert_scale=True)
    raise KeyError(family)


FAMILIES = ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "deepseek_v2", "deepseek_v4",
            "deepseek_v4_hash", "gpt_oss", "llama4", "longcat_flash", "gemma4"]
GROUPED = {"deepseek_v3", "deepseek_v2"}


def family_inputs(spec: RouterSpec, T: int, *, seed: int, vocab: int = 211):
    """(logits_TS f32, kwargs of route) on the CPU, with planted exact-tie rows first.

    Rows 0..7 take their logits from a small value set (exact ties between experts);
    the bias has duplicated values so biased keys tie exactly too. The rest are
    N(0, 2^2) logits. Returns (logits, kwargs, tie_rows).
    """
    g = torch.Generator().manual_seed(seed)
    S = spec.num_slots
    logits = torch.randn(T, S, generator=g) * 2.0
    values = torch.tensor([-2.75, -0.6, 0.45, 1.3, 3.1])
    n_tie = min(8, T)
    for t in range(n_tie):
        logits[t] = values[torch.randint(0, len(values), (S,), generator=g)]
    kwargs = {}
    if spec.use_bias:
        kwargs["bias"] = torch.tensor([-0.07, 0.0, 0.11])[torch.randint(0, 3, (S,), generator=g)]
    if spec.expert_scale:
        kwargs["expert_scale"] = torch.rand(S, generator=g) + 0.5
    if spec.hash_routing:
        kwargs["hash_table"] = torch.stack([torch.randperm(S, generator=g)[: spec.top_k] for _ in range(vocab)])
        kwargs["input_ids"] = torch.randint(0, vocab, (T,), generator=g)
    return logits, kwargs, list(range(n_tie))


def _key64(logits_TS: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None) -> torch.Tensor:
    l = logits_TS.double()
    if spec.score_fn == "softmax":
        s = torch.softmax(l, dim=-1)
    elif spec.score_fn == "sigmoid":
        s = torch.sigmoid(l)
    elif spec.score_fn == "sqrtsoftplus":
        s = torch.where(l > 20, l, torch.log1p(torch.exp(torch.clamp(l, max=20)))).sqrt()
    else:
        s = l
    return s if bias is None else s + bias.double()


def _near_TN(sorted_TN: torch.Tensor) -> torch.Tensor:
    """bool [T]: a gap 0 < g < NEAR_TIE (relative) between neighbours of the sorted rows."""
    a, b = sorted_TN[:, :-1], sorted_TN[:, 1:]
    gap = (a - b).abs()
    scale = torch.maximum(a.abs(), b.abs()).clamp_min(1e-30)
    near = (gap > 0) & (gap < NEAR_TIE * scale) & torch.isfinite(a) & torch.isfinite(b)
    return near.any(dim=1)


def near_tie_rows(logits_TS, spec: RouterSpec, bias, K: int | None = None, *, groups: bool = True,
                  mask_zero: bool = False) -> set[int]:
    """Rows whose float64 selection has a near tie at a pick or group boundary."""
    K = spec.top_k if K is None else K
    key = _key64(logits_TS, spec, bias)
    if mask_zero:
        key[:, spec.num_experts:] = float("-inf")
    T = key.shape[0]
    near = torch.zeros(T, dtype=torch.bool)
    G = spec.n_group if groups else 1
    if G > 1:
        P = spec.num_slots // G
        top = torch.sort(key.view(T, G, P), dim=-1, descending=True).values
        if spec.group_score == "top2_sum":
            gs = top[..., 0] + top[..., 1]
            near |= _near_TN(top[..., :2].reshape(T * G, 2)).view(T, G).any(dim=1)
        else:
            gs = top[..., 0]
        gsorted, gidx = torch.sort(gs, dim=-1, descending=True)
        near |= _near_TN(gsorted[:, : spec.topk_group + 1])
        keep = torch.zeros(T, G, dtype=torch.bool)
        keep.scatter_(1, gidx[:, : spec.topk_group], True)
        key = torch.where(keep.repeat_interleave(P, dim=1), key, torch.tensor(float("-inf"), dtype=key.dtype))
    near |= _near_TN(torch.sort(key, dim=-1, descending=True).values[:, : K + 1])
    return set(near.nonzero()[:, 0].tolist())


def compare_routing(res, ref, *, skip: set[int], what: str) -> None:
    ids, ref_ids = res.ids_TK.cpu(), ref.ids_TK
    keep = torch.ones(ids.shape[0], dtype=torch.bool)
    keep[list(skip)] = False
    bad = ((ids != ref_ids).any(dim=1) & keep).nonzero()[:, 0]
    if bad.numel():
        t = int(bad[0])
        raise AssertionError(
            f"{what}: ids differ in {bad.numel()} rows; first row {t}: gpu {ids[t].tolist()} ref {ref_ids[t].tolist()}"
        )
    if res.weights_TK is not None:
        assert_close(res.weights_TK.cpu()[keep], ref.weights_TK[keep], rtol=1e-6, atol=1e-30, what=f"{what} weights")


# --------------------------------------------------------------------------- logits


def _logits_ref(x_TH, w_EH):
    """float64 x @ w.T on the device (exact products, f64 sums), as a CPU tensor."""
    return (x_TH.double() @ w_EH.double().T).cpu()


def _logits_tol(x_TH, w_EH):
    return (2e-5 * (x_TH.double().abs() @ w_EH.double().abs().T) + 1e-6).cpu()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("E,H", [(61, 2880), (257, 7168), (384, 4096)])
def test_logits_bit_identical_across_T_and_positions(dtype, E, H):
    gpu = _gpu()
    g = torch.Generator(device=DEV).manual_seed(E + H)
    T = 4097
    x = torch.randn(T, H, device=DEV, generator=g).to(dtype)
    w = (torch.randn(E, H, device=DEV, generator=g) / math.sqrt(H)).to(dtype)
    full = gpu.router_logits_cuda(x, w)
    assert full.dtype == torch.float32 and full.shape == (T, E)
    err = (full.double().cpu() - _logits_ref(x, w)).abs()
    assert bool((err <= _logits_tol(x, w)).all()), f"logits error {float(err.max()):.3e}"
    # every batch size of a sample and every offset class of a row inside a tile
    for n, start in [(1, 0), (1, 4096), (1, 1234), (7, 3), (8, 100), (17, 40), (64, 1), (65, 63),
                     (128, 7), (513, 1000), (4000, 97)]:
        sub = gpu.router_logits_cuda(x[start : start + n], w)
        assert_bitwise_equal(sub, full[start : start + n], what=f"T={n} at {start}")
    # the same rows in another order (each row at another position)
    perm = torch.randperm(T, device=DEV, generator=g)
    assert_bitwise_equal(gpu.router_logits_cuda(x[perm], w), full[perm], what="permuted rows")
    # a batch padded with poison rows (NaN) around the sample changes nothing
    pad = torch.full((5, H), float("nan"), device=DEV, dtype=dtype)
    padded = torch.cat([pad, x[10:30], pad])
    out = gpu.router_logits_cuda(padded, w)
    assert_bitwise_equal(out[5:25], full[10:30], what="rows between NaN rows")


def test_logits_T_8192_and_every_small_T():
    gpu = _gpu()
    g = torch.Generator(device=DEV).manual_seed(7)
    E, H = 256, 7168
    x = torch.randn(8192, H, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(E, H, device=DEV, generator=g) / math.sqrt(H)).to(torch.bfloat16)
    full = gpu.router_logits_cuda(x, w)
    for n in range(1, 70):
        assert_bitwise_equal(gpu.router_logits_cuda(x[8192 - n :], w), full[8192 - n :], what=f"T={n}")
    # non-contiguous rows (a row stride of 2H) take the same path
    xs = torch.randn(300, 2 * H, device=DEV, generator=g).to(torch.bfloat16)[:, :H]
    assert_bitwise_equal(gpu.router_logits_cuda(xs, w)[17:18], gpu.router_logits_cuda(xs[17:18].contiguous(), w),
                         what="strided x")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_logits_fused_next_weight(dtype):
    gpu = _gpu()
    g = torch.Generator(device=DEV).manual_seed(3)
    H = 2880
    x = torch.randn(33, H, device=DEV, generator=g).to(dtype)
    w = (torch.randn(128, H, device=DEV, generator=g) / 50).to(dtype)
    w_next = (torch.randn(128, H, device=DEV, generator=g) / 50).to(dtype)
    w_other = (torch.randn(61, H, device=DEV, generator=g) / 50).to(dtype)
    a, b = gpu.router_logits_cuda(x, w, w_next)
    assert_bitwise_equal(a, gpu.router_logits_cuda(x, w), what="fused first output")
    assert_bitwise_equal(b, gpu.router_logits_cuda(x, w_next), what="fused second output")
    a2, c = gpu.router_logits_cuda(x, w, w_other)
    assert_bitwise_equal(a2, a, what="first output with a differently sized second weight")
    err = (c.double().cpu() - _logits_ref(x, w_other)).abs()
    assert bool((err <= _logits_tol(x, w_other)).all())


def test_logits_mixed_dtypes_and_refusals():
    gpu = _gpu()
    x = torch.randn(5, 256, device=DEV).to(torch.bfloat16)
    w = torch.randn(64, 256, device=DEV)  # DeepSeek keeps the gate weight in fp32
    out = gpu.router_logits_cuda(x, w)
    err = (out.double().cpu() - _logits_ref(x, w)).abs()
    assert bool((err <= _logits_tol(x, w)).all())
    with pytest.raises(ValueError, match="weight_EH"):
        gpu.router_logits_cuda(x, w[:, :128])
    with pytest.raises(TypeError, match="x_TH"):
        gpu.router_logits_cuda(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="unit stride"):
        gpu.router_logits_cuda(x.t().contiguous().t(), w[:, :5])
    with pytest.raises(ValueError, match="CUDA"):
        gpu.router_logits_cuda(x.cpu(), w.cpu())
    assert gpu.router_logits_cuda(x[:0], w).shape == (0, 64)


def test_public_router_logits_dispatches_to_the_kernel():
    import moeflow

    gpu = _gpu()
    x = torch.randn(9, 512, device=DEV).to(torch.bfloat16)
    w = torch.randn(40, 512, device=DEV).to(torch.bfloat16)
    assert_bitwise_equal(moeflow.router_logits(x, w), gpu.router_logits_cuda(x, w), what="moeflow.router_logits")


# --------------------------------------------------------------------------- selection


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("E", [61, 256, 384])
def test_route_matches_cpu_reference(family, E):
    from moeflow.routing.select import route_reference

    if family in GROUPED and E % 8:
        pytest.skip("group-limited families need E divisible by n_group=8")
    gpu = _gpu()
    spec = family_spec(family, E)
    T = 4097
    logits, kw, tie_rows = family_inputs(spec, T, seed=E)
    ref = route_reference(logits, spec, **kw)
    res = gpu.route_cuda(logits.to(DEV), spec, **{k: v.to(DEV) for k, v in kw.items()})
    assert res.ids_TK.dtype == torch.int32 and res.weights_TK.dtype == torch.float32
    assert res.ids_TK.shape == (T, spec.top_k)
    skip = set() if spec.hash_routing else near_tie_rows(logits, spec, kw.get("bias"))
    assert not skip & set(tie_rows), f"planted tie rows {sorted(skip & set(tie_rows))} are near ties"
    assert len(skip) < 0.01 * T, f"{len(skip)} near-tie rows of {T}"
    compare_routing(res, ref, skip=skip, what=f"{family} E={E}")
    res.check()  # no NaN: no raise
    # batch invariance of the selection: a row alone gives the same bits
    for t in (0, 5, 4096):
        one = gpu.route_cuda(logits[t : t + 1].to(DEV), spec,
                             **{k: (v[t : t + 1] if k == "input_ids" else v).to(DEV) for k, v in kw.items()})
        assert torch.equal(one.ids_TK, res.ids_TK[t : t + 1])
        assert_bitwise_equal(one.weights_TK, res.weights_TK[t : t + 1], what=f"{family} row {t} alone")


@pytest.mark.parametrize("T", [1, 7, 4097])
def test_route_deepseek_v3_negative_kept_keys(T):
    """A bias that makes kept keys negative: -inf masking (not 0.0) decides (routing.md)."""
    from moeflow.routing.select import route_reference

    gpu = _gpu()
    spec = family_spec("deepseek_v3", 256)
    logits, kw, _ = family_inputs(spec, T, seed=11)
    kw["bias"] = kw["bias"] - 1.5
    ref = route_reference(logits, spec, **kw)
    res = gpu.route_cuda(logits.to(DEV), spec, bias=kw["bias"].to(DEV))
    skip = near_tie_rows(logits, spec, kw["bias"])
    assert len(skip) <= max(1, 0.01 * T)
    compare_routing(res, ref, skip=skip, what="deepseek_v3 negative keys")


def test_route_infinite_logits_follow_the_reference():
    from moeflow.routing.select import route_reference

    gpu = _gpu()
    for family in ("qwen3_moe", "deepseek_v4", "gpt_oss", "llama4", "deepseek_v3"):
        spec = family_spec(family, 64)
        logits, kw, _ = family_inputs(spec, 12, seed=5)
        logits[0, 3] = float("inf")
        logits[1, [5, 9]] = float("inf")
        logits[2, :] = float("-inf")
        logits[3, 7] = float("-inf")
        logits[4, :] = float("inf")
        ref = route_reference(logits, spec, **kw)
        res = gpu.route_cuda(logits.to(DEV), spec, **{k: v.to(DEV) for k, v in kw.items()})
        assert torch.equal(res.ids_TK.cpu()[:5], ref.ids_TK[:5]), (family, res.ids_TK[:5], ref.ids_TK[:5])
        assert_close(res.weights_TK.cpu()[:5], ref.weights_TK[:5], rtol=1e-6, atol=1e-30, what=f"{family} inf")
        res.check()


def test_route_nan_status_names_the_row():
    gpu = _gpu()
    spec = family_spec("deepseek_v3", 256)
    logits, kw, _ = family_inputs(spec, 50, seed=2)
    logits[17, 100] = float("nan")
    logits[40, :] = float("nan")
    res = gpu.route_cuda(logits.to(DEV), spec, bias=kw["bias"].to(DEV), layer=3)
    status = res.status.status_T.cpu()
    assert status[17] == 1 and status[40] == 1 and int((status != 0).sum()) == 2
    assert bool(res.status.any_error())
    # failed rows: in-range ids, NaN weights; other rows untouched
    assert res.ids_TK[17].tolist() == list(range(spec.top_k))
    assert bool(torch.isnan(res.weights_TK[17]).all())
    assert bool(torch.isfinite(res.weights_TK[16]).all())
    with pytest.raises(ValueError, match=r"token row 17 of layer 3 \(2 rows hold NaN\)"):
        res.check()


def test_route_hash_bad_inputs_are_reported():
    gpu = _gpu()
    spec = family_spec("deepseek_v4_hash", 64)
    logits, kw, _ = family_inputs(spec, 20, seed=4, vocab=30)
    ids = kw["input_ids"].clone()
    ids[6] = 30  # out of the vocabulary
    res = gpu.route_cuda(logits.to(DEV), spec, input_ids=ids.to(DEV), hash_table=kw["hash_table"].to(DEV))
    assert int(res.status.status_T[6]) == 2
    with pytest.raises(ValueError, match=r"input_ids: id 30 in token row 6"):
        res.check()
    table = kw["hash_table"].clone()
    table[int(kw["input_ids"][2])] = 64  # an expert id outside [0, S)
    res = gpu.route_cuda(logits.to(DEV), spec, input_ids=kw["input_ids"].to(DEV), hash_table=table.to(DEV))
    with pytest.raises(ValueError, match=r"hash_table: expert id 64"):
        res.check()


def test_route_refusals_name_the_field():
    gpu = _gpu()
    spec = family_spec("deepseek_v3", 256)
    logits = torch.randn(4, 256, device=DEV)
    with pytest.raises(ValueError, match="bias"):
        gpu.route_cuda(logits, spec, bias=torch.zeros(255, device=DEV))
    with pytest.raises(TypeError, match="logits_TE"):
        gpu.route_cuda(logits.half(), spec, bias=torch.zeros(256, device=DEV))
    with pytest.raises(ValueError, match="logits_TE"):
        gpu.route_cuda(logits[:, :128], spec, bias=torch.zeros(256, device=DEV))
    with pytest.raises(ValueError, match="bias"):
        gpu.route_cuda(logits, spec, bias=torch.zeros(256))


def test_public_route_dispatches_to_the_kernel():
    import moeflow

    gpu = _gpu()
    spec = family_spec("qwen3_moe", 128)
    logits = torch.randn(33, 128, device=DEV)
    res = moeflow.route(logits, spec)
    assert isinstance(res, gpu.CudaRoutingResult)
    assert torch.equal(res.ids_TK, gpu.route_cuda(logits, spec).ids_TK)


# --------------------------------------------------------------------------- prediction


def _predict_ref(logits_TS, spec, *, bias, W, input_ids=None, hash_table=None):
    """moeflow.routing.predict's ranking on given logits (CPU), for the GPU's own logits."""
    from moeflow.routing.grouped import group_mask_TS
    from moeflow.routing.scores import scores_TS, selection_key_TS
    from moeflow.routing.topk import stable_topk_indices

    E = spec.num_experts
    key = selection_key_TS(scores_TS(logits_TS, spec), spec, None if bias is None else bias.float())
    if spec.hash_routing and input_ids is not None:
        table = hash_table[input_ids.long()].long()
        if W <= spec.top_k:
            return table[:, :W].to(torch.int32)
        key = key.scatter(1, table, float("-inf"))
        key[:, E:] = float("-inf")
        return torch.cat([table, stable_topk_indices(key, W - spec.top_k)], dim=1).to(torch.int32)
    per_group = spec.num_slots // spec.n_group
    if spec.n_group > 1 and W <= spec.topk_group * per_group:
        key = group_mask_TS(key, spec)
    if spec.num_zero_experts:
        key = key.clone()
        key[:, E:] = float("-inf")
    return stable_topk_indices(key, W).to(torch.int32)


@pytest.mark.parametrize("family,W", [("deepseek_v3", 8), ("deepseek_v3", 16), ("deepseek_v3", 64),
                                      ("longcat_flash", 12), ("longcat_flash", 40), ("qwen3_moe", 24),
                                      ("deepseek_v4_hash", 4), ("deepseek_v4_hash", 20)])
def test_predict_next_matches_reference(family, W):
    gpu = _gpu()
    spec = family_spec(family, 256)
    g = torch.Generator(device=DEV).manual_seed(W)
    H, T = 2048, 37
    x = torch.randn(T, H, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(spec.num_slots, H, device=DEV, generator=g) / 20).to(torch.bfloat16)
    _, kw, _ = family_inputs(spec, T, seed=W)
    if "bias" in kw:  # a continuous bias: keys clustered on a few bias values near-tie too often
        kw["bias"] = torch.randn(spec.num_slots, generator=torch.Generator().manual_seed(W)) * 0.05
    kw_dev = {k: v.to(DEV) for k, v in kw.items() if k != "expert_scale"}
    pred = gpu.predict_next_cuda(x, w, spec, width=W, layer=7, **kw_dev)
    assert pred.keys_TW2.shape == (T, W, 2) and pred.keys_TW2.dtype == torch.int32
    assert bool((pred.keys_TW2[..., 0] == 7).all())
    assert torch.equal(pred.keys_TW2[..., 1], pred.ids_TW)
    logits = gpu.router_logits_cuda(x, w).cpu()
    ref = _predict_ref(logits, spec, bias=kw.get("bias"), W=W, input_ids=kw.get("input_ids"),
                       hash_table=kw.get("hash_table"))
    if spec.hash_routing and W > spec.top_k:
        # the extra picks rank the plain key with the table's picks at -inf
        key = _key64(logits, spec, None)
        key.scatter_(1, kw["hash_table"][kw["input_ids"]].long(), float("-inf"))
        skip = set(_near_TN(torch.sort(key, dim=-1, descending=True).values[:, : W - spec.top_k + 1])
                   .nonzero()[:, 0].tolist())
    elif spec.hash_routing:
        skip = set()
    else:
        per_group = spec.num_slots // spec.n_group
        skip = near_tie_rows(logits, spec, kw.get("bias"), W, groups=W <= spec.topk_group * per_group,
                             mask_zero=spec.num_zero_experts > 0)
    assert len(skip) <= T // 4, f"{len(skip)} near-tie rows of {T}"
    keep = [t for t in range(T) if t not in skip]
    assert torch.equal(pred.ids_TW.cpu()[keep], ref[keep])
    pred.check()


def test_predict_next_public_shape_and_route_agreement():
    """Width K without hash/zero experts is exactly the next layer's routing of the same logits."""
    gpu = _gpu()
    spec = family_spec("deepseek_v3", 256)
    x = torch.randn(5, 7168, device=DEV).to(torch.bfloat16)
    w = (torch.randn(256, 7168, device=DEV) / 80).to(torch.bfloat16)
    bias = torch.randn(256, device=DEV) * 0.1
    pred = gpu.predict_next_cuda(x, w, spec, bias=bias, layer=2)
    routed = gpu.route_cuda(gpu.router_logits_cuda(x, w), spec, bias=bias)
    assert torch.equal(pred.ids_TW, routed.ids_TK)


def test_router_step_fused_equals_separate_calls():
    gpu = _gpu()
    g = torch.Generator(device=DEV).manual_seed(9)
    H = 2880
    spec = family_spec("gpt_oss", 128)
    nspec = family_spec("deepseek_v3", 256)
    x = torch.randn(70, H, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(128, H, device=DEV, generator=g) / 50).to(torch.bfloat16)
    rb = torch.randn(128, device=DEV, generator=g)  # gpt-oss router-linear bias
    wn = (torch.randn(256, H, device=DEV, generator=g) / 50).to(torch.bfloat16)
    nb = torch.randn(256, device=DEV, generator=g) * 0.1
    step = gpu.router_step_cuda(x, w, spec, router_bias=rb, next_weight_EH=wn, next_spec=nspec, next_bias=nb,
                                width=16, next_layer=4)
    logits = gpu.router_logits_cuda(x, w) + rb
    assert_bitwise_equal(step.logits_TS, logits, what="step logits")
    sep = gpu.route_cuda(logits, spec)
    assert torch.equal(step.routing.ids_TK, sep.ids_TK)
    assert_bitwise_equal(step.routing.weights_TK, sep.weights_TK, what="step weights")
    pred = gpu.predict_next_cuda(x, wn, nspec, bias=nb, width=16, layer=4)
    assert torch.equal(step.prediction.keys_TW2, pred.keys_TW2)


# --------------------------------------------------------------------------- CUDA graphs


def test_cuda_graph_capture_and_replay_with_new_inputs():
    gpu = _gpu()
    g = torch.Generator(device=DEV).manual_seed(21)
    T, H = 8, 7168
    spec = family_spec("deepseek_v3", 256)
    nspec = family_spec("deepseek_v3", 256)
    w = (torch.randn(256, H, device=DEV, generator=g) / 80).to(torch.bfloat16)
    wn = (torch.randn(256, H, device=DEV, generator=g) / 80).to(torch.bfloat16)
    bias = torch.randn(256, device=DEV, generator=g) * 0.1
    x_static = torch.randn(T, H, device=DEV, generator=g).to(torch.bfloat16)

    def step():
        logits, nlogits = gpu.router_logits_cuda(x_static, w, wn)
        routed = gpu.route_cuda(logits, spec, bias=bias)
        pred = gpu.predict_next_cuda(x_static, wn, nspec, bias=bias, width=16, layer=1)
        fused = gpu.router_step_cuda(x_static, w, spec, bias=bias, next_weight_EH=wn, next_spec=nspec,
                                     next_bias=bias, width=16, next_layer=1)
        return logits, nlogits, routed, pred, fused

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(3):
        x_new = torch.randn(T, H, device=DEV, generator=g).to(torch.bfloat16)
        if trial == 2:
            x_new[3] = float("nan")
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        logits, nlogits, routed, pred, fused = out
        e_logits, e_nlogits, e_routed, e_pred, e_fused = step()  # eager on the same input
        assert_bitwise_equal(logits, e_logits, what="graph logits")
        assert_bitwise_equal(nlogits, e_nlogits, what="graph next logits")
        assert torch.equal(routed.ids_TK, e_routed.ids_TK)
        assert_bitwise_equal(routed.weights_TK, e_routed.weights_TK, what="graph weights")
        assert torch.equal(pred.keys_TW2, e_pred.keys_TW2)
        assert torch.equal(fused.routing.ids_TK, e_routed.ids_TK)
        assert torch.equal(fused.prediction.keys_TW2, e_pred.keys_TW2)
        if trial < 2:
            routed.check()
            pred.check()
        else:  # the status tensor inside the graph reports the replay's NaN row
            with pytest.raises(ValueError, match="token row 3"):
                routed.check()
            with pytest.raises(ValueError, match="token row 3 of layer 1"):
                fused.prediction.check()
