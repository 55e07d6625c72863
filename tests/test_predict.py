"""`moeflow info --gpu-budget`: memory at a budget and the decode floor from stored byte counts.

Each test writes a tiny checkpoint in a stored format (bf16 Mixtral; FP8-block Qwen3-MoE fused and
DeepSeek-V3 per-expert; MXFP4 gpt-oss, quantized by moeflow.quant) and checks the predicted byte
counts exactly against the stored tensors' sizes (read back with safetensors).

Legend: L MoE layers, E experts per layer, K picks per token, B bytes of one routed expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_quant_checkpoint import FP8_CFG, MXFP4_CFG, write_quantized

from moeflow.cli import main
from moeflow.inspect import checkpoint_info, model_bytes, predict_checkpoint
from moeflow.predict import DEVICES, ModelBytes, decode_floor, parse_bytes, predict_memory
from moeflow.quant import MXFP4, fp8_block_spec

pytestmark = pytest.mark.usefixtures("one_thread", "hf_quiet")


def stored(path: str) -> dict[str, int]:
    """name -> bytes of every stored tensor (the tensors themselves, read back)."""
    out = {}
    for f in Path(path).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                out[k] = t.numel() * t.element_size()
    return out


def routed(name: str) -> bool:
    return ".experts." in name and "shared" not in name


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from hf_configs import tiny_model

    out = {}
    d = tmp_path_factory.mktemp("mixtral-bf16")
    tiny_model("mixtral").to(torch.bfloat16).save_pretrained(str(d))
    out["mixtral-bf16"] = (str(d), 4)
    spec = fp8_block_spec(FP8_CFG["weight_block_size"])
    out["qwen3-fp8-fused"] = (write_quantized(tmp_path_factory.mktemp("q3"), "qwen3_moe", spec, FP8_CFG, fmt="fused",
                                              layers=(0, 1))[0], 6)
    out["deepseek-fp8"] = (write_quantized(tmp_path_factory.mktemp("ds3"), "deepseek_v3", spec, FP8_CFG,
                                           fmt="per_expert")[0], 8)
    out["gpt-oss-mxfp4"] = (write_quantized(tmp_path_factory.mktemp("go"), "gpt_oss", MXFP4, MXFP4_CFG, fmt="fused",
                                            layers=(0, 1), intermediate_size=32)[0], 4)
    return out


FORMATS = ["mixtral-bf16", "qwen3-fp8-fused", "deepseek-fp8", "gpt-oss-mxfp4"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_bytes_are_the_stored_bytes(checkpoints, fmt):
    path, E = checkpoints[fmt]
    sizes = stored(path)
    info = checkpoint_info(path)
    mb = model_bytes(info)
    experts = {k: v for k, v in sizes.items() if routed(k)}
    other = {k: v for k, v in sizes.items() if not routed(k)}
    layers = sorted({int(k.split("layers.")[1].split(".")[0]) for k in experts})
    # one expert: expert 0's tensors (per-expert keys) or 1/E of the layer's fused tensors
    first = [k for k in experts if f"layers.{layers[0]}." in k]
    per_expert = [k for k in first if ".experts.0." in k]
    one = sum(experts[k] for k in per_expert) if per_expert else sum(experts[k] for k in first) // E
    assert mb.expert_bytes == one
    assert mb.routed_bytes == sum(experts.values()) == one * E * len(layers)
    assert mb.num_experts == E * len(layers) and mb.moe_layers == len(layers)
    assert mb.non_expert_bytes == sum(other.values())
    # the tiny configs are untied: a step reads the head, not the embedding table (one row of it)
    embed = sum(v for k, v in other.items() if "embed_tokens" in k)
    assert embed > 0 and any(k.startswith("lm_head.") for k in other)
    assert mb.decode_non_expert_bytes == sum(other.values()) - embed
    assert mb.step_bytes == mb.decode_non_expert_bytes + len(layers) * info.top_k * one
    # the experts are stored in their format (fp8 bytes / packed uint8 MXFP4 blocks), not dequantized
    want = {"mixtral-bf16": "BF16", "qwen3-fp8-fused": "F8_E4M3", "deepseek-fp8": "F8_E4M3", "gpt-oss-mxfp4": "U8"}
    assert want[fmt] in _dtypes(path, per_expert or first)


def _dtypes(path: str, keys: list[str]) -> set[str]:
    from moeflow.inspect import read_safetensors_header

    out = set()
    for f in Path(path).glob("*.safetensors"):
        h = read_safetensors_header(f)
        out |= {h[k]["dtype"] for k in keys if k in h}
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_memory_at_a_budget_and_the_floor(checkpoints, fmt):
    path, _ = checkpoints[fmt]
    mb = model_bytes(checkpoint_info(path))
    B, reserve = mb.expert_bytes, 1000
    S = mb.top_k + 1
    budget = mb.non_expert_bytes + reserve + S * B + B // 2  # half an expert left over: not a slot
    pred = predict_checkpoint(path, gpu_budget_bytes=budget, device="h200", reserve_bytes=reserve)
    m, f = pred["memory"], pred["decode_floor"]
    assert m["slots"] == S and m["offloaded"]
    assert m["resident_expert_bytes"] == S * B
    assert m["offloaded_expert_bytes"] == mb.routed_bytes - S * B
    assert m["gpu_bytes"] == mb.non_expert_bytes + S * B + reserve <= budget
    assert m["resident_fraction"] == S / mb.num_experts
    dev = DEVICES["h200"]
    misses = (1 - S / mb.num_experts) * mb.moe_layers * mb.top_k
    assert f["step_bytes"] == mb.step_bytes
    assert f["expected_misses"] == pytest.approx(misses, rel=1e-12)
    assert f["hbm_s"] == pytest.approx(mb.step_bytes / dev.hbm_bytes_per_s, rel=1e-12)
    assert f["pcie_s"] == pytest.approx(misses * B / dev.pcie_bytes_per_s, rel=1e-12)
    assert f["floor_s"] == pytest.approx(f["hbm_s"] + f["pcie_s"], rel=1e-12)
    assert pred["decode_floor_resident"]["pcie_s"] == 0.0
    # everything fits: no slot short, nothing offloaded, no PCIe term
    big = predict_checkpoint(path, gpu_budget_bytes=mb.non_expert_bytes + mb.routed_bytes + reserve,
                             reserve_bytes=reserve)
    assert big["memory"]["slots"] == mb.num_experts and big["memory"]["offloaded_expert_bytes"] == 0
    assert big["decode_floor"]["pcie_s"] == 0.0 and not big["memory"]["offloaded"]


def test_budget_below_k_experts_is_named(checkpoints):
    path, _ = checkpoints["mixtral-bf16"]
    mb = model_bytes(checkpoint_info(path))
    need = mb.non_expert_bytes + 10 + mb.top_k * mb.expert_bytes
    predict_memory(mb, gpu_budget_bytes=need, reserve_bytes=10)  # exactly K slots: fits
    with pytest.raises(ValueError, match=f"gpu_budget_bytes={need - 1}: below the {need} bytes"):
        predict_memory(mb, gpu_budget_bytes=need - 1, reserve_bytes=10)


def test_cli_json_and_text(checkpoints, capsys):
    path, _ = checkpoints["gpt-oss-mxfp4"]
    mb = model_bytes(checkpoint_info(path))
    budget = mb.non_expert_bytes + (1 << 10) + 3 * mb.expert_bytes
    assert main(["info", path, "--gpu-budget", str(budget), "--reserve", "1KiB", "--device", "a100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["memory"]["slots"] == 3 and d["memory"]["reserve_bytes"] == 1024
    assert d["device"] == DEVICES["a100"].name and d["model"]["step_bytes"] == mb.step_bytes
    assert main(["info", path, "--gpu-budget", str(budget), "--reserve", "1KiB"]) == 0
    out = capsys.readouterr().out
    assert "decode floor" in out and "expected misses" in out and "family          gpt_oss" in out
    assert main(["info", path, "--gpu-budget", "1KiB"]) == 2  # a user error: one line, exit 2
    assert "gpu_budget_bytes=1024: below" in capsys.readouterr().err
    assert main(["info", path, "--gpu-budget", "60 parsecs"]) == 2
    assert "--gpu-budget='60 parsecs'" in capsys.readouterr().err


def test_parse_bytes_and_bad_input():
    assert parse_bytes("60GiB") == 60 << 30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5 KiB") == 1536
    assert parse_bytes("4096") == 4096
    for bad in ("", "GiB", "-1GiB", "0", "12 furlongs"):
        with pytest.raises(ValueError, match="size="):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="ModelBytes.top_k=0"):
        ModelBytes(expert_bytes=1, num_experts=1, routed_bytes=1, moe_layers=1, top_k=0, non_expert_bytes=0,
                   decode_non_expert_bytes=0)
    mb = ModelBytes(expert_bytes=100, num_experts=8, routed_bytes=800, moe_layers=2, top_k=2, non_expert_bytes=50,
                    decode_non_expert_bytes=40)
    with pytest.raises(ValueError, match="resident_fraction=1.5"):
        decode_floor(mb, DEVICES["h100"], resident_fraction=1.5)
    # by hand: 40 + 2 * 2 * 100 = 440 bytes a step; half the experts resident -> 2 misses, 200 bytes
    f = decode_floor(mb, DEVICES["h100"], resident_fraction=0.5)
    assert f.step_bytes == 440 and f.expected_misses == 2.0 and f.miss_bytes == 200.0
    g = decode_floor(mb, DEVICES["h100"], resident_fraction=0.5, hit_rate=0.75)  # a measured hit rate
    assert g.expected_misses == 1.0 and g.pcie_s == pytest.approx(100 / DEVICES["h100"].pcie_bytes_per_s)
    with pytest.raises(ValueError, match="hit_rate=2"):
        decode_floor(mb, DEVICES["h100"], resident_fraction=0.5, hit_rate=2)
    with pytest.raises(ValueError, match="device='b200'"):
        predict_checkpoint("unused", device="b200")
