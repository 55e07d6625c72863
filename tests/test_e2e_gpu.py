"""A patched transformers model as a whole on the GPU: no host sync per layer, NaN still loud,
batch-invariant blocks with shared experts, CUDA-graph decode.

Everything here needs CUDA and Triton (`-m gpu`); without them the module is skipped.

Legend: B batch, S sequence, T tokens, H hidden, E routed experts, K picks, Is shared width.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from moeflow.testing import assert_bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                       reason="needs CUDA and Triton"),
]

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _sync_calls(fn) -> tuple[int, list[str]]:
    """Synchronising CUDA runtime calls made by fn() (torch profiler CPU events)."""
    from torch.profiler import ProfilerActivity, profile

    def count(f) -> list[str]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            f()
        return [e.name for e in prof.events() if any(e.name.startswith(s) for s in SYNC_EVENTS)
                and not e.name.startswith("cudaMemcpyAsync")]

    # The profiler itself synchronises when it stops: what an empty call records is not fn's.
    base = len(count(lambda: None))
    names = count(fn)
    return len(names) - base, names


def _tiny(family: str, **kw):
    from hf_configs import tiny_model

    return tiny_model(family, **kw).to("cuda", torch.bfloat16)


# ----------------------------------------------------------------------------- no host sync


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_patched_forward_makes_no_sync_per_layer(family, hf_quiet):
    import moeflow

    model = _tiny(family)
    ids = torch.randint(3, 97, (2, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        base, base_names = _sync_calls(lambda: model(ids))
        moeflow.patch_model(model, experts="triton")
        model(ids)  # warm-up: tile configs, kernel compiles
        model(ids)  # the second sighting of T is captured (layer graphs; torch.cuda.graph syncs once)
        got, names = _sync_calls(lambda: model(ids))
    # moeflow adds none: whatever syncs remain are HF's own (its unpatched count is the bound)
    assert got <= base, f"patched forward: {got} syncs {names} vs unpatched {base} {base_names}"
    # and the forward did replay (else this would only restate the eager test below)
    assert moeflow.moe_layers(model)[0].graphs.replays > 0
    moeflow.hf.disable_layer_graphs(model)
    with torch.no_grad():
        got, names = _sync_calls(lambda: model(ids))
    assert got <= base, f"patched eager forward: {got} syncs {names} vs unpatched {base} {base_names}"


def test_moelayer_step_is_sync_free_when_deferred():
    from moeflow.config import ExpertWeights, MoEConfig
    from moeflow.layer import MoELayer
    from moeflow.routing.monitor import RoutingMonitor
    from moeflow.routing.spec import RouterSpec

    g = torch.Generator().manual_seed(0)
    E, K, H, I = 16, 4, 256, 128
    spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=K, renorm=True)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu")
    w = ExpertWeights((torch.randn(E, 2 * I, H, generator=g) * 0.05).cuda().bfloat16(),
                      (torch.randn(E, H, I, generator=g) * 0.05).cuda().bfloat16())
    layer = MoELayer(cfg, router_weight_EH=torch.randn(E, H, generator=g).cuda().bfloat16(), experts=w,
                     experts_impl="triton")
    layer.check_routing, layer.routing_monitor = "deferred", RoutingMonitor()
    x = torch.randn(64, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(x)  # warm-up: kernel compiles, and the monitor's one pinned flag (allocated once)
        layer.routing_monitor.end_forward()
        n, names = _sync_calls(lambda: (layer.routing_monitor.poll(), layer(x), layer.routing_monitor.end_forward()))
    assert n == 0, f"a deferred MoELayer step synchronised: {names}"
    layer.routing_monitor.check(wait=True)  # nothing failed


def test_nan_is_still_named_after_a_deferred_forward(hf_quiet):
    import moeflow
    from moeflow import hf as mhf

    model = _tiny("mixtral")
    moeflow.patch_model(model, experts="triton")
    with torch.no_grad():
        model.get_input_embeddings().weight[5] = float("nan")
        ids = torch.tensor([[3, 4, 5, 6]], device="cuda")
        model(ids)  # deferred: no raise inside the forward
        with pytest.raises(ValueError, match=r"NaN logit in token row \d+ of layer \d+"):
            mhf.check_routing(model)
        model(ids)
        torch.cuda.synchronize()  # the flag has landed: the next forward raises before it runs
        with pytest.raises(ValueError, match="NaN logit in token row"):
            model(torch.tensor([[3, 4]], device="cuda"))


# ----------------------------------------------------------------------------- batch invariance


class _SwiGLU(nn.Module):
    """An HF-style shared MLP (gate_proj / up_proj / down_proj, no bias)."""

    def __init__(self, H: int, Is: int, limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, Is, bias=False)
        self.up_proj = nn.Linear(H, Is, bias=False)
        self.down_proj = nn.Linear(Is, H, bias=False)
        self.limit = limit

    def forward(self, x):
        g, u = self.gate_proj(x), self.up_proj(x)
        if self.limit is not None:
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return self.down_proj(nn.functional.silu(g) * u)


def _block(kind: str, impl: str):
    """A MoELayer at a real layer shape with a shared expert (random weights, bf16, CUDA)."""
    return _blocks(kind, (impl,))[0]


def _blocks(kind: str, impls: tuple[str, ...]) -> list:
    """One MoELayer per experts impl, all on the same weights (one copy on the GPU): a real layer shape with a
    shared expert (random weights, bf16, CUDA). The routed experts are drawn on the GPU: deepseek-v3's are 11 G
    values, which take minutes and 45 GB of host memory as f32 on the CPU, and two copies (one a layer) run
    the 8-worker GPU suite (tests/gpu_suite.sh) out of memory on an 80 GB card."""
    from moeflow.config import ExpertWeights, MoEConfig
    from moeflow.layer import MoELayer
    from moeflow.routing.spec import RouterSpec

    g = torch.Generator().manual_seed(3)
    g_dev = torch.Generator("cuda").manual_seed(3)
    if kind == "deepseek_v3":
        E, K, H, I, Is = 256, 8, 7168, 2048, 2048
        spec = RouterSpec(score_fn="sigmoid", num_experts=E, top_k=K, renorm=True, renorm_eps=1e-20,
                          scaling_factor=2.5, n_group=8, topk_group=4, group_score="top2_sum", use_bias=True)
        act, limit = "silu", None
    elif kind == "qwen2_moe":
        E, K, H, I, Is = 60, 4, 2048, 1408, 5632
        spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=K)
        act, limit = "silu", None
    else:  # deepseek_v4-like: sqrt-softplus, clamped SwiGLU routed and shared
        E, K, H, I, Is = 64, 6, 4096, 2048, 2048
        spec = RouterSpec(score_fn="sqrtsoftplus", num_experts=E, top_k=K, renorm=True, renorm_eps=1e-20,
                          use_bias=True)
        act, limit = "swiglu_clamp", 10.0
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation=act, swiglu_limit=limit,
                    shared_gated=kind == "qwen2_moe")
    dev = "cuda"
    w = ExpertWeights(torch.randn(E, 2 * I, H, generator=g_dev, device=dev, dtype=torch.bfloat16).mul_(0.02),
                      torch.randn(E, H, I, generator=g_dev, device=dev, dtype=torch.bfloat16).mul_(0.02))
    shared = _SwiGLU(H, Is, limit)
    with torch.no_grad():
        for lin in (shared.gate_proj, shared.up_proj, shared.down_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.02)
    shared = shared.to(dev, torch.bfloat16)
    kw = {}
    if spec.use_bias:
        kw["selection_bias_E"] = (torch.randn(E, generator=g) * 0.1).to(dev)
    if kind == "qwen2_moe":
        kw["shared_gate_weight_1H"] = (torch.randn(1, H, generator=g) * 0.02).to(dev, torch.bfloat16)
    router_EH = (torch.randn(E, H, generator=g) * 0.02).to(dev, torch.bfloat16)
    return [MoELayer(cfg, router_weight_EH=router_EH, experts=w, shared_expert=shared, experts_impl=impl, **kw)
            for impl in impls]


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen2_moe", "deepseek_v4"])
def test_block_with_shared_expert_is_batch_invariant(kind, one_real_size_layer_at_a_time):
    layer = _block(kind, "triton_bi")
    assert layer.shared_runner is not None, "triton_bi must run the shared expert through its kernels"
    H = layer.config.hidden_size
    gen = torch.Generator("cuda").manual_seed(7)
    probes = torch.randn(3, H, device="cuda", generator=gen).bfloat16()
    with torch.no_grad():
        alone = torch.cat([layer(probes[i : i + 1]) for i in range(3)])
        bad = []
        for T in (2, 3, 5, 8, 16, 33, 64, 257, 1000, 4096):
            x = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
            pos = sorted({0, T // 2, T - 1})[: min(3, T)]
            for i, p in enumerate(pos):
                x[p] = probes[i]
            out = layer(x)
            for i, p in enumerate(pos):
                if not torch.equal(out[p], alone[i]):
                    bad.append(f"T={T} pos={p}: max diff {float((out[p].float() - alone[i].float()).abs().max()):.3g}")
    assert not bad, f"{kind}: rows changed with the batch: {bad[:8]}"


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen2_moe"])
def test_batch_invariant_block_matches_the_default_within_bf16(kind, one_real_size_layer_at_a_time):
    bi, fast = _blocks(kind, ("triton_bi", "triton"))
    x = torch.randn(300, bi.config.hidden_size, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        a, b = bi(x.bfloat16()).float(), fast(x.bfloat16()).float()
    rel = float((a - b).norm() / b.norm())
    assert rel < 2e-2, f"{kind}: triton_bi vs triton rel-L2 {rel:.3g}"


# ----------------------------------------------------------------------------- CUDA graphs


@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("batch", [1, 16])
def test_decode_step_captures_in_a_cuda_graph(batch, patched, hf_quiet):
    """moeflow.hf.StaticDecoder (static cache + torch.cuda.graphs): replayed decode gives the eager tokens.

    Unpatched too: the recipe itself must hold before moeflow is judged by it. (A recipe
    that lets the pre-capture warm-up advance the static cache's write counter makes every
    replayed step write its keys one slot late: tokens differ from the second step on at
    batch 16, patched and unpatched alike; moeflow/hf/graphs.py.)
    """
    import moeflow
    from moeflow.hf.graphs import StaticDecoder

    model = _tiny("mixtral")
    # sdpa (transformers' default): its masks are built on the device; the eager path copies a
    # CPU scalar per mask, which CUDA-graph capture refuses.
    model.config._attn_implementation = "sdpa"
    if patched:
        moeflow.patch_model(model, experts="triton")
    P, N = 6, 12
    prompt = torch.randint(3, 97, (batch, P), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    eager, l_eager = StaticDecoder(model, batch_size=batch, max_len=P + N + 2, graph=False).generate(
        prompt, N, return_logits=True)
    dec = StaticDecoder(model, batch_size=batch, max_len=P + N + 2)
    replayed, l_replay = dec.generate(prompt, N, return_logits=True)
    assert dec.captured
    d = (l_replay - l_eager).abs().amax(dim=(1, 2)).tolist()
    assert torch.equal(replayed, eager), (f"graph replay {replayed.tolist()} != eager {eager.tolist()}; per-step "
                                          f"logits max diff {d}")
    assert_bitwise_equal(l_replay, l_eager, what="replayed vs eager decode logits")
    # the graph is reused by a second call with another prompt length
    again = dec.generate(prompt[:, 2:], N)
    want = StaticDecoder(model, batch_size=batch, max_len=P + N + 2, graph=False).generate(prompt[:, 2:], N)
    assert torch.equal(again, want)
