"""benchmarks/peers/vllm_fused_moe.py: the vLLM 0.33 fused-MoE peer computes the layer (CPU, Triton interpreter).

The peer is only timed on the GPU (bench_experts --vllm); here its harness (config choice, naive
vs aligned assignment, the two activations, biases, routed weights, the slot sum) is checked
against the fp32 reference at tiny shapes, so a wrong peer never becomes a speed claim.
"""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HAS_CUDA = torch.cuda.is_available()

POINTS = [("tiny-silu", 1, True), ("tiny-silu", 8, False), ("tiny-gptoss", 3, False)]


def check_points(device: str, dtype: torch.dtype, tol: float) -> None:
    """The peer against the fp32 reference at POINTS (naive and aligned assignment, both activations)."""
    from benchmarks.bench_experts import reference, rel_l2
    from benchmarks.peers.vllm_fused_moe import VllmFusedMoE
    from benchmarks.tune_experts import make_config, make_weights, routing, shape_spec

    for name, T, naive in POINTS:
        spec = shape_spec(name)
        w = make_weights(spec, device, dtype=dtype)
        peer = VllmFusedMoE(w, spec["activation"], spec.get("limit"))
        ids, wts = routing(T, spec["E"], spec["K"], "uniform", device)
        x = torch.randn(T, spec["H"], generator=torch.Generator().manual_seed(T)).to(device, dtype)
        assert (T * spec["K"] * 4 <= spec["E"]) == naive  # the assignment vLLM takes here
        out = peer(x, ids, wts).float()
        ref = reference(x, ids, wts, w, make_config(spec))
        err = rel_l2(out, ref)
        assert math.isfinite(err) and err <= tol, (
            f"{name} T={T}: rel-L2 {err:.3g} > {tol}; max-abs {float((out - ref).abs().max()):.3g}")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (the interpreter comes with it)")
def test_peer_matches_reference_in_the_interpreter():
    # fp32 weights and activations: only the summation order differs from the reference
    from moeflow.testing import run_interpreter_check

    run_interpreter_check(__file__, "points")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_peer_matches_reference():
    check_points("cuda", torch.bfloat16, 2e-2)  # bench_experts' own check tolerance for bf16


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the peer module imports triton")
def test_peer_config_choice():
    from benchmarks.peers.vllm_fused_moe import config_for, default_config

    # vLLM's H200 table for qwen3 (E=128, N=768): the nearest batch size, ties to the smaller key
    cfg, src = config_for(3, 128, 768)
    assert src.startswith("tuned") and cfg == config_for(2, 128, 768)[0]
    assert config_for(8192, 128, 768)[0] == config_for(4096, 128, 768)[0]
    # no table (deepseek-v3 E=256, N=2048): vLLM's default bf16 config
    cfg, src = config_for(2048, 256, 2048)
    assert src == "vLLM default" and cfg == default_config(2048, 256)
    assert cfg["BLOCK_SIZE_M"] == 128 and cfg["num_warps"] == 8


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the peer module imports triton")
def test_peer_refuses_a_layout_it_does_not_read():
    from benchmarks.peers.vllm_fused_moe import VllmFusedMoE
    from benchmarks.tune_experts import make_weights, shape_spec

    spec = shape_spec("tiny-gptoss")
    w = make_weights(spec, "cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="interleaved"):
        VllmFusedMoE(w, "silu")
    with pytest.raises(ValueError, match="activation"):
        VllmFusedMoE(w, "gelu")


if __name__ == "__main__":  # run_interpreter_check: python tests/test_peer_vllm.py points
    from benchmarks.tune_experts import patch_interpreter_index

    patch_interpreter_index()
    check_points("cpu", torch.float32, 1e-5)
    print(f"PASS {sys.argv[1]}")
