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
