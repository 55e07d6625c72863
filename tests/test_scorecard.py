"""benchmarks/scorecard.py: the experts' targets read from bench_experts rows (pure Python)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scorecard import load_points, main, scorecard  # noqa: E402


def _row(shape, T, impl, mode, time_s, frac, floor_kind, routing="uniform", status="ok"):
    return dict(shape=shape, routing=routing, T=T, impl=impl, mode=mode, time_s=time_s, roof_frac=frac,
                floor_kind=floor_kind, status=status)


def test_scorecard_targets(tmp_path, capsys):
    rows = [
        _row("mixtral-8x7b", 8192, "moeflow", "eager", 1.0, 0.70, "compute"),
        _row("mixtral-8x7b", 8192, "moeflow", "graph", 1.0, 0.80, "compute"),  # the graph row wins
        _row("mixtral-8x7b", 8192, "moeflow_bi", "graph", 1.2, 0.66, "compute"),
        _row("qwen3-30b-a3b", 1, "moeflow", "graph", 1e-5, 0.50, "hbm"),
        _row("qwen3-30b-a3b", 8, "moeflow", "graph", 1e-5, 0.95, "hbm"),
        _row("deepseek-v3", 2048, "moeflow", "graph", 1e-3, 0.9, "hbm", status="error: boom"),  # ignored
    ]
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"rows": rows}))
    got = {(r["target"], r["shape"], r["T"]): r for r in scorecard(load_points([str(path)]))}
    assert set(got) == {("prefill", "mixtral-8x7b", 8192), ("peer", "mixtral-8x7b", 8192), ("bi_cost", "mixtral-8x7b", 8192),
                        ("decode", "qwen3-30b-a3b", 1), ("peer", "qwen3-30b-a3b", 1), ("decode", "qwen3-30b-a3b", 8)}
    assert got[("prefill", "mixtral-8x7b", 8192)]["met"] and got[("prefill", "mixtral-8x7b", 8192)]["ours"] == 0.80
    assert got[("peer", "mixtral-8x7b", 8192)]["met"]  # 0.80 >= the peer's 0.68
    assert not got[("bi_cost", "mixtral-8x7b", 8192)]["met"]  # +20% > 10%
    assert not got[("decode", "qwen3-30b-a3b", 1)]["met"]  # 2.0x the floor > 1.6x
    assert got[("peer", "qwen3-30b-a3b", 1)]["met"]  # 0.50 >= 0.43
    assert got[("decode", "qwen3-30b-a3b", 8)]["met"]
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "4 of 6 points met." in out and "| bi_cost | mixtral-8x7b | uniform | 8192 | +20.0% | <= 10% | **no** |" in out


def test_scorecard_measured_peer(tmp_path, capsys):
    """Rows of the vLLM peer measured in the run (bench_experts --vllm): the peer target at every point, x >= 1.0."""
    rows = [
        _row("qwen3-30b-a3b", 8, "moeflow", "graph", 100e-6, 0.90, "hbm"),
        _row("qwen3-30b-a3b", 8, "vllm", "graph", 120e-6, 0.75, "hbm"),
        _row("qwen3-30b-a3b", 8, "vllm", "eager", 200e-6, 0.45, "hbm"),  # the graph row wins
        _row("gpt-oss-120b", 512, "moeflow", "graph", 100e-6, 0.90, "hbm"),
        _row("gpt-oss-120b", 512, "vllm", "graph", 95e-6, 0.95, "hbm"),
    ]
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"rows": rows}))
    got = [r for r in scorecard(load_points([str(path)])) if r["target"] == "peer" and r["fmt"] == "ratio"]
    by = {(r["shape"], r["T"]): r for r in got}
    assert set(by) == {("qwen3-30b-a3b", 8), ("gpt-oss-120b", 512)}
    assert by[("qwen3-30b-a3b", 8)]["met"] and abs(by[("qwen3-30b-a3b", 8)]["ours"] - 1.2) < 1e-9
    assert not by[("gpt-oss-120b", 512)]["met"] and abs(by[("gpt-oss-120b", 512)]["ours"] - 0.95) < 1e-9
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| peer | gpt-oss-120b | uniform | 512 | 0.950x | >= 1.00x | **no** |" in out
