"""benchmarks/bench_experts_quant.py dry run (CPU, Triton interpreter): every point checked against its
reference and timed; the prefill impls timed in one rotation (benchmarks.common.time_cuda_graphs_interleaved
on the GPU), so speedup_vs_bf16 compares times taken under the same clocks."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (the interpreter comes with it)")
def test_dry_run_prefill_in_one_rotation(tmp_path):
    out = tmp_path / "beq.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/bench_experts_quant.py", "--dry-run", "--shapes", "tiny-fp8",
                           "--decode", "1", "--prefill", "8", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"] * len(rows), rows
    pre = {r["impl"]: r for r in rows if r["phase"] == "prefill"}
    assert set(pre) == {"triton_quant", "triton_quant_bi", "triton_bf16"}
    for r in pre.values():
        assert r["timing"].startswith("graph replay, round-robin") and r["graph_s"] > 0 and "eager_s" not in r
    q = pre["triton_quant"]
    assert q["speedup_vs_bf16"] == pytest.approx(pre["triton_bf16"]["graph_s"] / q["graph_s"])
    assert q["rel_l2_vs_w8a8_ref"] < 2e-2  # the point was checked before it was timed
    dec = [r for r in rows if r["phase"] == "decode"]
    assert dec and all("eager_s" in r for r in dec)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (the interpreter comes with it)")
def test_dry_run_nvfp4_point(tmp_path):
    """The bench builds NVFP4 weights as ModelOpt stores them (e4m3 scales a 16 values, gate and up each with
    their own weight_scale_2) and checks a decode point against the dequantized reference before timing it."""
    out = tmp_path / "beq.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/bench_experts_quant.py", "--dry-run", "--shapes", "tiny-nvfp4",
                           "--decode", "1", "--no-prefill", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and [r["status"] for r in rows] == ["ok"] * len(rows), rows
    assert {r["fmt"] for r in rows} == {"nvfp4"}
    for r in rows:
        assert r["rel_l2_vs_dequant_ref"] < 1e-2, r


def test_build_weights_nvfp4_matches_its_plain_weights():
    """build_weights' NVFP4 experts dequantize to their plain weights within NVFP4's rounding (CPU, f32)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_experts_quant import SHAPES, build_weights

    cfg, wq, plain = build_weights(SHAPES["tiny-nvfp4"], "cpu", torch.float32, seed=1)
    assert wq.quant.format == "nvfp4" and wq.gate_up_scale_2.shape == (6, 2) and wq.down_scale_2.shape == (6,)
    deq = wq.dequantize(torch.float32)
    for name in ("gate_up", "down"):
        got, want = getattr(deq, name), getattr(plain, name)
        rel = float((got - want).norm() / want.norm())
        assert rel < 0.15, f"{name}: rel-L2 {rel:.3g} against the plain weights (E2M1 keeps ~2 bits)"
