"""tools/diag_half_tiles.py --dry-run (CPU, fp32, a tiny shape under the Triton interpreter, a subprocess):
every variant of a point runs or, pinned to a variant the plan refuses there, says so; each one that
must give its base's bits does (half tiles, the persistent form, the pinned gate_up and down variants:
a row's dot products take the same K steps whatever the tile or schedule). The pinned variants run
through `TritonExperts(options=KernelOptions(pin=...))`."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
def test_diag_half_tiles_dry_run():
    from tools.tests.interp import interpreter_env

    r = subprocess.run([sys.executable, str(ROOT / "tools" / "diag_half_tiles.py"), "--dry-run", "--vllm", "--gmm"],
                       capture_output=True, text=True, env=interpreter_env(), cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if " us " in ln]
    refused = {ln.split()[4] for ln in r.stdout.splitlines() if " refused: " in ln}
    variants = {ln.split()[4] for ln in lines}
    assert {"table", "half", "bi", "bi_half", "bi_pers", "vllm", "gmm"} <= variants, r.stdout
    assert {"gather_x", "no_gather_x", "flat_down", "tiled_down"} <= variants | refused, r.stdout
    assert refused <= {"gather_x", "no_gather_x", "gu_pers_gather_x", "flat_down", "tiled_down"}, r.stdout
    # half tiles, the persistent form and the pinned variants give their base's bits (the bi / table pair may differ)
    for ln in lines:
        if ln.split()[4] in ("half", "bi_half", "bi_pers", "gather_x", "no_gather_x", "flat_down", "tiled_down"):
            assert "bits = " in ln, ln
