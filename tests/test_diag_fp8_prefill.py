"""benchmarks/diag_fp8_prefill.py: its dry run (CPU, Triton interpreter) builds every variant, checks each
against the W8A8 reference, the TMA kernels bitwise against the pointer kernels and the fused gate_up
against the two-dot form, and fails on any error."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (the interpreter comes with it)")
def test_dry_run():
    import os

    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/diag_fp8_prefill.py", "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "21 ok, 0 not" in out, out
    # the TMA kernels (t:bm64, BM 64) equal the pointer kernels at the same tiles
    assert out.count("bitwise_vs_ptr=True") == 2 and "bitwise_vs_ptr=False" not in out, out
    # the fused gate_up (one [BM, 2BN] dot) equals the two-dot form, bf16 and fp8
    # and the flat down equals the tiled down, bf16 and fp8 (and the fp8 Gluon variants equal fp8: on the CPU the
    # flags change nothing)
    assert out.count("bitwise_vs_base=True") == 11 and "bitwise_vs_base=False" not in out, out
