"""moeflow.layer_graphs: MoE layer steps replayed from CUDA graphs cached per token count.

CPU: argument checks, steps that are not eligible stay eager (and equal), the model helpers.
GPU (`-m gpu`): replays equal the eager steps bit for bit (layer with and without a shared
expert, several T, LRU eviction), last_routing and the routing monitor after replays, a patched
model's prefill logits and greedy tokens with graphs equal to without.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moeflow.config import ExpertWeights, MoEConfig
from moeflow.layer import MoELayer
from moeflow.layer_graphs import LayerGraphs
from moeflow.routing.spec import RouterSpec
from moeflow.testing import assert_bitwise_equal

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                               reason="needs CUDA and Triton")


def _layer(device: str, dtype: torch.dtype, *, E=16, K=4, H=256, I=128, shared=False, impl="auto"):
    g = torch.Generator().manual_seed(0)
    spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=K, renorm=True)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu")
    w = ExpertWeights((torch.randn(E, 2 * I, H, generator=g) * 0.05).to(device, dtype),
                      (torch.randn(E, H, I, generator=g) * 0.05).to(device, dtype))
    kw = {}
    if shared:
        mlp = torch.nn.Sequential(torch.nn.Linear(H, 2 * I, bias=False), torch.nn.SiLU(),
                                  torch.nn.Linear(2 * I, H, bias=False))
        with torch.no_grad():
            for lin in (mlp[0], mlp[2]):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.05)
        kw["shared_expert"] = mlp.to(device, dtype)
    return MoELayer(cfg, router_weight_EH=(torch.randn(E, H, generator=g) * 0.1).to(device, dtype), experts=w,
                    experts_impl=impl, **kw)


@pytest.mark.parametrize("kw", [dict(max_shapes=0), dict(max_shapes=True), dict(max_shapes=2.0),
                                dict(capture_after=0), dict(capture_after=None), dict(max_bytes=-1)])
def test_bad_arguments_are_named(kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        LayerGraphs(**kw)


def test_cpu_steps_stay_eager_and_equal():
    layer = _layer("cpu", torch.float32)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = layer(x)
        layer.graphs = graphs = LayerGraphs()
        for _ in range(3):
            assert_bitwise_equal(layer(x), want, what="CPU step with graphs set")
    assert (graphs.captures, graphs.replays, graphs.eager) == (0, 0, 0)


def test_model_helpers(hf_quiet):
    from hf_configs import tiny_model

    import moeflow

    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match="no patched MoE layer"):
        moeflow.enable_layer_graphs(model)
    moeflow.patch_model(model, experts="reference")
    graphs = moeflow.enable_layer_graphs(model, max_shapes=3)
    layers = moeflow.moe_layers(model)
    assert layers and all(layer.graphs is graphs for layer in layers)
    from moeflow.hf import disable_layer_graphs

    disable_layer_graphs(model)
    assert all(layer.graphs is None for layer in layers)


def test_patch_model_layer_graphs_option(hf_quiet):
    from hf_configs import tiny_model

    import moeflow

    model = tiny_model("qwen3_moe")
    moeflow.patch_model(model, experts="reference")  # on by default
    layers = moeflow.moe_layers(model)
    assert layers and all(isinstance(layer.graphs, LayerGraphs) for layer in layers)
    assert len({id(layer.graphs) for layer in layers}) == 1  # one pool per model
    # reference experts sync on the host: never captured, the step stays eager (and equal)
    assert not LayerGraphs.eligible(layers[0], torch.zeros(2, layers[0].config.hidden_size), None, None)
    moeflow.unpatch_model(model)
    moeflow.patch_model(model, experts="reference", layer_graphs={"max_shapes": 2})
    assert moeflow.moe_layers(model)[0].graphs.max_shapes == 2
    moeflow.unpatch_model(model)
    moeflow.patch_model(model, experts="reference", layer_graphs=False)
    assert all(layer.graphs is None for layer in moeflow.moe_layers(model))
    moeflow.unpatch_model(model)
    with pytest.raises(TypeError, match="layer_graphs"):
        moeflow.patch_model(model, layer_graphs="yes")
    with pytest.raises(ValueError, match="max_shapes"):
        moeflow.patch_model(model, layer_graphs={"max_shapes": 0})
    with pytest.raises(TypeError, match="unexpected keyword"):
        moeflow.patch_model(model, layer_graphs={"max_shape": 2})
    assert not moeflow.moe_layers(model)  # refused before the model was touched


# ----------------------------------------------------------------------------- GPU


def _steps(layer, xs):
    with torch.no_grad():
        return [(layer(x).clone(), layer.last_routing.ids_TK.clone()) for x in xs]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shared", [False, True])
def test_gpu_replays_equal_eager_steps(shared):
    layer = _layer("cuda", torch.bfloat16, E=64, K=8, H=512, I=256, shared=shared, impl="triton")
    g = torch.Generator(device="cuda").manual_seed(2)
    Ts = (1, 7, 64, 300, 2048)
    # three steps per T with different inputs: eager, capture + replay, replay
    xs = [torch.randn(T, 512, device="cuda", dtype=torch.bfloat16, generator=g) for T in Ts for _ in range(3)]
    want = _steps(layer, xs)
    layer.graphs = graphs = LayerGraphs(max_shapes=8)
    got = _steps(layer, xs)
    for i, ((o, ids), (wo, wids)) in enumerate(zip(got, want)):
        assert_bitwise_equal(o, wo, what=f"step {i} (T={xs[i].shape[0]}) output, graphs vs eager")
        assert torch.equal(ids, wids), f"step {i}: last_routing ids differ"
    assert (graphs.captures, graphs.replays, graphs.eager) == (len(Ts), 2 * len(Ts), len(Ts))
    assert graphs.refused(layer) == {}


@pytest.mark.gpu
@needs_gpu
def test_gpu_lru_eviction_keeps_results():
    layer = _layer("cuda", torch.bfloat16, impl="triton")
    g = torch.Generator(device="cuda").manual_seed(3)
    order = [5, 5, 6, 6, 7, 7, 5, 5, 6, 7, 5]
    xs = [torch.randn(T, 256, device="cuda", dtype=torch.bfloat16, generator=g) for T in order]
    want = _steps(layer, xs)
    layer.graphs = graphs = LayerGraphs(max_shapes=2)
    got = _steps(layer, xs)
    for i, ((o, _), (wo, _)) in enumerate(zip(got, want)):
        assert_bitwise_equal(o, wo, what=f"step {i} (T={order[i]})")
    assert graphs.captures > 3, "T=5 was evicted by 6 and 7 and captured again"


@pytest.mark.gpu
@needs_gpu
def test_gpu_memory_budget_refuses_a_capture():
    layer = _layer("cuda", torch.bfloat16, impl="triton")
    x_small = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    x_big = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    layer.graphs = graphs = LayerGraphs(max_bytes=2 * x_small.numel() * 2)  # room for T = 4 only
    with torch.no_grad():
        want = layer(x_big).clone()  # no graph yet: eager
        for _ in range(3):
            layer(x_small)
            assert_bitwise_equal(layer(x_big), want, what="T = 64 step over the budget (eager)")
    assert graphs.captures == 1 and graphs.bytes == 2 * x_small.numel() * 2
    assert "memory budget" in graphs.refused(layer)[64]


@pytest.mark.gpu
@needs_gpu
def test_gpu_inference_mode_and_no_grad_keep_separate_graphs():
    layer = _layer("cuda", torch.bfloat16, impl="triton")
    x = torch.randn(9, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer(x).clone()
    layer.graphs = graphs = LayerGraphs()
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with mode():
            for _ in range(3):
                assert_bitwise_equal(layer(x), want, what=f"step under {mode.__name__}")
    # buffers captured under inference_mode are inference tensors: no_grad steps get their own graph
    assert graphs.captures == 2 and graphs.refused(layer) == {}


@pytest.mark.gpu
@needs_gpu
def test_gpu_nan_still_raises_from_a_replay():
    layer = _layer("cuda", torch.bfloat16, impl="triton")
    layer.graphs = LayerGraphs()
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            layer(x)  # eager, capture, replay: "eager" check_routing passes
        bad = x.clone()
        bad[2] = float("nan")
        with pytest.raises(ValueError, match="NaN logit in token row 2"):
            layer(bad)  # a replay of the captured T = 4 graph


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_gpu_patched_model_with_layer_graphs_equals_without(family, hf_quiet):
    from hf_configs import tiny_model

    import moeflow

    model = tiny_model(family).to("cuda", torch.bfloat16)
    moeflow.patch_model(model, experts="triton", layer_graphs=False)
    gen = torch.Generator(device="cuda").manual_seed(4)
    prompts = [torch.randint(3, 97, (2, S), device="cuda", generator=gen) for S in (16, 16, 16, 33, 33, 33)]
    with torch.no_grad():
        want = [model(p).logits.clone() for p in prompts]
        want_tokens = model.generate(prompts[0][:1], max_new_tokens=8, do_sample=False)
        graphs = moeflow.enable_layer_graphs(model)
        got = [model(p).logits.clone() for p in prompts]
        tokens = model.generate(prompts[0][:1], max_new_tokens=8, do_sample=False)
    for i, (a, b) in enumerate(zip(got, want)):
        assert_bitwise_equal(a, b, what=f"forward {i} logits with layer graphs")
    assert torch.equal(tokens, want_tokens)
    assert graphs.replays > 0 and graphs.captures > 0
    moeflow.hf.check_routing(model)
    # a NaN after replays: the deferred monitor still names it
    with torch.no_grad():
        model.get_input_embeddings().weight[5] = float("nan")
        ids = prompts[0].clone()
        ids[0, 3] = 5
        model(ids)
    with pytest.raises(ValueError, match="NaN logit in token row"):
        moeflow.hf.check_routing(model)
