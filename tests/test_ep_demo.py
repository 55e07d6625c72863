"""`torchrun --nproc-per-node N -m moeflow demo --ep N` (the README's command) exits 0 and says OK."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_torchrun_ep_demo_two_ranks():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "moeflow", "demo", "--ep", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "OK: every rank generated the unsharded model's tokens" in out
    assert "rank 1: experts 4..7" in out


def test_ep_0_is_refused_in_one_line(capsys):
    """`moeflow demo --ep 0` is no silent single-process demo: exit 2, one line naming --ep."""
    from moeflow.cli import main

    assert main(["demo", "--ep", "0"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and "moeflow demo: error: --ep=0: expected an int >= 1" in err
