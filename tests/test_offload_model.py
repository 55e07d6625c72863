"""Offloaded models give the resident model's outputs bit for bit, for every policy and family (CPU).

Legend: L layers, H hidden, I intermediate per expert, E routed experts, Z zero
experts, K picks per token, S slots, T tokens.

The model is a residual stack x <- x + moe_l(x) of MoELayers; the offloaded copy
serves its experts from an ExpertStore through S slots (S < L*E, so experts are
evicted and copied back constantly).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from moeflow.config import ExpertWeights, MoEConfig
from moeflow.experts.activations import apply_activation
from moeflow.experts.base import check_pairs, down_as_KN, gate_up_one
from moeflow.experts.reference import ReferenceExperts
from moeflow.layer import MoELayer
from moeflow.offload.attach import attach_offload
from moeflow.offload.config import OffloadConfig
from moeflow.routing.spec import RouterSpec
from moeflow.testing import assert_bitwise_equal

L, H, I, E = 4, 32, 16, 8


class _MLP(nn.Module):
    def __init__(self, g: torch.Generator):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(24, H, generator=g) * 0.1)
        self.w2 = nn.Parameter(torch.randn(H, 24, generator=g) * 0.1)

    def forward(self, x):
        return torch.relu(x @ self.w1.T) @ self.w2.T


def _layer(family: str, idx: int, g: torch.Generator) -> MoELayer:
    def p(*shape, scale=0.2):
        return nn.Parameter(torch.randn(*shape, generator=g) * scale)

    kw: dict = {}
    Z = 0
    if family == "mixtral":
        spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=2, renorm=True)
        cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu")
    elif family == "deepseek":
        spec = RouterSpec(score_fn="sigmoid", num_experts=E, top_k=3, renorm=True, renorm_eps=1e-20,
                          scaling_factor=2.5, n_group=4, topk_group=2, use_bias=True)
        cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu")
        kw = dict(selection_bias_E=p(E, scale=0.05), shared_expert=_MLP(g))
    elif family == "gpt_oss":
        spec = RouterSpec(score_fn="topk_softmax", num_experts=E, top_k=2)
        cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="gptoss", swiglu_limit=7.0,
                        layout="matmul", interleaved=True, expert_bias=True)
        kw = dict(router_bias_E=p(E, scale=0.1))
    elif family == "longcat":
        Z = 2
        spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=2, num_zero_experts=Z)
        cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu")
    elif family == "llama4":
        spec = RouterSpec(score_fn="topk_sigmoid", num_experts=E, top_k=1, weight_on_input=True)
        cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu")
        kw = dict(shared_expert=_MLP(g))
    else:
        raise AssertionError(family)
    if cfg.layout == "linear":
        w = ExpertWeights(p(E, 2 * I, H), p(E, H, I))
    else:
        w = ExpertWeights(p(E, H, 2 * I), p(E, I, H), p(E, 2 * I, scale=0.05), p(E, H, scale=0.05),
                          layout="matmul", interleaved=True)
    return MoELayer(cfg, router_weight_EH=p(E + Z, H, scale=1.0), experts=w, layer_idx=idx, **kw)


def _model(family: str, seed: int = 0) -> nn.ModuleList:
    g = torch.Generator().manual_seed(seed)
    return nn.ModuleList([_layer(family, i, g) for i in range(L)])


def _run(layers, x):
    for m in layers:
        x = x + m(x)
    return x


def _inputs(seed: int, n_decode: int = 10, n_prefill: int = 9):
    """A decode-like sequence (correlated consecutive tokens: real reuse) and one prefill batch."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, H, generator=g)
    seq = []
    for _ in range(n_decode):
        x = 0.8 * x + 0.6 * torch.randn(1, H, generator=g)
        seq.append(x.clone())
    return seq, torch.randn(n_prefill, H, generator=g)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


FAMILIES = ["mixtral", "deepseek", "gpt_oss", "longcat", "llama4"]


class ShapeSensitiveExperts(ReferenceExperts):
    """Reference experts whose down projection blocks its reduction by the call's row count N.

    What a BLAS does for a batch of GEMMs, or a tiled kernel with tiles chosen by the step's
    shape: the bits of a row depend on how many rows the call has, not on the row alone. The
    resident layer makes one call of all N rows; an offloaded step gives its bits only if its
    calls have the same rows (each expert on all its rows, in order, in a call of N rows).
    `calls` records (N, experts held) of every call.
    """

    name = "shape_sensitive"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def forward_pairs(self, x_NH, expert_N, w, config):
        check_pairs(x_NH, expert_N, w, config)
        N = int(x_NH.shape[0])
        self.calls.append((N, w.num_experts))
        y_NH = torch.empty_like(x_NH)
        down = down_as_KN(w)  # [E, I, H]
        blocks = 1 + N % 4  # the reduction over I in this many blocks, summed in order
        for e in sorted({int(i) for i in expert_N.tolist()}):
            rows = (expert_N == e).nonzero().squeeze(1)
            act = apply_activation(gate_up_one(x_NH.index_select(0, rows), w, e), config)
            y = None
            for part in torch.tensor_split(torch.arange(act.shape[1]), blocks):
                p = act[:, part] @ down[e][part]
                y = p if y is None else y + p
            if w.down_bias is not None:
                y = y + w.down_bias[e]
            y_NH.index_copy_(0, rows, y)
        return y_NH


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["lru", "random_oldest", "predictive"])
@pytest.mark.parametrize("prefetch", [0, 3])
def test_offloaded_output_is_bitwise_resident(family, policy, prefetch):
    ref = _model(family)
    off = copy.deepcopy(ref)
    K = ref[0].config.top_k
    slots = max(K, 4)  # 4 of the 32 experts: constant eviction
    gate_up0 = off[0].expert_weights.gate_up  # the tensor the layer held before offloading
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=slots, policy=policy, prefetch_width=prefetch,
                                                 prefetch_rule="always",
                                                 device="cpu", oldest_fraction=0.5), progress=False)
    seq, prefill = _inputs(1)
    for x in seq:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} decode")
    # 9 tokens x K picks touch more distinct experts than 4 slots: the chunked path
    assert_bitwise_equal(_run(off, prefill), _run(ref, prefill), what=f"{family} prefill")
    distinct = [len({int(e) for e in m.last_routing.ids_TK.flatten() if e < E}) for m in ref]
    assert max(distinct) > slots, f"the prefill should need more experts than slots: {distinct}"
    for a, b in zip(off, ref):
        assert torch.equal(a.last_routing.ids_TK, b.last_routing.ids_TK), "last_routing keeps expert ids"
    s = rt.stats()
    rt.cache.table.check_invariants()
    assert s.misses > 0 and s.evictions > 0
    if prefetch:
        assert s.prefetch_issued > 0
    else:
        assert s.prefetch_issued == 0
    assert s.bytes_copied == (s.misses + s.prefetch_issued) * rt.store.expert_bytes
    assert gate_up0.numel() == 0, "the layer's expert storage was released to the store"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("slots", [1, 2, 4])
def test_chunked_steps_run_the_resident_call_shape(family, slots):
    # More distinct experts in a step than slots: the experts run in groups, and every call has
    # the step's N rows (the resident call's shape), so an impl whose bits follow the call's
    # shape gives the resident bits. slots=1 (K=1 only) has no spare slot in the pool.
    ref = _model(family)
    K = ref[0].config.top_k
    if slots < K:
        pytest.skip(f"K={K} > {slots} slots")
    impl_ref, impl_off = ShapeSensitiveExperts(), ShapeSensitiveExperts()
    off = copy.deepcopy(ref)
    for a, b in zip(ref, off):
        a.experts_impl, b.experts_impl = impl_ref, impl_off
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=slots, device="cpu"), progress=False)
    seq, prefill = _inputs(4, n_decode=3, n_prefill=7)
    for x in [*seq, prefill]:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} {slots} slots, T={x.shape[0]}")
    assert {n for n, _ in impl_off.calls} == {n for n, _ in impl_ref.calls}, "each call has the resident N"
    assert rt.stats().misses > 0


def test_large_cache_hits_after_warmup_and_releases_nothing_with_release_false():
    ref = _model("mixtral", seed=3)
    off = copy.deepcopy(ref)
    gate_up0 = off[0].expert_weights.gate_up
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=L * E, device="cpu"), release=False, progress=False)
    assert gate_up0.numel() == E * 2 * I * H
    seq, _ = _inputs(2, n_decode=30)
    for x in seq:
        assert_bitwise_equal(_run(off, x), _run(ref, x))
    s = rt.stats()
    assert s.evictions == 0 and s.misses <= L * E and s.hits + s.misses == 30 * L * 2


def test_prefetch_hits_a_predictable_next_layer():
    # Every layer has the same router, and the residual update is tiny: layer l+1 routes
    # (almost) as its router predicts from layer l's input, so prefetched experts get used.
    g = torch.Generator().manual_seed(5)
    layers = _model("mixtral", seed=5)
    for m in layers:
        m.router_weight.copy_(layers[0].router_weight)
        m.expert_weights.down.mul_(1e-3)
    ref = copy.deepcopy(layers)
    rt = attach_offload(list(layers), OffloadConfig(gpu_slots=4, policy="predictive", prefetch_width=2,
                                                    prefetch_rule="always",
                                                    device="cpu"), progress=False)
    for _ in range(12):
        x = torch.randn(1, H, generator=g)
        assert_bitwise_equal(_run(layers, x), _run(ref, x))
    s = rt.stats()
    assert s.prefetch_used >= 0.8 * s.prefetch_issued > 0
    assert s.prefetch_precision > 0.8


def test_attach_errors():
    m = _model("deepseek")  # K = 3
    with pytest.raises(ValueError, match="OffloadConfig.gpu_slots=2: fewer slots than the K=3"):
        attach_offload(list(m), OffloadConfig(gpu_slots=2, device="cpu"), progress=False)
    with pytest.raises(ValueError, match="OffloadConfig.prefetch_width=9"):
        attach_offload(list(m), OffloadConfig(gpu_slots=4, prefetch_width=9, device="cpu"), progress=False)
    with pytest.raises(TypeError, match="OffloadConfig"):
        attach_offload(list(m), {"gpu_slots": 4})
    attach_offload(list(m), OffloadConfig(gpu_slots=4, device="cpu"), progress=False)
    with pytest.raises(ValueError, match="already offloaded"):
        attach_offload(list(m), OffloadConfig(gpu_slots=4, device="cpu"), progress=False)
    meta = _model("mixtral")
    attach_offload(list(meta), OffloadConfig(gpu_slots=4, device="meta"), progress=False)
    with pytest.raises(ValueError, match="expected the offload cache's device meta"):
        meta[0](torch.randn(1, H))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["mixtral", "deepseek", "gpt_oss", "longcat"])
@pytest.mark.parametrize("policy, prefetch", [("lru", 0), ("random_oldest", 3), ("predictive", 3)])
def test_offloaded_cuda_is_bitwise_resident_cuda(family, policy, prefetch):
    # Copies on the side stream, per-slot events, pinned host store: the same bits as the
    # resident model on the same GPU, decode and a chunked prefill.
    ref = _model(family).to("cuda", torch.bfloat16)
    off = copy.deepcopy(ref)
    slots = max(ref[0].config.top_k, 4)
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=slots, policy=policy, prefetch_width=prefetch,
                                                 prefetch_rule="always",
                                                 device="cuda", oldest_fraction=0.5), progress=False)
    assert rt.store.pinned and rt.cache.device.type == "cuda"
    seq, prefill = _inputs(1)
    for x in seq:
        x = x.to("cuda", torch.bfloat16)
        assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} cuda decode")
    p = prefill.to("cuda", torch.bfloat16)
    assert_bitwise_equal(_run(off, p), _run(ref, p), what=f"{family} cuda prefill")
    torch.cuda.synchronize()
    s = rt.stats()
    rt.cache.table.check_invariants()
    assert s.misses > 0 and s.wait_s >= 0.0
    assert (s.prefetch_issued > 0) == (prefetch > 0)


TINY = __import__("pathlib").Path(__file__).resolve().parents[1] / "moeflow" / "assets" / "tiny-moe"


@pytest.mark.parametrize("store", ["pinned", "mmap"])
def test_patch_model_offload_on_the_tiny_checkpoint_is_bitwise_resident(store):
    """The embedded trained model: patch_model(offload=...) logits and greedy text equal the resident ones."""
    from transformers import AutoModelForCausalLM

    from moeflow.hf import patch_model

    res = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    off = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    patch_model(res)
    cfg = OffloadConfig(gpu_slots=5, policy="predictive", prefetch_width=2,
                        prefetch_rule="always", device="cpu", store=store,
                        checkpoint=str(TINY))
    report = patch_model(off, offload=cfg)
    assert report.offload
    rt = off.model.layers[0].mlp.moe_layer.offload
    assert rt.store.mode == store and rt.cache.num_slots == 5
    ids = (torch.tensor(list(b"import os\nimport sys\n\n\ndef main(argv):\n")) + 3).unsqueeze(0)
    assert_bitwise_equal(off(ids).logits, res(ids).logits, what="tiny prefill logits")
    g_res = res.generate(ids, max_new_tokens=12, do_sample=False)
    g_off = off.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(g_off, g_res)
    s = rt.stats()
    assert s.misses > 0 and s.prefetch_issued > 0 and s.hits + s.misses > 12 * 4
    assert off.model.layers[0].mlp.experts.gate_up_proj.numel() == 0, "the HF experts' storage was released"


@pytest.mark.parametrize("cpu_experts", ["off", "always"])
def test_tiny_checkpoint_small_cache_is_bitwise_resident_at_the_default_thread_count(cpu_experts):
    """The embedded model with 3 slots (fewer than a 6-token step's experts: chunked groups) and with
    every miss run on the CPU, at torch's default thread count: the resident logits, bit for bit."""
    from transformers import AutoModelForCausalLM

    from moeflow.hf import patch_model

    res = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    off = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    patch_model(res)
    patch_model(off, offload=OffloadConfig(gpu_slots=3, device="cpu", cpu_experts=cpu_experts))
    rt = off.model.layers[0].mlp.moe_layer.offload
    text = b"class Queue:\n    def __init__(self, items):\n        self.items = list(items)\n"
    for n in (1, 6, 8, 19, 31, 64):
        ids = (torch.tensor(list(text[:n])) + 3).unsqueeze(0)
        assert_bitwise_equal(off(ids).logits, res(ids).logits, what=f"{n} tokens, cpu_experts={cpu_experts!r}")
    assert (rt.cpu_stats().cpu_experts > 0) == (cpu_experts == "always")


@pytest.mark.parametrize("key, layer, expert, tensor", [
    ("model.layers.2.block_sparse_moe.experts.5.w3.weight", 2, 5, "gate_up"),  # the up half
    ("model.layers.0.block_sparse_moe.experts.0.w2.weight", 0, 0, "down"),
])
def test_mmap_store_refuses_a_checkpoint_that_is_not_the_models(tmp_path, key, layer, expert, tensor):
    """Same shapes, one expert's weights x1.5 in the file: refused at attach, naming layer and expert; the
    refused call leaves the model as it was (it then offloads from its own checkpoint, bit for bit)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from moeflow.hf import patch_model
    from moeflow.offload.store import ExpertMismatchError

    other = tmp_path / "other"
    shutil.copytree(TINY, other)
    sd = load_file(str(other / "model.safetensors"))
    sd[key] = sd[key] * 1.5
    save_file(sd, str(other / "model.safetensors"), metadata={"format": "pt"})
    res = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    off = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    patch_model(res)
    cfg = dict(gpu_slots=4, device="cpu", store="mmap")
    with pytest.raises(ExpertMismatchError, match=rf"layer {layer} .*expert {expert}: {tensor} row") as err:
        patch_model(off, offload=OffloadConfig(**cfg, checkpoint=str(other)))
    assert (err.value.layer, err.value.expert, err.value.tensor) == (layer, expert, tensor)
    assert off.model.layers[0].mlp.experts.gate_up_proj.numel() > 0, "nothing was released"
    patch_model(off, offload=OffloadConfig(**cfg, checkpoint=str(TINY)))
    ids = (torch.tensor(list(b"def f(x):\n    return x\n")) + 3).unsqueeze(0)
    assert_bitwise_equal(off(ids).logits, res(ids).logits, what="own checkpoint")


def _tiny_state_dict_x15():
    """The embedded model's state_dict with every expert tensor x1.5, and a resident model patched on it."""
    from transformers import AutoModelForCausalLM

    from moeflow.hf import patch_model

    sd = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).state_dict()
    sd = {k: v * 1.5 if ".experts." in k else v.clone() for k, v in sd.items()}
    ref = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    ref.load_state_dict(sd)
    patch_model(ref)
    return sd, ref


@pytest.mark.parametrize("store", ["pinned", "model"])
@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_on_an_offloaded_model_writes_the_host_store(store, assign):
    """load_state_dict reaches offloaded experts through the host store (their Parameters were released, or
    are the store itself), and the experts already cached are copied again: the new weights' resident bits."""
    from transformers import AutoModelForCausalLM

    from moeflow.hf import patch_model

    sd, ref = _tiny_state_dict_x15()
    off = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    patch_model(off, offload=OffloadConfig(gpu_slots=32, device="cpu", store=store))  # every expert stays cached
    ids = (torch.tensor(list(b"import os\nimport sys\n")) + 3).unsqueeze(0)
    off(ids)  # the cache holds the old experts
    off.load_state_dict(sd, assign=assign)
    assert_bitwise_equal(off(ids).logits, ref(ids).logits, what=f"store={store} assign={assign}")
    if store == "pinned":
        assert off.model.layers[0].mlp.experts.gate_up_proj.numel() == 0, "still released"


@pytest.mark.parametrize("kw, match", [
    (dict(store="mmap", checkpoint=str(TINY)), "store mode 'mmap'"),
    (dict(store="pinned", sync_free=True), "sync_free=True"),
])
def test_load_state_dict_refuses_what_the_store_cannot_take_before_loading_anything(kw, match):
    from transformers import AutoModelForCausalLM

    from moeflow.hf import patch_model
    from moeflow.offload.attach import OffloadedExpertsError

    sd, _ = _tiny_state_dict_x15()
    for k in ("model.embed_tokens.weight", "lm_head.weight"):  # tied
        if k in sd:
            sd[k] = sd[k] + 1.0
    off = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    patch_model(off, offload=OffloadConfig(gpu_slots=8, device="cpu", **kw))
    before = off.model.embed_tokens.weight.clone()
    with pytest.raises(OffloadedExpertsError, match=rf"model.layers.0.mlp.experts.gate_up_proj.*{match}"):
        off.load_state_dict(sd)
    assert torch.equal(off.model.embed_tokens.weight, before), "refused before torch loaded anything"
    # without the expert tensors the rest loads
    off.load_state_dict({k: v for k, v in sd.items() if ".experts." not in k}, strict=False)
    assert torch.equal(off.model.embed_tokens.weight, sd["model.embed_tokens.weight"])


def test_load_state_dict_refuses_an_expert_tensor_of_another_shape():
    from transformers import AutoModelForCausalLM

    from moeflow.hf import patch_model
    from moeflow.offload.attach import OffloadedExpertsError

    sd, _ = _tiny_state_dict_x15()
    key = "model.layers.1.mlp.experts.down_proj"
    sd[key] = sd[key][:, :, :-1]
    off = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).eval()
    patch_model(off, offload=OffloadConfig(gpu_slots=4, device="cpu"))
    with pytest.raises(OffloadedExpertsError, match=rf"{key}: shape \(8, 128, 255\), expected \(8, 128, 256\)"):
        off.load_state_dict(sd)
