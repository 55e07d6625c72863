"""`moeflow.route` against the Hugging Face router of every supported family, on identical f32 logits.

Legend: T rows (tokens), S = E + Z logit columns (routed + LongCat zero experts),
E routed experts, K picks per token, G expert groups, V vocabulary (hash layers).

Identical logits: every HF router here computes F.linear(x, W) in f32. The test
builds it with hidden_size = S and W = I, feeds x = the wanted logits and asserts
that the logits HF returns are bit-identical to the ones given to `moeflow.route`
(gpt-oss: F.linear(x, I, b), its router bias included; gemma4, whose router
normalises x before its projection: the projection is replaced by a module that
returns the logits). Only the selection is compared.

Per row (docs/routing.md): the (id, weight) pairs sorted by id are equal,
ids exactly, weights within rtol 1e-6 (atol = the smallest normal f32: a
subnormal weight has no relative precision and weighs nothing).

HF calls torch.topk, whose choice among equal keys is undefined. A row is *tied*
when HF's own arithmetic (mirrored here op for op) gives equal keys across a
selection boundary: the K-th and (K+1)-th key, or the topk_group-th and next
group score. Tied rows are compared on their non-zero-weight pairs (softmax
underflow, DeepSeek-V2's 0.0 masking: zero-weight picks are don't-care); a tied
row whose non-zero pairs differ is counted as "undefined" (bounded below).
Independently of HF, every row's ids *in order* are checked against a
pure-Python oracle of the spec's rule: key descending, lower index on ties.

Rows per case: normal, near-ties at the K boundary (bisected on the f32 lattice
until the two keys are adjacent or equal), +-1e4, +-80 (sigmoid/softmax saturate),
very negative (-1e4 everywhere) and mixed magnitudes. Run with `pytest -s` to
see the row counts per family.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moeflow
from moeflow.testing import assert_bitwise_equal, assert_close

transformers = pytest.importorskip("transformers")


class _HF:
    """transformers.models.<family>'s configuration and modeling modules, attribute access merged."""

    def __init__(self, family: str) -> None:
        self.family = family
        self._mods = [
            importlib.import_module(f"transformers.models.{family}.configuration_{family}"),
            importlib.import_module(f"transformers.models.{family}.modeling_{family}"),
        ]

    def __getattr__(self, name: str) -> Any:
        for m in self._mods:
            if hasattr(m, name):
                return getattr(m, name)
        raise AttributeError(f"transformers.models.{self.family} has no {name}")


# Compared (strict + zero-weight-tied) rows every case must reach.
MIN_ROWS = 200
# Tied rows whose non-zero picks HF leaves undefined, at most this share of a case's rows.
MAX_UNDEFINED_SHARE = 0.10
W_RTOL = 1e-6
W_ATOL = torch.finfo(torch.float32).tiny
# Attention fields every tiny config gets (the routers never read them).
TINY = dict(num_attention_heads=1, num_key_value_heads=1, num_hidden_layers=1, intermediate_size=8)


# ----------------------------------------------------------------------------- rows


def _near_ties(x_RS: torch.Tensor, key_of_x: Callable, K: int, g: torch.Generator) -> torch.Tensor:
    """Move, per row, the logit of the (K+1)-th expert until its key meets the K-th's.

    Bisection on the f32 value of that one logit (every family's key difference is
    monotone in it), stopped when the bracket holds two adjacent floats; one end is
    kept at random, so the two keys end adjacent or exactly equal.
    """
    x = x_RS.clone()
    key = key_of_x(x)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    i_R1, j_R1 = order[:, K - 1 : K], order[:, K : K + 1]

    def diff(v_R: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y.scatter_(1, j_R1, v_R[:, None])
        k = key_of_x(y)
        return (k.gather(1, j_R1) - k.gather(1, i_R1)).squeeze(1)

    lo = x.gather(1, j_R1).squeeze(1).clone()
    hi = torch.maximum(x.gather(1, i_R1).squeeze(1), lo) + 40.0
    ok = diff(hi) > 0
    for _ in range(300):
        mid = lo + (hi - lo) / 2
        done = (mid <= lo) | (mid >= hi)
        if bool(done.all()):
            break
        up = diff(mid) > 0
        hi = torch.where(~done & up, mid, hi)
        lo = torch.where(~done & ~up, mid, lo)
    # The low end may sit exactly on the tie (identity keys): step one float below it, so
    # the near-tie rows are near, not exact (exact ties come from rounding, and their own test).
    lo = torch.where(diff(lo) < 0, lo, torch.nextafter(lo, torch.full_like(lo, float("-inf"))))
    take_hi = torch.rand(lo.shape, generator=g) < 0.5
    v = torch.where(take_hi, hi, lo)
    v = torch.where(ok, v, x.gather(1, j_R1).squeeze(1))
    x.scatter_(1, j_R1, v[:, None])
    return x


def make_rows(S: int, K: int, seed: int, key_of_x: Callable) -> tuple[torch.Tensor, dict[str, int]]:
    """f32 [T, S] router inputs of every kind the module docstring lists, and the count of each kind."""
    g = torch.Generator().manual_seed(seed)

    def randn(n: int) -> torch.Tensor:
        return torch.randn(n, S, generator=g)

    def rand(n: int) -> torch.Tensor:
        return torch.rand(n, S, generator=g)

    def sign(n: int) -> torch.Tensor:
        return torch.where(rand(n) < 0.5, -1.0, 1.0)

    blocks = {
        "normal": randn(96) * (0.5 + 3.5 * torch.rand(96, 1, generator=g)),
        "near_tie": _near_ties(randn(96) * 2.0, key_of_x, K, g),
        "pm1e4": (rand(32) * 2 - 1) * 1e4,
        "pm80": randn(24) * 80.0,
        "sat80": sign(24) * 80.0 * (1 + 1e-3 * rand(24)),
        "very_neg": -1e4 + randn(16) * 10.0,
    }
    choice = torch.randint(0, 5, (32, S), generator=g)
    mag = torch.stack(
        [randn(32), 1e4 * (1 + 1e-3 * rand(32)), -1e4 * (1 + 1e-3 * rand(32)), 80 * (1 + rand(32)), -80 * (1 + rand(32))]
    )
    blocks["mixed"] = mag.gather(0, choice[None]).squeeze(0)
    x = torch.cat(list(blocks.values())).float().contiguous()
    return x, {k: v.shape[0] for k, v in blocks.items()}


# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    config: Any
    layer_idx: int
    # x [T, S], input_ids [T] | None -> (logits HF computed | None, ids [T, K] | None, weights [T, K] or dense [T, S])
    run_hf: Callable[[torch.Tensor, torch.Tensor | None], tuple]
    # x -> the f32 logits moeflow routes (bit-identical to HF's)
    to_logits: Callable[[torch.Tensor], torch.Tensor]
    # logits -> HF's selection key before any group mask (same ops as HF)
    key_fn: Callable[[torch.Tensor], torch.Tensor]
    hf_mask_value: float = float("-inf")
    bias: torch.Tensor | None = None
    expert_scale: torch.Tensor | None = None
    hash_table: torch.Tensor | None = None
    dense: bool = False  # llama4: HF returns the [T, E] score matrix
    old_port_check: bool = False  # DeepSeek-V3 negative keys: a 0.0-masking port must differ


def _identity_router(router: nn.Module, S: int, attr: str = "weight") -> nn.Module:
    with torch.no_grad():
        getattr(router, attr).copy_(torch.eye(S))
    return router.eval()


def _linear_case(name, config, router_cls, S, *, key_fn, out=(0, 1, 2), bias_attr=None, bias=None, **kw) -> Case:
    """A router with `weight` [S, S] = I returning (logits, weights, ids) in the positions `out`."""
    router = _identity_router(router_cls(config), S)
    if bias_attr is not None:
        with torch.no_grad():
            getattr(router, bias_attr).copy_(bias)

    def run(x, input_ids):
        with torch.no_grad():
            res = router(x)
        return res[out[0]], res[out[2]], res[out[1]]

    return Case(name, config, 0, run, lambda x: x, key_fn, bias=bias, **kw)


def _softmax(logits):
    return torch.softmax(logits.float(), dim=-1)


def _bias(S: int, seed: int, scale: float = 0.1, offset: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (offset + scale * torch.randn(S, generator=g)).float()


def _ds3_like(name, cfg_cls, router_cls, *, E, K, n_group, topk_group, norm, scale, bias, model_type=None, **extra):
    cfg = cfg_cls(
        hidden_size=E,
        n_routed_experts=E,
        num_experts_per_tok=K,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scale,
        n_shared_experts=1,
        moe_intermediate_size=8,
        **TINY,
    )
    if model_type is not None:
        cfg.model_type = model_type  # Kimi-K2 checkpoints: a DeepSeek-V3 config under its own name
    return _linear_case(
        name, cfg, router_cls, E, key_fn=lambda l: l.sigmoid() + bias,
        bias_attr="e_score_correction_bias", bias=bias, **extra,
    )


def _softmax_families() -> list[Case]:
    cases = []
    m = _HF("mixtral")
    cases.append(_linear_case(
        "mixtral", m.MixtralConfig(hidden_size=8, num_local_experts=8, num_experts_per_tok=2, **TINY),
        m.MixtralTopKRouter, 8, key_fn=_softmax))
    m = _HF("qwen2_moe")
    cases.append(_linear_case(
        "qwen2_moe", m.Qwen2MoeConfig(hidden_size=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                                      **TINY),
        m.Qwen2MoeTopKRouter, 16, key_fn=_softmax))
    m = _HF("qwen3_moe")
    cases.append(_linear_case(
        "qwen3_moe", m.Qwen3MoeConfig(hidden_size=16, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                                      **TINY),
        m.Qwen3MoeTopKRouter, 16, key_fn=_softmax))
    m = _HF("olmoe")
    cases.append(_linear_case(
        "olmoe", m.OlmoeConfig(hidden_size=16, num_experts=16, num_experts_per_tok=3, norm_topk_prob=False, **TINY),
        m.OlmoeTopKRouter, 16, key_fn=_softmax))
    return cases


def _deepseek_v2() -> list[Case]:
    """greedy and group_limited_greedy (group score = max; HF masks the other groups to 0.0)."""
    m = _HF("deepseek_v2")
    cases = []
    for method, groups in (("greedy", (1, 1)), ("group_limited_greedy", (4, 2))):
        cfg = m.DeepseekV2Config(
            hidden_size=16, n_routed_experts=16, num_experts_per_tok=3, topk_method=method, n_group=groups[0],
            topk_group=groups[1], routed_scaling_factor=1.5, n_shared_experts=1, moe_intermediate_size=8, **TINY,
        )
        cases.append(_linear_case(
            f"deepseek_v2/{method}", cfg, m.DeepseekV2TopkRouter, 16, key_fn=_softmax, hf_mask_value=0.0))
    return cases


def _deepseek_v3() -> list[Case]:
    """sigmoid + bias, group-limited top-2-sum; Kimi-K2 is this router under its own model_type."""
    m = _HF("deepseek_v3")
    cfg, router = m.DeepseekV3Config, m.DeepseekV3TopkRouter
    return [
        _ds3_like("deepseek_v3", cfg, router, E=32, K=4, n_group=8, topk_group=3, norm=True, scale=2.5,
                  bias=_bias(32, 1)),
        # A bias that makes every kept key negative: -inf masking vs the 0.0 of older ports.
        _ds3_like("deepseek_v3/negative_keys", cfg, router, E=32, K=4, n_group=8, topk_group=2, norm=True,
                  scale=2.5, bias=_bias(32, 2, 0.2, -2.5), old_port_check=True),
        _ds3_like("deepseek_v3/no_renorm", cfg, router, E=16, K=3, n_group=4, topk_group=2, norm=False, scale=1.0,
                  bias=_bias(16, 3)),
        _ds3_like("kimi_k2", cfg, router, E=24, K=6, n_group=1, topk_group=1, norm=True, scale=2.827,
                  bias=_bias(24, 4), model_type="kimi_k2"),
    ]


def _glm4_moe() -> list[Case]:
    m = _HF("glm4_moe")
    return [_ds3_like("glm4_moe", m.Glm4MoeConfig, m.Glm4MoeTopkRouter, E=16, K=4, n_group=1, topk_group=1,
                      norm=True, scale=1.0, bias=_bias(16, 5))]


def _dots1() -> list[Case]:
    m = _HF("dots1")
    return [_ds3_like("dots1", m.Dots1Config, m.Dots1TopkRouter, E=16, K=4, n_group=2, topk_group=1,
                      norm=True, scale=2.5, bias=_bias(16, 6))]


def _deepseek_v4() -> list[Case]:
    """sqrt(softplus), bias, plain top-k, always renormalised (K=1 too); hash layers use tid2eid."""
    m = _HF("deepseek_v4")
    cases = []
    for K in (3, 1):
        E = 16
        cfg = m.DeepseekV4Config(hidden_size=E, n_routed_experts=E, num_experts_per_tok=K, vocab_size=64,
                                 num_hidden_layers=4, num_attention_heads=1, routed_scaling_factor=1.5)
        b = _bias(E, 7 + K)
        case = _linear_case(
            f"deepseek_v4/K={K}", cfg, m.DeepseekV4TopKRouter, E,
            key_fn=lambda l, b=b: F.softplus(l).sqrt() + b, bias_attr="e_score_correction_bias", bias=b)
        case.layer_idx = 3  # mlp_layer_types = 3 x hash_moe, then moe
        cases.append(case)
    cfg = m.DeepseekV4Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, vocab_size=64,
                             num_hidden_layers=4, num_attention_heads=1, routed_scaling_factor=1.5)
    hash_router = _identity_router(m.DeepseekV4HashRouter(cfg), 16)
    gh = torch.Generator().manual_seed(11)
    table_VK = torch.stack([torch.randperm(16, generator=gh)[:4] for _ in range(64)])
    with torch.no_grad():
        hash_router.tid2eid.copy_(table_VK)

    def run_hash(x, input_ids):
        with torch.no_grad():
            logits, w, ids = hash_router(x, input_ids)
        return logits, ids, w

    cases.append(Case("deepseek_v4/hash", cfg, 1, run_hash, lambda x: x, lambda l: F.softplus(l).sqrt(),
                      hash_table=table_VK))
    return cases


def _gpt_oss() -> list[Case]:
    """top-K of the logits (router bias included), softmax over the K."""
    m = _HF("gpt_oss")
    E = 16
    cfg = m.GptOssConfig(hidden_size=E, num_local_experts=E, num_experts_per_tok=4, **TINY)
    gpt = _identity_router(m.GptOssTopKRouter(cfg), E)
    router_bias = _bias(E, 12, 1.0)
    with torch.no_grad():
        gpt.bias.copy_(router_bias)

    def gpt_logits(x):
        return F.linear(x, torch.eye(E), router_bias)

    def run_gpt(x, input_ids):
        with torch.no_grad():
            logits, w, ids = gpt(x)
        return logits, ids, w

    return [Case("gpt_oss", cfg, 0, run_gpt, gpt_logits, lambda l: l)]


def _llama4() -> list[Case]:
    """top-K of the logits, sigmoid of the picked ones, returned as a dense [T, E] matrix."""
    m = _HF("llama4")
    cases = []
    for K in (1, 2):
        cfg = m.Llama4TextConfig(hidden_size=16, num_local_experts=16, num_experts_per_tok=K, **TINY)
        l4 = _identity_router(m.Llama4Router(cfg), 16)

        def run_l4(x, input_ids, l4=l4):
            with torch.no_grad():
                scores, logits = l4(x)
            return logits, None, scores

        cases.append(Case(f"llama4/K={K}", cfg, 0, run_l4, lambda x: x, lambda l: l, dense=True))
    return cases


def _longcat_flash() -> list[Case]:
    """softmax over E + Z, bias on the key, no renorm, x routed_scaling_factor."""
    m = _HF("longcat_flash")
    E, Z = 16, 8
    cfg = m.LongcatFlashConfig(hidden_size=E + Z, n_routed_experts=E, zero_expert_num=Z, moe_topk=4,
                               routed_scaling_factor=6.0, num_attention_heads=1, num_layers=1)
    lc_bias = _bias(E + Z, 13, 0.02)
    lc = m.LongcatFlashTopkRouter(cfg)
    with torch.no_grad():
        lc.classifier.weight.copy_(torch.eye(E + Z))
        lc.e_score_correction_bias.copy_(lc_bias)
    lc.eval()

    def run_lc(x, input_ids):
        with torch.no_grad():
            logits, w, ids = lc(x)
        return logits, ids, w

    return [Case("longcat_flash", cfg, 0, run_lc, lambda x: x, lambda l: l.softmax(dim=-1) + lc_bias, bias=lc_bias)]


class FixedLogits(nn.Module):
    """Stands in for gemma4's router proj: returns the logits under test, whatever its input."""

    logits: torch.Tensor | None = None

    def forward(self, h):
        assert self.logits is not None and self.logits.shape[0] == h.shape[0]
        return self.logits


def _gemma4_config(m: _HF):
    return m.Gemma4TextConfig(hidden_size=32, enable_moe_block=True, num_experts=16, top_k_experts=4,
                              moe_intermediate_size=8, num_attention_heads=1, num_key_value_heads=1,
                              num_hidden_layers=1)


def _gemma4() -> list[Case]:
    """softmax, renorm, x per_expert_scale; the proj replaced by fixed logits."""
    m = _HF("gemma4")
    cfg = _gemma4_config(m)
    gem = m.Gemma4TextRouter(cfg).eval()
    scale_E = (0.5 + 1.5 * torch.rand(16, generator=torch.Generator().manual_seed(14))).float()
    with torch.no_grad():
        gem.per_expert_scale.copy_(scale_E)
    fixed = FixedLogits()
    gem.proj = fixed

    def run_gem(x, input_ids):
        fixed.logits = x
        with torch.no_grad():
            _probs, w, ids = gem(torch.randn(x.shape[0], 32))
        return None, ids, w

    return [Case("gemma4", cfg, 0, run_gem, lambda x: x, _softmax, expert_scale=scale_E)]


BUILDERS = {
    "mixtral/qwen2_moe/qwen3_moe/olmoe": _softmax_families, "deepseek_v2": _deepseek_v2,
    "deepseek_v3/kimi_k2": _deepseek_v3, "glm4_moe": _glm4_moe, "dots1": _dots1, "deepseek_v4": _deepseek_v4,
    "gpt_oss": _gpt_oss, "llama4": _llama4, "longcat_flash": _longcat_flash, "gemma4": _gemma4,
}
# transformers at or above this version ships every family (a missing one there is a failure).
ALL_FAMILIES_SINCE = (5, 24)


def _cases() -> tuple[list[Case], dict[str, str]]:
    """The cases the installed transformers can build, and why the others could not be."""
    torch.manual_seed(0)
    cases: list[Case] = []
    missing: dict[str, str] = {}
    for label, build in BUILDERS.items():
        try:
            cases += build()
        except (ImportError, AttributeError) as e:  # a family newer than the installed transformers
            missing[label] = f"{type(e).__name__}: {e}"
    return cases, missing


CASES, MISSING = _cases()
CASE_BY_NAME = {c.name: c for c in CASES}


# ----------------------------------------------------------------------------- oracles


def _group_scores(key_TS: torch.Tensor, spec) -> torch.Tensor:
    """HF's group score: topk(2).sum (DeepSeek-V3 family) or max (DeepSeek-V2), f32 [T, G]."""
    T, S = key_TS.shape
    key_TGP = key_TS.view(T, spec.n_group, S // spec.n_group)
    if spec.group_score == "top2_sum":
        return key_TGP.topk(2, dim=-1)[0].sum(dim=-1)
    return key_TGP.max(dim=-1).values


def spec_ids(key_TS: torch.Tensor, spec) -> list[list[int]]:
    """Pure-Python spec rule: best groups (lower group on ties), then key descending, lower index on ties."""
    rows = key_TS.tolist()
    groups = _group_scores(key_TS, spec).tolist() if spec.n_group > 1 else None
    out = []
    for t, key in enumerate(rows):
        cand = range(len(key))
        if groups is not None:
            P = len(key) // spec.n_group
            kept = sorted(range(spec.n_group), key=lambda gi: (-groups[t][gi], gi))[: spec.topk_group]
            cand = [e for gi in sorted(kept) for e in range(gi * P, (gi + 1) * P)]
        out.append(sorted(cand, key=lambda e: (-key[e], e))[: spec.top_k])
    return out


def hf_tied_rows(key_TS: torch.Tensor, spec, mask_value: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where HF's torch.topk faces equal keys across a selection boundary.

    Returns (group_tied bool [T], expert_tied bool [T], HF's masked key f32 [T, S]);
    the masked key is exact where the group choice is not tied.
    """
    T, S = key_TS.shape
    group_tied = torch.zeros(T, dtype=torch.bool)
    masked = key_TS
    if spec.n_group > 1:
        g_TG = _group_scores(key_TS, spec)
        if spec.topk_group < spec.n_group:
            gs = torch.sort(g_TG, dim=-1, descending=True).values
            group_tied = gs[:, spec.topk_group - 1] == gs[:, spec.topk_group]
        keep = torch.zeros_like(g_TG, dtype=torch.bool)
        keep.scatter_(1, torch.sort(g_TG, dim=-1, descending=True, stable=True).indices[:, : spec.topk_group], True)
        keep_TS = keep.repeat_interleave(S // spec.n_group, dim=1)
        masked = key_TS.masked_fill(~keep_TS, mask_value)
    expert_tied = torch.zeros(T, dtype=torch.bool)
    if spec.top_k < S:
        ks = torch.sort(masked, dim=-1, descending=True).values
        expert_tied = ks[:, spec.top_k - 1] == ks[:, spec.top_k]
    return group_tied, expert_tied, masked


def _by_id(ids_TK: torch.Tensor, w_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_TK = ids_TK.long()
    order = torch.sort(ids_TK, dim=-1, stable=True).indices
    return ids_TK.gather(1, order), w_TK.float().gather(1, order)


def _nonzero_pairs_equal(ids_a, w_a, ids_b, w_b) -> bool:
    ka, kb = w_a != 0, w_b != 0
    if not torch.equal(ids_a[ka], ids_b[kb]):
        return False
    a, b = w_a[ka].double(), w_b[kb].double()
    return bool(((a - b).abs() <= W_ATOL + W_RTOL * b.abs()).all())


# ----------------------------------------------------------------------------- the comparison


@functools.cache
def compare_case(name: str) -> dict[str, int]:
    """Run one case; raise AssertionError on any mismatch; return its row counts."""
    case = CASE_BY_NAME[name]
    spec = moeflow.router_spec_from_hf(case.config, case.layer_idx)
    S, K = spec.num_slots, spec.top_k
    seed = sum(map(ord, name))
    x, kinds = make_rows(S, K, seed, lambda x: case.key_fn(case.to_logits(x)))
    T = x.shape[0]
    input_ids = None
    if spec.hash_routing:
        input_ids = torch.randint(0, case.hash_table.shape[0], (T,), generator=torch.Generator().manual_seed(seed))

    hf_logits, hf_ids, hf_w = case.run_hf(x, input_ids)
    logits = case.to_logits(x)
    if hf_logits is not None:
        assert_bitwise_equal(hf_logits.float(), logits, what=f"{name}: logits HF computed vs the ones routed")
    res = moeflow.route(logits, spec, bias=case.bias, expert_scale=case.expert_scale, input_ids=input_ids,
                        hash_table=case.hash_table)
    assert res.ids_TK.dtype == torch.int32 and res.weights_TK.dtype == torch.float32
    assert res.ids_TK.shape == (T, K) and res.weights_TK.shape == (T, K)

    # The spec's own rule, order included, on every row (ties: lower index).
    key = case.key_fn(logits)
    if spec.hash_routing:
        want = case.hash_table[input_ids].tolist()
    else:
        want = spec_ids(key, spec)
    got = res.ids_TK.tolist()
    bad = [t for t in range(T) if got[t] != want[t]]
    assert not bad, f"{name}: {len(bad)} rows differ from the spec rule; row {bad[0]}: got {got[bad[0]]}, want {want[bad[0]]}"

    if spec.hash_routing:
        group_tied = expert_tied = torch.zeros(T, dtype=torch.bool)
        masked = key
    else:
        group_tied, expert_tied, masked = hf_tied_rows(key, spec, case.hf_mask_value)
    tied = group_tied | expert_tied
    ours_ids, ours_w = _by_id(res.ids_TK, res.weights_TK)
    if case.dense:
        # llama4: HF's [T, E] matrix holds sigmoid(logit) at the picks and sigmoid(-inf) = 0 elsewhere.
        dense = torch.zeros(T, S).scatter_(1, res.ids_TK.long(), res.weights_TK)
        hf_dense = hf_w.float()
        strict = ~tied
        assert_close(dense[strict], hf_dense[strict], rtol=W_RTOL, atol=W_ATOL, what=f"{name}: dense scores")
        hf_nz = [set(torch.nonzero(r).flatten().tolist()) for r in hf_dense]
        for t in torch.nonzero(strict).flatten().tolist():
            ours_nz = {e for e, w in zip(got[t], res.weights_TK[t].tolist()) if w != 0}
            assert hf_nz[t] == ours_nz, f"{name}: row {t}: HF picked {sorted(hf_nz[t])}, moeflow {sorted(ours_nz)}"
        zero_tied = undefined = 0
        for t in torch.nonzero(tied).flatten().tolist():
            ok = torch.equal(dense[t] != 0, hf_dense[t] != 0) and bool(
                ((dense[t] - hf_dense[t]).abs() <= W_ATOL + W_RTOL * hf_dense[t].abs()).all()
            )
            zero_tied += ok
            undefined += not ok
    else:
        hf_ids_s, hf_w_s = _by_id(hf_ids, hf_w)
        strict = ~tied
        if not torch.equal(ours_ids[strict], hf_ids_s[strict]):
            rows = torch.nonzero(strict).flatten()
            first = int(rows[(ours_ids[strict] != hf_ids_s[strict]).any(dim=1)][0])
            raise AssertionError(
                f"{name}: ids differ from HF on untied rows; row {first}: moeflow {ours_ids[first].tolist()}, "
                f"HF {hf_ids_s[first].tolist()}, logits {logits[first].tolist()}"
            )
        assert_close(ours_w[strict], hf_w_s[strict], rtol=W_RTOL, atol=W_ATOL, what=f"{name}: weights by id")
        zero_tied = undefined = 0
        for t in torch.nonzero(tied).flatten().tolist():
            ok = _nonzero_pairs_equal(ours_ids[t], ours_w[t], hf_ids_s[t], hf_w_s[t])
            zero_tied += ok
            undefined += not ok
        # Where only the expert choice is tied, HF still picks *a* top-K by key: the key
        # values of its picks equal ours (only which of the equal ones differs).
        only_expert = expert_tied & ~group_tied
        hf_keys = torch.sort(masked.gather(1, hf_ids_s), dim=-1).values
        our_keys = torch.sort(masked.gather(1, ours_ids), dim=-1).values
        assert_bitwise_equal(hf_keys[only_expert], our_keys[only_expert], what=f"{name}: key values of tied rows' picks")

    if case.old_port_check:
        # An older port masks the other groups to 0.0: with every kept key negative it picks
        # masked experts instead. The case must tell the two apart, or it tests nothing.
        g_TG = _group_scores(key, spec)
        keep = torch.zeros_like(g_TG, dtype=torch.bool)
        keep.scatter_(1, g_TG.topk(spec.topk_group, dim=-1).indices, True)
        old_key = key.masked_fill(~keep.repeat_interleave(S // spec.n_group, dim=1), 0.0)
        old_ids, _ = _by_id(old_key.topk(K, dim=-1).indices, torch.zeros(T, K))
        differ = (old_ids != hf_ids_s).any(dim=1).float().mean().item()
        assert differ > 0.9, f"{name}: the 0.0-masking port differs from HF on only {differ:.0%} of rows"

    counts = dict(rows=T, strict=int((~tied).sum()), zero_weight_tied=zero_tied, undefined=undefined,
                  group_tied=int(group_tied.sum()), **kinds)
    counts["compared"] = counts["strict"] + zero_tied
    assert counts["compared"] >= MIN_ROWS, f"{name}: only {counts['compared']} rows compared with HF: {counts}"
    assert undefined <= MAX_UNDEFINED_SHARE * T, f"{name}: {undefined} rows where HF's pick is undefined: {counts}"
    return counts


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_route_matches_hf(name: str) -> None:
    counts = compare_case(name)
    print(f"\n{name}: {counts}")


def test_hf_rows_summary() -> None:
    """Every supported family is covered, each with >= MIN_ROWS rows compared (printed with -s)."""
    families = {c.config.model_type for c in CASES}
    required = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe",
                "dots1", "deepseek_v4", "gpt_oss", "llama4_text", "longcat_flash", "gemma4_text"}
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    if version >= ALL_FAMILIES_SINCE:
        assert not MISSING, f"transformers {transformers.__version__} failed to build: {MISSING}"
        assert required <= families, f"families without an HF comparison: {sorted(required - families)}"
    if MISSING:
        print(f"\nnot in transformers {transformers.__version__}: {MISSING}")
    total = 0
    lines = []
    for name in CASE_BY_NAME:
        c = compare_case(name)
        total += c["compared"]
        lines.append(f"{name:28s} rows={c['rows']:4d} compared={c['compared']:4d} (strict={c['strict']}, "
                     f"zero-weight ties={c['zero_weight_tied']}) undefined={c['undefined']}")
    print("\nHF comparison rows per case:\n" + "\n".join(lines) + f"\ntotal compared rows: {total}")


def test_gemma4_router_from_hidden_states() -> None:
    """The whole gemma4 router on hidden states: its proj's output, routed by moeflow, gives HF's picks."""
    if "gemma4" not in CASE_BY_NAME:
        pytest.skip(f"transformers {transformers.__version__} has no gemma4: {MISSING.get('gemma4')}")
    m = _HF("gemma4")
    cfg = _gemma4_config(m)
    spec = moeflow.router_spec_from_hf(cfg)
    assert spec.router_prenorm and spec.expert_scale and spec.renorm
    torch.manual_seed(3)
    router = m.Gemma4TextRouter(cfg).eval()
    with torch.no_grad():
        router.proj.weight.normal_()
        router.scale.uniform_(0.5, 1.5)
        router.per_expert_scale.uniform_(0.5, 2.0)
    seen = {}
    router.proj.register_forward_hook(lambda m, i, o: seen.__setitem__("logits", o))
    x = torch.randn(256, 32) * 3
    with torch.no_grad():
        _p, hf_w, hf_ids = router(x)
    res = moeflow.route(seen["logits"].float(), spec, expert_scale=router.per_expert_scale.detach())
    ids, w = _by_id(res.ids_TK, res.weights_TK)
    hids, hw = _by_id(hf_ids, hf_w)
    assert torch.equal(ids, hids)
    assert_close(w, hw, rtol=W_RTOL, atol=W_ATOL, what="gemma4 weights from hidden states")
