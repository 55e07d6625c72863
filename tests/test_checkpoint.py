"""moeflow.checkpoint: lazy safetensors index, per-family key adapters, one-layer loads.

Every family the installed transformers ships is saved with save_pretrained in both
on-disk formats (default `save_original_format=True`: per-expert names where the family
has a conversion mapping; False: transformers 5's fused tensors); each MoE layer loaded
by `load_moe_layer` must equal the model's own parameters bit for bit, and a subset of
experts must equal the same rows. Errors (missing, unexpected, wrong-shape, wrong-dtype
key) must name the key, what it is and what was expected.

Legend: E experts, H hidden, I intermediate per expert.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_configs import available_families, tiny_config, tiny_model
from safetensors.torch import save_file

from moeflow.checkpoint import CheckpointError, CheckpointIndex, load_moe_layer, moe_layer_indices, plan_layer
from moeflow.checkpoint.families import adapter_for
from moeflow.testing import assert_bitwise_equal, assert_close

pytestmark = pytest.mark.usefixtures("one_thread", "hf_quiet")

FAMILIES = available_families()


def _block_params(model, family: str, layer_idx: int) -> dict[str, torch.Tensor]:
    """The HF model's own tensors of one MoE layer, by LayerWeights field."""
    layer = model.model.layers[layer_idx]
    get = {
        "mixtral": lambda: (layer.mlp, "gate", None),
        "gpt_oss": lambda: (layer.mlp, "router", None),
        "llama4": lambda: (layer.feed_forward, "router", "shared_expert"),
        "longcat_flash": lambda: (layer.mlp, "router", None),
        "gemma4": lambda: (layer, "router", None),
        "qwen2_moe": lambda: (layer.mlp, "gate", "shared_expert"),
    }.get(family, lambda: (layer.mlp, "gate", "shared_experts"))
    block, router_name, shared_name = get()
    router = getattr(block, router_name)
    out = {"gate_up": block.experts.gate_up_proj, "down": block.experts.down_proj}
    if family == "longcat_flash":
        out["router_weight_EH"] = router.classifier.weight
        out["gate_up"] = out["gate_up"][: model.config.n_routed_experts]
    elif family == "gemma4":
        out["router_weight_EH"] = router.proj.weight
        out["expert_scale_E"] = router.per_expert_scale
        out["prenorm_weight_H"] = router.scale
    else:
        out["router_weight_EH"] = router.weight
    if family == "gpt_oss":
        out["router_bias_E"] = router.bias
        out["gate_up_bias"] = block.experts.gate_up_proj_bias
        out["down_bias"] = block.experts.down_proj_bias
    if hasattr(router, "e_score_correction_bias"):
        out["selection_bias_E"] = router.e_score_correction_bias
    if hasattr(router, "tid2eid"):
        out["hash_table_VK"] = router.tid2eid
    shared = getattr(block, shared_name, None) if shared_name else None
    if shared is not None:
        out["shared.gate_IH"] = shared.gate_proj.weight
        out["shared.up_IH"] = shared.up_proj.weight
        out["shared.down_HI"] = shared.down_proj.weight
    if family == "qwen2_moe":
        out["shared_gate_weight_1H"] = block.shared_expert_gate.weight
    return out


def _loaded(lw, name: str) -> torch.Tensor | None:
    if name.startswith("shared."):
        return getattr(lw.shared, name.split(".", 1)[1]) if lw.shared is not None else None
    if name in ("gate_up", "down", "gate_up_bias", "down_bias"):
        return getattr(lw.experts, name)
    return getattr(lw, name)


@pytest.mark.parametrize("original_format", [True, False], ids=["original", "fused"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_loads_bit_exact(family, original_format, tiny_checkpoint):
    path = tiny_checkpoint(family, original_format=original_format)
    model = tiny_model(family)
    index = CheckpointIndex(path)
    layers = moe_layer_indices(index, model.config)
    assert layers, family
    for i in layers:
        lw = load_moe_layer(index, model.config, i)
        assert lw.family == adapter_for(family).family and lw.layer_idx == i
        assert lw.expert_ids == tuple(range(lw.experts.num_experts))
        want = _block_params(model, family, i)
        for name, t in want.items():
            got = _loaded(lw, name)
            assert got is not None, f"{family} layer {i}: {name} not loaded"
            assert_bitwise_equal(got, t.detach(), what=f"{family} layer {i} {name} ({lw.source_format})")
        # Nothing loaded that the model does not have.
        for name in ("router_bias_E", "selection_bias_E", "expert_scale_E", "prenorm_weight_H", "hash_table_VK",
                     "shared_gate_weight_1H"):
            assert (getattr(lw, name) is None) == (name not in want), f"{family} layer {i}: {name}"
        assert (lw.shared is None) == ("shared.gate_IH" not in want)
        # A subset of experts: the same rows, in the order asked for (EP / offload).
        E = lw.experts.num_experts
        for subset in ([E - 1, 0], range(1, 3)):
            sub = load_moe_layer(index, family, i, experts=subset)
            assert sub.expert_ids == tuple(subset)
            assert_bitwise_equal(sub.experts.gate_up, want["gate_up"].detach()[list(subset)], what="subset gate_up")
            assert_bitwise_equal(sub.experts.down, want["down"].detach()[list(subset)], what="subset down")
            assert_bitwise_equal(sub.router_weight_EH, want["router_weight_EH"].detach(), what="subset router")
    expected_format = "per_expert" if original_format and adapter_for(family).per_expert is not None else "fused"
    assert lw.source_format == expected_format


def test_original_format_is_per_expert_by_default(tiny_checkpoint):
    """transformers 5.17-5.24 save_pretrained writes the legacy per-expert names by default."""
    idx = CheckpointIndex(tiny_checkpoint("mixtral"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in idx
    assert "model.layers.0.mlp.experts.gate_up_proj" not in idx
    fused = CheckpointIndex(tiny_checkpoint("mixtral", original_format=False))
    assert fused.info("model.layers.0.mlp.experts.gate_up_proj").shape == (4, 48, 32)


def test_sharded_checkpoint_reads_only_the_layers_shards(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe", original_format=False, max_shard_size="20KB")
    with open(os.path.join(path, "model.safetensors.index.json")) as fh:
        weight_map = json.load(fh)["weight_map"]
    assert len(set(weight_map.values())) > 3
    idx = CheckpointIndex(path)
    model = tiny_model("qwen3_moe")
    lw = load_moe_layer(idx, model.config, 1, experts=[4])
    assert_bitwise_equal(lw.experts.gate_up[0], model.model.layers[1].mlp.experts.gate_up_proj.detach()[4],
                         what="expert 4")
    opened = {os.path.basename(f) for f in idx._handles}
    needed = {v for k, v in weight_map.items() if k.startswith("model.layers.1.mlp.")}
    assert opened == needed, (opened, needed)  # no other shard was even opened


def test_loaded_layer_runs_like_the_hf_block(tiny_checkpoint):
    """A MoELayer built from load_moe_layer (no HF model) equals the HF block."""
    from moeflow.config import MoEConfig
    from moeflow.layer import MoELayer
    from moeflow.routing.families import router_spec_from_hf

    model = tiny_model("deepseek_v3")
    lw = load_moe_layer(tiny_checkpoint("deepseek_v3"), "deepseek_v3", 1)
    spec = router_spec_from_hf(model.config, 1)
    cfg = MoEConfig(hidden_size=32, intermediate_size=24, router=spec, activation="silu")
    layer = MoELayer(cfg, router_weight_EH=lw.router_weight_EH, experts=lw.experts,
                     selection_bias_E=lw.selection_bias_E, shared_expert=lw.shared.module(), experts_impl="reference")
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model.model.layers[1].mlp(x)
        got = layer(x)
    assert_close(got, want, rtol=1e-5, atol=1e-6, what="deepseek_v3 layer 1 from checkpoint")


# ---------------------------------------------------------------------------------- errors


def _fused_mixtral(tmp_path, edit) -> str:
    """A fused-format Mixtral checkpoint (config.json + model.safetensors) after `edit(tensors)`."""
    model = tiny_model("mixtral")
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(str(tmp_path))
    return str(tmp_path)


L1 = "model.layers.1."


def test_missing_key_is_named(tmp_path):
    path = _fused_mixtral(tmp_path, lambda t: t.pop(L1 + "mlp.experts.down_proj"))
    with pytest.raises(CheckpointError, match=r"mixtral layer 1 \(fused format\): missing key "
                                              r"model\.layers\.1\.mlp\.experts\.down_proj") as exc:
        load_moe_layer(path, "mixtral", 1)
    assert exc.value.key == L1 + "mlp.experts.down_proj"
    load_moe_layer(path, "mixtral", 0)  # the other layer is fine


def test_unexpected_key_is_named(tmp_path):
    path = _fused_mixtral(tmp_path, lambda t: t.update({L1 + "mlp.experts.down_proj_bias": torch.zeros(4, 32)}))
    with pytest.raises(CheckpointError, match=r"unexpected key model\.layers\.1\.mlp\.experts\.down_proj_bias"):
        load_moe_layer(path, "mixtral", 1)


def test_mixed_formats_are_refused(tmp_path):
    def edit(t):
        t[L1 + "block_sparse_moe.experts.0.w1.weight"] = torch.zeros(24, 32)

    path = _fused_mixtral(tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"unexpected key model\.layers\.1\.block_sparse_moe\.experts\.0\.w1"):
        load_moe_layer(path, "mixtral", 1)


def test_wrong_shape_is_named_with_got_and_expected(tmp_path):
    path = _fused_mixtral(tmp_path, lambda t: t.update({L1 + "mlp.experts.gate_up_proj": torch.zeros(3, 48, 32)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj: shape \[3, 48, 32\], "
                                              r"expected \[4, 48, 32\]"):
        load_moe_layer(path, "mixtral", 1)


def test_wrong_dtype_is_named_with_got_and_expected(tmp_path):
    def edit(t):
        t[L1 + "mlp.experts.down_proj"] = t[L1 + "mlp.experts.down_proj"].half()

    path = _fused_mixtral(tmp_path, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.down_proj: dtype torch\.float16, "
                                              r"expected torch\.float32"):
        load_moe_layer(path, "mixtral", 1)


def test_per_expert_errors_are_named(tmp_path, tiny_checkpoint):
    from safetensors.torch import load_file

    src = tiny_checkpoint("deepseek_v4")  # per-expert names, hash layer 0 with tid2eid
    tensors = load_file(os.path.join(src, "model.safetensors"))
    cfg = tiny_config("deepseek_v4")

    def write(edit) -> str:
        d = tmp_path / f"ck{len(os.listdir(tmp_path))}"
        d.mkdir()
        t = dict(tensors)
        edit(t)
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(str(d))
        return str(d)

    missing = write(lambda t: t.pop("model.layers.1.ffn.experts.2.w3.weight"))
    with pytest.raises(CheckpointError, match=r"per_expert format\): missing key model\.layers\.1\.ffn\.experts\.2\.w3"):
        load_moe_layer(missing, cfg, 1)
    extra = write(lambda t: t.update({"model.layers.1.ffn.experts.6.w1.weight": torch.zeros(24, 32)}))
    with pytest.raises(CheckpointError, match=r"unexpected key model\.layers\.1\.ffn\.experts\.6\.w1\.weight"):
        load_moe_layer(extra, cfg, 1)
    float_hash = write(lambda t: t.update({"model.layers.0.ffn.gate.tid2eid": t["model.layers.0.ffn.gate.tid2eid"].float()}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.ffn\.gate\.tid2eid: dtype torch\.float32, "
                                              r"expected an integer dtype"):
        load_moe_layer(float_hash, cfg, 0)
    # The learned layer needs its bias; the hash layer must not have one.
    no_bias = write(lambda t: t.pop("model.layers.1.ffn.gate.bias"))
    with pytest.raises(CheckpointError, match=r"missing key model\.layers\.1\.ffn\.gate\.bias"):
        load_moe_layer(no_bias, cfg, 1)
    load_moe_layer(no_bias, cfg, 0)
    hash_bias = write(lambda t: t.update({"model.layers.0.ffn.gate.bias": torch.zeros(6)}))
    with pytest.raises(CheckpointError, match=r"unexpected key model\.layers\.0\.ffn\.gate\.bias"):
        load_moe_layer(hash_bias, cfg, 0)


def test_bad_arguments_are_named(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("deepseek_v3")
    with pytest.raises(CheckpointError, match="deepseek_v3 layer 0 is a dense layer"):
        load_moe_layer(path, "deepseek_v3", 0)
    with pytest.raises(ValueError, match=r"layer_idx=2: expected an int in \[0, 2\)"):
        load_moe_layer(path, "deepseek_v3", 2)
    with pytest.raises(ValueError, match=r"experts: id 8 outside \[0, 8\)"):
        load_moe_layer(path, "deepseek_v3", 1, experts=[0, 8])
    with pytest.raises(ValueError, match="ids repeat"):
        load_moe_layer(path, "deepseek_v3", 1, experts=[1, 1])
    with pytest.raises(CheckpointError, match="model_type='deepseek_v3'"):
        load_moe_layer(path, "mixtral", 1)
    with pytest.raises(ValueError, match="family='bert'"):
        load_moe_layer(path, "bert", 1)
    with pytest.raises(CheckpointError, match="neither model.safetensors.index.json nor model.safetensors"):
        CheckpointIndex(tmp_path)
    plan = plan_layer(path, "deepseek_v3", 1)  # headers only
    assert plan.source_format == "per_expert" and plan.prefix == "model.layers.1."


def test_index_get_rows_and_info(tmp_path):
    t = torch.arange(24, dtype=torch.float32).reshape(4, 3, 2)
    save_file({"a": t, "b": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path / "x.safetensors"))
    idx = CheckpointIndex(tmp_path / "x.safetensors")
    assert idx.info("a").shape == (4, 3, 2) and idx.info("b").dtype == torch.bfloat16
    assert_bitwise_equal(idx.get("a", rows=slice(1, 3)), t[1:3], what="slice rows")
    assert_bitwise_equal(idx.get("a", rows=[3, 0]), t[[3, 0]], what="list rows")
    assert idx.get("a", rows=[]).shape == (0, 3, 2)
    with pytest.raises(ValueError, match=r"rows \[4\] outside \[0, 4\)"):
        idx.get("a", rows=[4])
    with pytest.raises(CheckpointError, match="checkpoint has no tensor 'c'"):
        idx.info("c")
