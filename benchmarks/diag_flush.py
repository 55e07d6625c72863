"""How much of a small decode step's distance to the HBM roof is the benchmark's L2 flush (GPU).

shared/spec/benchmarks.md flushes L2 with a 256 MB write before each timed call. That leaves L2
full of dirty lines, and the timed kernel's first ~L2-size of reads also pays their write-back;
the HBM roof (benchmarks.common.hbm_read_roof_bytes_per_s: 2 GiB read, no flush) never pays it.
Here, per buffer size of the decode points (the weight bytes the experts read):
    read roof at size   the best of torch.amax over a bf16 buffer of that size and torch.sum over
                        it as f32, after a write flush and after a read flush (256 MB read: clean lines)
and the expert pipeline (graph replay) after each flush. Ratios are to the 2 GiB read roof.

    PYTHONPATH=. python benchmarks/diag_flush.py --shapes qwen3-30b-a3b,deepseek-v3-fp8 --tokens 1,8

--ncu: no timing; for each point, between cudaProfilerStart / Stop: [write flush, expert step,
read flush, expert step, write flush, plain read, read flush, plain read] (each step eager, once),
for Nsight Compute with the caches left alone, so each kernel's DRAM write bytes show the
flush's write-back it pays:

    ncu --cache-control none --profile-from-start off --metrics \
        dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        python benchmarks/diag_flush.py --ncu --shapes qwen3-30b-a3b --tokens 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import env_info, hbm_read_roof_bytes_per_s, time_cuda, time_cuda_graph, write_json  # noqa: E402
from benchmarks.diag_pdl import _shape  # noqa: E402
from benchmarks.tune_experts import routing  # noqa: E402


def read_time(nbytes: int, flush: str, reps: int) -> float:
    """Seconds of the faster read-only reduction over nbytes (bf16 amax, f32 sum) after `flush`."""
    a = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    b = a.view(torch.bfloat16)
    return min(time_cuda(a.sum, reps=reps, flush=flush), time_cuda(b.amax, reps=reps, flush=flush))


def _points(args, dev):
    """The points of --shapes x --tokens, shape by shape (weights built once per shape), each as
    (name, spec, cfg, w, impl, T, x [T, H] bf16, ids / wts [T, K] uniform routing, nbytes: weight
    bytes of the distinct experts the routing touches)."""
    for name in args.shapes.split(","):
        spec, cfg, w, impl = _shape(name, dev)
        for T in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(T, spec["H"], device=dev, dtype=torch.bfloat16)
            ids, wts = routing(T, spec["E"], spec["K"], "uniform", dev)
            nbytes = int(torch.unique(ids).numel()) * w.expert_bytes
            yield name, spec, cfg, w, impl, T, x, ids, wts, nbytes


def ncu_range(args, dev) -> int:
    """The --ncu mode: one profiled range per point (the order of its kernels is printed)."""
    from benchmarks.common import flush_l2

    for name, _spec, cfg, w, impl, T, x, ids, wts, nbytes in _points(args, dev):
        buf = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=dev)
        for _ in range(3):  # compile and warm outside the range
            impl.forward_tokens(x, ids, wts, w, cfg)
            buf.amax()
            flush_l2("write")
            flush_l2("read")
        torch.cuda.synchronize()
        print(f"ncu range {name} T={T}: {nbytes / 1e6:.1f} MB of weights; kernels in order: write flush, "
              "step, read flush, step, write flush, amax read, read flush, amax read", flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        for kind in ("write", "read"):
            flush_l2(kind)
            impl.forward_tokens(x, ids, wts, w, cfg)
        for kind in ("write", "read"):
            flush_l2(kind)
            buf.amax()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-fp8")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--json", default=None)
    ap.add_argument("--ncu", action="store_true", help="profile range for ncu --cache-control none (see above)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    if args.ncu:
        return ncu_range(args, dev)
    roof = hbm_read_roof_bytes_per_s()
    print(f"HBM read roof (2 GiB, no flush) {roof / 1e12:.3f} TB/s")
    print(f"{'point':26} {'MB':>7} {'floor us':>8} | {'read after write-flush':>24} {'read after read-flush':>24} |"
          f" {'experts write-flush':>20} {'experts read-flush':>20}")
    rows = []
    for name, _spec, cfg, w, impl, T, x, ids, wts, nbytes in _points(args, dev):
        floor = nbytes / roof
        rw, rr = read_time(nbytes, "write", args.reps), read_time(nbytes, "read", args.reps)

        def step(x=x, ids=ids, wts=wts, w=w, cfg=cfg, impl=impl):
            impl.forward_tokens(x, ids, wts, w, cfg)

        ew = time_cuda_graph(step, reps=args.reps, flush="write")
        er = time_cuda_graph(step, reps=args.reps, flush="read")
        row = dict(shape=name, T=T, weight_bytes=nbytes, floor_us=floor * 1e6, read_wflush_us=rw * 1e6,
                   read_rflush_us=rr * 1e6, experts_wflush_us=ew * 1e6, experts_rflush_us=er * 1e6)
        rows.append(row)
        print(f"{name + ' T=' + str(T):26} {nbytes / 1e6:7.1f} {floor * 1e6:8.1f} | "
              f"{rw * 1e6:9.1f} us ({floor / rw:.2f} roof) {rr * 1e6:9.1f} us ({floor / rr:.2f} roof) | "
              f"{ew * 1e6:8.1f} ({floor / ew:.2f}) {er * 1e6:11.1f} ({floor / er:.2f})")
    if args.json:
        write_json(args.json, rows, {"env": env_info(), "hbm_read_Bps": roof, "argv": sys.argv})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
