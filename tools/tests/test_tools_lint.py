"""tools/ passes `ruff check` with the project's configuration (pyproject.toml), as the product's code does
(tests/test_lint.py)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_passes():
    ruff = shutil.which("ruff")
    cmd = [ruff] if ruff else [sys.executable, "-m", "ruff"]
    try:
        proc = subprocess.run([*cmd, "check", "tools"], cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.fail("ruff is not installed: pip install -e '.[dev]'")
    assert proc.returncode == 0, f"ruff check failed:\n{proc.stdout}\n{proc.stderr}"
