"""A patched model under torch.compile: one custom op per MoE block, 0 graph breaks, eager's outputs.

Per family (tests/hf_configs.py: fp32, 2 layers, H=32): `torch._dynamo.explain` of the patched
model finds one graph, 0 breaks and one `moeflow::` op call per patched block (gemma4: two,
router and experts); `torch.compile(fullgraph=True, backend="aot_eager")` (dynamo, fake tensors
and functionalization; inductor's codegen is tests/test_compile_generate.py's) gives the eager
patched logits within rtol 1e-5 (atol 1e-5 x max|logit|; max-abs and RMS error printed).
Also: prefill lengths compile twice (the first length static, then one dynamic graph for every
later length), NaN router logits and bad hash ids raise the eager ValueError from the compiled
model, offload runs inside the op, and a step that cannot be replayed from a CUDA graph refuses
a capture with CompiledStepError.

Legend: B batch, S sequence, T tokens, H hidden, E experts.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_configs import available_families, tiny_model

import moeflow
from moeflow import hf as mhf
from moeflow.hf import op as moe_op
from moeflow.testing import assert_close, error_stats

pytestmark = pytest.mark.usefixtures("one_thread", "hf_quiet")

FAMILIES = [f for f in available_families() if f in mhf.available_hf_families()]
RTOL = 1e-5


def _ids(S: int, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 97, (B, S), generator=torch.Generator().manual_seed(seed))


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    max_abs, rms, _ = error_stats(got, want)
    print(f"{what}: max_abs={max_abs:.3e} rms={rms:.3e}")
    assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()), what=what)


def _op_calls(graphs) -> int:
    return sum(1 for g in graphs for n in g.graph.nodes
               if n.op == "call_function" and str(n.target).startswith("moeflow."))


def _recording_backend(inner: str = "aot_eager"):
    """A dynamo backend that keeps every graph it is given and compiles it with `inner`."""
    from torch._dynamo.backends.registry import lookup_backend

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(inner)(gm, example_inputs)

    return backend, graphs


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_family_traces_whole_and_matches_eager(family):
    """fullgraph=True refuses any graph break; the one graph holds one moeflow op per patched module."""
    torch._dynamo.reset()
    model = tiny_model(family, seed=2)
    report = moeflow.patch_model(model, experts="reference")
    ids_BS = _ids(9)
    backend, graphs = _recording_backend()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    with torch.no_grad():
        want = model(ids_BS).logits
        got = compiled(ids_BS).logits
    assert len(graphs) == 1
    per_block = 2 if family == "gemma4" else 1  # gemma4: its router and its experts modules
    assert _op_calls(graphs) == per_block * len(report), graphs[0].code
    _check(got, want, f"{family} compiled logits")
    torch._dynamo.reset()


def test_explain_finds_no_graph_break():
    torch._dynamo.reset()
    model = tiny_model("deepseek_v3", seed=2)
    moeflow.patch_model(model, experts="reference")
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(_ids(9))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()


def test_prefill_lengths_compile_once_after_the_first():
    """17 then every later length: one static graph, then one dynamic graph (dynamo's automatic
    dynamic shapes); the op never specialises T."""
    torch._dynamo.reset()
    model = tiny_model("qwen3_moe", seed=3, max_position_embeddings=512)
    moeflow.patch_model(model, experts="reference")
    backend, graphs = _recording_backend("eager")
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    lengths = (17, 18, 33, 100, 257, 400)
    with torch.no_grad():
        for S in lengths:
            ids = _ids(S, B=1, seed=S)
            _check(compiled(ids).logits, model(ids).logits, f"S={S}")
    assert len(graphs) == 2, f"{len(graphs)} compiles for prefill lengths {lengths}, expected 2"
    torch._dynamo.reset()


def _errors_after(family: str, seed: int, spoil) -> tuple[str, str]:
    """(eager message, compiled message) of the ValueError a patched tiny model raises after
    spoil(model, ids) breaks a weight; compiled while every routing was still valid."""
    torch._dynamo.reset()
    model = tiny_model(family, seed=seed)
    moeflow.patch_model(model, experts="reference")
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    ids = _ids(6)
    with torch.no_grad():
        compiled(ids)
        spoil(model, ids)
        with pytest.raises(ValueError) as eager:
            model(ids)
        with pytest.raises(ValueError) as got:
            compiled(ids)
    torch._dynamo.reset()
    return str(eager.value), str(got.value)


def test_nan_router_logits_raise_the_named_error_from_the_compiled_model():
    def spoil(model, ids):
        model.model.layers[1].mlp.gate.weight[3].fill_(float("nan"))  # every row of layer 1: NaN logits

    eager, msg = _errors_after("qwen3_moe", 4, spoil)
    assert "NaN logit in token row 0 of layer 1" in msg, msg
    assert msg == eager


def test_bad_hash_ids_raise_the_eager_error_from_the_compiled_model():
    if "deepseek_v4" not in FAMILIES:
        pytest.skip("this transformers has no DeepSeek-V4")

    def spoil(model, ids):
        model.model.layers[0].mlp.gate.tid2eid[int(ids[0, 2])].fill_(99)  # layer 0 is the hash layer

    eager, msg = _errors_after("deepseek_v4", 5, spoil)
    assert "hash_table: expert id 99" in msg and msg == eager


def test_a_compiled_step_leaves_no_tensor_of_its_own_on_the_layer():
    """Inside the op a hash layer routes on ids copied into rows the layer keeps (on CUDA, where those
    rows exist: simulated here with CPU rows), and `last_routing` is None afterwards: a tensor made in
    a CUDA graph torch.compile records must not outlive the call."""
    if "deepseek_v4" not in FAMILIES:
        pytest.skip("this transformers has no DeepSeek-V4")
    model = tiny_model("deepseek_v4", seed=5)
    moeflow.patch_model(model, experts="reference")
    state = model.model.layers[0].mlp.__dict__["_moeflow"]  # layer 0 is the hash layer
    layer = state.layer
    assert layer.config.router.hash_routing and layer.__dict__["_status_rows"] is None  # CPU: none kept
    layer.__dict__["_status_rows"] = torch.zeros(16, dtype=torch.int32)
    layer.__dict__["_ids_rows"] = torch.zeros(16, dtype=torch.int64)
    x, ids = torch.randn(6, 32), _ids(6)[0]
    with torch.no_grad():
        want = layer(x, input_ids=ids)
        got = torch.ops.moeflow.moe_block(x, ids, state.op_id)
    assert torch.equal(got, want)
    assert torch.equal(layer.__dict__["_ids_rows"][:6], ids)
    assert layer.last_routing is None


def test_offloaded_model_compiles_and_runs_the_slot_cache_inside_the_op():
    from moeflow.offload.config import OffloadConfig

    torch._dynamo.reset()
    resident = tiny_model("qwen3_moe", seed=6)
    moeflow.patch_model(resident, experts="reference")
    off = tiny_model("qwen3_moe", seed=6)
    moeflow.patch_model(off, experts="reference", offload=OffloadConfig(gpu_slots=3, device="cpu"))
    compiled = torch.compile(off, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        rt = mhf.moe_layers(off)[0].offload
        before = rt.stats().steps
        for seed in (7, 8):  # one length: one compile
            _check(compiled(_ids(7, seed=seed)).logits, resident(_ids(7, seed=seed)).logits, f"offload seed={seed}")
    assert rt.stats().steps > before, "the compiled model never reached the offload cache"
    torch._dynamo.reset()


def test_a_capture_refuses_offloaded_and_expert_parallel_steps(monkeypatch):
    """Inside a CUDA graph torch.compile records, a step needing host work per call raises
    CompiledStepError naming the layer (the capture is simulated: no GPU here)."""
    from moeflow.offload.config import OffloadConfig

    model = tiny_model("qwen3_moe", seed=7)
    moeflow.patch_model(model, experts="reference", offload=OffloadConfig(gpu_slots=3, device="cpu"))
    state = model.model.layers[0].mlp.__dict__["_moeflow"]
    x = torch.randn(4, 32)
    monkeypatch.setattr(moe_op, "_capturing", lambda: True)
    with pytest.raises(moe_op.CompiledStepError, match=r"layers\.0\.mlp \(layer 0\).*offloaded"):
        torch.ops.moeflow.moe_block(x, None, state.op_id)
    monkeypatch.setattr(moe_op, "_capturing", lambda: False)
    assert torch.ops.moeflow.moe_block(x, None, state.op_id).shape == (4, 32)


def test_op_ids_are_per_block_and_a_copy_gets_its_own():
    model = tiny_model("mixtral", seed=8)
    moeflow.patch_model(model, experts="reference")
    states = [m.__dict__["_moeflow"] for _, m in mhf.patch.patched_modules(model)]
    ids = [s.op_id for s in states]
    assert len(set(ids)) == len(ids)
    assert [moe_op.lookup(i) for i in ids] == states
    assert [(s.first_in_model, s.last_in_model) for s in states] == [(True, False), (False, True)]
    twin = copy.copy(states[0])  # (a deepcopy of a patched model meets the routing monitor's lock)
    assert twin.op_id not in ids and moe_op.lookup(twin.op_id) is twin
    x = torch.randn(5, 32)
    with torch.no_grad():
        got = torch.ops.moeflow.moe_block(x, None, ids[0])
        assert torch.equal(got, model.model.layers[0].mlp(x))
    with pytest.raises(ValueError, match="block=0 names no live patched block"):
        moe_op.lookup(0)


def test_a_block_compiles_alone():
    """A patched block compiled without its model (no transformers forward sets an output collector)."""
    torch._dynamo.reset()
    model = tiny_model("qwen2_moe", seed=10)
    moeflow.patch_model(model, experts="reference")
    block = model.model.layers[0].mlp
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(compiled(x), block(x))
    torch._dynamo.reset()


def test_router_logits_are_recorded_under_compile():
    """output_router_logits=True: the patched blocks feed transformers' recorder inside the compiled graph."""
    torch._dynamo.reset()
    model = tiny_model("gpt_oss", seed=11)
    ids = _ids(7)
    with torch.no_grad():
        want = model(ids, output_router_logits=True).router_logits
        moeflow.patch_model(model, experts="reference")
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids, output_router_logits=True).router_logits
    assert len(got) == len(want) == 2
    for i, (g, w) in enumerate(zip(got, want)):
        _check(g, w, f"router logits of layer {i}")
    torch._dynamo.reset()
