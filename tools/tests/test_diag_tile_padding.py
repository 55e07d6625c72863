"""tools/diag_tile_padding.py: rows the tensor cores compute per tile scheme (pure torch, CPU)."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.diag_tile_padding import main, point_counts, rows_computed, useful_fraction  # noqa: E402


def test_rows_computed_by_hand():
    c = torch.tensor([0, 1, 64, 65, 128, 129, 200, 256])
    # BM 128: 0, 128, 128, 128, 128, 256, 256, 256
    assert rows_computed(c, (128,)) == 1280
    # 128 + 64 tail: 0, 64, 64, 128, 128, 192, 256, 256
    assert rows_computed(c, (64, 128)) == 1088
    # 128 + 16/32/64 tails: 0, 16, 64, 128, 128, 144, 256, 256
    assert rows_computed(c, (16, 32, 64, 128)) == 992
    assert useful_fraction(c, (128,)) == pytest.approx(int(c.sum()) / 1280)
    assert useful_fraction(torch.zeros(4, dtype=torch.int64), (128,)) == 1.0
    with pytest.raises(ValueError, match="heights"):
        rows_computed(c, ())


def test_point_counts_follow_the_bench_routing(capsys):
    c = point_counts("deepseek-v3", 2048, "uniform")
    assert c.shape == (256,) and int(c.sum()) == 2048 * 8
    # more rows per expert pad less; a finer tail never computes more rows
    assert useful_fraction(c, (64,)) > useful_fraction(c, (128,))
    assert rows_computed(c, (16, 32, 64, 128)) <= rows_computed(c, (64, 128)) <= rows_computed(c, (128,))
    assert main(["--points", "deepseek-v3:2048", "--routing", "uniform"]) == 0
    out = capsys.readouterr().out
    assert "| deepseek-v3 T=2048 | uniform | 64 ± 7.8 |" in out
    with pytest.raises(SystemExit, match="shape:T"):
        main(["--points", "deepseek-v3"])
