"""tools/diag_fp8_stages.py --small (CPU, Triton interpreter, a subprocess): every stage's report prints for
both modes and the run ends; the bounds on those numbers are the product's (tests/test_experts_triton_quant.py,
check_fp8_stages)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~3.5 min on 2 cores
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed (the interpreter comes with it)")
def test_small_run_reports_every_stage():
    from tools.tests.interp import interpreter_env

    r = subprocess.run([sys.executable, str(ROOT / "tools" / "diag_fp8_stages.py"), "--small"], cwd=ROOT,
                       capture_output=True, text=True, env=interpreter_env(), timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("E=")]
    assert len(lines) == 2 * 2 * 2, r.stdout  # two cases x two T x (default, batch_invariant)
    for ln in lines:
        assert "quant_x 0 scales / 0 codes" in ln and "ref_device 0 scales / 0 codes" in ln, ln
    assert "done in" in r.stdout
