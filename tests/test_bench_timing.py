"""Benchmark timing plumbing: round-robin graph timing (benchmarks.common) and the half-tile diagnostic.

CPU with Triton: `benchmarks/diag_half_tiles.py --dry-run` under the Triton interpreter (a
subprocess) runs every variant of a point and prints its bits check; each variant that must give
its base's bits does. `bench_experts.py --dry-run --rotation` times ours, the batch-invariant mode and
the vLLM peer round-robin, one row each. GPU (`-m gpu`): time_cuda_graphs_interleaved returns one positive median per
function, keyed by name, and ranks a 4x larger matmul chain slower.
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


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
def test_diag_half_tiles_dry_run():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "diag_half_tiles.py"), "--dry-run", "--vllm", "--gmm"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if " us " in ln]
    variants = {ln.split()[4] for ln in lines}
    assert {"table", "half", "bi", "bi_half", "bi_pers", "two_dot", "flat_down", "tiled_down", "vllm", "gmm", "ws", "ws_down",
            "ws_gate_up"} <= variants, r.stdout
    # half tiles, the persistent form, the two-dot gate_up and the flat down give their base's bits (the
    # bi / table pair may differ)
    for ln in lines:
        if ln.split()[4] in ("half", "bi_half", "bi_pers", "two_dot", "flat_down", "tiled_down", "ws", "ws_down",
                             "ws_gate_up"):
            assert "bits = " in ln, ln


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
