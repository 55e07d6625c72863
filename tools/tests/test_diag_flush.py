"""tools/diag_flush.py's size-matched floor (stream_times) on the CPU, under the Triton interpreter: the
one-launch and the two-launch (gate_up bytes, then the rest) reads of a buffer whose split is not
word-aligned run and time > 0."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HAS_TRITON = importlib.util.find_spec("triton") is not None


def check_size_matched() -> None:
    from benchmarks.common import time_cpu
    from tools.diag_flush import stream_times

    st = stream_times(4 * 20_000 + 2, 4 * 13_000 + 1, "write", 1, torch.device("cpu"),
                      timer=lambda fn: time_cpu(fn, reps=1, warmup=0), sms=2)
    assert st["one"] > 0 and st["two"] > 0 and st["one_cfg"].startswith("triton stream BLOCK=")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
def test_size_matched_floor_in_the_interpreter():
    from tools.tests.interp import run_interpreter_check

    run_interpreter_check(__file__, "size_matched")


if __name__ == "__main__":  # run_interpreter_check: python tools/tests/test_diag_flush.py size_matched
    from moeflow.testing import patch_interpreter_index

    patch_interpreter_index()
    check_size_matched()
    print(f"PASS {sys.argv[1]}")
