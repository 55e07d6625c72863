"""Experts implementations (reference, grouped), activations, ExpertWeights/MoEConfig, selection.

Legend: N (token, slot) rows, H hidden, I intermediate per expert, E experts.
All fp32 on CPU; tolerances are stated per assertion.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeflow.config import ExpertWeights, MoEConfig
from moeflow.experts import select as select_mod
from moeflow.experts.activations import apply_activation
from moeflow.experts.base import down_as_KN, gate_up_as_KN
from moeflow.experts.grouped import GroupedExperts, grouped_mm_usable
from moeflow.experts.reference import ReferenceExperts
from moeflow.experts.select import get_impl, select_experts_impl
from moeflow.routing.spec import RouterSpec
from moeflow.testing import assert_bitwise_equal, assert_close, poisoned_like

RTOL = ATOL = 1e-5  # fp32, different GEMM groupings of the same sums

# (activation, layout, interleaved, expert_bias): every family's combination plus crossings.
CASES = [
    ("silu", "linear", False, False),  # mixtral / qwen / deepseek_v3 / olmoe / longcat
    ("gelu_tanh", "linear", False, False),  # gemma4
    ("swiglu_clamp", "linear", False, False),  # deepseek_v4
    ("gptoss", "matmul", True, True),  # gpt-oss
    ("silu", "matmul", False, False),  # llama4
    ("gptoss", "linear", True, True),
    ("silu", "linear", True, False),
    ("swiglu_clamp", "matmul", False, True),
]
IMPLS = [ReferenceExperts(), GroupedExperts("grouped_mm"), GroupedExperts("bmm")]
LIMIT = 1.5  # small, so that random activations cross it and the clamps are exercised


def make_config(E=4, K=2, H=16, I=8, activation="silu", layout="linear", interleaved=False, bias=False, **kw):
    spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=K, renorm=True)
    return MoEConfig(
        hidden_size=H,
        intermediate_size=I,
        router=spec,
        activation=activation,
        swiglu_limit=LIMIT if activation in ("swiglu_clamp", "gptoss") else None,
        layout=layout,
        interleaved=interleaved,
        expert_bias=bias,
        **kw,
    )


def make_weights(cfg: MoEConfig, seed=0, dtype=torch.float32) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    if cfg.layout == "linear":
        gu, dn = rnd(E, 2 * I, H, scale=H**-0.5 * 2), rnd(E, H, I, scale=I**-0.5)
    else:
        gu, dn = rnd(E, H, 2 * I, scale=H**-0.5 * 2), rnd(E, I, H, scale=I**-0.5)
    gb = rnd(E, 2 * I, scale=0.5) if cfg.expert_bias else None
    db = rnd(E, H, scale=0.5) if cfg.expert_bias else None
    return ExpertWeights(gu, dn, gb, db, layout=cfg.layout, interleaved=cfg.interleaved)


def naive_pairs(x_NH, expert_N, w: ExpertWeights, cfg: MoEConfig) -> torch.Tensor:
    """Row-by-row oracle written from the layout definitions (independent of moeflow.experts)."""
    out = []
    for n in range(x_NH.shape[0]):
        e = int(expert_N[n])
        x = x_NH[n]
        gu = w.gate_up[e] @ x if w.layout == "linear" else x @ w.gate_up[e]
        if w.gate_up_bias is not None:
            gu = gu + w.gate_up_bias[e]
        if cfg.interleaved:
            gate, up = gu[0::2], gu[1::2]
        else:
            gate, up = gu[: cfg.intermediate_size], gu[cfg.intermediate_size :]
        if cfg.activation in ("swiglu_clamp", "gptoss"):
            gate, up = torch.clamp(gate, max=LIMIT), torch.clamp(up, -LIMIT, LIMIT)
        if cfg.activation == "gptoss":
            act = (up + 1) * gate * torch.sigmoid(cfg.gptoss_alpha * gate)
        elif cfg.activation == "gelu_tanh":
            act = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3))) * up
        else:
            act = gate * torch.sigmoid(gate) * up
        y = w.down[e] @ act if w.layout == "linear" else act @ w.down[e]
        if w.down_bias is not None:
            y = y + w.down_bias[e]
        out.append(y)
    return torch.stack(out) if out else x_NH.new_zeros(0, x_NH.shape[1])


def rows(N, H, E, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, H, generator=g), torch.randint(0, E, (N,), generator=g)


# ---------------------------------------------------------------- activations vs HF


def _hf_half_split(gu):
    return gu.chunk(2, dim=-1)


def test_activations_match_hf_modules_bitwise():
    from transformers import DeepseekV4Config, GptOssConfig
    from transformers.activations import ACT2FN
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    g = torch.Generator().manual_seed(3)
    gu = torch.randn(33, 2 * 12, generator=g) * 4  # |v| up to ~15: well past the limits below

    # silu (mixtral / qwen / ...), and llama4's `up * silu(gate)` order.
    gate, up = _hf_half_split(gu)
    ours = apply_activation(gu, make_config(I=12, activation="silu"))
    assert_bitwise_equal(ours, ACT2FN["silu"](gate) * up, what="silu")
    assert_bitwise_equal(ours, up * ACT2FN["silu"](gate), what="llama4 up*silu(gate)")
    # gelu_tanh (gemma4's hidden_activation "gelu_pytorch_tanh").
    ours = apply_activation(gu, make_config(I=12, activation="gelu_tanh"))
    assert_bitwise_equal(ours, ACT2FN["gelu_pytorch_tanh"](gate) * up, what="gelu_tanh")

    # DeepSeek-V4 clamp, through the HF module's own _apply_gate.
    dcfg = DeepseekV4Config(hidden_size=16, moe_intermediate_size=12, n_routed_experts=2, num_experts_per_tok=1,
                            num_hidden_layers=1, vocab_size=8)
    dmod = DeepseekV4Experts(dcfg)
    dmod.limit = 2.5
    cfg = MoEConfig(hidden_size=16, intermediate_size=12, router=make_config().router, activation="swiglu_clamp",
                    swiglu_limit=2.5)
    assert (gate > 2.5).any() and (up.abs() > 2.5).any(), "test data must cross the clamp"
    assert_bitwise_equal(apply_activation(gu, cfg), dmod._apply_gate(gu), what="deepseek_v4 clamp")

    # gpt-oss interleaved clamped SwiGLU, through GptOssExperts._apply_gate.
    gcfg = GptOssConfig(hidden_size=16, intermediate_size=12, num_local_experts=2, num_experts_per_tok=1)
    gmod = GptOssExperts(gcfg)
    cfg = MoEConfig(hidden_size=16, intermediate_size=12, router=make_config().router, activation="gptoss",
                    swiglu_limit=float(gmod.limit), gptoss_alpha=float(gmod.alpha), layout="matmul",
                    interleaved=True, expert_bias=True)
    assert (gu[:, ::2] > gmod.limit).any(), "test data must cross the gpt-oss limit"
    assert_bitwise_equal(apply_activation(gu, cfg), gmod._apply_gate(gu), what="gpt-oss gate")


def test_clamp_is_asymmetric():
    # A very negative gate stays unclamped (no lower bound); up is clamped both ways.
    cfg = make_config(I=1, activation="swiglu_clamp")
    gu = torch.tensor([[-30.0, -30.0], [30.0, 30.0]])
    got = apply_activation(gu, cfg)
    want = torch.stack([F.silu(torch.tensor(-30.0)) * -LIMIT, F.silu(torch.tensor(LIMIT)) * LIMIT]).reshape(2, 1)
    assert_close(got, want, rtol=1e-6, atol=0, what="clamped swiglu")


# ---------------------------------------------------------------- implementations


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c))
@pytest.mark.parametrize("H", [16, 13])  # 13: fp32 rows not 16-byte aligned -> per-expert fallback
def test_impls_match_naive(case, H):
    act, layout, inter, bias = case
    cfg = make_config(E=5, H=H, I=6, activation=act, layout=layout, interleaved=inter, bias=bias)
    w = make_weights(cfg)
    x, ids = rows(37, H, 5)
    want = naive_pairs(x, ids, w, cfg)
    ref = ReferenceExperts().forward_pairs(x, ids, w, cfg)
    assert_close(ref, want, rtol=RTOL, atol=ATOL, what=f"reference {case}")
    for impl in IMPLS[1:]:
        got = impl.forward_pairs(x, ids, w, cfg)
        assert got.dtype == torch.float32 and got.shape == (37, H)
        assert_close(got, ref, rtol=RTOL, atol=ATOL, what=f"{impl!r} {case} H={H}")


def test_grouped_mm_path_is_really_used_when_aligned():
    cfg = make_config(H=16, I=8)
    w = make_weights(cfg)
    x, ids = rows(10, 16, cfg.num_experts)
    assert grouped_mm_usable(x, gate_up_as_KN(w)) == (True, "")
    assert grouped_mm_usable(torch.randn(10, 8), down_as_KN(w)) == (True, "")
    ok, why = grouped_mm_usable(torch.randn(10, 13), torch.randn(3, 13, 6))
    assert not ok and "aligned" in why


def test_grouping_is_stable_and_bit_identical_per_expert():
    """An expert's rows, in the same order, give the same bits alone or mixed with others."""
    cfg = make_config(E=4, H=16, I=8)
    w = make_weights(cfg)
    x, ids = rows(40, 16, 4, seed=5)
    for impl in IMPLS:
        full = impl.forward_pairs(x, ids, w, cfg)
        for e in range(4):
            sel = (ids == e).nonzero().squeeze(1)
            alone = impl.forward_pairs(x[sel], ids[sel], w, cfg)
            assert_bitwise_equal(alone, full[sel], what=f"{impl!r} expert {e}")
        # Rows of experts {1, 3} only, as an EP rank would send them.
        sel = ((ids == 1) | (ids == 3)).nonzero().squeeze(1)
        assert_bitwise_equal(impl.forward_pairs(x[sel], ids[sel], w, cfg), full[sel], what=f"{impl!r} subset")


def test_bmm_path_rows_are_batch_invariant():
    cfg = make_config(E=3, H=16, I=8, activation="gptoss", layout="matmul", interleaved=True, bias=True)
    w = make_weights(cfg)
    x, ids = rows(9, 16, 3)
    impl = GroupedExperts("bmm")
    full = impl.forward_pairs(x, ids, w, cfg)
    for n in range(9):
        assert_bitwise_equal(impl.forward_pairs(x[n : n + 1], ids[n : n + 1], w, cfg), full[n : n + 1], what=f"row {n}")


@pytest.mark.parametrize("impl", IMPLS, ids=repr)
def test_zero_rows_and_single_expert(impl):
    cfg = make_config(E=3, H=16, I=8)
    w = make_weights(cfg)
    y = impl.forward_pairs(torch.zeros(0, 16), torch.zeros(0, dtype=torch.long), w, cfg)
    assert y.shape == (0, 16) and y.dtype == torch.float32
    x, _ = rows(11, 16, 3)
    ids = torch.full((11,), 2)  # every row on the last expert
    assert_close(impl.forward_pairs(x, ids, w, cfg), naive_pairs(x, ids, w, cfg), rtol=RTOL, atol=ATOL,
                 what="all rows on one expert")


@pytest.mark.parametrize("impl", IMPLS, ids=repr)
@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["silu", "gptoss"])
def test_poisoned_unused_experts_never_read(impl, case):
    """NaN weights of experts that get no rows, and NaN storage past E, never reach the output."""
    act, layout, inter, bias = case
    cfg = make_config(E=4, H=16, I=8, activation=act, layout=layout, interleaved=inter, bias=bias)
    clean = make_weights(cfg)
    x, ids = rows(20, 16, 3)  # experts 0..2 only: expert 3 is unused
    want = impl.forward_pairs(x, ids, clean, cfg)

    def poison(t):
        if t is None:
            return None
        t = t.clone()
        t[3] = float("nan")
        # Two more NaN experts past the end of the storage the view covers.
        return poisoned_like(t, 2)[:4]

    pw = ExpertWeights(poison(clean.gate_up), poison(clean.down), poison(clean.gate_up_bias),
                       poison(clean.down_bias), layout=layout, interleaved=inter)
    got = impl.forward_pairs(x, ids, pw, cfg)
    assert torch.isfinite(got).all()
    assert_bitwise_equal(got, want, what=f"{impl!r} with a poisoned unused expert")


def test_subset_weights_give_same_rows():
    """EP: the experts [2, 5) as a view renumbered 0..2 compute the same rows bit for bit."""
    cfg = make_config(E=6, H=16, I=8, activation="gptoss", layout="matmul", interleaved=True, bias=True)
    w = make_weights(cfg)
    sub = w.subset(range(2, 5))
    x, ids = rows(30, 16, 6)
    sel = ((ids >= 2) & (ids < 5)).nonzero().squeeze(1)
    for impl in IMPLS:
        full = impl.forward_pairs(x, ids, w, cfg)
        got = impl.forward_pairs(x[sel], ids[sel] - 2, sub, cfg)
        assert_bitwise_equal(got, full[sel], what=f"{impl!r} subset view")


# ---------------------------------------------------------------- errors


def test_forward_pairs_errors_name_the_field():
    cfg = make_config(E=3, H=16, I=8)
    w = make_weights(cfg)
    impl = GroupedExperts()
    x, ids = rows(4, 16, 3)
    with pytest.raises(ValueError, match="x_NH.*H=16"):
        impl.forward_pairs(torch.randn(4, 15), ids, w, cfg)
    with pytest.raises(TypeError, match="x_NH: dtype torch.float64"):
        impl.forward_pairs(x.double(), ids, w, cfg)
    with pytest.raises(ValueError, match="expert_N: id 3 outside"):
        impl.forward_pairs(x, torch.tensor([0, 1, 2, 3]), w, cfg)
    with pytest.raises(ValueError, match="expert_N: shape"):
        impl.forward_pairs(x, ids[:3], w, cfg)
    with pytest.raises(TypeError, match="expert_N: dtype"):
        impl.forward_pairs(x, ids.float(), w, cfg)
    with pytest.raises(ValueError, match="layout"):
        impl.forward_pairs(x, ids, w, make_config(E=3, H=16, I=8, layout="matmul"))


def test_expert_weights_validation():
    E, H, I = 3, 16, 8
    gu, dn = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    with pytest.raises(ValueError, match=r"ExpertWeights.down: shape \(3, 8, 16\)"):
        ExpertWeights(gu, torch.randn(E, I, H))
    with pytest.raises(ValueError, match="ExpertWeights.gate_up.*odd"):
        ExpertWeights(torch.randn(E, 2 * I + 1, H), dn)
    with pytest.raises(TypeError, match="ExpertWeights.down: dtype torch.float64"):
        ExpertWeights(gu, dn.double())
    with pytest.raises(ValueError, match="ExpertWeights.gate_up_bias: shape"):
        ExpertWeights(gu, dn, torch.randn(E, I), torch.randn(E, H))
    with pytest.raises(ValueError, match="give both or neither"):
        ExpertWeights(gu, dn, torch.randn(E, 2 * I), None)
    with pytest.raises(ValueError, match="ExpertWeights.layout='mm'"):
        ExpertWeights(gu, dn, layout="mm")
    with pytest.raises(ValueError, match="ExpertWeights.gate_up: shape"):
        ExpertWeights(gu[0], dn)
    w = ExpertWeights(gu.transpose(1, 2), dn.transpose(1, 2), layout="matmul")
    assert (w.num_experts, w.hidden_size, w.intermediate_size) == (E, H, I)
    with pytest.raises(ValueError, match="ExpertWeights.intermediate_size=8 disagrees with MoEConfig.intermediate_size=4"):
        w.check_config(make_config(E=E, H=H, I=4, layout="matmul"))


def test_subset_views_and_copies():
    w = ExpertWeights(torch.randn(5, 8, 4), torch.randn(5, 4, 4), torch.randn(5, 8), torch.randn(5, 4))
    v = w.subset(range(1, 4))
    assert v.num_experts == 3
    # A contiguous range is a view of the same storage, no copy.
    assert v.gate_up.untyped_storage().data_ptr() == w.gate_up.untyped_storage().data_ptr()
    assert v.gate_up.data_ptr() == w.gate_up[1].data_ptr()
    assert_bitwise_equal(v.down_bias, w.down_bias[1:4])
    c = w.subset([4, 0])
    assert c.gate_up.untyped_storage().data_ptr() != w.gate_up.untyped_storage().data_ptr()
    assert_bitwise_equal(c.gate_up, w.gate_up[[4, 0]])
    assert w.subset(slice(2, None)).num_experts == 3
    with pytest.raises(ValueError, match="expert_ids: 5 outside"):
        w.subset([5])
    with pytest.raises(ValueError, match="empty"):
        w.subset([])


def test_moe_config_validation():
    spec = make_config().router
    base = dict(hidden_size=16, intermediate_size=8, router=spec)
    with pytest.raises(ValueError, match="MoEConfig.swiglu_limit=None.*gptoss"):
        MoEConfig(**base, activation="gptoss")
    with pytest.raises(ValueError, match="MoEConfig.swiglu_limit=7.0.*swiglu_clamp"):
        MoEConfig(**base, activation="silu", swiglu_limit=7.0)
    with pytest.raises(ValueError, match="MoEConfig.activation='relu'"):
        MoEConfig(**base, activation="relu")
    with pytest.raises(ValueError, match="MoEConfig.layout='transposed'"):
        MoEConfig(**base, activation="silu", layout="transposed")
    with pytest.raises(ValueError, match="MoEConfig.hidden_size=0"):
        MoEConfig(hidden_size=0, intermediate_size=8, router=spec, activation="silu")
    with pytest.raises(TypeError, match="MoEConfig.router"):
        MoEConfig(hidden_size=16, intermediate_size=8, router="softmax", activation="silu")
    with pytest.raises(ValueError, match="MoEConfig.swiglu_limit=-1"):
        MoEConfig(**base, activation="swiglu_clamp", swiglu_limit=-1.0)
    with pytest.raises(TypeError):
        MoEConfig(16, 8, spec, "silu")  # kw-only
    c = MoEConfig(**base, activation="silu")
    assert (c.num_experts, c.top_k) == (4, 2)
    with pytest.raises(AttributeError):
        c.hidden_size = 3  # frozen


# ---------------------------------------------------------------- selection


def test_select_auto_and_named():
    cfg = make_config(E=8, K=2, H=16, I=8)
    big = select_experts_impl(cfg, "cpu", 100)
    assert big.name == "grouped" and big.path == "grouped_mm"
    small = select_experts_impl(cfg, torch.device("cpu"), 1)
    assert small.name == "grouped" and small.path == "bmm"
    assert select_experts_impl(cfg, "cpu", 0).path == "bmm"
    assert select_experts_impl(cfg, "cpu", 100, "grouped").path == "grouped_mm"
    assert select_experts_impl(cfg, "cpu", 100, "reference").name == "reference"
    assert get_impl("reference").name == "reference" and get_impl("grouped").name == "grouped"
    # Pure: the same arguments give the same object.
    assert select_experts_impl(cfg, "cpu", 100) is big
    with pytest.raises(ValueError, match="experts impl 'fast': unknown"):
        select_experts_impl(cfg, "cpu", 4, "fast")
    with pytest.raises(ValueError, match="T=-1"):
        select_experts_impl(cfg, "cpu", -1)


class _FakeTriton:
    name = "triton"

    def __init__(self, ok: bool):
        self.ok = ok

    def supports(self, config):
        return (True, "") if self.ok else (False, "interleaved gate/up not implemented")

    def forward_pairs(self, x_NH, expert_N, w, config):  # pragma: no cover - never run
        raise AssertionError


def test_triton_hook(monkeypatch):
    cfg = make_config()
    monkeypatch.setattr(select_mod, "_triton_impl", lambda options=None: None)
    with pytest.raises(ValueError, match="'triton': unavailable"):
        select_experts_impl(cfg, "cpu", 4, "triton")
    assert select_experts_impl(cfg, "cuda", 64).name == "grouped"  # no triton: grouped on CUDA too

    fake = _FakeTriton(ok=True)
    monkeypatch.setattr(select_mod, "_triton_impl", lambda options=None: fake)
    assert select_experts_impl(cfg, "cuda", 64) is fake  # auto on CUDA
    assert select_experts_impl(cfg, "cpu", 64).name == "grouped"  # never auto on CPU
    with pytest.raises(ValueError, match="refuses device cpu"):
        select_experts_impl(cfg, "cpu", 4, "triton")

    refusing = _FakeTriton(ok=False)
    monkeypatch.setattr(select_mod, "_triton_impl", lambda options=None: refusing)
    assert select_experts_impl(cfg, "cuda", 64).name == "grouped"  # auto skips a refusal
    with pytest.raises(ValueError, match="refuses this config: interleaved gate/up not implemented"):
        select_experts_impl(cfg, "cuda", 4, "triton")
