"""MoELayer: against Hugging Face blocks of each family, against a direct torch oracle, edge cases.

Legend: B batch, S sequence, T tokens, H hidden, E routed experts, Z zero experts,
K picks per token, I intermediate per expert.
All fp32 on CPU. Tolerance against HF: rtol = atol = 1e-5 (same math, different
summation order of the combine and of the router GEMM).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moeflow.config import ExpertWeights, MoEConfig
from moeflow.experts.select import get_impl
from moeflow.layer import MoELayer, run_experts
from moeflow.parallel.local import combine_TH, dispatch_rows, local_dispatch, unpermute_TKH
from moeflow.routing.spec import RouterSpec
from moeflow.testing import assert_bitwise_equal, assert_close, poisoned_like
from moeflow.types import RoutingResult

TOL = dict(rtol=1e-5, atol=1e-5)
# bf16 layer vs an f64 oracle on the same bf16 weights and routing: bf16 rounding of
# the intermediate activations (8 bits of mantissa).
BF16_TOL = dict(rtol=3e-2, atol=3e-2)
IMPLS = ["reference", "grouped"]


def init_(module: nn.Module, seed: int, std: float = 0.3) -> None:
    """Deterministic random values for every float parameter and buffer (HF leaves torch.empty)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(module.parameters()) + [b for b in module.buffers() if b.dtype.is_floating_point]:
            t.copy_(torch.randn(t.shape, generator=g) * std)


def hidden(B, S, H, seed=7, scale=1.0):
    return torch.randn(B, S, H, generator=torch.Generator().manual_seed(seed)) * scale


def both_impls(build, hf_out, x, **fw):
    """Run the layer `build(impl)` for each impl and T (small T takes grouped's bmm path)."""
    for impl in IMPLS:
        layer = build(impl)
        got = layer(x, **fw)
        assert got.shape == x.shape and got.dtype == x.dtype
        assert_close(got, hf_out, **TOL, what=f"{impl} vs HF")
        # A single token (bmm path for grouped) must agree with the batched call.
        got1 = layer(x[:1, :1], **{k: v[:1, :1] for k, v in fw.items()})
        assert_close(got1, hf_out[:1, :1], **TOL, what=f"{impl} T=1 vs HF")
    return layer


# ------------------------------------------------------------------ HF families


def test_mixtral_block():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    c = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    c._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(c).eval()
    init_(block, 0)
    x = hidden(2, 9, 16)
    with torch.no_grad():
        want = block(x)
    spec = RouterSpec(score_fn="softmax", num_experts=4, top_k=2, renorm=True)
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, router=spec, activation="silu")

    def build(impl):
        w = ExpertWeights(block.experts.gate_up_proj, block.experts.down_proj)
        return MoELayer(cfg, router_weight_EH=block.gate.weight, experts=w, experts_impl=impl)

    layer = both_impls(build, want, x)
    # Stored by reference: the HF Parameters themselves.
    assert layer.source.gate_up is block.experts.gate_up_proj and layer.router_weight is block.gate.weight
    assert layer.last_routing.ids_TK.shape == (1, 2)  # the last call was the single token


def test_gpt_oss_block():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    c = GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=5, num_experts_per_tok=2)
    c._experts_implementation = "eager"
    block = GptOssMLP(c).eval()
    init_(block, 1, std=0.8)  # large: gate values cross swiglu_limit=7
    x = hidden(2, 7, 16)
    with torch.no_grad():
        want = block(x)[0]
        gates = torch.einsum("th,ehi->tei", x.reshape(-1, 16), block.experts.gate_up_proj)[..., ::2]
    assert (gates > c.swiglu_limit).any(), "test data must exercise the gpt-oss clamp"
    spec = RouterSpec(score_fn="topk_softmax", num_experts=5, top_k=2)
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, router=spec, activation="gptoss",
                    swiglu_limit=c.swiglu_limit, gptoss_alpha=c.swiglu_alpha, layout="matmul",
                    interleaved=True, expert_bias=True)

    def build(impl):
        e = block.experts
        w = ExpertWeights(e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias,
                          layout="matmul", interleaved=True)
        return MoELayer(cfg, router_weight_EH=block.router.weight, router_bias_E=block.router.bias,
                        experts=w, experts_impl=impl)

    both_impls(build, want, x)


def test_qwen2_moe_block_gated_shared():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    c = Qwen2MoeConfig(hidden_size=16, moe_intermediate_size=8, shared_expert_intermediate_size=12,
                       num_experts=6, num_experts_per_tok=3, norm_topk_prob=False)
    c._experts_implementation = "eager"
    block = Qwen2MoeSparseMoeBlock(c).eval()
    init_(block, 2)
    x = hidden(3, 4, 16)
    with torch.no_grad():
        want = block(x)
    spec = RouterSpec(score_fn="softmax", num_experts=6, top_k=3, renorm=False)
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, router=spec, activation="silu", shared_gated=True)

    def build(impl):
        w = ExpertWeights(block.experts.gate_up_proj, block.experts.down_proj)
        return MoELayer(cfg, router_weight_EH=block.gate.weight, experts=w, shared_expert=block.shared_expert,
                        shared_gate_weight_1H=block.shared_expert_gate.weight, experts_impl=impl)

    layer = both_impls(build, want, x)
    assert layer.shared_expert is block.shared_expert


def test_llama4_block_weight_on_input():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    c = Llama4TextConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    block = Llama4TextMoe(c).eval()
    init_(block, 3)
    x = hidden(2, 5, 16)
    with torch.no_grad():
        want = block(x)[0].reshape(x.shape)
    spec = RouterSpec(score_fn="topk_sigmoid", num_experts=4, top_k=2, weight_on_input=True)
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, router=spec, activation="silu", layout="matmul")

    def build(impl):
        w = ExpertWeights(block.experts.gate_up_proj, block.experts.down_proj, layout="matmul")
        return MoELayer(cfg, router_weight_EH=block.router.weight, experts=w, shared_expert=block.shared_expert,
                        experts_impl=impl)

    both_impls(build, want, x)


def test_longcat_zero_experts_block():
    from transformers import LongcatFlashConfig
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMoE

    E, Z = 4, 2
    c = LongcatFlashConfig(hidden_size=16, expert_ffn_hidden_size=8, n_routed_experts=E, zero_expert_num=Z,
                           moe_topk=2)
    c._experts_implementation = "eager"
    block = LongcatFlashMoE(c).eval()
    init_(block, 4)
    with torch.no_grad():
        block.router.e_score_correction_bias[E:] = 0.2  # make zero experts win often
    x = hidden(2, 8, 16)
    with torch.no_grad():
        want = block(x)
    spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=2, num_zero_experts=Z,
                      scaling_factor=c.routed_scaling_factor, use_bias=True)
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, router=spec, activation="silu")

    def build(impl):
        # HF's gate_up_proj holds E + Z rows; the routed experts are its first E (a view).
        w = ExpertWeights(block.experts.gate_up_proj[:E], block.experts.down_proj)
        return MoELayer(cfg, router_weight_EH=block.router.classifier.weight,
                        selection_bias_E=block.router.e_score_correction_bias, experts=w, experts_impl=impl)

    layer = both_impls(build, want, x)
    layer(x)  # both_impls ended on a single token
    ids = layer.last_routing.ids_TK
    assert (ids >= E).any() and (ids < E).any(), "test must route to both zero and routed experts"
    # The view is kept as the whole HF Parameter plus a row range: no copy, survives .to().
    assert layer.source.gate_up_full is block.experts.gate_up_proj
    layer.to(torch.bfloat16)  # (the CPU stand-in for a device move)
    assert block.experts.gate_up_proj.dtype == torch.bfloat16  # converted in place, still shared
    w = layer.expert_weights
    assert w.gate_up.shape == (E, 16, 16) and w.gate_up.data_ptr() == block.experts.gate_up_proj.data_ptr()
    check_oracle(layer, x.bfloat16(), "longcat after .to(bfloat16)", **BF16_TOL)


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["hash", "topk"])
def test_deepseek_v4_block(layer_idx):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

    E, K, V = 6, 2, 32
    c = DeepseekV4Config(hidden_size=16, moe_intermediate_size=8, intermediate_size=8, n_routed_experts=E,
                         num_experts_per_tok=K, num_hidden_layers=2, vocab_size=V,
                         mlp_layer_types=["hash_moe", "moe"], swiglu_limit=1.0)
    c._experts_implementation = "eager"
    block = DeepseekV4SparseMoeBlock(c, layer_idx).eval()
    init_(block, 5, std=0.6)
    g = torch.Generator().manual_seed(9)
    if layer_idx == 0:
        block.gate.tid2eid.copy_(torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(V)]))
    x = hidden(2, 6, 16)
    input_ids = torch.randint(0, V, (2, 6), generator=g)
    with torch.no_grad():
        want = block(x, input_ids=input_ids)
    is_hash = layer_idx == 0
    spec = RouterSpec(score_fn="sqrtsoftplus", num_experts=E, top_k=K, renorm=True, renorm_eps=1e-20,
                      scaling_factor=c.routed_scaling_factor, use_bias=not is_hash, hash_routing=is_hash)
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, router=spec, activation="swiglu_clamp",
                    swiglu_limit=c.swiglu_limit)

    def build(impl):
        w = ExpertWeights(block.experts.gate_up_proj, block.experts.down_proj)
        return MoELayer(
            cfg,
            router_weight_EH=block.gate.weight,
            selection_bias_E=None if is_hash else block.gate.e_score_correction_bias,
            hash_table_VK=block.gate.tid2eid if is_hash else None,
            experts=w,
            shared_expert=block.shared_experts,
            experts_impl=impl,
            layer_idx=layer_idx,
        )

    both_impls(build, want, x, input_ids=input_ids)


def test_gemma4_router_prenorm_and_expert_scale():
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4TextExperts, Gemma4TextRouter

    c = Gemma4TextConfig(hidden_size=16, moe_intermediate_size=8, num_experts=5, top_k_experts=2,
                         enable_moe_block=True, num_hidden_layers=1, vocab_size=32)
    c._experts_implementation = "eager"
    router, experts = Gemma4TextRouter(c).eval(), Gemma4TextExperts(c).eval()
    pre_norm_2 = Gemma4RMSNorm(16, eps=c.rms_norm_eps)
    for i, m in enumerate((router, experts, pre_norm_2)):
        init_(m, 10 + i, std=0.5)
    residual = hidden(2, 5, 16, scale=3.0)
    flat = residual.reshape(-1, 16)
    with torch.no_grad():
        # Gemma4TextDecoderLayer: routes on the residual, experts see pre_feedforward_layernorm_2(residual).
        _, top_w, top_i = router(flat)
        expert_in = pre_norm_2(flat)
        want = experts(expert_in, top_i, top_w).reshape(residual.shape)
    spec = RouterSpec(score_fn="softmax", num_experts=5, top_k=2, renorm=True, expert_scale=True,
                      router_prenorm=True)
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, router=spec, activation="gelu_tanh",
                    router_prenorm_eps=c.rms_norm_eps)

    def build(impl):
        w = ExpertWeights(experts.gate_up_proj, experts.down_proj)
        return MoELayer(cfg, router_weight_EH=router.proj.weight, prenorm_weight_H=router.scale,
                        expert_scale_E=router.per_expert_scale, experts=w, experts_impl=impl)

    both_impls(build, want, expert_in.reshape(residual.shape), router_input=residual)


# ------------------------------------------------------------------ direct torch oracle


def oracle(layer: MoELayer, x_TH: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
    """Token by token, slot by slot, from the definitions (independent of moeflow's dispatch)."""
    cfg, w = layer.config, layer.expert_weights
    E, I = cfg.num_experts, cfg.intermediate_size
    out = torch.zeros_like(x_TH, dtype=torch.float64)
    for t in range(x_TH.shape[0]):
        for k in range(cfg.top_k):
            e, wt = int(routing.ids_TK[t, k]), float(routing.weights_TK[t, k])
            xin = x_TH[t].double()
            if e >= E:  # zero expert: identity
                out[t] += wt * xin
                continue
            if cfg.router.weight_on_input:
                xin, wt = xin * wt, 1.0
            gu = w.gate_up[e].double() @ xin if w.layout == "linear" else xin @ w.gate_up[e].double()
            y_act = F.silu(gu[:I]) * gu[I:]
            y = w.down[e].double() @ y_act if w.layout == "linear" else y_act @ w.down[e].double()
            out[t] += wt * y
    if layer.shared_expert is not None:
        s = layer.shared_expert(x_TH).double()
        if layer.shared_gate_weight is not None:
            s = torch.sigmoid(x_TH.double() @ layer.shared_gate_weight.double().T) * s
        out += s
    return out.to(x_TH.dtype)


def synth_layer(E=4, K=2, H=16, I=8, Z=0, impl="grouped", seed=0, layout="linear", shared=None,
                gated=False, weight_on_input=False, poison_expert=None):
    g = torch.Generator().manual_seed(seed)
    spec = RouterSpec(score_fn="topk_sigmoid" if weight_on_input else "softmax", num_experts=E, top_k=K,
                      renorm=not weight_on_input, num_zero_experts=Z, weight_on_input=weight_on_input)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu", layout=layout,
                    shared_gated=gated)
    gu_shape, dn_shape = ((E, 2 * I, H), (E, H, I)) if layout == "linear" else ((E, H, 2 * I), (E, I, H))
    gu = torch.randn(gu_shape, generator=g) * H**-0.5
    dn = torch.randn(dn_shape, generator=g) * I**-0.5
    if poison_expert is not None:
        gu[poison_expert] = float("nan")
        dn[poison_expert] = float("nan")
    router_w = torch.randn(E + Z, H, generator=g)
    sgw = torch.randn(1, H, generator=g) if gated else None
    return MoELayer(cfg, router_weight_EH=router_w, experts=ExpertWeights(gu, dn, layout=layout),
                    shared_expert=shared, shared_gate_weight_1H=sgw, experts_impl=impl)


def check_oracle(layer, x, what, rtol=TOL["rtol"], atol=TOL["atol"], **fw):
    got = layer(x, **fw)
    x_TH = x.reshape(-1, x.shape[-1])
    want = oracle(layer, x_TH, layer.last_routing).reshape(x.shape)
    assert_close(got, want, rtol=rtol, atol=atol, what=what)
    return got


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("E,H", [(3, 13), (61, 24), (8, 16)])
@pytest.mark.parametrize("T", [0, 1, 5, 40])
def test_layer_vs_oracle_shapes(impl, E, H, T):
    layer = synth_layer(E=E, K=2 if E > 3 else 3, H=H, I=6, impl=impl, seed=E + T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    got = check_oracle(layer, x, f"{impl} E={E} H={H} T={T}")
    assert got.shape == (T, H)
    assert layer.last_routing.ids_TK.shape == (T, layer.config.top_k)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch_3d(impl):
    layer = synth_layer(impl=impl)
    y = layer(torch.zeros(2, 0, 16))
    assert y.shape == (2, 0, 16)


@pytest.mark.parametrize("impl", IMPLS)
def test_unused_expert_poisoned_and_all_on_one(impl):
    H = 16
    clean = synth_layer(E=4, K=1, H=H, impl=impl, seed=3)
    poisoned = synth_layer(E=4, K=1, H=H, impl=impl, seed=3, poison_expert=2)
    for m in (clean, poisoned):
        with torch.no_grad():
            m.router_weight[1] = 5.0  # positive x -> expert 1 wins every token
            m.router_weight[2] = -5.0  # never picked
    x = torch.rand(30, H, generator=torch.Generator().manual_seed(1)) + 0.1
    want = check_oracle(clean, x, "all tokens on expert 1")
    assert torch.all(clean.last_routing.ids_TK == 1)
    got = poisoned(x)
    assert torch.isfinite(got).all()
    assert_bitwise_equal(got, want, what="NaN weights of an unused expert")
    # Some tokens on expert 0 as well, expert 2 still unused and poisoned.
    with torch.no_grad():
        for m in (clean, poisoned):
            m.router_weight[0] = 5.0
            m.router_weight[0, :8] = -5.0
    x2 = x.clone()
    x2[:10, :8] = -3.0  # expert 0's logit: +120 + ..., expert 1's: -120 + ...
    want = check_oracle(clean, x2, "two experts used")
    ids = clean.last_routing.ids_TK
    assert set(ids.unique().tolist()) == {0, 1}
    assert_bitwise_equal(poisoned(x2), want, what="poisoned unused expert, 2 used")


@pytest.mark.parametrize("impl", IMPLS)
def test_poisoned_input_padding_never_read(impl):
    layer = synth_layer(E=5, H=16, impl=impl)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(2))
    want = layer(x)
    padded = poisoned_like(x, 7)[:9]  # NaN rows right after the view's end
    assert_bitwise_equal(layer(padded), want, what="NaN padding after x")


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_experts_oracle(impl):
    E, Z = 4, 3
    layer = synth_layer(E=E, K=3, Z=Z, impl=impl, seed=11)
    x = torch.randn(25, 16, generator=torch.Generator().manual_seed(4))
    check_oracle(layer, x, f"zero experts {impl}")
    ids = layer.last_routing.ids_TK
    assert (ids >= E).any() and (ids < E).any()
    # A token whose picks are all zero experts returns sum(w) * x.
    with torch.no_grad():
        layer.router_weight[E:] = 0.0
        layer.router_weight[:E] = -50.0
    xp = torch.rand(3, 16, generator=torch.Generator().manual_seed(5)) + 0.5
    out = check_oracle(layer, xp, "only zero experts")
    assert torch.all(layer.last_routing.ids_TK >= E)
    wsum = layer.last_routing.weights_TK.sum(1, keepdim=True)
    assert_close(out, wsum * xp, rtol=1e-6, atol=1e-6, what="identity experts")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert_added_once(impl, gated):
    g = torch.Generator().manual_seed(6)
    shared = nn.Sequential(nn.Linear(16, 12, bias=False), nn.SiLU(), nn.Linear(12, 16, bias=False))
    init_(shared, 6)
    layer = synth_layer(E=5, K=2, impl=impl, shared=shared, gated=gated)
    x = torch.randn(2, 6, 16, generator=g)
    got = check_oracle(layer, x, f"shared gated={gated}")
    no_shared = synth_layer(E=5, K=2, impl=impl, gated=False)
    routed = no_shared(x)
    s = shared(x)
    if gated:
        s = torch.sigmoid(x @ layer.shared_gate_weight.T) * s
    assert_close(got, routed + s, **TOL, what="routed + shared once")


@pytest.mark.parametrize("impl", IMPLS)
def test_weight_on_input_oracle(impl):
    layer = synth_layer(E=4, K=2, impl=impl, layout="matmul", weight_on_input=True, seed=8)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(8))
    got = check_oracle(layer, x, "weight_on_input")
    # Differs from weighting the output (silu is not linear): the test can tell the two apart.
    out_weighted = MoEConfig(hidden_size=16, intermediate_size=8, activation="silu", layout="matmul",
                             router=layer.config.router.replace(weight_on_input=False))
    other = run_experts(x, layer.last_routing, layer.expert_weights, out_weighted, get_impl(impl))
    assert (got - other).abs().max() > 1e-3


# ------------------------------------------------------------------ dispatch / combine units


def test_local_dispatch_is_stable_and_skips_zero_experts():
    ids = torch.tensor([[2, 0], [0, 5], [2, 1], [4, 0]], dtype=torch.int32)  # E=4, Z=2: 4, 5 are zero
    d = local_dispatch(ids, 4, num_zero_experts=2)
    assert d.order_N.tolist() == [1, 2, 7, 5, 0, 4]  # expert 0: pairs 1,2,7; 1: 5; 2: 0,4
    assert d.expert_N.tolist() == [0, 0, 0, 1, 2, 2]
    assert d.token_N.tolist() == [0, 1, 3, 2, 0, 2]
    assert d.counts_E.tolist() == [3, 1, 2, 0]
    assert d.zero_TK.tolist() == [[False, False], [False, True], [False, False], [True, False]]
    d0 = local_dispatch(ids.clamp(max=3), 4)
    assert d0.zero_TK is None and d0.num_rows == 8
    with pytest.raises(ValueError, match="ids_TK: id 6 outside"):
        local_dispatch(torch.tensor([[6, 0]]), 4, num_zero_experts=2)
    with pytest.raises(ValueError, match="ids_TK: id 4 outside"):
        local_dispatch(torch.tensor([[4, 0]]), 4)
    with pytest.raises(TypeError, match="ids_TK: dtype"):
        local_dispatch(torch.zeros(2, 2), 4)


def test_combine_slot_order_and_zero_slots():
    T, K, H = 3, 3, 5
    g = torch.Generator().manual_seed(0)
    y = torch.randn(T, K, H, generator=g)
    x = torch.randn(T, H, generator=g)
    w = torch.rand(T, K, generator=g)
    zero = torch.tensor([[False, True, False], [False, False, False], [True, True, True]])
    y[zero] = float("nan")  # whatever sits at a zero slot must not leak
    out = combine_TH(y, w, x_TH=x, zero_TK=zero)
    want = torch.zeros(T, H)
    for k in range(K):  # slot order
        want = want + w[:, k : k + 1] * torch.where(zero[:, k : k + 1], x, y[:, k])
    assert_bitwise_equal(out, want, what="combine in slot order")
    woi = combine_TH(y, w, x_TH=x, zero_TK=zero, weight_on_input=True)
    want = torch.zeros(T, H)
    for k in range(K):
        want = want + torch.where(zero[:, k : k + 1], w[:, k : k + 1] * x, y[:, k])
    assert_bitwise_equal(woi, want, what="weight_on_input combine")
    with pytest.raises(ValueError, match="x_TH: None"):
        combine_TH(y, w, zero_TK=zero)
    with pytest.raises(ValueError, match="weights_TK: shape"):
        combine_TH(y, w[:, :2])


def test_dispatch_roundtrip():
    ids = torch.randint(0, 5, (7, 2), generator=torch.Generator().manual_seed(1))
    x = torch.randn(7, 4)
    d = local_dispatch(ids, 5)
    x_NH = dispatch_rows(x, d)
    back = unpermute_TKH(x_NH, d)
    assert_bitwise_equal(back, x.unsqueeze(1).expand(7, 2, 4).contiguous(), what="gather then unpermute")


class _FusedImpl:
    name = "fused"

    def __init__(self):
        self.calls = 0

    def supports(self, config):
        return True, ""

    def forward_pairs(self, x_NH, expert_N, w, config):
        return torch.zeros_like(x_NH)

    def forward_tokens(self, x_TH, ids_TK, weights_TK, w, config):
        self.calls += 1
        return torch.full_like(x_TH, 7.0)


def test_forward_tokens_used_without_zero_experts():
    layer = synth_layer(E=4, K=2)
    x = torch.randn(5, 16)
    r = layer.route(x)
    fused = _FusedImpl()
    out = run_experts(x, r, layer.expert_weights, layer.config, fused)
    assert fused.calls == 1 and torch.all(out == 7.0)
    zl = synth_layer(E=4, K=2, Z=2, seed=11)
    rz = zl.route(x)
    out = run_experts(x, rz, zl.expert_weights, zl.config, fused)
    assert fused.calls == 1, "forward_tokens must not run when zero experts are possible"
    assert out.shape == (5, 16)


# ------------------------------------------------------------------ storage and errors


def test_to_dtype_keeps_shared_parameters():
    layer = synth_layer(E=4, K=2)
    gu = nn.Parameter(layer.expert_weights.gate_up.detach().clone())
    dn = nn.Parameter(layer.expert_weights.down.detach().clone())
    rw = nn.Parameter(layer.router_weight.detach().clone())
    m = MoELayer(layer.config, router_weight_EH=rw, experts=ExpertWeights(gu, dn))
    assert {id(p) for p in m.parameters()} == {id(gu), id(dn), id(rw)}
    m.to(torch.bfloat16)  # (the CPU stand-in for a device move)
    assert m.source.gate_up is gu and m.expert_weights.gate_up is gu and gu.dtype == torch.bfloat16 and m.expert_weights.dtype == torch.bfloat16
    x = torch.randn(6, 16)
    got = check_oracle(m, x.bfloat16(), "after .to(bfloat16)", **BF16_TOL)
    assert got.dtype == torch.bfloat16


def test_constructor_errors_name_the_field():
    base = synth_layer(E=4, K=2)
    cfg, w = base.config, base.expert_weights
    rw = base.router_weight
    with pytest.raises(ValueError, match=r"router_weight_EH: shape \(4, 15\), expected \(4, 16\)"):
        MoELayer(cfg, router_weight_EH=torch.randn(4, 15), experts=w)
    with pytest.raises(ValueError, match="experts: 3 experts"):
        MoELayer(cfg, router_weight_EH=rw, experts=w.subset(range(3)))
    with pytest.raises(ValueError, match="selection_bias_E: given, but config.router.use_bias"):
        MoELayer(cfg, router_weight_EH=rw, experts=w, selection_bias_E=torch.zeros(4))
    biased = MoEConfig(hidden_size=16, intermediate_size=8, activation="silu",
                       router=cfg.router.replace(use_bias=True, score_fn="sigmoid"))
    with pytest.raises(ValueError, match="selection_bias_E: None, but config.router.use_bias"):
        MoELayer(biased, router_weight_EH=rw, experts=w)
    with pytest.raises(ValueError, match=r"selection_bias_E: shape \(3,\)"):
        MoELayer(biased, router_weight_EH=rw, experts=w, selection_bias_E=torch.zeros(3))
    gated = MoEConfig(hidden_size=16, intermediate_size=8, activation="silu", router=cfg.router, shared_gated=True)
    with pytest.raises(ValueError, match="shared_expert: None"):
        MoELayer(gated, router_weight_EH=rw, experts=w, shared_gate_weight_1H=torch.zeros(1, 16))
    with pytest.raises(ValueError, match="ExpertWeights.layout='linear' disagrees with MoEConfig.layout='matmul'"):
        MoELayer(MoEConfig(hidden_size=16, intermediate_size=8, activation="silu", router=cfg.router,
                           layout="matmul"), router_weight_EH=rw, experts=w)
    with pytest.raises(ValueError, match="experts impl 'fast': unknown"):
        MoELayer(cfg, router_weight_EH=rw, experts=w, experts_impl="fast")
    with pytest.raises(TypeError, match="experts: expected ExpertWeights"):
        MoELayer(cfg, router_weight_EH=rw, experts=(w.gate_up, w.down))


def test_forward_errors_name_the_field():
    layer = synth_layer(E=4, K=2)
    with pytest.raises(ValueError, match=r"x: shape \(3, 15\).*hidden_size=16"):
        layer(torch.randn(3, 15))
    with pytest.raises(TypeError, match="x: dtype torch.float64"):
        layer(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="x: shape"):
        layer(torch.randn(16))
    with pytest.raises(ValueError, match="router_input: shape"):
        layer(torch.randn(3, 16), router_input=torch.randn(4, 16))
    with pytest.raises(ValueError, match="NaN logit in token row 1 of layer 0"):
        x = torch.randn(3, 16)
        x[1, 0] = float("nan")
        layer(x)


def test_hash_layer_needs_input_ids():
    spec = RouterSpec(score_fn="sqrtsoftplus", num_experts=4, top_k=2, renorm=True, hash_routing=True)
    cfg = MoEConfig(hidden_size=16, intermediate_size=8, router=spec, activation="silu")
    base = synth_layer(E=4, K=2)
    table = torch.tensor([[0, 1], [2, 3], [3, 0]])
    layer = MoELayer(cfg, router_weight_EH=base.router_weight, experts=base.expert_weights, hash_table_VK=table)
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="hash_table/input_ids"):
        layer(x)
    with pytest.raises(ValueError, match="input_ids: 3 ids, expected one per token"):
        layer(x, input_ids=torch.tensor([0, 1, 2]))
    ids_in = torch.tensor([2, 0, 1, 2])
    layer(x, input_ids=ids_in)
    assert layer.last_routing.ids_TK.tolist() == [[3, 0], [0, 1], [2, 3], [3, 0]]
    with pytest.raises(ValueError, match="hash_table_VK: None"):
        MoELayer(cfg, router_weight_EH=base.router_weight, experts=base.expert_weights)
