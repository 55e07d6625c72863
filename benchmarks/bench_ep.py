"""Expert-parallel dispatch + combine: time and bytes moved, against the naive plan and the roof.

    torchrun --nproc-per-node 4 benchmarks/bench_ep.py            # gloo on CPU, NCCL on GPUs
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --tokens 1,64

What is timed (per rank, median of --reps, then the slowest rank), with the experts
replaced by the identity (y = x) so only the exchange is measured:
    a2a         moeflow all_to_all dynamic mode: counts exchange, token rows (one per
                (token, destination rank)) + pair metadata out, y rows back, weighted
                combine in slot order on the source rank (AllToAllDispatcher + combine_TH).
    a2a_static  the decode mode (fixed worst-case buffers, no host read), T <= 64 only.
    naive       the peer plan: all_gather of every rank's tokens and picks, each rank sums
                its experts' weighted outputs for all W*T tokens, reduce_scatter back.
    roof        a bare all_to_all_single moving the same bytes as `a2a` (one call, equal
                splits): what the transport gives for those bytes.
Columns: us (slowest rank), MB_sent (per rank, to other ranks), vs_naive = naive us / us,
roof_frac = roof us / us (1.0 = a2a costs no more than its bytes on the wire).

Every plan is checked against the single-process combine of the same routing before it
is timed (a2a / a2a_static bit for bit, naive within bf16 rounding), and a wrong one is
refused. Routing: uniform and Zipf(s = 1.2) over experts, fixed seed, K distinct per token.

CPU scaling (gloo, `--h-div`, default 4 on CPU, 1 on CUDA): H is divided by h-div, so
rows are H/4 wide (mixtral 1024, deepseek-v3 1792, ...); E and K are the standard ones;
T per rank from --tokens (default 1,16,128,512,2048 on CPU: the standard list thinned;
1..2048 on GPU). About 90 s with 4 ranks on 2 CPU cores.

Legend: T tokens per rank, H hidden, E experts, K picks, W ranks.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import STANDARD_SHAPES, env_info, format_table, write_json  # noqa: E402
from moeflow.parallel.all_to_all import AllToAllDispatcher  # noqa: E402
from moeflow.parallel.dist_utils import leave_process_group  # noqa: E402
from moeflow.parallel.local import combine_TH  # noqa: E402
from moeflow.parallel.plan import Placement  # noqa: E402

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _routing(T: int, E: int, K: int, kind: str, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        p = torch.ones(E)
    else:  # Zipf s = 1.2 over a fixed random expert order
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        p = p[torch.randperm(E, generator=g)].float()
    ids = torch.multinomial(p.expand(T, E), K, replacement=False, generator=g) if T else torch.zeros(0, K).long()
    w = torch.rand(T, K, generator=g)
    w = w / w.sum(1, keepdim=True)
    return ids.to(torch.int32).to(device), w.to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, reps: int, warmup: int = 2) -> float:
    """Median seconds on this rank, each rep started together (barrier outside the timing)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _max_over_ranks(v: float, device) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _mean_over_ranks(v: float, device) -> float:
    t = torch.tensor([v], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def bench_point(shape: str, dims: dict, T: int, kind: str, *, h_div: int, reps: int, device, dtype) -> list[dict]:
    W, me = dist.get_world_size(), dist.get_rank()
    H, E, K = max(8, dims["H"] // h_div), dims["E"], dims["K"]
    placement = Placement.contiguous(E, W)
    rank_of_E, _ = placement.tensors(device)
    seed = 1000 * me + T
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype).to(device)
    ids, w = _routing(T, E, K, kind, seed, device)
    elem = x.element_size()
    # Reference: identity experts, single-process combine in slot order.
    ref = combine_TH(x.unsqueeze(1).expand(T, K, H), w, out_dtype=dtype)
    group = dist.group.WORLD
    rows = []
    base = dict(shape=shape, H=H, E=E, K=K, W=W, T=T, routing=kind)

    # --- moeflow all_to_all (dynamic)
    disp = AllToAllDispatcher(placement, group)

    def a2a():
        h = disp.dispatch_pairs(x, ids, w)
        y = disp.combine_pairs(h.recv_x_NH, h)
        return combine_TH(y, w, out_dtype=dtype), h

    out, h = a2a()
    ok = bool(torch.equal(out, ref))
    bytes_a2a = h.bytes_moved(elem)
    results = {"a2a": (_time(lambda: a2a(), device, reps) if _all_ok(ok, device) else None, bytes_a2a)}

    # --- static decode mode
    if T <= 64:
        sdisp = AllToAllDispatcher(placement, group, static_tokens=T)

        def a2a_static():
            hs = sdisp.dispatch_pairs(x, ids, w)
            return combine_TH(sdisp.combine_pairs(hs.recv_x_NH, hs), w, out_dtype=dtype), hs

        out_s, hs = a2a_static()
        ok_s = bool(torch.equal(out_s, ref))
        results["a2a_static"] = (_time(lambda: a2a_static(), device, reps) if _all_ok(ok_s, device) else None,
                                 hs.bytes_moved(elem))

    # --- naive: all_gather tokens + picks, local experts on every token, reduce_scatter
    picks = torch.stack([ids, w.view(torch.int32)], dim=2).contiguous()

    def naive():
        x_all = x.new_empty((W * T, H))
        p_all = picks.new_empty((W * T, K, 2))
        _all_gather(x_all, x.contiguous(), group=group)
        _all_gather(p_all, picks, group=group)
        ids_all = p_all[..., 0].long()
        w_all = p_all[..., 1].contiguous().view(torch.float32)
        mine = rank_of_E[ids_all] == me
        w_mine = torch.where(mine, w_all, torch.zeros((), device=device))
        partial = (w_mine.sum(1, keepdim=True) * x_all.float()).to(dtype)  # identity experts
        out_n = x.new_empty((T, H))
        _reduce_scatter(out_n, partial, group=group)
        return out_n

    out_n = naive()
    ok_n = bool(torch.allclose(out_n.float(), ref.float(), rtol=2e-2, atol=2e-2))
    bytes_naive = (W - 1) * T * (H * elem + K * 8) + (W - 1) * T * H * elem
    results["naive"] = (_time(naive, device, reps) if _all_ok(ok_n, device) else None, bytes_naive)

    # --- roof: one bare all_to_all_single of a2a's bytes (mean over ranks, equal splits)
    mean_bytes = _mean_over_ranks(bytes_a2a, device)
    per_peer_rows = max(1, math.ceil(mean_bytes / max(W - 1, 1) / (H * elem)))
    buf_in = torch.randn(W * per_peer_rows, H).to(dtype).to(device)
    buf_out = torch.empty_like(buf_in)
    results["roof"] = (_time(lambda: dist.all_to_all_single(buf_out, buf_in, group=group), device, reps),
                       (W - 1) * per_peer_rows * H * elem)

    t_a2a = _max_over_ranks(results["a2a"][0] or float("nan"), device)
    t_naive = _max_over_ranks(results["naive"][0] or float("nan"), device)
    t_roof = _max_over_ranks(results["roof"][0], device)
    for impl, (t, nbytes) in results.items():
        t_max = _max_over_ranks(t if t is not None else float("nan"), device)
        mb = _max_over_ranks(nbytes, device) / 1e6
        row = dict(base, impl=impl, us=t_max * 1e6, MB_sent=mb, checked="ok" if t is not None else "WRONG")
        if impl in ("a2a", "a2a_static"):
            row["vs_naive"] = t_naive / t_max
            row["roof_frac"] = t_roof / t_max
        elif impl == "naive":
            row["vs_a2a"] = t_a2a / t_max
        rows.append(row)
    return rows


def _all_ok(ok: bool, device) -> bool:
    """Every rank's check passed (all ranks must agree on whether to time: it is collective)."""
    t = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t) == 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(STANDARD_SHAPES))
    ap.add_argument("--tokens", default=None, help="comma-separated T per rank")
    ap.add_argument("--routing", default="uniform,zipf")
    ap.add_argument("--h-div", type=int, default=None, help="divide H by this (default 16 on CPU, 1 on CUDA)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default="out", help="directory for bench_ep_<backend>_w<W>.json")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    args = ap.parse_args(argv)

    if "RANK" not in os.environ:
        print("bench_ep: launch with torchrun, e.g. `torchrun --nproc-per-node 4 benchmarks/bench_ep.py`")
        return 2
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    W, me = dist.get_world_size(), dist.get_rank()
    h_div = args.h_div or (1 if use_cuda else 4)
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    else:
        tokens = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048] if use_cuda else [1, 16, 128, 512, 2048]
    reps = args.reps or (20 if use_cuda else 10)
    dtype = torch.bfloat16
    rows = []
    t0 = time.perf_counter()
    for shape in args.shapes.split(","):
        dims = STANDARD_SHAPES[shape]
        if dims["E"] % W:
            if me == 0:
                print(f"skip {shape}: E={dims['E']} does not split over {W} ranks")
            continue
        for T in tokens:
            for kind in args.routing.split(","):
                rows += bench_point(shape, dims, T, kind, h_div=h_div, reps=reps, device=device, dtype=dtype)
    backend = dist.get_backend()
    if me == 0:
        meta = {**env_info(), "backend": str(backend), "world_size": W, "h_div": h_div, "dtype": str(dtype),
                "reps": reps, "seconds": time.perf_counter() - t0}
        name = f"bench_ep_{backend}_w{W}.json"
        write_json(Path(args.out) / name, rows, meta)
        print(f"### EP dispatch+combine, {backend}, W={W}, bf16, H/{h_div}, reps={reps} "
              f"({meta['seconds']:.0f} s; JSON: {Path(args.out) / name})\n")
        print(format_table(rows, ["shape", "H", "T", "routing", "impl", "us", "MB_sent", "vs_naive",
                                  "roof_frac", "vs_a2a", "checked"]))
    leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
