"""Offloaded decode on the GPU: a many-layer decode loop with experts streamed from pinned host memory.

Legend: L layers, H hidden, I intermediate per expert, E routed experts per layer,
K picks per token, S slots (25/50/75% of the L*E experts), W prefetch width.

For each shape x cache size x policy x {no prefetch, prefetch W (--prefetch-width, default K) under each
--prefetch-rules rule: "always" copies every predicted missing expert, "cost" only those whose expected
saving pays their bytes (moeflow.offload.gate) at this run's measured overlap}:
    tokens/s of the end-to-end decode loop (T = 1), hit rate, misses per token,
    prefetch precision, the compute stream's wait on copies, and
    roof_frac = floor / time per token, floor = bytes copied per token / pinned H2D
    bandwidth (1 GiB pinned -> device, measured in this run), i.e. how close the loop
    runs to the PCIe bound for the copies it made. A second floor counts demand-miss
    bytes only (`roof_frac_miss`).
The overlap (OffloadConfig.prefetch_overlap, printed and in every row): expert copies the host link
completes behind one layer step's compute = pinned H2D bandwidth x (resident ms per token / L) /
expert bytes, from this run's resident row and PCIe measurement (--prefetch-overlap overrides it).
For lru and random_oldest also a sync-free row (OffloadConfig.sync_free: no host sync per
layer step; "sync_free": true): its hit rate and misses are the device's (experts found in
the device table / staged from host memory), its bytes the staged rows plus the refill's loads.

The model: L MoELayers (bf16, the family's router), a residual stream x <- x + moe(x),
consecutive tokens correlated (x_{t+1} = 0.8 x_t + 0.6 noise) and Zipf(1.2)-skewed
routing (a per-layer logit bias), so caches see reuse and the next-layer prediction
means something. All layers share one set of E expert tensors (the cache still holds
(layer, expert) keys apart and copies each from the host), which keeps host and GPU
memory small enough for the run; every layer has its own router.

Before timing, each configuration's first tokens are checked bit for bit against the
fully resident model (same layers, experts on the GPU); a mismatch stops the run.
Then the torch profiler looks at steady-state steps: CUDA runtime calls that allocate
(cudaMalloc/cudaFree/cudaHostAlloc) and that block the host (stream/device/event
synchronize, synchronous memcpy) are counted per layer step.

    python benchmarks/bench_offload.py --out out/bench_offload.json
    python benchmarks/bench_offload.py --shapes mixtral-8x7b --layers 4 --fractions 0.25 --policies lru predictive \
        --prefetch-width 2 --cpu-experts off --no-profile --no-graphs --out out/offload_rule.json   # the rule rows
    python benchmarks/bench_offload.py --quick      # small shapes, runs on CPU too
    python benchmarks/bench_offload.py --cpu        # the quick CPU configuration (a few seconds)

CPU execution of missed experts (OffloadConfig.cpu_experts, rows with "bench": "cpu_experts"):
per shape, at --cpu-fractions caches (25%, 50%), tokens/s of the same decode loop with
cpu_experts off vs auto (the cost model on this host's measured B_cpu / B_pcie; the quick
CPU run adds "always"), the experts run on the CPU and the bytes not copied per token, and
the largest difference from the resident model over the checked tokens (0 for off; within
the documented tolerance otherwise, routing flips aside). --cpu-experts off turns it off.

Without CUDA (or with --cpu) the script runs the quick configuration on the CPU and says
so: the full shapes allocate tens of GB (mixtral-8x7b's experts alone are ~45 GB in fp32)
and measure no PCIe copies on a CPU, so they would only exhaust host memory.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import STANDARD_SHAPES, env_info, format_table, pcie_roof_bytes_per_s, write_json  # noqa: E402
from moeflow.config import ExpertWeights, MoEConfig  # noqa: E402
from moeflow.layer import MoELayer  # noqa: E402
from moeflow.offload.attach import attach_offload  # noqa: E402
from moeflow.offload.config import OffloadConfig  # noqa: E402
from moeflow.offload.store import ExpertStore  # noqa: E402
from moeflow.routing.spec import RouterSpec  # noqa: E402


class SharedMLP(nn.Module):
    """A SwiGLU shared expert [H] -> [H] (DeepSeek-V3 style)."""

    def __init__(self, H: int, I: int, dtype, device, g: torch.Generator):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(2 * I, H, generator=g, device=device, dtype=dtype) / math.sqrt(H))
        self.down = nn.Parameter(torch.randn(H, I, generator=g, device=device, dtype=dtype) * (0.3 / math.sqrt(I)))

    def forward(self, x):
        g, u = torch.nn.functional.linear(x, self.gate_up).chunk(2, dim=-1)
        return torch.nn.functional.linear(torch.nn.functional.silu(g) * u, self.down)


def build_layers(shape: str, L: int, device: str, dtype, seed: int = 0, zipf_s: float = 1.2):
    """L MoELayers of a standard shape sharing one ExpertWeights (see module doc)."""
    s = STANDARD_SHAPES[shape]
    H, I, E, K = s["H"], s["I"], s["E"], s["K"]
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = nn.Parameter(torch.randn(E, 2 * I, H, generator=g, device=device, dtype=dtype) / math.sqrt(H))
    down = nn.Parameter(torch.randn(E, H, I, generator=g, device=device, dtype=dtype) * (0.3 / math.sqrt(I)))
    w = ExpertWeights(gate_up, down)
    if shape.startswith("deepseek"):
        spec = RouterSpec(score_fn="sigmoid", num_experts=E, top_k=K, renorm=True, renorm_eps=1e-20,
                          scaling_factor=2.5, n_group=8, topk_group=4, use_bias=True)
    else:
        spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=K, renorm=True)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu")
    ranks = torch.arange(1, E + 1, dtype=torch.float32)
    layers = []
    for idx in range(L):
        perm = torch.randperm(E, generator=torch.Generator().manual_seed(seed * 1000 + idx))
        bias = (-zipf_s * torch.log(ranks))[perm].to(device)  # log Zipf(s) probabilities, per-layer order
        router = nn.Parameter(torch.randn(E, H, generator=g, device=device, dtype=dtype) * (2.0 / math.sqrt(H)))
        kw = {}
        if spec.use_bias:
            kw["selection_bias_E"] = torch.zeros(E, device=device)
        if s["shared"]:
            kw["shared_expert"] = SharedMLP(H, I * s["shared"], dtype, device, g)
        layers.append(MoELayer(cfg, router_weight_EH=router, experts=w, router_bias_E=bias, layer_idx=idx, **kw))
    return nn.ModuleList(layers)


def token_inputs(n: int, H: int, device: str, dtype, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, H, generator=g, device=device)
    out = []
    for _ in range(n):
        x = 0.8 * x + 0.6 * torch.randn(1, H, generator=g, device=device)
        out.append(x.to(dtype))
    return out


def decode(layers, x: torch.Tensor) -> torch.Tensor:
    for m in layers:
        x = x + m(x)
    return x


def profile_steps(layers, xs, device: str) -> dict:
    """Counts of allocating and host-blocking CUDA runtime calls over a few decode tokens."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    alloc_names = ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost", "cudaMallocAsync")
    sync_names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
                  "cudaMemcpy", "cudaStreamWaitEvent")
    before = torch.cuda.memory_stats() if device == "cuda" else {}
    with profile(activities=acts) as prof:
        for x in xs:
            decode(layers, x)
        if device == "cuda":
            torch.cuda.synchronize()
    after = torch.cuda.memory_stats() if device == "cuda" else {}
    counts: dict[str, int] = {}
    for ev in prof.events():
        name = ev.name
        if name in alloc_names or name in sync_names or name.startswith("cudaMemcpy"):
            counts[name] = counts.get(name, 0) + 1
    steps = len(xs) * len(layers)
    out = {"layer_steps": steps, "runtime_calls": counts,
           "allocating_calls": sum(v for k, v in counts.items() if k in alloc_names),
           # the final torch.cuda.synchronize() above is the profiler's, not the loop's
           "host_syncs_per_layer_step": (counts.get("cudaStreamSynchronize", 0) + counts.get("cudaDeviceSynchronize", 0)
                                         + counts.get("cudaEventSynchronize", 0) - (1 if device == "cuda" else 0))
           / steps}
    if device == "cuda":
        out["new_segments"] = after.get("segment.all.allocated", 0) - before.get("segment.all.allocated", 0)
        out["caching_allocator_blocks_per_layer_step"] = (
            after.get("allocation.all.allocated", 0) - before.get("allocation.all.allocated", 0)) / steps
    return out


def run_shape(shape: str, L: int, args, pcie: float, device: str, dtype) -> list[dict]:
    s = STANDARD_SHAPES[shape]
    E, K, H = s["E"], s["K"], s["H"]
    total = L * E
    resident = build_layers(shape, L, device, dtype)
    # the offloaded copies share the resident router weights; their experts live in the store
    xs = token_inputs(args.warmup + args.tokens + args.check, H, device, dtype)
    # warm-up tokens continue the same correlated walk (seeded apart from the timed ones)
    warm_xs = token_inputs(max(args.warmup, math.ceil(2 * total / (L * K))), H, device, dtype, seed=2)
    with torch.no_grad():
        ref_out = [decode(resident, x) for x in xs[: args.check]]
    with torch.no_grad():
        for x in xs[:3]:
            decode(resident, x)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in xs[-args.tokens:]:
            decode(resident, x)
        if device == "cuda":
            torch.cuda.synchronize()
        dt_res = time.perf_counter() - t0
    rows = [{"shape": shape, "layers": L, "experts": total, "slots": total, "cache_frac": 1.0,
             "policy": "resident", "prefetch": 0, "tokens_per_s": args.tokens / dt_res,
             "ms_per_token": dt_res / args.tokens * 1e3, "hit_rate": 1.0, "misses_per_token": 0.0}]
    print(f"{shape:>13} resident (all {total} experts on the device): {rows[0]['tokens_per_s']:.2f} tok/s", flush=True)
    W = K if args.prefetch_width is None else args.prefetch_width
    # one pinned host copy of the experts, shared by every configuration below
    # packed: the sync-free rows' kernel reads an expert as one row of bytes (the other rows read the same views)
    store = ExpertStore.from_weights([m.expert_weights for m in resident], mode="pinned", progress=False,
                                     packed=True)
    # an untimed offloaded run first: kernels, allocator pools and pinned pages warm before any row
    rt = attach_offload(list(resident), OffloadConfig(gpu_slots=max(K, total // 4), device=device), release=False,
                        progress=False, store=store)
    with torch.no_grad():
        for x in xs[: args.warmup]:
            decode(resident, x)
    rt.detach()
    # the cost rule's overlap: copies of one expert the link completes during one resident layer step
    overlap = args.prefetch_overlap
    if overlap is None:
        overlap = pcie * (dt_res / args.tokens / L) / store.expert_bytes
    print(f"{shape:>13} prefetch overlap {overlap:.3f} expert copies per layer step "
          f"({pcie / 1e9:.1f} GB/s x {dt_res / args.tokens / L * 1e3:.3f} ms / {store.expert_bytes / 1e6:.1f} MB)",
          flush=True)
    del rt
    for frac in (args.fractions if args.main_rows else []):
        slots = max(K, int(round(frac * total)))
        for policy in args.policies:
            # sync-free rows (OffloadConfig.sync_free): no prefetch, no predictor-driven policy
            variants = ([(0, False, "cost")] + [(W, False, rule) for rule in args.prefetch_rules]
                        + ([(0, True, "cost")] if policy in ("lru", "random_oldest") else []))
            for pf, sync_free, rule in variants:
                cfg = OffloadConfig(gpu_slots=slots, policy=policy, prefetch_width=pf, device=device,
                                    sync_free=sync_free, prefetch_rule=rule, prefetch_overlap=overlap)
                t_setup = time.perf_counter()
                # release=False: the same layers run resident (reference) and offloaded (hooks, then detach)
                rt = attach_offload(list(resident), cfg, release=False, progress=False, store=store)
                off = resident
                t_setup = time.perf_counter() - t_setup
                with torch.no_grad():
                    for i in range(args.check):
                        got = decode(off, xs[i])
                        if not torch.equal(got, ref_out[i]):
                            raise SystemExit(f"{shape} slots={slots} {policy} pf={pf}: output differs from the "
                                             f"resident model at token {i} (max abs "
                                             f"{(got.float() - ref_out[i].float()).abs().max().item():.3e})")
                    # fill the cache about twice over before timing, so rows measure steady state
                    n_warm = max(args.warmup, math.ceil(2 * slots / (L * K)))
                    for i in range(n_warm):
                        decode(off, warm_xs[i % len(warm_xs)])
                    if device == "cuda":
                        torch.cuda.synchronize()
                    rt.reset_stats()
                    gate = rt.prefetcher.gate
                    declined0 = gate.declined if gate is not None else 0
                    t0 = time.perf_counter()
                    for x in xs[args.check + args.warmup :]:
                        decode(off, x)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                st = rt.stats()
                n = args.tokens
                per_tok = dt / n
                copied = st.bytes_copied / n
                miss_bytes = st.misses * rt.store.expert_bytes / n
                hit_rate, misses = st.hit_rate, st.misses
                gs = rt.graph_stats()
                if gs is not None:
                    # the device's truth (read back lagged): staged misses + the refill's loads crossed PCIe
                    copied = (gs.bytes_staged + gs.refill_bytes) / n
                    miss_bytes = gs.bytes_staged / n
                    hit_rate, misses = gs.hit_rate, gs.staged
                row = {
                    "shape": shape, "layers": L, "experts": total, "slots": slots, "cache_frac": frac,
                    "policy": policy, "prefetch": pf, "sync_free": sync_free,
                    "prefetch_rule": rule if pf else None, "prefetch_overlap": overlap,
                    "prefetch_declined_per_token": (gate.declined - declined0) / n if gate is not None else None,
                    "tokens_per_s": n / dt,
                    "ms_per_token": per_tok * 1e3, "hit_rate": hit_rate, "misses_per_token": misses / n,
                    "prefetch_issued_per_token": st.prefetch_issued / n,
                    "prefetch_precision": st.prefetch_precision,
                    "wait_ms_per_token": st.wait_s * 1e3 / n,
                    "GB_copied_per_token": copied / 1e9,
                    "floor_ms": copied / pcie * 1e3, "roof_frac": (copied / pcie) / per_tok if per_tok else 0.0,
                    "roof_frac_miss": (miss_bytes / pcie) / per_tok if per_tok else 0.0,
                    "setup_s": t_setup,
                }
                if args.profile and frac == args.fractions[len(args.fractions) // 2] and policy == "predictive" \
                        and pf:
                    with torch.no_grad():
                        row["profile"] = profile_steps(off, xs[-3:], device)
                if sync_free and device == "cuda" and args.graphs:
                    row.update(graph_decode_row(off, rt, xs, ref_out, args))
                rows.append(row)
                print(f"{shape:>13} S={slots:>4} ({frac:.0%}) {policy:>13} pf={pf}{' ' + rule if pf else ''}"
                      f"{' sync-free' * sync_free}: "
                      f"{row['tokens_per_s']:7.2f} tok/s "
                      f"hit {row['hit_rate']:.3f} miss/tok {row['misses_per_token']:.2f} "
                      f"roof_frac {row['roof_frac']:.3f} prec {row['prefetch_precision']:.2f}", flush=True)
                rt.detach()
                del rt
                if device == "cuda":
                    torch.cuda.empty_cache()
    if "off" not in args.cpu_experts or len(args.cpu_experts) > 1:
        rows += cpu_experts_rows(shape, L, args, device, resident, store, xs, ref_out, warm_xs)
    return rows


def graph_decode_row(layers, rt, xs, ref_out, args) -> dict:
    """Sync-free offloaded decode replayed from one CUDA graph of the whole L-layer step.

    The step is captured once (static input buffer); before each replay `rt.refill()` runs on
    the replaying stream (the lagged cache refill, no wait). The first `args.check` replays are
    compared bit for bit with the resident model; then `args.tokens` replays of fresh tokens
    (another seed of the same correlated walk) are timed after `args.warmup` untimed ones.
    Returns graph_tokens_per_s, graph_ms_per_token, graph_hit_rate, graph_GB_copied_per_token.
    """
    static_x = xs[0].clone()
    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up outside the capture (lazy buffers)
            decode(layers, static_x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_y = decode(layers, static_x)

        def step(x):
            static_x.copy_(x)
            rt.refill()
            g.replay()
            return static_y

        for i in range(args.check):
            got = step(xs[i])
            if not torch.equal(got, ref_out[i]):
                raise SystemExit(f"graph replay differs from the resident model at token {i} (max abs "
                                 f"{(got.float() - ref_out[i].float()).abs().max().item():.3e})")
        # timed on tokens the cache has not seen: the eager sync-free row before this one decoded
        # `xs`, and replaying them would measure a cache that already holds their experts
        fresh = token_inputs(args.warmup + args.tokens, xs[0].shape[-1], str(xs[0].device), xs[0].dtype, seed=3)
        for x in fresh[: args.warmup]:
            step(x)
        torch.cuda.synchronize()
        rt.refill()
        before = copy.copy(rt.graph_stats())  # graph_stats() is the live counter object
        t0 = time.perf_counter()
        for x in fresh[args.warmup:]:
            step(x)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rt.refill()  # fold the last replays' read-back into the stats
        after = rt.graph_stats()
    n = args.tokens
    hits, staged = after.device_hits - before.device_hits, after.staged - before.staged
    copied = (after.bytes_staged - before.bytes_staged) + (after.refill_bytes - before.refill_bytes)
    return {"graph_tokens_per_s": n / dt, "graph_ms_per_token": dt / n * 1e3,
            "graph_hit_rate": hits / (hits + staged) if hits + staged else None,
            "graph_GB_copied_per_token": copied / n / 1e9}


def cpu_experts_rows(shape: str, L: int, args, device: str, layers, store, xs, ref_out, warm_xs) -> list[dict]:
    """tokens/s with OffloadConfig.cpu_experts in args.cpu_experts, at args.cpu_fractions caches (see module doc)."""
    s = STANDARD_SHAPES[shape]
    E, K = s["E"], s["K"]
    total = L * E
    policy = args.policies[0]
    rows = []
    for frac in args.cpu_fractions:
        slots = max(K, int(round(frac * total)))
        for mode in args.cpu_experts:
            cfg = OffloadConfig(gpu_slots=slots, policy=policy, device=device, cpu_experts=mode)
            rt = attach_offload(list(layers), cfg, release=False, progress=False, store=store)
            with torch.no_grad():
                diff = 0.0
                for i in range(args.check):  # also where "auto" measures B_cpu / B_pcie (untimed)
                    got = decode(layers, xs[i])
                    diff = max(diff, (got.float() - ref_out[i].float()).abs().max().item())
                if mode == "off" and diff != 0.0:
                    raise SystemExit(f"{shape} slots={slots} cpu_experts=off: differs from the resident model "
                                     f"(max abs {diff:.3e})")
                if not math.isfinite(diff):
                    raise SystemExit(f"{shape} slots={slots} cpu_experts={mode}: non-finite output")
                for i in range(max(args.warmup, math.ceil(2 * slots / (L * K)))):
                    decode(layers, warm_xs[i % len(warm_xs)])
                if mode == "auto" and rt.bandwidths is None:
                    rt.measure_bandwidths()  # else the cost model measures at its first choice, timed
                if device == "cuda":
                    torch.cuda.synchronize()
                rt.reset_stats()
                t0 = time.perf_counter()
                for x in xs[args.check + args.warmup :]:
                    decode(layers, x)
                if device == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
            st, cs = rt.stats(), rt.cpu_stats()
            n = args.tokens
            bw = rt.bandwidths or (None, None)
            row = {"bench": "cpu_experts", "shape": shape, "layers": L, "experts": total, "slots": slots,
                   "cache_frac": frac, "policy": policy, "cpu_experts": mode, "tokens_per_s": n / dt,
                   "ms_per_token": dt / n * 1e3, "hit_rate": st.hit_rate, "misses_per_token": st.misses / n,
                   "cpu_experts_per_token": cs.cpu_experts / n, "cpu_ms_per_token": cs.cpu_s * 1e3 / n,
                   "GB_not_copied_per_token": cs.bytes_not_copied / n / 1e9,
                   "GB_copied_per_token": st.bytes_copied / n / 1e9, "max_abs_diff_vs_resident": diff,
                   "cpu_GBps": bw[0] / 1e9 if bw[0] else None, "pcie_GBps": bw[1] / 1e9 if bw[1] else None,
                   "reuse": rt.reuse.reuse}
            rows.append(row)
            print(f"{shape:>13} S={slots:>4} ({frac:.0%}) cpu_experts={mode:>6}: {row['tokens_per_s']:7.2f} tok/s "
                  f"cpu/tok {row['cpu_experts_per_token']:.2f} miss/tok {row['misses_per_token']:.2f} "
                  f"diff {diff:.2e}", flush=True)
            rt.detach()
            del rt
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def val_text_bytes(n_bytes: int) -> tuple[bytes, list[str]]:
    """Held-out text: the stdlib files train_tiny_moe.py keeps for validation (same name hash)."""
    import glob
    import os
    import sysconfig
    import zlib

    root = sysconfig.get_paths()["stdlib"]
    names = [os.path.basename(f) for f in sorted(glob.glob(os.path.join(root, "*.py")))]
    val = [n for n in names if (zlib.crc32(n.encode()) % 1000) < 50]
    data, used = b"", []
    for n in val:
        with open(os.path.join(root, n), "rb") as f:
            data += f.read()
        used.append(n)
        if len(data) >= n_bytes:
            break
    return data[:n_bytes], used


def trace_stats_main(args) -> int:
    """Record the tiny model's routing on held-out text, then replay every policy (CPU is enough)."""
    from transformers import AutoModelForCausalLM

    from moeflow.hf import patch_model
    from moeflow.offload.trace import record_trace, replay, trace_stats

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    patch_model(model)
    data, files = val_text_bytes(args.trace_tokens)
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long() + 3  # ByT5 ids: byte + 3
    K = model.config.num_experts_per_tok
    with torch.no_grad(), record_trace(model, width=2 * K, meta={"model": args.model, "files": files}) as rec:
        for start in range(0, ids.numel(), 128):  # prefill windows of the training context
            model(input_ids=ids[start : start + 128].unsqueeze(0))
    trace = rec.trace.as_decode()  # the decode view: one pass per token
    if args.trace_out:
        trace.save(args.trace_out)
    stats = trace_stats(trace)
    total = trace.num_layers * min(trace.num_experts)
    rows = []
    for slots in args.trace_slots:
        for policy in ("lru", "random_oldest", "predictive", "belady"):
            for pf in ((0,) if policy == "belady" else (0, K, 2 * K)):
                r = replay(trace, slots, policy, pf, prefetch_rule="always")
                d = r.as_dict()
                d["cache_frac"] = slots / total
                rows.append(d)
    by = {(r["slots"], r["policy"], r["prefetch"]): r for r in rows}
    cut = {}
    for slots in args.trace_slots:
        lru = by[(slots, "lru", 0)]["misses"]
        best = min((by[(slots, "predictive", pf)] for pf in (K, 2 * K)), key=lambda r: r["misses"])
        cut[str(slots)] = {"lru_misses": lru, "predictive_prefetch_misses": best["misses"],
                           "prefetch": best["prefetch"], "miss_cut": 1 - best["misses"] / lru if lru else 0.0,
                           "prefetch_precision": best["prefetch_precision"],
                           "bytes_vs_lru": best["bytes_copied"] / by[(slots, "lru", 0)]["bytes_copied"]
                           if lru else 0.0,
                           "belady_misses": by[(slots, "belady", 0)]["misses"]}
    cols = ["slots", "policy", "prefetch", "hit_rate", "misses_per_token", "prefetch_precision", "prefetch_recall",
            "bytes_copied"]
    print(format_table(rows, cols))
    print(json.dumps({k: v for k, v in stats.items() if not k.endswith("per_layer") and k != "load_skew"}, indent=1))
    print(json.dumps(cut, indent=1))
    meta = env_info()
    meta.update(command=f"python benchmarks/bench_offload.py --trace-stats --trace-tokens {args.trace_tokens} "
                        f"--trace-slots {' '.join(map(str, args.trace_slots))}",
                trace_tokens=stats["tokens"], val_files=files)
    Path(args.stats_out).write_text(json.dumps({"meta": meta, "stats": stats, "miss_cut_vs_lru": cut,
                                                "replay": rows}, indent=1))
    print(f"wrote {args.stats_out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["mixtral-8x7b", "deepseek-v3"])
    p.add_argument("--layers", type=int, nargs="+", default=[8, 4], help="layers per shape (same order)")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    p.add_argument("--policies", nargs="+", default=["lru", "random_oldest", "predictive"])
    p.add_argument("--prefetch-width", type=int, default=None, help="W of the prefetch rows (default: K)")
    p.add_argument("--prefetch-rules", nargs="+", default=["always", "cost"], choices=["always", "cost"],
                   help="OffloadConfig.prefetch_rule of the prefetch rows")
    p.add_argument("--prefetch-overlap", type=float, default=None,
                   help="the cost rule's overlap (default: measured, see the module doc)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--check", type=int, default=2, help="tokens compared bitwise with the resident model")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument("--only-cpu-experts", dest="main_rows", action="store_false",
                   help="skip the policy rows: only the resident row and the cpu_experts rows")
    p.add_argument("--no-graphs", dest="graphs", action="store_false",
                   help="skip the CUDA-graph replay timing of the sync-free rows")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke test of the script)")
    p.add_argument("--cpu", action="store_true",
                   help="run on the CPU, in the quick configuration (the default without CUDA)")
    p.add_argument("--cpu-experts", nargs="+", default=None, choices=["off", "auto", "always"],
                   help="OffloadConfig.cpu_experts modes compared (default: off auto; the quick run adds always; "
                        "'off' alone skips the comparison)")
    p.add_argument("--cpu-fractions", type=float, nargs="+", default=[0.25, 0.5],
                   help="cache sizes of the cpu_experts comparison")
    p.add_argument("--out", default="out/bench_offload.json")
    p.add_argument("--trace-stats", action="store_true",
                   help="instead: record the tiny model's trace on held-out text, replay it, write --stats-out")
    p.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "moeflow/assets/tiny-moe"))
    p.add_argument("--trace-tokens", type=int, default=4096)
    p.add_argument("--trace-slots", type=int, nargs="+", default=[4, 8, 16, 24])
    p.add_argument("--trace-out", default=None, help="also save the decode-view trace (JSON lines)")
    p.add_argument("--stats-out", default="benchmarks/results/offload_trace_stats.json")
    args = p.parse_args(argv)
    if args.trace_stats:
        return trace_stats_main(args)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu" and not args.quick:
        # Full shapes on a CPU only exhaust host memory (see the module doc): the quick run instead.
        why = "--cpu" if args.cpu else "no CUDA on this machine"
        print(f"bench_offload: {why}: running the quick CPU configuration (tiny shapes, fp32, host->host "
              f"copies); its figures are a check of the script, not offload performance", flush=True)
        args.quick = True
    if args.quick:
        STANDARD_SHAPES["quick-mixtral"] = {"H": 64, "I": 128, "E": 8, "K": 2, "shared": 0}
        STANDARD_SHAPES["quick-deepseek"] = {"H": 64, "I": 32, "E": 32, "K": 4, "shared": 1}
        args.shapes, args.layers = ["quick-mixtral", "quick-deepseek"], [4, 2]
        args.tokens, args.warmup = 6, 3
        if args.cpu_experts is None:
            args.cpu_experts = ["off", "auto", "always"]
    if args.cpu_experts is None:
        args.cpu_experts = ["off", "auto"]
    if len(args.layers) != len(args.shapes):
        p.error(f"--layers: {len(args.layers)} values for {len(args.shapes)} shapes")
    pcie = pcie_roof_bytes_per_s() if device == "cuda" else 10e9
    print(f"pinned H2D: {pcie / 1e9:.1f} GB/s (device {device})", flush=True)
    rows = []
    t0 = time.perf_counter()
    for shape, L in zip(args.shapes, args.layers):
        rows += run_shape(shape, L, args, pcie, device, dtype)
        if device == "cuda":  # the pinned store of this shape stays in torch's host cache otherwise
            gc.collect()
            empty_host = getattr(torch._C, "_accelerator_emptyHostCache", None) or getattr(torch._C,
                                                                                         "_host_emptyCache", None)
            if empty_host is not None:
                empty_host()
    cols = ["shape", "slots", "cache_frac", "policy", "prefetch", "prefetch_rule", "sync_free", "tokens_per_s",
            "hit_rate", "GB_copied_per_token",
            "misses_per_token", "prefetch_precision", "wait_ms_per_token", "roof_frac", "roof_frac_miss",
            "graph_tokens_per_s", "graph_hit_rate"]
    print(format_table([r for r in rows if "bench" not in r], cols))
    cpu_rows = [r for r in rows if r.get("bench") == "cpu_experts"]
    if cpu_rows:
        print(format_table(cpu_rows, ["shape", "slots", "cache_frac", "cpu_experts", "tokens_per_s", "hit_rate",
                                      "misses_per_token", "cpu_experts_per_token", "GB_not_copied_per_token",
                                      "cpu_GBps", "pcie_GBps", "reuse", "max_abs_diff_vs_resident"]))
    for r in rows:
        if "profile" in r:
            print(f"profile {r['shape']} S={r['slots']} {r['policy']} pf={r['prefetch']}: {r['profile']}")
    meta = env_info()
    meta.update(pcie_GBps=pcie / 1e9,
                command="python " + " ".join(["benchmarks/bench_offload.py", *(argv or sys.argv[1:])]),
                wall_s=time.perf_counter() - t0,
                median_roof_frac=statistics.median([r["roof_frac"] for r in rows if "roof_frac" in r] or [float("nan")]))
    write_json(args.out, rows, meta)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
