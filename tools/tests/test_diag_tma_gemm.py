"""tools/diag_tma_gemm.py --dry-run (CPU, Triton interpreter, a subprocess): the TMA and persistent GEMMs
(moeflow/kernels/moe_gemm_tma.py) against the pointer kernels on a tiny shape; the tool exits 1 on a
wrong variant."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (the interpreter comes with it)")
def test_dry_run_matches_the_pointer_kernels():
    from tools.tests.interp import interpreter_env

    r = subprocess.run([sys.executable, str(ROOT / "tools" / "diag_tma_gemm.py"), "--dry-run"], cwd=ROOT,
                       capture_output=True, text=True, env=interpreter_env(), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count(" tma ") == 2 and r.stdout.count(" pers ") == 2, r.stdout
