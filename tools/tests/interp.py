"""Run a check of a tools test module under the Triton interpreter in a subprocess (CPU).

As moeflow.testing.run_interpreter_check, for test files two levels below the repository root
(tools/tests/): the calling process never imports Triton in interpreter mode; the root goes first
on PYTHONPATH (the caller's stays after it); CUDA is hidden.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def interpreter_env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}


def run_interpreter_check(script: str, check: str, *, timeout: float = 900) -> None:
    """`python script check` under the interpreter; assert it exited 0 and printed "PASS check"."""
    proc = subprocess.run([sys.executable, script, check], cwd=ROOT, capture_output=True, text=True,
                          env=interpreter_env(), timeout=timeout)
    assert proc.returncode == 0, f"interpreter check {check!r} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    assert f"PASS {check}" in proc.stdout, proc.stdout
