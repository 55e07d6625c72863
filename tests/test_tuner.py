"""benchmarks/tune_experts.refine_best: the stage-sum ranking's best few are re-timed whole (pure logic, CPU)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="refine_best imports moeflow.experts.triton")


def test_refine_keeps_the_fastest_whole_step(monkeypatch):
    import benchmarks.tune_experts as te
    from moeflow.tuning import GemmTile, MoETileConfig

    def cfg(bm, bn):
        t = GemmTile(block_n=bn, block_k=64, num_warps=4, num_stages=3)
        return MoETileConfig(block_m=bm, gate_up=t, down=t)

    a, b, c = cfg(64, 128), cfg(16, 64), cfg(16, 32)
    whole = {a: 9e-6, b: 7e-6, c: 8e-6}  # the stage sums ranked a first; whole steps put b first
    seen = []

    def fake_replay(fn, reps):
        cfg_ = fn.__defaults__[0]
        seen.append(cfg_)
        if cfg_ == c:
            raise RuntimeError("cannot capture")  # a refused candidate is skipped, not fatal
        return whole[cfg_]

    monkeypatch.setattr(te, "time_replay", fake_replay)
    logs = []
    out = te.refine_best(te.shape_spec("tiny-silu"), {1: [(1e-6, a), (2e-6, b), (3e-6, c)]}, reps=2,
                         log=logs.append, dtype=__import__("torch").float32)
    assert seen == [a, b, c]
    best, t, first = out[1]
    assert best == b and t == 7e-6 and first == 9e-6
    assert any("cannot capture" in m for m in logs) and any("against 9.0 us" in m for m in logs)
