"""moeflow.patch_model on every MoE family the installed transformers ships.

Per family (tests/hf_configs.py: fp32, 2 layers, a few experts, H=32): the tiny model
is saved with save_pretrained (transformers' default per-expert "original" format and
the fused format), loaded with AutoModelForCausalLM, and patched with the "reference"
and the "grouped" experts. Logits over 3 sequences must match the unpatched model
within rtol 1e-5 (atol 1e-5 x max|logit|; max-abs and RMS error printed, `pytest -s`),
and 16 greedy tokens per sequence must be identical. The patched blocks must share
the model's tensors (same data_ptr), keep state_dict keys, and keep each block's
return signature.

Legend: B batch, S sequence, T tokens, H hidden, E experts, K picks per token.
"""

from __future__ import annotations

import pytest
import torch
from hf_configs import available_families, tiny_config, tiny_model
from torch import nn

import moeflow
from moeflow import hf as mhf
from moeflow.layer import MoELayer
from moeflow.testing import assert_close, error_stats

pytestmark = pytest.mark.usefixtures("one_thread", "hf_quiet")

FAMILIES = [f for f in available_families() if f in mhf.available_hf_families()]
RTOL = 1e-5
GEN_TOKENS = 16


def _load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def _ids(seed: int = 1, B: int = 3, S: int = 10) -> torch.Tensor:
    return torch.randint(3, 97, (B, S), generator=torch.Generator().manual_seed(seed))


def _generate(model, prompt_BS: torch.Tensor) -> torch.Tensor:
    return model.generate(prompt_BS, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS, do_sample=False,
                          pad_token_id=0)


def _check_logits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    max_abs, rms, _ = error_stats(got, want)
    print(f"{what}: max_abs={max_abs:.3e} rms={rms:.3e} (max|logit|={float(want.abs().max()):.3f})")
    assert_close(got, want, rtol=RTOL, atol=RTOL * float(want.abs().max()), what=what)


def _expert_param(module: nn.Module) -> nn.Parameter:
    """The HF gate_up Parameter behind a patched module."""
    if isinstance(module, mhf.blocks._Gemma4Experts):  # gemma4: the experts module itself
        return module.gate_up_proj
    return mhf.util.attr_path(module, module.__dict__["_moeflow"].fam.hf.experts).gate_up_proj


def _assert_shares_weights(model) -> int:
    """Every MoELayer holds the block's own Parameters (same objects, same data_ptr)."""
    n = 0
    for path, module in model.named_modules():
        if not isinstance(module, mhf.MoEBlock) or module.__dict__["_moeflow"].exposed_by is not module:
            continue
        state = module.__dict__["_moeflow"]
        layer = module.moe_layer
        block_gate_up = _expert_param(module)
        src = layer.source
        mine = src.gate_up_full if hasattr(src, "gate_up_full") else src.gate_up
        assert mine is block_gate_up, f"{path}: MoELayer gate_up is not the block's Parameter"
        assert layer.expert_weights.gate_up.data_ptr() == block_gate_up.data_ptr(), path
        src = state.sources()
        assert layer.router_weights.weight_EH.data_ptr() == src["router_weight"].data_ptr(), path
        assert layer.expert_weights.down.data_ptr() == src["down"].data_ptr(), path
        if src["selection_bias"] is not None:
            assert layer.router_weights.selection_bias_E is src["selection_bias"], path
        n += 1
    return n


@pytest.mark.parametrize("family", FAMILIES)
def test_patched_family_matches_unpatched(family, tiny_checkpoint, capsys):
    model = _load(tiny_checkpoint(family, original_format=True))
    ids_BS = _ids()
    with torch.no_grad():
        ref_logits = model(ids_BS).logits
        ref_tokens = _generate(model, ids_BS[:, :6])
    keys = list(model.state_dict())
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    n_moe = sum(1 for _, m in model.named_modules() if "experts" in m._modules)

    for impl in ("reference", "grouped"):
        report = moeflow.patch_model(model, experts=impl)
        assert len(report) == n_moe, str(report)
        assert {b.family for b in report} == {family}
        assert all(b.impl == impl for b in report), str(report)
        assert all(p in str(report) for p in report.paths)
        assert _assert_shares_weights(model) == n_moe
        assert list(model.state_dict()) == keys  # no new, no lost keys
        assert {k: v.data_ptr() for k, v in model.state_dict().items()} == ptrs  # no copies
        assert len(mhf.moe_layers(model)) == n_moe
        assert len([m for m in model.modules() if isinstance(m, MoELayer)]) == n_moe
        with torch.no_grad():
            logits = model(ids_BS).logits
            tokens = _generate(model, ids_BS[:, :6])
        _check_logits(logits, ref_logits, f"{family}/{impl}/logits")
        assert torch.equal(tokens, ref_tokens), f"{family}/{impl}: greedy tokens differ\n{tokens}\n{ref_tokens}"
        assert mhf.unpatch_model(model) >= n_moe
        assert not any(isinstance(m, mhf.MoEBlock) for m in model.modules())

    # The fused on-disk format loads to the same weights and patches the same way.
    fused = _load(tiny_checkpoint(family, original_format=False))
    for (k, a), (k2, b) in zip(model.state_dict().items(), fused.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    moeflow.patch_model(fused, experts="grouped")
    with torch.no_grad():
        _check_logits(fused(ids_BS).logits, ref_logits, f"{family}/fused-format/grouped/logits")


def test_report_is_readable():
    model = tiny_model("mixtral")
    report = moeflow.patch_model(model, experts="reference")
    text = str(report)
    print(text)
    assert text.splitlines()[0].startswith("moeflow.patch_model: MixtralForCausalLM (mixtral): 2 MoE block(s)")
    assert "model.layers.0.mlp" in text and "model.layers.1.mlp" in text and "reference" in text
    with pytest.raises(AttributeError):  # frozen
        report.experts = "grouped"
    assert report.blocks[1].layer_idx == 1 and report.blocks[0].num_experts == 4 and report.blocks[0].top_k == 2


@pytest.mark.parametrize("family", [f for f in ("gpt_oss", "llama4", "deepseek_v4") if f in FAMILIES])
def test_block_return_signature_kept(family):
    """Each patched block returns what its HF block returned, given the same input."""
    model = tiny_model(family)
    block = next(m for m in model.modules() if "experts" in m._modules)
    x_BSH = torch.randn(2, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    kwargs = {"input_ids": _ids(B=2, S=5)} if family == "deepseek_v4" else {}
    with torch.no_grad():
        want = block(x_BSH, **kwargs)
        moeflow.patch_model(model, experts="reference")
        got = block(x_BSH, **kwargs)
    assert type(got) is type(want)
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.dtype == w.dtype, (i, g.shape, w.shape)
            assert_close(g, w, rtol=1e-5, atol=1e-6, what=f"{family} output[{i}]")
    else:
        assert_close(got, want, rtol=1e-5, atol=1e-6, what=f"{family} output")


def test_router_logits_still_recorded():
    """output_router_logits=True: the aux-loss logits are still captured from the kept router."""
    model = tiny_model("mixtral")
    ids = _ids()
    with torch.no_grad():
        want = model(ids, output_router_logits=True).router_logits
        moeflow.patch_model(model)
        got = model(ids, output_router_logits=True).router_logits
    assert len(got) == len(want) == 2
    # Layer 0's logits are bit-identical (same input); layer 1's input differs by rounding.
    assert_close(got[0], want[0], rtol=0, atol=0, what="router_logits[0]")
    assert_close(got[1], want[1], rtol=RTOL, atol=RTOL * float(want[1].abs().max()), what="router_logits[1]")


@pytest.mark.skipif("deepseek_v3" not in FAMILIES, reason="transformers lacks deepseek_v3")
def test_module_apply_keeps_buffers_shared():
    """.to()/_apply replace buffers (e_score_correction_bias) by new tensors: the MoELayer follows."""
    model = tiny_model("deepseek_v3")
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    moeflow.patch_model(model, experts="reference")
    block = next(m for m in model.modules() if isinstance(m, mhf.MoEBlock))
    old_bias = block.gate.e_score_correction_bias
    model._apply(lambda t: t.clone())  # what .to(other device) does: every buffer is a new tensor
    assert block.gate.e_score_correction_bias is not old_bias
    assert block.moe_layer.router_weights.selection_bias_E is block.gate.e_score_correction_bias
    with torch.no_grad():
        _check_logits(model(ids).logits, want, "deepseek_v3 after _apply(clone)")
    model.to(torch.bfloat16)
    assert block.moe_layer.router_weights.selection_bias_E is block.gate.e_score_correction_bias
    assert block.moe_layer.expert_weights.gate_up.dtype == torch.bfloat16
    with torch.no_grad():
        assert model(ids).logits.dtype == torch.bfloat16


@pytest.mark.skipif("deepseek_v4" not in FAMILIES, reason="transformers lacks deepseek_v4")
def test_hash_layer_without_input_ids_is_named():
    model = tiny_model("deepseek_v4")
    moeflow.patch_model(model)
    embeds = model.get_input_embeddings()(_ids())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp.*hash.*input_ids"):
        with torch.no_grad():
            model(inputs_embeds=embeds)


class _OddMoE(nn.Module):
    """An MoE block no family covers (an `experts` child)."""

    def __init__(self, H: int):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(H, H)])

    def forward(self, x):
        return self.experts[0](x)


def test_unsupported_block_raises_naming_it_and_changes_nothing():
    model = tiny_model("mixtral")
    model.model.layers[1].mlp = _OddMoE(model.config.hidden_size)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp \(_OddMoE\).*cannot patch"):
        moeflow.patch_model(model)
    assert not any(isinstance(m, mhf.MoEBlock) for m in model.modules())


def test_refusals_are_named():
    from transformers import AutoModelForCausalLM, LlamaConfig

    dense = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16,
                                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="no MoE block found in LlamaForCausalLM"):
        moeflow.patch_model(dense)
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match="ep_mode='ring'"):
        moeflow.patch_model(model, ep_mode="ring")
    with pytest.raises(TypeError, match="ep_group: expected a torch.distributed ProcessGroup"):
        moeflow.patch_model(model, ep_group=object())
    with pytest.raises(TypeError, match="offload: expected an OffloadConfig"):
        moeflow.patch_model(model, offload=object())
    with pytest.raises(ValueError, match="bogus"):
        moeflow.patch_model(model, experts="bogus")
    assert not any(isinstance(m, mhf.MoEBlock) for m in model.modules())  # untouched after each refusal
    moeflow.patch_model(model)
    with pytest.raises(ValueError, match="already patched"):
        moeflow.patch_model(model)
    bad = tiny_model("mixtral", hidden_act="gelu")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp.*hidden_act='gelu'"):
        moeflow.patch_model(bad)


def test_offload_hook_runs_the_model_through_the_cache():
    from moeflow.offload.config import OffloadConfig

    model = tiny_model("mixtral")
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
        report = moeflow.patch_model(model, experts="reference", offload=OffloadConfig(gpu_slots=4, device="cpu"))
        got = model(ids).logits
    assert report.offload and "offload" in str(report)
    assert all(getattr(layer, "offload", None) is not None for layer in mhf.moe_layers(model))
    _check_logits(got, want, "mixtral offloaded (4 slots)")


def test_ep_hook_single_rank_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = tiny_model("qwen2_moe")
        ids = _ids()
        with torch.no_grad():
            want = model(ids).logits
            report = moeflow.patch_model(model, experts="reference", ep_group=dist.group.WORLD)
            got = model(ids).logits
        assert report.ep_mode == "all_to_all" and {b.dispatcher for b in report} == {"all_to_all"}
        _check_logits(got, want, "qwen2_moe EP world_size=1")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", [f for f in ("mixtral", "gpt_oss", "deepseek_v4", "gemma4") if f in FAMILIES])
def test_experts_implementation_moeflow(family, tiny_checkpoint, monkeypatch):
    """from_pretrained(..., experts_implementation="moeflow"): HF routing, moeflow experts."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(family, original_format=True)
    calls = []
    real = mhf.interface.run_experts
    monkeypatch.setattr(mhf.interface, "run_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    eager = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", experts_implementation="eager")
    mine = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", experts_implementation="moeflow")
    assert mine.config._experts_implementation == "moeflow"
    ids = _ids()
    with torch.no_grad():
        want = eager(ids).logits
        calls.clear()
        got = mine(ids).logits
    n_moe = sum(1 for _, m in mine.named_modules() if type(m).__name__.endswith("Experts"))
    assert len(calls) == n_moe > 0
    _check_logits(got, want, f"{family} experts_implementation=moeflow")


def test_tiny_config_is_reusable_and_fixed():
    a, b = tiny_model("mixtral"), tiny_model("mixtral")
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
    assert tiny_config("mixtral").num_hidden_layers == 2
    with pytest.raises(ValueError, match="family='nope'"):
        tiny_config("nope")


def test_demo_matches_and_reports_load(capsys):
    from moeflow.demo import run_demo_result

    lines: list[str] = []
    result = run_demo_result(out=lines.append, model="random")
    text = "\n".join(lines)
    print(text)
    assert result.identical and len(result.moeflow_tokens) == 32
    assert "output tokens identical to the unpatched model: yes" in text
    assert len(result.expert_load) == 2
    # prompt (8) + 32 decode steps... the last generated token is never fed back: 8 + 31 tokens x K=2.
    assert all(sum(load) == (8 + 31) * 2 for load in result.expert_load.values())


def test_demo_embedded_model_writes_python(capsys):
    """The default demo loads the trained checkpoint and its greedy text looks like Python."""
    from moeflow.demo import EMBEDDED_MODEL, EMBEDDED_PROMPT, run_demo, run_demo_result

    assert (EMBEDDED_MODEL / "model.safetensors").is_file()
    lines: list[str] = []
    result = run_demo_result(out=lines.append, tokens=24)
    text = "\n".join(lines)
    assert result.identical, text
    assert len(result.expert_load) == 4
    body = text.split("as text:\n", 1)[1]
    assert body.startswith(EMBEDDED_PROMPT)
    generated = body[len(EMBEDDED_PROMPT):].split("\nexpert load")[0]
    # A trained byte model continues an argument list with printable ASCII (a random one
    # emits arbitrary bytes): at least 90% of its bytes are printable.
    printable = sum(c.isprintable() or c in "\n\t" for c in generated)
    assert printable >= 0.9 * max(1, len(generated)), repr(generated)
    assert run_demo(out=lambda s: None, tokens=4) == 0
