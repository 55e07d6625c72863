"""Benchmark timing plumbing: round-robin graph timing (benchmarks.common) and bench_experts' rotation.

CPU with Triton: `bench_experts.py --dry-run --rotation` times ours, the batch-invariant mode and the vLLM
peer round-robin, one row each. GPU (`-m gpu`): time_cuda_graphs_interleaved returns one positive median
per function, keyed by name, and ranks a 4x larger matmul chain slower.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_interleaved_graph_timing():
    from benchmarks.common import time_cuda_graphs_interleaved

    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)

    def small():
        torch.mm(a, a, out=c)

    def big():
        for _ in range(4):
            torch.mm(a, a, out=c)

    t = time_cuda_graphs_interleaved({"small": small, "big": big}, rounds=3, reps=2)
    assert set(t) == {"small", "big"} and all(v > 0 for v in t.values()), t
    assert t["big"] > 2 * t["small"], t


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
def test_bench_experts_rotation_dry_run(tmp_path):
    import json

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_experts.py"), "--dry-run", "--rotation", "2",
                        "--vllm", "--hf", "", "--no-gmm", "--tokens", "1", "--routing", "uniform", "--shapes", "tiny-silu",
                        "--out-dir", str(tmp_path), "--tag", "rot"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "rot.json").read_text())["rows"]
    timed = {(row["impl"], row["mode"]): row for row in rows}
    for impl in ("moeflow", "moeflow_bi", "vllm"):
        assert timed[(impl, "eager")]["status"] == "ok", timed[(impl, "eager")]
        rot = timed[(impl, "rotation")]  # the dry run's stand-in for the graphs' round-robin
        assert rot["status"].startswith("ok (round-robin") and rot["time_s"] > 0, rot
    assert "vllm_config" in timed[("vllm", "rotation")]


def test_kernel_options_from_arguments():
    """benchmarks.common: --tma / --pdl / --no-fast-launch / --pin become one KernelOptions."""
    import argparse

    from benchmarks.common import add_kernel_options_args, kernel_options, options_record

    ap = argparse.ArgumentParser()
    add_kernel_options_args(ap)
    o = kernel_options(ap.parse_args([]))
    assert (o.tma, o.pdl, o.fast_launch, o.pin) == (None, None, True, ())
    args = ap.parse_args(["--tma", "off", "--pdl", "off", "--no-fast-launch", "--pin", "gate_up=tma_gather_x",
                          "--pin", "down=tma_flat"])
    o = kernel_options(args)
    assert (o.tma, o.pdl, o.fast_launch) == (False, False, False)
    assert o.pinned("gate_up") == "tma_gather_x" and o.pinned("down") == "tma_flat"
    assert options_record(o) == dict(tma=False, pdl=False, fast_launch=False,
                                     pin={"down": "tma_flat", "gate_up": "tma_gather_x"})
    assert kernel_options(ap.parse_args(["--pin", "gate_up=tma,down=tma"]), tma=True).tma is True
    with pytest.raises(ValueError, match="STAGE=VARIANT"):
        kernel_options(ap.parse_args(["--pin", "gate_up"]))
    with pytest.raises(ValueError, match="stage"):
        kernel_options(ap.parse_args(["--pin", "up=tma"]))


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
def test_bench_experts_pinned_variant_dry_run(tmp_path):
    """`--tma on --pin gate_up=tma`: every moeflow row ran the pinned gate_up (its `variants`), and the run's
    metadata names the options (a row is comparable only with rows of the same options)."""
    import json

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_experts.py"), "--dry-run", "--tma", "on",
                        "--pin", "gate_up=tma", "--no-bi", "--hf", "", "--no-gmm", "--tokens", "8", "--routing",
                        "uniform", "--shapes", "tiny-silu", "--out-dir", str(tmp_path), "--tag", "pin"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads((tmp_path / "pin.json").read_text())
    assert out["meta"]["kernel_options"] == dict(tma=True, pdl=None, fast_launch=True, pin={"gate_up": "tma"})
    ours = [row for row in out["rows"] if row["impl"] == "moeflow"]
    assert ours and all(row["status"].startswith("ok") for row in ours), ours
    assert all(row["variants"]["gate_up"] == "tma" for row in ours), ours
