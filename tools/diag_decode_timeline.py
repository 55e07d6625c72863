"""Where a decode step's time goes: each kernel's start and duration inside one CUDA-graph replay (GPU).

For each shape and T, the expert pipeline (TritonExperts / TritonQuantExperts, default tiles) is
captured in a CUDA graph, the L2 flushed (256 MB write) before each replay, and the replays are
recorded by the torch profiler (CUPTI kernel records carry GPU start and end times). Per kernel:
its start after the first kernel's start, its duration, and the gap since the previous kernel
ended (negative: it overlapped, as programmatic dependent launch allows); medians over --reps
replays. Printed once in plain stream order (KernelOptions(pdl=False)) and once with the defaults
(programmatic dependent launch on sm_90 or newer).

    PYTHONPATH=. python tools/diag_decode_timeline.py --shapes qwen3-30b-a3b --tokens 1,8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import env_info, flush_l2, write_json  # noqa: E402
from benchmarks.tune_experts import routing  # noqa: E402
from moeflow.experts.options import KernelOptions  # noqa: E402
from tools.diag_pdl import _shape, make_impl  # noqa: E402


def _replay_kernels(g: torch.cuda.CUDAGraph, reps: int) -> list[list[tuple[str, float, float]]]:
    """Per replay: [(kernel name, start us, end us)] in start order, the flush kernel left out."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush_l2()
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    replays, cur = [], []
    for e in evs:
        if "fill" in e.name or "FillFunctor" in e.name or "zero" in e.name.lower():  # the L2 flush
            if cur:
                replays.append(cur)
            cur = []
            continue
        cur.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    if cur:
        replays.append(cur)
    return replays


def timeline(replays: list[list[tuple[str, float, float]]]) -> list[dict]:
    """Median start / duration / gap per kernel position over replays with the same kernel count."""
    n = statistics.mode(len(r) for r in replays)
    rs = [r for r in replays if len(r) == n]
    rows = []
    for i in range(n):
        starts = [r[i][1] - r[0][1] for r in rs]
        durs = [r[i][2] - r[i][1] for r in rs]
        gaps = [r[i][1] - r[i - 1][2] for r in rs] if i else [0.0]
        rows.append(dict(kernel=rs[0][i][0][:60], start_us=statistics.median(starts),
                         dur_us=statistics.median(durs), gap_us=statistics.median(gaps)))
    total = statistics.median(r[-1][2] - r[0][1] for r in rs)
    rows.append(dict(kernel="first start -> last end", start_us=0.0, dur_us=total, gap_us=0.0))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    out_rows = []
    for name in args.shapes.split(","):
        spec, cfg, w, _ = _shape(name, dev)
        modes = {"stream": make_impl(name, KernelOptions(pdl=False)), "pdl": make_impl(name, KernelOptions())}
        for T in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(T, spec["H"], device=dev, dtype=torch.bfloat16)
            ids, wts = routing(T, spec["E"], spec["K"], "uniform", dev)
            for mode, impl in modes.items():
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        impl.forward_tokens(x, ids, wts, w, cfg)
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    impl.forward_tokens(x, ids, wts, w, cfg)
                rows = timeline(_replay_kernels(g, args.reps))
                print(f"\n{name} T={T} {mode}: median of {args.reps} replays, L2 flushed")
                print(f"  {'kernel':60} {'start':>7} {'dur':>7} {'gap':>6}")
                for r in rows:
                    print(f"  {r['kernel']:60} {r['start_us']:7.1f} {r['dur_us']:7.1f} {r['gap_us']:6.1f}")
                    out_rows.append(dict(shape=name, T=T, mode=mode, **r))
    if args.json:
        write_json(args.json, out_rows, {"env": env_info(), "argv": sys.argv})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
