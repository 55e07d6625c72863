"""Sweep the alignment kernels' schedule (issue 16): one-program vs count/scan/scatter, chunk, SUB.

For each (E, K, T) the default schedule and every variant are timed by CUDA events on the same
routing ids (L2 flushed), and every variant's sorted_P / block_expert_B is compared with the
default's as integers (the layout is a pure function of the ids, so any difference is a bug).
Prints one table row per case: default µs, the best variant and its µs, and whether all matched.

    python3 benchmarks/diag_align.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.common import env_info, time_cuda, time_cuda_graph, write_json  # noqa: E402

# (label, E, K, T): the standard shapes' expert counts at decode and prefill sizes.
CASES = [
    ("qwen3 T=1", 128, 8, 1), ("qwen3 T=2", 128, 8, 2), ("qwen3 T=4", 128, 8, 4), ("qwen3 T=8", 128, 8, 8),
    ("gpt-oss T=1", 128, 4, 1), ("gpt-oss T=16", 128, 4, 16), ("deepseek T=1", 256, 8, 1),
    ("deepseek T=8", 256, 8, 8), ("qwen3 T=64", 128, 8, 64), ("qwen3 T=256", 128, 8, 256),
    ("gpt-oss T=512", 128, 4, 512), ("qwen3 T=512", 128, 8, 512), ("qwen3 T=2048", 128, 8, 2048),
    ("qwen3 T=8192", 128, 8, 8192), ("mixtral T=2048", 8, 2, 2048), ("mixtral T=8192", 8, 2, 8192),
    ("deepseek T=512", 256, 8, 512), ("deepseek T=2048", 256, 8, 2048), ("ds-v4.1 T=8192", 384, 6, 8192),
]
BLOCK_M = 64
# Small-kernel launches tried at decode sizes: name -> ALIGN_SMALL_LAUNCH ({NP: (warps, BB elements)}).
SMALL_KNOBS = {"small w4 bb2k": {16: (4, 2048), 32: (4, 2048), 64: (4, 2048)},
               "small w8 bb2k": {16: (4, 2048), 32: (8, 2048), 64: (8, 2048)},
               "small w4 bb8k": {16: (4, 8192), 32: (4, 8192), 64: (4, 8192)},
               "small w8 bb8k": {16: (8, 8192), 32: (8, 8192), 64: (8, 8192)},
               "small w2 bb2k": {16: (2, 2048), 32: (2, 2048), 64: (4, 2048)}}


def _variants():
    """(name, small_max, fused_max, chunk, sub, max_chunks, sorted) for every schedule tried; the first is today's
    default. Every other variant turns the small-N kernel off (small_max 0), so at decode sizes they time the
    histogram kernels it replaced."""
    import moeflow.kernels.moe_align as A

    out = [("default", A.ALIGN_SMALL_MAX, A.ALIGN_FUSED_MAX, A.ALIGN_CHUNK, A.ALIGN_SUB, A.ALIGN_MAX_CHUNKS,
            A.ALIGN_SORTED),
           # the schedule before the small-N kernel: what default replaced at N <= ALIGN_SMALL_MAX
           ("no-small", 0, A.ALIGN_FUSED_MAX, A.ALIGN_CHUNK, A.ALIGN_SUB, A.ALIGN_MAX_CHUNKS, A.ALIGN_SORTED)]
    out += [(name, A.ALIGN_SMALL_MAX, A.ALIGN_FUSED_MAX, A.ALIGN_CHUNK, A.ALIGN_SUB, A.ALIGN_MAX_CHUNKS, A.ALIGN_SORTED)
            for name in SMALL_KNOBS]
    for fused_max in (0, 1 << 30):
        # chunk swept at SUB 32, SUB swept at chunk 1024 (a full grid compiles ~3x as many kernels)
        for chunk, sub in [(c, 32) for c in (128, 256, 512, 1024, 2048)] + [(256, 16), (256, 64)]:
            # the chunk exactly (no cap on the chunk count), serial one-hot steps
            out.append((f"{'multi' if fused_max == 0 else 'one'} c{chunk} s{sub}", 0, fused_max, chunk, sub, 1 << 30,
                        False))
        for chunk in (128, 256, 512, 1024, 2048):  # placed by one sort per chunk
            out.append((f"{'multi' if fused_max == 0 else 'one'} c{chunk} sort", 0, fused_max, chunk, 32, 1 << 30, True))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--cases", default=None, help="comma list of case labels to run (default: all)")
    args = ap.parse_args(argv)
    import moeflow.kernels.moe_align as A

    small_saved = A.ALIGN_SMALL_LAUNCH
    saved = (A.ALIGN_SMALL_MAX, A.ALIGN_FUSED_MAX, A.ALIGN_CHUNK, A.ALIGN_SUB, A.ALIGN_MAX_CHUNKS, A.ALIGN_SORTED)
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    print("GPU us from CUDA graph replays (L2 flushed); 'eager' adds the host's launch gaps")
    print(f"{'case':18} {'N':>7} {'default us':>10} {'best variant':>18} {'best us':>8} {'one-prog best':>14} "
          f"{'multi best':>11}  match")
    wanted = None if args.cases is None else {c.strip() for c in args.cases.split(",")}
    for label, E, K, T in CASES:
        if wanted is not None and label not in wanted:
            continue
        ids_N = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=-1).indices.to(torch.int32).reshape(-1)
        n = ids_N.numel()
        max_blocks = -(-n // BLOCK_M) + min(n, E)
        ref = None
        times = {}
        all_match = True
        for name, small_max, fused_max, chunk, sub, max_chunks, sorted_ in _variants():
            small_n = n <= saved[0]  # the module's ALIGN_SMALL_MAX (variants change it below)
            if (small_n and name not in ("default", "no-small") and name not in SMALL_KNOBS) or (
                    not small_n and name in SMALL_KNOBS):
                continue  # decode sizes: the small kernel's knobs and what it replaced, no schedule grid
            A.ALIGN_SMALL_LAUNCH = SMALL_KNOBS.get(name, small_saved)
            if name.startswith("one") and n > 4096:
                # one program over 16k+ pairs took 1-5 ms (2026-12-03), and its histogram is as wide
                # as the pairs since the launcher's change: not a candidate, not compiled
                continue
            A.ALIGN_SMALL_MAX = small_max
            A.ALIGN_FUSED_MAX, A.ALIGN_CHUNK, A.ALIGN_SUB, A.ALIGN_MAX_CHUNKS = fused_max, chunk, sub, max_chunks
            A.ALIGN_SORTED = sorted_
            sorted_P = torch.empty(max_blocks * BLOCK_M, dtype=torch.int32, device="cuda")
            be_B = torch.empty(max_blocks, dtype=torch.int32, device="cuda")
            scratch = torch.empty(2 * (-(-n // A.align_chunk(n))) * 1024, dtype=torch.int32, device="cuda")

            def step(ids_N=ids_N, E=E, sorted_P=sorted_P, be_B=be_B, scratch=scratch):
                A.align_launch(ids_N, E, BLOCK_M, sorted_P, be_B, scratch=scratch)

            step()
            torch.cuda.synchronize()
            # slots of blocks past the last used one are never written (module doc of moe_align)
            used_P = (be_B >= 0).repeat_interleave(BLOCK_M)
            got = (torch.where(used_P, sorted_P, -1), be_B.clone())
            if ref is None:
                ref = got
            elif not (torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])):
                all_match = False
                print(f"  MISMATCH {label} {name}: sorted_P differs at "
                      f"{int((got[0] != ref[0]).sum())} slots, block_expert at {int((be_B != ref[1]).sum())}")
            # GPU time from a CUDA graph replay: eager events would time the host's launch gaps
            times[name] = time_cuda_graph(step, reps=args.reps) * 1e6
            times[name + " eager"] = time_cuda(step, reps=10, warmup=2) * 1e6
        A.ALIGN_SMALL_MAX, A.ALIGN_FUSED_MAX, A.ALIGN_CHUNK, A.ALIGN_SUB, A.ALIGN_MAX_CHUNKS, A.ALIGN_SORTED = saved
        A.ALIGN_SMALL_LAUNCH = small_saved
        graph = {k: v for k, v in times.items() if not k.endswith(" eager")}
        best = min(graph, key=graph.get)
        one = min((v for k, v in graph.items() if k.startswith("one")), default=float("nan"))
        multi = min((v for k, v in graph.items() if k.startswith("multi")), default=float("nan"))
        print(f"{label:18} {n:7d} {times['default']:10.1f} {best:>18} {times[best]:8.1f} {one:14.1f} {multi:11.1f}"
              f"  {all_match}   eager: default {times['default eager']:.1f}, {best} {times[best + ' eager']:.1f}")
        rows.append({"case": label, "E": E, "K": K, "T": T, "N": n, "times_us": times, "best": best,
                     "all_match": all_match})
    if args.json:
        write_json(args.json, rows, env_info())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
