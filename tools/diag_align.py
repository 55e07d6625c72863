"""Sweep the alignment kernels' schedule: the small-N kernel's launch, one program, count/place chunks (GPU).

For each (E, K, T) the library's alignment (moeflow.kernels.moe_align.align_launch) and every variant are
timed by CUDA-graph replay on the same routing ids (L2 flushed), and every variant's sorted_P /
block_expert_B is compared with the default's as integers (the layout is a pure function of the ids, so
any difference is a bug). The variants launch the alignment kernels themselves with the schedule's
parameters given here (nothing in the library is changed):
    small <knob>   N <= ALIGN_SMALL_MAX: moe_align_small_kernel at other (warps, block-owner elements)
    fused          one program (moe_align_fused_kernel), its chunk as the library picks it
    one c<C>       one program, C pairs a chunk (N <= 4096: one program over more pairs took 1-5 ms)
    multi c<C>     count + place (moe_align_count_kernel, moe_align_place_kernel), C pairs a chunk
Chunks are placed as the library places them on the GPU (the sorted placement, where the kernels take
SORTED). Prints one table row per case: default µs, the best variant and its µs, and whether all matched.

    python3 tools/diag_align.py [--json OUT.json] [--cases "qwen3 T=1,qwen3 T=2048"]
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
# Small-kernel launches tried at decode sizes: name -> {NP: (warps, BB elements)}.
SMALL_KNOBS = {"small w4 bb2k": {16: (4, 2048), 32: (4, 2048), 64: (4, 2048)},
               "small w8 bb2k": {16: (4, 2048), 32: (8, 2048), 64: (8, 2048)},
               "small w4 bb8k": {16: (4, 8192), 32: (4, 8192), 64: (4, 8192)},
               "small w8 bb8k": {16: (8, 8192), 32: (8, 8192), 64: (8, 8192)},
               "small w2 bb2k": {16: (2, 2048), 32: (2, 2048), 64: (4, 2048)}}
CHUNKS = (128, 256, 512, 1024, 2048)


def _meta(kernel, **kw) -> dict:
    """kw less the constexprs `kernel` does not take (the kernels' parameters are the library's)."""
    names = set(getattr(kernel, "arg_names", kw))
    return {k: v for k, v in kw.items() if k in names}


def _warps(e_pad: int) -> int:
    return 4 if e_pad <= 256 else 8  # as align_launch: ~32 ints a thread for the [*, E_PAD] matrices


def small_launch(knob: dict):
    """A step launching moe_align_small_kernel with `knob` ({NP: (warps, BB elements)})."""
    import moeflow.kernels.moe_align as A

    def launch(ids_N, E, sorted_P, be_B, scratch):
        n = ids_N.numel()
        np_ = max(16, A._next_pow2(n))
        warps, bb = knob.get(np_, (8, 8192))
        k = A.moe_align_small_kernel
        k[(1,)](ids_N, sorted_P, be_B, n, E, be_B.numel(),
                **_meta(k, BLOCK_M=BLOCK_M, NP=np_, FB=1024, BB=max(16, bb // np_)), num_warps=warps)
    return launch


def one_program_launch(chunk: int | None):
    """A step launching moe_align_fused_kernel (one program); chunk None: the library's chunk for N."""
    import moeflow.kernels.moe_align as A

    def launch(ids_N, E, sorted_P, be_B, scratch):
        n = ids_N.numel()
        c = chunk or (64 if n <= 64 else min(A._next_pow2(n), 4096))
        e_pad = A._next_pow2(E + 1)
        k = A.moe_align_fused_kernel
        k[(1,)](ids_N, sorted_P, be_B, n, E, be_B.numel(),
                **_meta(k, BLOCK_M=BLOCK_M, E_PAD=e_pad, CHUNK=c, SUB=A.ALIGN_SUB, BLOCKS=A.ALIGN_BLOCKS,
                        SORTED=c >= n), num_warps=_warps(e_pad))
    return launch


def multi_launch(chunk: int):
    """A step launching moe_align_count_kernel + moe_align_place_kernel, `chunk` pairs a chunk."""
    import triton

    import moeflow.kernels.moe_align as A

    def launch(ids_N, E, sorted_P, be_B, scratch):
        n = ids_N.numel()
        e_pad = A._next_pow2(E + 1)
        num_chunks = triton.cdiv(n, chunk)
        counts = scratch[: num_chunks * e_pad]
        kc, kp = A.moe_align_count_kernel, A.moe_align_place_kernel
        kc[(num_chunks,)](ids_N, counts, n, E, **_meta(kc, CHUNK=chunk, E_PAD=e_pad), num_warps=4)
        kp[(num_chunks,)](ids_N, counts, sorted_P, be_B, n, E, num_chunks, be_B.numel(),
                          **_meta(kp, BLOCK_M=BLOCK_M, E_PAD=e_pad, CHUNK=chunk, SUB=A.ALIGN_SUB,
                                  BLOCKS=A.ALIGN_BLOCKS, ROWS=A.ALIGN_ROWS, SORTED=True),
                          num_warps=_warps(e_pad))
    return launch


def _variants(n: int) -> list[tuple[str, object]]:
    """(name, launch) of every schedule tried at N = n pairs; the first is the library's own."""
    import moeflow.kernels.moe_align as A

    def default(ids_N, E, sorted_P, be_B, scratch):
        A.align_launch(ids_N, E, BLOCK_M, sorted_P, be_B, scratch=scratch)

    out = [("default", default)]
    if n <= A.ALIGN_SMALL_MAX:  # decode sizes: the small kernel's knobs and the one program it replaced
        out += [(name, small_launch(knob)) for name, knob in SMALL_KNOBS.items()]
        out.append(("fused", one_program_launch(None)))
        return out
    if n <= 4096:
        out += [(f"one c{c}", one_program_launch(c)) for c in CHUNKS]
    out += [(f"multi c{c}", multi_launch(c)) for c in CHUNKS]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--cases", default=None, help="comma list of case labels to run (default: all)")
    args = ap.parse_args(argv)

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
        for name, launch in _variants(n):
            sorted_P = torch.empty(max_blocks * BLOCK_M, dtype=torch.int32, device="cuda")
            be_B = torch.empty(max_blocks, dtype=torch.int32, device="cuda")
            # the largest chunk histograms any variant asks for (chunks of >= 128 pairs, E_PAD <= 1024)
            scratch = torch.empty(2 * (-(-n // 128) + 1) * 1024, dtype=torch.int32, device="cuda")

            def step(launch=launch, ids_N=ids_N, E=E, sorted_P=sorted_P, be_B=be_B, scratch=scratch):
                launch(ids_N, E, sorted_P, be_B, scratch)

            try:
                step()
                torch.cuda.synchronize()
            except Exception as exc:  # a schedule the kernels refuse is a result, not the end of the sweep
                print(f"  {label} {name}: error {type(exc).__name__}: {str(exc)[:160]}")
                continue
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
        graph = {k: v for k, v in times.items() if not k.endswith(" eager")}
        best = min(graph, key=graph.get)
        one = min((v for k, v in graph.items() if k.startswith(("one", "fused"))), default=float("nan"))
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
