"""Useful MMA rows per tile scheme at the benchmark's own routing (CPU, no timing).

Legend: T tokens, K slots, E experts; an expert with c (token, slot) rows computes its rows in
tiles of BM rows, so ceil(c / BM) * BM rows go through the tensor cores. "useful" = real rows /
rows computed, over all experts. Schemes:
    BM<n>        every tile n rows (what the aligned kernels run today, n = the tuned block_m);
    128+<tails>  full 128-row tiles, then one tail tile of the smallest listed height that holds
                 the expert's remainder (64: wgmma's M per warpgroup; smaller tails only save work
                 where the kernel can issue smaller MMAs).
Why: where a prefill point misses its compute roof, padding is one suspect; at deepseek-v3 T = 8192
(256 +- 15 rows per expert) BM 128 computes 19% padding (`python3 tools/diag_tile_padding.py`).

    python3 tools/diag_tile_padding.py                                  # the standard prefill points
    python3 tools/diag_tile_padding.py --points deepseek-v3:8192,qwen3-30b-a3b:2048 --routing zipf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.tune_experts import routing, shape_spec  # noqa: E402

DEFAULT_POINTS = ("qwen3-30b-a3b:8192,deepseek-v3:8192,gpt-oss-120b:8192,mixtral-8x7b:2048,mixtral-8x7b:8192,"
                  "ds-v4.1-like:8192,qwen3-30b-a3b:2048,deepseek-v3:2048")
SCHEMES = {"BM64": (64,), "BM128": (128,), "128+64": (64, 128), "128+16/32/64": (16, 32, 64, 128)}


def rows_computed(counts_E: torch.Tensor, heights: tuple[int, ...]) -> int:
    """Rows the tensor cores compute for per-expert row counts [E] (int) when full tiles are
    max(heights) rows and the remainder takes the smallest height that holds it."""
    if not heights or min(heights) <= 0:
        raise ValueError(f"heights: {heights!r}, expected positive tile heights")
    top = max(heights)
    full, rem = torch.div(counts_E, top, rounding_mode="floor"), counts_E % top
    tail = torch.zeros_like(rem)
    for h in sorted(heights, reverse=True):  # the smallest height >= rem wins (set last)
        tail = torch.where((rem > 0) & (rem <= h), torch.full_like(rem, h), tail)
    return int((full * top + tail).sum())


def useful_fraction(counts_E: torch.Tensor, heights: tuple[int, ...]) -> float:
    """Real rows / rows computed (1.0 when nothing is routed)."""
    computed = rows_computed(counts_E, heights)
    return 1.0 if computed == 0 else int(counts_E.sum()) / computed


def point_counts(shape: str, T: int, dist: str, seed: int = 0) -> torch.Tensor:
    """int64 [E] rows per expert of bench_experts' routing at (shape, T, dist, seed)."""
    spec = shape_spec(shape)
    ids, _ = routing(T, spec["E"], spec["K"], dist, "cpu", seed=seed)
    return torch.bincount(ids.reshape(-1).long(), minlength=spec["E"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=DEFAULT_POINTS, help="comma list of shape:T")
    ap.add_argument("--routing", default="uniform,zipf")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    print("| point | routing | rows per expert (mean ± sd) | " + " | ".join(SCHEMES) + " |")
    print("|---" * (3 + len(SCHEMES)) + "|")
    for item in args.points.split(","):
        shape, _, t = item.partition(":")
        if not t.isdigit():
            raise SystemExit(f"--points: {item!r}, expected shape:T (e.g. deepseek-v3:8192)")
        for dist in args.routing.split(","):
            c = point_counts(shape, int(t), dist, args.seed)
            fr = " | ".join(f"{useful_fraction(c, h):.3f}" for h in SCHEMES.values())
            print(f"| {shape} T={t} | {dist} | {c.float().mean():.0f} ± {c.float().std():.1f} | {fr} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
