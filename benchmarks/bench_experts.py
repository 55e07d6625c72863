"""Benchmark the Triton experts against Hugging Face's experts implementations and the roofs (GPU).

Legend: T tokens, K slots, N = T*K pairs, E experts, H hidden, I intermediate per expert.

For each standard shape (shared/spec/benchmarks.md), each T and each routing (uniform, Zipf 1.2),
on the same bf16 weights and inputs:
    moeflow        TritonExperts(options=...).forward_tokens, eager and under CUDA-graph replay;
                   the options from --tma / --pdl / --no-fast-launch / --pin (benchmarks.common.kernel_options:
                   `--pin gate_up=tma_gather_x` times that variant wherever it serves, an A/B against a run
                   without it)
    moeflow_bi     TritonExperts(batch_invariant=True, options=...), eager and graph (the mode's cost)
    hf_eager / hf_batched_mm / hf_grouped_mm
                   the transformers experts module of the family (MixtralExperts, GptOssExperts)
                   with config._experts_implementation set, sharing our weight tensors
    vllm           (--vllm) vLLM 0.33's Triton fused MoE kernel with its H200 tile tables
                   (benchmarks/peers/vllm_fused_moe.py: what it runs, and its stand-ins), eager and
                   graph; vs_vllm = its graph time / ours
    torch_gmm      two torch grouped GEMMs (+ activation) on tokens already permuted by expert:
                   the best a user gets from plain PyTorch (no routing, permutation or combine)
Every implementation is checked against an fp32 reference (rel-L2 <= 2e-2) before it is timed;
a wrong one is reported and not timed. --rotation: the graph rows of moeflow, moeflow_bi and vllm at a
point are timed round-robin (benchmarks.common.time_cuda_graphs_interleaved, --rotation passes) rather
than one implementation after another. Why: timed one after the other on an H100, the default and the
batch-invariant mode ran the same kernels on the same inputs 6.7% and 12% apart at two points (the
power-capped clock drifts; `--rotation 5` puts the drift on every implementation alike). Times are
medians of >= 20 CUDA-event timings with L2 flushed before each (256 MB write) so weights come from HBM.

Roofs measured in the same run: HBM = the fastest read-only stream over 2 GiB, bytes read / time
(benchmarks.common.hbm_read_roof_detail: torch.sum, torch.amax and benchmarks/stream_read.py's
kernel; the fastest one's name is recorded as hbm_reader; the 2 GiB device copy's (read + write) /
time is printed beside it as hbm_copy), compute = 8192^3 bf16 mm. floor = max(bytes of distinct experts touched + x + out over HBM, 2*3*H*I*T*K
FLOP over compute); roof_frac = floor / time; vs_hf = best HF time / time (both eager, and our
graph time against the same HF figure).

    PYTHONPATH=. python benchmarks/bench_experts.py --quick --out-dir out/
    PYTHONPATH=. python benchmarks/bench_experts.py --shapes qwen3-30b-a3b,mixtral-8x7b --tokens 1,8,64
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_experts.py --dry-run   # CPU check of the script
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    STANDARD_TOKENS,
    add_kernel_options_args,
    compute_roof_flops,
    env_info,
    format_table,
    hbm_read_roof_detail,
    hbm_roof_bytes_per_s,
    kernel_options,
    options_record,
    time_cpu,
    time_cuda,
    time_cuda_graph,
    time_cuda_graphs_interleaved,
)
from benchmarks.tune_experts import (  # noqa: E402
    make_config,
    make_weights,
    parse_shapes,
    patch_interpreter_index,
    routing,
    shape_spec,
)
from moeflow.experts.activations import apply_activation  # noqa: E402

QUICK_TOKENS = (1, 8, 64, 512, 8192)
CHECK_REL_L2 = 2e-2
BATCHED_MM_MAX_BYTES = 16 << 30  # batched_mm gathers one expert's weights per pair


# --------------------------------------------------------------------------- peers
def hf_experts_module(spec: dict, w, impl: str) -> nn.Module | None:
    """The transformers experts module of the family, holding our tensors (no copy)."""
    try:
        if spec["activation"] == "gptoss":
            from transformers import GptOssConfig
            from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls

            cfg = GptOssConfig(hidden_size=spec["H"], intermediate_size=spec["I"], num_local_experts=spec["E"],
                               num_experts_per_tok=spec["K"])
        else:
            from transformers import MixtralConfig
            from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls

            cfg = MixtralConfig(hidden_size=spec["H"], intermediate_size=spec["I"], num_local_experts=spec["E"],
                                num_experts_per_tok=spec["K"], hidden_act="silu")
    except ImportError:
        return None
    cfg._experts_implementation = impl
    with torch.device("meta"):
        mod = cls(cfg)
    mod.gate_up_proj = nn.Parameter(w.gate_up, requires_grad=False)
    mod.down_proj = nn.Parameter(w.down, requires_grad=False)
    if w.gate_up_bias is not None:
        mod.gate_up_proj_bias = nn.Parameter(w.gate_up_bias, requires_grad=False)
        mod.down_proj_bias = nn.Parameter(w.down_bias, requires_grad=False)
    if spec["activation"] == "gptoss":
        mod.limit, mod.alpha = float(spec["limit"]), 1.702
    return mod


def torch_gmm_runner(x, ids, w, cfg):
    """(run() -> y_sorted, unpermute(y_sorted) -> y_TKH): grouped GEMMs on pre-permuted rows."""
    from moeflow.experts.base import down_as_KN, gate_up_as_KN
    from moeflow.experts.grouped import _grouped_mm_fn, grouped_mm_usable

    fn = _grouped_mm_fn()
    T, K = ids.shape
    E = w.num_experts
    ids_N = ids.reshape(-1).long()
    sorted_e, order = torch.sort(ids_N, stable=True)
    x_sorted = x.index_select(0, order // K).contiguous()
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, sorted_e, torch.ones_like(sorted_e))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gu_w, dn_w = gate_up_as_KN(w), down_as_KN(w)
    ok, why = (False, "no grouped_mm") if fn is None else grouped_mm_usable(x_sorted, gu_w)
    if not ok:
        return None, why
    gub = w.gate_up_bias.index_select(0, sorted_e) if w.gate_up_bias is not None else None
    db = w.down_bias.index_select(0, sorted_e) if w.down_bias is not None else None

    def run():
        gu = fn(x_sorted, gu_w, offs=offs)
        if gub is not None:
            gu = gu + gub
        act = apply_activation(gu, cfg).contiguous()
        y = fn(act, dn_w, offs=offs)
        if db is not None:
            y = y + db
        return y

    def unpermute(y_sorted):
        y = torch.empty_like(y_sorted)
        y.index_copy_(0, order, y_sorted)
        return y.view(T, K, -1)

    return (run, unpermute), ""


def reference(x, ids, wts, w, cfg):
    """fp32 out_TH from the bf16 weights, one expert at a time (weights upcast per expert)."""
    from moeflow.config import ExpertWeights
    from moeflow.experts.base import down_one, gate_up_one

    T, K = ids.shape
    H = x.shape[1]
    out = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    ids_l = ids.long()
    for e in torch.unique(ids_l).tolist():
        t_idx, k_idx = torch.nonzero(ids_l == e, as_tuple=True)
        we = ExpertWeights(w.gate_up[e : e + 1].float(), w.down[e : e + 1].float(),
                           None if w.gate_up_bias is None else w.gate_up_bias[e : e + 1].float(),
                           None if w.down_bias is None else w.down_bias[e : e + 1].float(),
                           layout=w.layout, interleaved=w.interleaved)
        act = apply_activation(gate_up_one(x[t_idx].float(), we, 0), cfg)
        y = down_one(act, we, 0)
        out.index_put_((t_idx,), y * wts[t_idx, k_idx, None].float(), accumulate=True)
    return out


def rel_l2(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def vllm_point(spec, w, x, ids, wts, base, add, rows, timers, T, rotation: dict | None = None) -> None:
    """The vLLM 0.33 fused-MoE peer (benchmarks/peers/vllm_fused_moe.py) at this point: its eager
    row through `add` (checked against the fp32 reference there), then its CUDA-graph row; both
    appended to `rows` with the config vLLM would pick (`vllm_config`, `vllm_config_source`).
    rotation (a dict, --rotation): its fn goes there for bench_point's round-robin timing instead."""
    try:
        peer = _vllm_peer(spec, w)
    except ValueError as e:
        rows.append(dict(base, impl="vllm", mode="eager", status=f"skipped: {e}"))
        return
    config, source = peer.config(T)

    def fn():
        return peer(x, ids, wts)

    add("vllm", "eager", fn, fn)
    eager = rows[-1]
    eager.update(vllm_config=config, vllm_config_source=source)
    if eager["status"] == "ok" and rotation is not None:
        rotation["vllm"] = (fn, dict(vllm_config=config, vllm_config_source=source))
        return
    if eager["status"] != "ok" or timers.get("graph") is None:
        return
    row = dict(base, impl="vllm", mode="graph", vllm_config=config, vllm_config_source=source)
    try:
        t = timers["graph"](fn)
        row.update(time_s=t, roof_frac=base["floor_s"] / t, status="ok (checked eager)")
    except Exception as e:
        row["status"] = f"error: {type(e).__name__}: {str(e)[:160]}"
    rows.append(row)


def rotation_rows(rotation: dict, base: dict, rows: list[dict], timers: dict) -> None:
    """Time rotation's fns round-robin (timers["rotation"]: {name: fn} -> {name: seconds}) and append one
    row each: mode "graph" (CUDA graphs, what summarize reads) or "rotation" (the CPU dry run's plain
    calls, which summarize leaves out)."""
    mode = timers.get("rotation_mode", "graph")
    try:
        times = timers["rotation"]({name: fn for name, (fn, _) in rotation.items()})
    except Exception as e:
        for name, (_, extra) in rotation.items():
            rows.append(dict(base, impl=name, mode=mode, **extra, status=f"error: {type(e).__name__}: {str(e)[:160]}"))
        return
    for name, (_, extra) in rotation.items():
        t = times[name]
        rows.append(dict(base, impl=name, mode=mode, **extra, time_s=t, roof_frac=base["floor_s"] / t,
                         status="ok (round-robin, checked eager)"))


def _cpu_rotation(fns: dict, rounds: int, reps: int) -> dict:
    """The dry run's stand-in for time_cuda_graphs_interleaved: plain calls, round-robin, median."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


_VLLM_PEERS: dict = {}


def _vllm_peer(spec, w):
    """One VllmFusedMoE per weights (its vLLM-layout copy is made once per shape)."""
    key = (spec["name"], id(w))
    if key not in _VLLM_PEERS:
        from benchmarks.peers.vllm_fused_moe import VllmFusedMoE

        _VLLM_PEERS.clear()  # one shape's copy at a time (deepseek-v3's is 22 GB)
        _VLLM_PEERS[key] = VllmFusedMoE(w, spec["activation"], spec.get("limit"))
    return _VLLM_PEERS[key]


# --------------------------------------------------------------------------- one (shape, T, routing)
def bench_point(spec, w, cfg, T, dist, roofs, args, timers) -> list[dict]:
    from moeflow.experts.triton import TritonExperts

    dev = w.device
    E, K, H, I = spec["E"], spec["K"], spec["H"], spec["I"]
    ids, wts = routing(T, E, K, dist, dev, seed=args.seed)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dev, w.dtype)
    ref = reference(x, ids, wts, w, cfg)
    n_distinct = int(torch.unique(ids).numel())
    bias_el = (2 * I + H) if spec["bias"] else 0
    bytes_ = n_distinct * (3 * H * I + bias_el) * w.dtype.itemsize + 2 * T * H * w.dtype.itemsize
    flops = 2 * 3 * H * I * T * K
    floor_hbm, floor_cmp = bytes_ / roofs["hbm"], flops / roofs["compute"]
    floor = max(floor_hbm, floor_cmp)
    base = dict(shape=spec["name"], routing=dist, T=T, distinct_experts=n_distinct, floor_s=floor,
                floor_kind="hbm" if floor_hbm >= floor_cmp else "compute")
    rows = []

    def add(impl, mode, fn, check_out):
        row = dict(base, impl=impl, mode=mode)
        try:
            out = check_out()
            err = rel_l2(out.float(), ref)
            row["rel_l2"] = err
            if not math.isfinite(err) or err > CHECK_REL_L2:
                row["status"] = f"WRONG (rel-L2 {err:.3g} > {CHECK_REL_L2}): not timed"
                rows.append(row)
                return
            t = timers["eager"](fn)
            row.update(time_s=t, roof_frac=floor / t, status="ok")
        except Exception as e:  # an implementation that cannot run this point says so in the table
            row["status"] = f"error: {type(e).__name__}: {str(e)[:160]}"
        rows.append(row)

    # --rotation: name -> (fn, extra row fields) of the implementations whose graphs are timed round-robin
    rotation = {} if getattr(args, "rotation", 0) else None
    cpu = dev.type == "cpu"
    impls = [("moeflow", TritonExperts(allow_cpu=cpu, options=args.options))]
    if not args.no_bi:
        impls.append(("moeflow_bi", TritonExperts(batch_invariant=True, allow_cpu=cpu, options=args.options)))
    for name, impl in impls:
        def fn(impl=impl):
            return impl.forward_tokens(x, ids, wts, w, cfg)

        add(name, "eager", fn, fn)
        if rotation is not None:
            if rows[-1].get("status") == "ok":
                rotation[name] = (fn, {})
        elif timers.get("graph") is not None:
            row = dict(base, impl=name, mode="graph")
            try:
                t = timers["graph"](fn)
                row.update(time_s=t, roof_frac=floor / t, status="ok (checked eager)")
            except Exception as e:
                row["status"] = f"error: {type(e).__name__}: {str(e)[:160]}"
            rows.append(row)
        try:  # what ran (the options' pins too); a pin the plan refuses here is in the row's status already
            plan = impl.plan(w, T, K, activation=spec["activation"])
            rows[-1]["variants"] = {st.stage: st.variant for st in plan.stages}
            rows[-1]["tiles"] = plan.tiles.to_dict()
        except ValueError as e:
            rows[-1]["plan_error"] = str(e)[:200]
        if name == "moeflow_bi" and T > 1:
            # batch invariance, checked where it is timed: token 0 alone == token 0 in this batch
            alone = impl.forward_tokens(x[:1], ids[:1], wts[:1], w, cfg)
            full = impl.forward_tokens(x, ids, wts, w, cfg)
            same = torch.equal(alone.view(torch.int16), full[:1].view(torch.int16)) if alone.dtype.itemsize == 2 \
                else torch.equal(alone, full[:1])
            for r in rows:
                if r["impl"] == "moeflow_bi":
                    r["bi_bitwise_vs_T1"] = bool(same)
    if args.vllm:
        vllm_point(spec, w, x, ids, wts, base, add, rows, timers, T, rotation)
    if rotation:
        rotation_rows(rotation, base, rows, timers)
    for hf_impl in args.hf_impls:
        if hf_impl == "batched_mm" and T * K * 3 * H * I * w.dtype.itemsize > BATCHED_MM_MAX_BYTES:
            rows.append(dict(base, impl=f"hf_{hf_impl}", mode="eager",
                             status=f"skipped: gathers {T * K * 3 * H * I * 2 / 2**30:.0f} GiB of weights"))
            continue
        mod = hf_experts_module(spec, w, hf_impl)
        if mod is None:
            rows.append(dict(base, impl=f"hf_{hf_impl}", mode="eager", status="skipped: transformers lacks it"))
            continue
        ids64 = ids.long()

        def hfn(mod=mod, ids64=ids64):
            with torch.no_grad():
                return mod(x, ids64, wts)

        add(f"hf_{hf_impl}", "eager", hfn, hfn)
    runner, why = (None, "--no-gmm") if args.no_gmm else torch_gmm_runner(x, ids, w, cfg)
    if runner is None:
        rows.append(dict(base, impl="torch_gmm", mode="eager", status=f"skipped: {why}"))
    else:
        run, unpermute = runner

        def gmm_check():
            y = unpermute(run())
            return (y.float() * wts[..., None].float()).sum(1)

        add("torch_gmm", "eager", run, gmm_check)
    # vs_hf: best HF eager time over this row's time
    hf_times = [r["time_s"] for r in rows if r["impl"].startswith("hf_") and "time_s" in r]
    best_hf = min(hf_times) if hf_times else None
    for r in rows:
        if best_hf and "time_s" in r:
            r["vs_hf"] = best_hf / r["time_s"]
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (shape, routing, T)."""
    out = {}
    for r in rows:
        k = (r["shape"], r["routing"], r["T"])
        s = out.setdefault(k, dict(shape=r["shape"], routing=r["routing"], T=r["T"], floor_us=r["floor_s"] * 1e6,
                                   floor=r["floor_kind"]))
        if "time_s" not in r:
            if r["status"].startswith(("WRONG", "error")):
                s.setdefault("notes", []).append(f"{r['impl']}: {r['status'][:60]}")
            continue
        us = r["time_s"] * 1e6
        if "bi_bitwise_vs_T1" in r:
            s["bi_bitwise"] = r["bi_bitwise_vs_T1"]
        key = {("moeflow", "eager"): "ours_us", ("moeflow", "graph"): "ours_graph_us",
               ("moeflow_bi", "eager"): "bi_us", ("moeflow_bi", "graph"): "bi_graph_us",
               ("vllm", "eager"): "vllm_us", ("vllm", "graph"): "vllm_graph_us"}.get((r["impl"], r["mode"]))
        if key:
            s[key] = us
        elif r["impl"] == "torch_gmm":
            s["torch_gmm_us"] = us
        elif r["impl"].startswith("hf_") and us < s.get("best_hf_us", float("inf")):
            s["best_hf_us"], s["best_hf"] = us, r["impl"][3:]
    lines = []
    for s in out.values():
        best_ours = s.get("ours_graph_us", s.get("ours_us"))
        if best_ours:
            s["roof_frac"] = s["floor_us"] / best_ours
        if "ours_us" in s and "best_hf_us" in s:
            s["vs_hf"] = s["best_hf_us"] / s["ours_us"]
            if "ours_graph_us" in s:
                s["vs_hf_graph"] = s["best_hf_us"] / s["ours_graph_us"]
        for mine, peer in (("ours_graph_us", "vllm_graph_us"), ("ours_us", "vllm_us")):
            if mine in s and peer in s:  # graph to graph where both replayed
                s["vs_vllm"] = s[peer] / s[mine]
                s["vllm_roof_frac"] = s["floor_us"] / s[peer]
                break
        for mine, bi in (("ours_graph_us", "bi_graph_us"), ("ours_us", "bi_us")):
            if mine in s and bi in s:
                s["bi_cost"] = s[bi] / s[mine] - 1.0
                break
        s["notes"] = "; ".join(s.get("notes", []))
        lines.append(s)
    return lines


SUMMARY_COLUMNS = ["shape", "routing", "T", "floor", "floor_us", "ours_us", "ours_graph_us", "roof_frac",
                   "bi_graph_us", "bi_cost", "bi_bitwise", "vllm_graph_us", "vllm_roof_frac", "vs_vllm", "best_hf", "best_hf_us", "vs_hf", "vs_hf_graph", "torch_gmm_us",
                   "notes"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--tokens", default=None, help=f"comma list (default {STANDARD_TOKENS})")
    ap.add_argument("--routing", default="uniform,zipf")
    ap.add_argument("--hf", default="eager,batched_mm,grouped_mm", help="HF experts implementations to run")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS}, uniform routing only")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--no-bi", action="store_true", help="skip the batch-invariant mode")
    ap.add_argument("--rotation", type=int, default=0, metavar="PASSES",
                    help="time the graphs of ours, bi and vllm round-robin in PASSES passes (0: one after another)")
    add_kernel_options_args(ap)
    ap.add_argument("--no-gmm", action="store_true", help="skip the torch grouped-GEMM baseline")
    ap.add_argument("--vllm", action="store_true",
                    help="also run vLLM 0.33's Triton fused MoE (benchmarks/peers/vllm_fused_moe.py), eager and graph")
    ap.add_argument("--out-dir", default=str(ROOT / "out"))
    ap.add_argument("--tag", default="bench_experts")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop starting new points after this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes, fp32")
    args = ap.parse_args(argv)
    args.options = kernel_options(args)
    if args.rotation < 0:
        ap.error(f"--rotation {args.rotation}: expected the number of round-robin passes, >= 0 (0: off)")
    t0 = time.time()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    args.hf_impls = [h for h in args.hf.split(",") if h]
    dists = ["uniform"] if args.quick else [d for d in args.routing.split(",") if d]
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    else:
        tokens = list(QUICK_TOKENS if args.quick else STANDARD_TOKENS)

    if args.dry_run:
        patch_interpreter_index()
        dev, dtype = torch.device("cpu"), torch.float32
        names = ["tiny-silu", "tiny-gptoss"] if args.shapes == "all" else parse_shapes(args.shapes)
        tokens = [t for t in tokens if t <= 64] or [1, 8]
        roofs = {"hbm": 20e9, "hbm_reader": "dry run (fixed)", "hbm_copy": 20e9, "compute": 200e9}
        timers = {"eager": lambda fn: time_cpu(fn, reps=max(3, args.reps // 10), warmup=1), "graph": None,
                  "rotation": lambda fns: _cpu_rotation(fns, max(1, args.rotation), 1), "rotation_mode": "rotation"}
    else:
        if not torch.cuda.is_available():
            print("bench_experts: needs CUDA (or --dry-run under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        dev, dtype = torch.device("cuda"), torch.bfloat16
        names = parse_shapes(args.shapes)
        read = hbm_read_roof_detail()
        roofs = {"hbm": read["bytes_per_s"], "hbm_reader": read["reader"], "hbm_copy": hbm_roof_bytes_per_s(),
                 "compute": compute_roof_flops()}
        timers = {"eager": lambda fn: time_cuda(fn, reps=args.reps, warmup=3, flush=True),
                  "graph": None if args.no_graph else (lambda fn: time_cuda_graph(fn, reps=args.reps, flush=True))}
        if args.rotation and args.no_graph:
            print("bench_experts: --rotation times CUDA graphs; it cannot run with --no-graph", file=sys.stderr)
            return 2
        # --rotation passes, each timing every graph max(1, reps // passes) times: about reps timings each
        timers["rotation"] = lambda fns: time_cuda_graphs_interleaved(
            fns, rounds=max(1, args.rotation), reps=max(1, args.reps // max(1, args.rotation)), flush=True)
    meta = dict(env_info(), roofs=roofs, command=" ".join(sys.argv), shapes={n: shape_spec(n) for n in names},
                kernel_options=options_record(args.options))
    print(f"roofs: HBM read {roofs['hbm'] / 1e12:.3f} TB/s ({roofs['hbm_reader']}; copy, read + write: "
          f"{roofs['hbm_copy'] / 1e12:.3f} TB/s), "
          f"compute {roofs['compute'] / 1e12:.1f} TFLOP/s", flush=True)
    rows: list[dict] = []
    stopped = None
    json_path = out_dir / f"{args.tag}.json"
    for name in names:
        spec = shape_spec(name)
        w = make_weights(spec, dev, dtype=dtype)
        cfg = make_config(spec)
        for T in tokens:
            for dist in dists:
                if time.time() - t0 > args.budget_s:
                    stopped = f"budget of {args.budget_s:.0f}s reached before {name} T={T} {dist}"
                    break
                pts = bench_point(spec, w, cfg, T, dist, roofs, args, timers)
                rows += pts
                s = summarize(pts)[0]
                print(f"[{time.time() - t0:6.1f}s] {name:14s} {dist:7s} T={T:5d} floor "
                      f"{s['floor_us']:8.1f}us ours {s.get('ours_us', float('nan')):8.1f} graph "
                      f"{s.get('ours_graph_us', float('nan')):8.1f} roof {s.get('roof_frac', float('nan')):.2f} "
                      f"bi {s.get('bi_cost', float('nan')):+.2f} "
                      f"vllm graph {s.get('vllm_graph_us', float('nan')):8.1f} x{s.get('vs_vllm', float('nan')):.2f} "
                      f"hf {s.get('best_hf', '-')} {s.get('best_hf_us', float('nan')):8.1f} "
                      f"gmm {s.get('torch_gmm_us', float('nan')):8.1f} {s['notes']}", flush=True)
            if stopped:
                break
        json_path.write_text(json.dumps({"meta": dict(meta, stopped=stopped), "rows": rows}, indent=1))
        del w
        _VLLM_PEERS.clear()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        if stopped:
            print(stopped, flush=True)
            break
    summary = summarize(rows)
    table = format_table(summary, SUMMARY_COLUMNS)
    head = (f"device {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, transformers "
            f"{meta['transformers']}; HBM read roof {roofs['hbm'] / 1e12:.3f} TB/s ({roofs['hbm_reader']}; copy roof "
            f"{roofs['hbm_copy'] / 1e12:.3f} TB/s), compute roof "
            f"{roofs['compute'] / 1e12:.1f} TFLOP/s; times in us, median of {args.reps}")
    (out_dir / f"{args.tag}.md").write_text(f"{head}\n\ncommand: `{meta['command']}`\n\n{table}\n")
    json_path.write_text(json.dumps({"meta": dict(meta, stopped=stopped), "rows": rows, "summary": summary}, indent=1))
    print(head)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
