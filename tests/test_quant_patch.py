"""patch_model on a transformers model whose experts are transformers' FP8Experts modules.

The quantized model is built from a tiny fp32 model: its expert tensors are quantized with
moeflow's FP8 block quantizer and put into real `FP8Experts` modules (transformers 5's
class for quant_method "fp8"); the oracle is the same model with the *dequantized* f32
expert weights run by HF's own experts. Tolerance: rtol 1e-5, atol 1e-5 * max|logit|
(the reference experts compute in f32 from the exact dequantized weights; only the
summation order differs from HF's).
"""

from __future__ import annotations

import copy

import pytest
import torch

import moeflow
from moeflow import hf as mhf
from moeflow.config import ExpertWeights
from moeflow.quant.experts import quantize_experts
from moeflow.quant.spec import fp8_block_spec
from moeflow.testing import assert_close

fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")


def _fp8_model(family: str):
    from hf_configs import tiny_model

    model = tiny_model(family, seed=11)
    spec = fp8_block_spec((16, 16))  # small blocks: partial edge blocks at these tiny shapes
    quantized = copy.deepcopy(model)
    n = 0
    for (_name, mod), (_, qmod) in zip(model.named_modules(), quantized.named_modules()):
        experts = getattr(mod, "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj"):
            continue
        w = ExpertWeights(experts.gate_up_proj.detach(), experts.down_proj.detach())
        qw = quantize_experts(w, spec)
        deq = qw.dequantize(torch.float32)
        with torch.no_grad():  # the oracle runs the exactly dequantized weights
            experts.gate_up_proj.copy_(deq.gate_up)
            experts.down_proj.copy_(deq.down)
        fe = fp8.FP8Experts(model.config, block_size=(16, 16))
        with torch.no_grad():
            fe.gate_up_proj.data = qw.gate_up.clone()
            fe.gate_up_proj_scale_inv.data = qw.gate_up_scale.clone()
            fe.down_proj.data = qw.down.clone()
            fe.down_proj_scale_inv.data = qw.down_scale.clone()
        qmod.experts = fe
        n += 1
    assert n > 0
    return model, quantized


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_patch_model_runs_hf_fp8_experts(family):
    oracle, quantized = _fp8_model(family)
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = oracle(ids).logits
    report = moeflow.patch_model(quantized, experts="reference")
    layers = mhf.moe_layers(quantized)
    assert layers and all(m.source.quant is not None and m.source.quant.format == "fp8_block" for m in layers)
    fe = next(m for m in quantized.modules() if isinstance(m, fp8.FP8Experts))
    w = layers[0].source.weights
    assert w.gate_up.data_ptr() == fe.gate_up_proj.data_ptr(), "FP8 experts are read in place"
    with torch.no_grad():
        got = quantized(ids).logits
    assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), what=f"{family} FP8Experts patched")
    assert len(report) == len(layers)
    with torch.no_grad():
        g1 = quantized.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        g0 = oracle.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(g1, g0), f"greedy tokens differ: {g1.tolist()} vs {g0.tolist()}"


def test_offloaded_fp8_experts_keep_their_bytes_and_bits():
    """The host store and the slots hold the FP8 data and scales (about half the bf16 bytes); the
    offloaded model's logits are bit-identical to the resident quantized model's."""
    _, resident = _fp8_model("qwen3_moe")
    off = copy.deepcopy(resident)
    moeflow.patch_model(resident, experts="reference")
    moeflow.patch_model(off, experts="reference", offload=moeflow.OffloadConfig(gpu_slots=4, device="cpu"))
    rt = mhf.moe_layers(off)[0].offload
    assert rt.store.quant is not None and rt.store.dtypes["gate_up"] == torch.float8_e4m3fn
    w = mhf.moe_layers(resident)[0].source.weights
    assert rt.store.expert_bytes == w.expert_bytes
    plain_bytes = (w.gate_up[0].numel() + w.down[0].numel()) * 2  # the same expert in bf16
    assert rt.store.expert_bytes < 0.6 * plain_bytes, (rt.store.expert_bytes, plain_bytes)
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = resident(ids).logits
        got = off(ids).logits
    assert torch.equal(got, want), f"offloaded FP8 differs: max {float((got - want).abs().max()):.3g}"
    s = rt.stats()
    assert s.misses > 0 and s.bytes_copied == (s.misses + s.prefetch_issued) * rt.store.expert_bytes


def test_info_shows_the_quantized_format(tmp_path, capsys):
    from test_quant_checkpoint import FP8_CFG, write_quantized

    from moeflow.cli import main

    path, _, _ = write_quantized(tmp_path, "deepseek_v3", fp8_block_spec((16, 16)), FP8_CFG, fmt="per_expert")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "experts stored  fp8_block: float8_e4m3fn, 16x16 blocks of float32 scales" in out, out
