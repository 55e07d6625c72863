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

Legend: T tokens per rank, H hidden, E experts, K picks, W ranks, R redundant copies, L layers.

Load-balance simulation (`--simulate`: CPU, no process group, pure arithmetic on routings):

    python benchmarks/bench_ep.py --simulate                 # ~70 s on 2 CPU cores
    python benchmarks/bench_ep.py --simulate --trace my.jsonl.gz --worlds 8,16

Routings: the embedded model's trace (`moeflow trace record moeflow/assets/tiny-moe --tokens 4096
--ctx 256`, stored as benchmarks/results/tiny_moe_trace.jsonl.gz; any --trace file works), and
bench_offload's skewed synthetic routing (Zipf(1.2) per-layer logit bias, correlated tokens
x_{t+1} = 0.8 x_t + 0.6 noise, the family's router) for deepseek-v3 and qwen3-30b-a3b shapes.
Tokens form steps of --step-tokens (the W ranks hold equal consecutive blocks). The expert load
of the first half of the steps plans the placement (moeflow.parallel.plan_placement, R =
0, W/4, W/2, W); the second half is served: every rank maps its tokens' picks to copies with
the runtime's rule (moeflow.parallel.plan.physical_ids, offset = its rank). Per layer step:
imbalance = max over ranks of the pairs computed / their mean (summed over steps and layers
as `ModelPlacement.imbalance` does; imb_planned: the placement on the load it was planned
from; imb_window: on the served half's load as a whole, without the per-step noise), rows a rank sends (one per token and remote destination,
the dynamic all_to_all's rows) and bytes it sends (those rows in bf16 with their metadata,
plus the pairs it computed for other ranks, back in bf16), max over ranks vs the mean (the
ideal, every rank the same). "before": the placement without EPLB (expert e on rank e*W//E,
one copy each).
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


# ---------------------------------------------------------------------------- load-balance simulation

TINY_TRACE = Path(__file__).resolve().parent / "results" / "tiny_moe_trace.jsonl.gz"
_RECORD = [sys.executable, "-m", "moeflow", "trace", "record", "moeflow/assets/tiny-moe", "--tokens", "4096",
           "--ctx", "256"]


def trace_routings(path: Path) -> tuple[str, list[torch.Tensor], int]:
    """(name, per layer int64 [N, K] ids in token order over the trace's passes, H of one row in bytes-ish)."""
    from moeflow.offload.trace import Trace

    tr = Trace.load(path)
    per_layer: list[list[list[int]]] = [[] for _ in range(tr.num_layers)]
    for st in tr.steps:
        per_layer[st.layer].extend(st.ids)
    return path.name.split(".")[0], [torch.tensor(rows, dtype=torch.int64) for rows in per_layer], tr.num_experts[0]


def synthetic_routings(shape: str, L: int, N: int, seed: int = 0, zipf_s: float = 1.2) -> list[torch.Tensor]:
    """bench_offload's skewed routing for `shape`: per layer int64 [N, K] ids of N correlated tokens."""
    from benchmarks.bench_offload import token_inputs
    from moeflow.routing.router import route
    from moeflow.routing.spec import RouterSpec

    s = STANDARD_SHAPES[shape]
    H, E, K = s["H"], s["E"], s["K"]
    if shape.startswith("deepseek"):
        spec = RouterSpec(score_fn="sigmoid", num_experts=E, top_k=K, renorm=True, renorm_eps=1e-20,
                          scaling_factor=2.5, n_group=8, topk_group=4, use_bias=True)
    else:
        spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=K, renorm=True)
    x = torch.cat(token_inputs(N, H, "cpu", torch.float32, seed=seed + 1))
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, E + 1, dtype=torch.float32)
    out = []
    for idx in range(L):
        perm = torch.randperm(E, generator=torch.Generator().manual_seed(seed * 1000 + idx))
        w_EH = torch.randn(E, H, generator=g) * (2.0 / math.sqrt(H))
        # plain f32 logits (the runtime's batch-invariant CPU GEMM is ~10x slower; same selection rule)
        logits = x @ w_EH.t() + (-zipf_s * torch.log(ranks))[perm]
        out.append(route(logits, spec, bias=torch.zeros(E) if spec.use_bias else None).ids_TK.to(torch.int64))
    return out


def simulate_serving(ids_L: list[torch.Tensor], placements, W: int, H: int, K: int, step_tokens: int,
                     elem: int = 2) -> dict:
    """Serve each step of ids_L (per layer [N, K]) under per-layer placements; totals over steps and layers."""
    from moeflow.parallel.plan import physical_ids

    N = int(ids_L[0].shape[0])
    per = step_tokens // W
    row_bytes = H * elem + 4 * (1 + 2 * K)  # the dynamic all_to_all's packed row
    acc = {"max_pairs": 0.0, "mean_pairs": 0.0, "max_rows": 0.0, "mean_rows": 0.0, "max_bytes": 0.0,
           "mean_bytes": 0.0, "steps": 0}
    for start in range(0, N - step_tokens + 1, step_tokens):
        for ids_NK, p in zip(ids_L, placements):
            pairs_W = torch.zeros(W, dtype=torch.int64)
            rows_W = torch.zeros(W, dtype=torch.int64)
            back_W = torch.zeros(W, dtype=torch.int64)  # pairs a rank computed for other ranks
            for r in range(W):
                ids = ids_NK[start + r * per: start + (r + 1) * per]
                phys = physical_ids(ids, p, copy_offset=r)
                dest = p.rank_of_Q[phys.clamp(min=0)].masked_fill(phys < 0, -1)
                pairs_W += torch.bincount(dest[dest >= 0], minlength=W)
                remote = (dest >= 0) & (dest != r)
                back_W += torch.bincount(dest[remote], minlength=W)
                # one row per (token, remote destination)
                visit = torch.zeros(int(ids.shape[0]), W + 1, dtype=torch.bool)
                visit.scatter_(1, torch.where(remote, dest, torch.full_like(dest, W)), True)
                rows_W[r] = int(visit[:, :W].sum())
            bytes_W = rows_W * row_bytes + back_W * H * elem
            for key, t in (("pairs", pairs_W), ("rows", rows_W), ("bytes", bytes_W)):
                acc[f"max_{key}"] += float(t.max())
                acc[f"mean_{key}"] += float(t.double().mean())
        acc["steps"] += 1
    return acc


def _load(ids_L: list[torch.Tensor], E: int) -> torch.Tensor:
    """int64 [L, E] pairs per expert (zero experts dropped)."""
    return torch.stack([torch.bincount(t.reshape(-1)[t.reshape(-1) < E], minlength=E) for t in ids_L])


def _before_placement(E: int, W: int):
    from moeflow.parallel.plan import Placement

    return Placement.from_map([e * W // E for e in range(E)], world_size=W)


def simulate(args) -> int:
    import subprocess

    from moeflow.parallel import plan_placement

    worlds = [int(w) for w in args.worlds.split(",")]
    sources = []
    traces = [Path(t) for t in args.trace.split(",")] if args.trace else [TINY_TRACE]
    for path in traces:
        if not path.exists() and path == TINY_TRACE:
            subprocess.run([*_RECORD, "--out", str(path)], check=True, cwd=Path(__file__).resolve().parents[1])
        name, ids_L, E = trace_routings(path)
        sources.append((f"trace:{name}", ids_L, E, 128))  # H of the embedded model
    for shape in args.synthetic.split(",") if args.synthetic else []:
        d = STANDARD_SHAPES[shape]
        sources.append((f"zipf1.2:{shape}", synthetic_routings(shape, args.layers, args.sim_tokens), d["E"], d["H"]))
    rows = []
    t0 = time.perf_counter()
    for name, ids_L, E, H in sources:
        K = int(ids_L[0].shape[1])
        N = int(ids_L[0].shape[0])
        for W in worlds:
            st = max(args.step_tokens // W, 1) * W
            n_steps = N // st
            if n_steps < 2:
                print(f"skip {name} W={W}: {N} tokens make {n_steps} step(s) of {st}")
                continue
            half = (n_steps // 2) * st
            plan_ids = [t[:half] for t in ids_L]
            serve_ids = [t[half: n_steps * st] for t in ids_L]
            load_LE = _load(plan_ids, E)
            serve_LE = _load(serve_ids, E)
            before = simulate_serving(serve_ids, [_before_placement(E, W)] * len(ids_L), W, H, K, st)
            for R in sorted({0, W // 4, W // 2, W}):
                p = plan_placement(load_LE, W, redundant_experts=R)
                after = simulate_serving(serve_ids, p.layers, W, H, K, st)
                rows.append(dict(
                    routing=name, E=E, K=K, W=W, R=R, step_tokens=st, steps=after["steps"],
                    imb_before=before["max_pairs"] / before["mean_pairs"],
                    imb_after=after["max_pairs"] / after["mean_pairs"],
                    imb_planned=p.imbalance(load_LE), imb_window=p.imbalance(serve_LE),
                    rows_max_before=before["max_rows"] / before["steps"], rows_max=after["max_rows"] / after["steps"],
                    rows_mean=after["mean_rows"] / after["steps"],
                    MB_max_before=before["max_bytes"] / before["steps"] / 1e6,
                    MB_max=after["max_bytes"] / after["steps"] / 1e6, MB_mean=after["mean_bytes"] / after["steps"] / 1e6,
                ))
        print(f"{name}: done ({time.perf_counter() - t0:.0f} s)")
    meta = {**env_info(), "command": "python benchmarks/bench_ep.py --simulate " + " ".join(
        a for a in sys.argv[1:] if a != "--simulate"), "seconds": time.perf_counter() - t0,
        "step_tokens": args.step_tokens, "sim_tokens": args.sim_tokens, "layers": args.layers}
    out = Path(args.out) / "bench_ep_simulate.json"
    write_json(out, rows, meta)
    print(f"### EP load balance (simulated), per step: imbalance = max/mean pairs per rank; rows / MB a rank sends "
          f"per step, max over ranks (mean = the ideal) ({meta['seconds']:.0f} s; JSON: {out})\n")
    print(format_table(rows, ["routing", "W", "R", "imb_before", "imb_after", "imb_planned", "imb_window",
                              "rows_max_before",
                              "rows_max", "rows_mean", "MB_max_before", "MB_max", "MB_mean"]))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(STANDARD_SHAPES))
    ap.add_argument("--tokens", default=None, help="comma-separated T per rank")
    ap.add_argument("--routing", default="uniform,zipf")
    ap.add_argument("--h-div", type=int, default=None, help="divide H by this (default 16 on CPU, 1 on CUDA)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default="out", help="directory for bench_ep_<backend>_w<W>.json")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--simulate", action="store_true", help="the load-balance simulation (CPU, no torchrun)")
    ap.add_argument("--trace", default=None, help="--simulate: comma-separated trace files (default: the embedded "
                                                  "model's, recorded if missing)")
    ap.add_argument("--synthetic", default="deepseek-v3,qwen3-30b-a3b", help="--simulate: bench_offload shapes")
    ap.add_argument("--worlds", default="8,16,32,64,256", help="--simulate: world sizes")
    ap.add_argument("--step-tokens", type=int, default=1024, help="--simulate: tokens per step over all ranks")
    ap.add_argument("--sim-tokens", type=int, default=8192, help="--simulate: synthetic tokens per layer")
    ap.add_argument("--layers", type=int, default=4, help="--simulate: synthetic layers")
    args = ap.parse_args(argv)
    if args.simulate:
        return simulate(args)

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
