"""How much of a small decode step's distance to the HBM roof is the benchmark's L2 flush (GPU).

shared/spec/benchmarks.md flushes L2 with a 256 MB write before each timed call. That leaves L2
full of dirty lines, and the timed kernel's first ~L2-size of reads also pays their write-back;
the HBM roof (benchmarks.common.hbm_read_roof_bytes_per_s: 2 GiB read, no flush) never pays it.
Here, per buffer size of the decode points (the weight bytes the experts read):
    read roof at size   the best of torch.amax over a bf16 buffer of that size and torch.sum over
                        it as f32, after a write flush and after a read flush (256 MB read: clean lines)
and the expert pipeline (graph replay) after each flush. Ratios are to the 2 GiB read roof.

--stream adds the size-matched floor of a decode step: benchmarks/stream_read.py's kernel (the
fastest pure read we have; its best configuration at this size, graph-replayed after the write
flush) reading the step's weight bytes, once as one launch and once as two dependent launches
(the gate_up bytes, then the down bytes: the experts' two GEMMs cannot overlap, down needs all of
gate_up's rows). No kernel that reads those bytes after that flush beats these times; the step's
time over them says how much of its distance to the roof is the kernel's own.

    PYTHONPATH=. python tools/diag_flush.py --shapes qwen3-30b-a3b,deepseek-v3-fp8 --tokens 1,8

--ncu: no timing; for each point, between cudaProfilerStart / Stop: [write flush, expert step,
read flush, expert step, write flush, plain read, read flush, plain read] (each step eager, once),
for Nsight Compute with the caches left alone, so each kernel's DRAM write bytes show the
flush's write-back it pays:

    ncu --cache-control none --profile-from-start off --metrics \
        dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \
        python tools/diag_flush.py --ncu --shapes qwen3-30b-a3b --tokens 1
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
from benchmarks.tune_experts import routing  # noqa: E402
from tools.diag_pdl import _shape  # noqa: E402


def read_time(nbytes: int, flush: str, reps: int) -> float:
    """Seconds of the faster read-only reduction over nbytes (bf16 amax, f32 sum) after `flush`."""
    a = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    b = a.view(torch.bfloat16)
    return min(time_cuda(a.sum, reps=reps, flush=flush), time_cuda(b.amax, reps=reps, flush=flush))


def stream_times(nbytes: int, gate_up_bytes: int, flush: str, reps: int, dev, *, timer=None,
                 sms: int | None = None) -> dict:
    """Seconds of the best stream_read configuration over nbytes after `flush` (graph replay):
    {"one": one read of nbytes, "two": gate_up_bytes then the rest, two dependent launches,
    "one_cfg": the configuration (benchmarks.stream_read.reader_name) of "one"}.
    timer(fn) -> seconds and sms replace the CUDA graph timer and the device's SM count (the CPU test)."""
    from benchmarks.stream_read import best_stream_read_bytes_per_s, reader_name, stream_read_fn

    if timer is None:
        def timer(fn):
            return time_cuda_graph(fn, reps=reps, flush=flush)

    words = -(-nbytes // 4)
    buf = torch.ones(words, dtype=torch.int32, device=dev)
    bps, cfg, _ = best_stream_read_bytes_per_s(buf, timer, sms=sms)
    gu_words = -(-gate_up_bytes // 4)
    first, second = buf[:gu_words], buf[gu_words:]
    out1, out2 = (torch.zeros(4096, dtype=torch.int32, device=dev) for _ in range(2))
    best_two = float("inf")
    for c1 in (cfg, dict(cfg, progs_per_sm=4)):  # the smaller second read may want another grid
        for c2 in (cfg, dict(cfg, progs_per_sm=1), dict(cfg, progs_per_sm=4)):
            f1, f2 = stream_read_fn(first, out1, sms=sms, **c1)[0], stream_read_fn(second, out2, sms=sms, **c2)[0]

            def two(f1=f1, f2=f2):
                f1()
                f2()

            best_two = min(best_two, timer(two))
    return {"one": words * 4 / bps, "two": best_two, "one_cfg": reader_name(cfg)}


def _gate_up_bytes(w) -> int:
    """Bytes of one expert's gate_up tensors (weights, scales, bias): the first of the step's two reads."""
    return sum(t.numel() * t.element_size() for n in w.TENSOR_FIELDS
               if n.startswith("gate_up") and (t := getattr(w, n)) is not None) // w.num_experts


def _points(args, dev):
    """The points of --shapes x --tokens, shape by shape (weights built once per shape), each as
    (name, spec, cfg, w, impl, T, x [T, H] bf16, ids / wts [T, K] uniform routing, nbytes: weight
    bytes of the distinct experts the routing touches)."""
    for name in args.shapes.split(","):
        spec, cfg, w, impl = _shape(name, dev)
        for T in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(T, spec["H"], device=dev, dtype=torch.bfloat16)
            ids, wts = routing(T, spec["E"], spec["K"], "uniform", dev)
            distinct = int(torch.unique(ids).numel())
            nbytes = distinct * w.expert_bytes
            yield name, spec, cfg, w, impl, T, x, ids, wts, nbytes, distinct * _gate_up_bytes(w)


def ncu_range(args, dev) -> int:
    """The --ncu mode: one profiled range per point (the order of its kernels is printed)."""
    from benchmarks.common import flush_l2

    for name, _spec, cfg, w, impl, T, x, ids, wts, nbytes, _gu in _points(args, dev):
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
    ap.add_argument("--stream", action="store_true", help="also the size-matched stream_read floors (see above)")
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
    for name, _spec, cfg, w, impl, T, x, ids, wts, nbytes, gu_bytes in _points(args, dev):
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
        if args.stream:
            st = stream_times(nbytes, gu_bytes, "write", args.reps, dev)
            row.update(stream_one_wflush_us=st["one"] * 1e6, stream_two_wflush_us=st["two"] * 1e6,
                       stream_reader=st["one_cfg"])
            print(f"{'':26} stream_read after write flush: one launch {st['one'] * 1e6:.1f} us ({floor / st['one']:.2f} "
                  f"roof), gate_up then down {st['two'] * 1e6:.1f} us ({floor / st['two']:.2f} roof); experts / two "
                  f"launches = {ew / st['two']:.2f}  [{st['one_cfg']}]", flush=True)
    if args.json:
        write_json(args.json, rows, {"env": env_info(), "hbm_read_Bps": roof, "argv": sys.argv})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
