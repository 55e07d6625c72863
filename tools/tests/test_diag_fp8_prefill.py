"""tools/diag_fp8_prefill.py: its dry run (CPU, Triton interpreter) builds every variant (each an impl with its
KernelOptions), checks each against the W8A8 reference, the TMA kernels bitwise against the pointer kernels
and the pinned Triton TMA gate_up against the plan's own, and fails on any error."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (the interpreter comes with it)")
def test_dry_run():
    from tools.tests.interp import interpreter_env

    proc = subprocess.run([sys.executable, "tools/diag_fp8_prefill.py", "--dry-run"], cwd=ROOT, env=interpreter_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # bf16, fp8_ptr, fp8, fp8_bi, t:bm64, t:bm64_ptr, t:bm64_tma, t:bm64_pers
    assert "8 ok, 0 not" in out, out
    # the TMA kernels (fp8 and t:bm64 under the interpreter's tma=True) equal the pointer kernels at the same tiles
    assert out.count("bitwise_vs_ptr=True") == 2 and "bitwise_vs_ptr=False" not in out, out
    # the gate_up pinned to the Triton TMA kernel equals the plan's choice at the same tiles
    assert out.count("bitwise_vs_base=True") == 1 and "bitwise_vs_base=False" not in out, out
