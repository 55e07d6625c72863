"""Router benchmark: CPU routing throughput and GPU router-step time vs HF's ops and the HBM floor.

Legend: T tokens, H hidden size, E routed experts, K picks per token.

Rows (one per shape x T x implementation x mode), all ratios taken in this run:
  CPU  `route`          moeflow.route on f32 logits (validation and NaN check included);
       `router_logits`  moeflow.router_logits (the CPU batch-invariant reference), small T only.
  GPU  `moeflow`        router_step_cuda as the layer runs it: one fused kernel (GEMM partials, the
                        last program per row group sums them and selects) for T <= FUSED_MAX_T,
                        the two-kernel step above;
       `moeflow-fused`  router_step_cuda(fused=True): the single-kernel step at every T timed;
       `moeflow-2k`     router_step_cuda(fused=False): batch-invariant GEMM + selection kernel
                        (2 launches), same bits;
       `moeflow-sep`    router_logits_cuda + route_cuda (what moeflow.router_logits + moeflow.route run);
       `variant`        the same kernels with a T-dependent H split (a batch-*variant* tuning of
                        the same design: fewer splits as T grows), to price batch invariance;
       `hf`             F.linear + the family's torch ops (softmax / sigmoid / topk / renorm),
                        what the HF router modules run;
  each `eager` (CUDA events around one call: includes Python launch overhead) and
  `graph` (one CUDA-graph replay), L2 flushed (256 MB write) before every timed call.
  floor_us = E*H*2 bytes / HBM roof (a 2 GiB device copy, measured here), at T <= 8;
  roof_frac = floor / time; vs_peer = hf time / this time (same mode).
Every implementation is checked before it is timed (logits against a float64 product,
ids against the torch reference on that implementation's own logits) and refused if wrong.

    python benchmarks/bench_routing.py --cpu                 # CPU rows (quick)
    python benchmarks/bench_routing.py --gpu --out DIR       # GPU rows, JSON + markdown in DIR
    python benchmarks/bench_routing.py --gpu --sweep         # GEMM tile/split sweep (tuning)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    STANDARD_SHAPES,
    env_info,
    format_table,
    hbm_roof_bytes_per_s,
    time_cpu,
    time_cuda,
    time_cuda_graph,
    write_json,
)
from moeflow.routing.spec import RouterSpec  # noqa: E402

CPU_TOKENS = (1, 8, 64, 512, 4096, 8192)
GPU_TOKENS = (1, 8, 64, 512, 4096)


def shape_spec(name: str) -> RouterSpec:
    """The routing family of each standard shape (routing.md's table)."""
    s = STANDARD_SHAPES[name]
    E, K = s["E"], s["K"]
    if name == "mixtral-8x7b":
        return RouterSpec(score_fn="softmax", num_experts=E, top_k=K, renorm=True)
    if name == "qwen3-30b-a3b":
        return RouterSpec(score_fn="softmax", num_experts=E, top_k=K, renorm=True)
    if name == "deepseek-v3":
        return RouterSpec(score_fn="sigmoid", num_experts=E, top_k=K, renorm=True, renorm_eps=1e-20,
                          scaling_factor=2.5, n_group=8, topk_group=4, use_bias=True)
    if name == "gpt-oss-120b":
        return RouterSpec(score_fn="topk_softmax", num_experts=E, top_k=K)
    if name == "ds-v4.1-like":
        return RouterSpec(score_fn="sqrtsoftplus", num_experts=E, top_k=K, renorm=True, renorm_eps=1e-20,
                          scaling_factor=1.5, use_bias=True)
    raise KeyError(name)


def make_inputs(name: str, T: int, device: str, *, seed: int = 0):
    """x_TH bf16, w_EH bf16 (scaled so logits are O(1)), selection bias, gpt-oss router bias."""
    s = STANDARD_SHAPES[name]
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, s["H"], device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(s["E"], s["H"], device=device, generator=g) / math.sqrt(s["H"])).to(torch.bfloat16)
    spec = shape_spec(name)
    bias = torch.randn(s["E"], device=device, generator=g) * 0.05 if spec.use_bias else None
    rbias = torch.randn(s["E"], device=device, generator=g) * 0.1 if name == "gpt-oss-120b" else None
    return x, w, bias, rbias


# --------------------------------------------------------------------------- HF peer


def hf_router(x, w, spec: RouterSpec, bias, rbias):
    """The torch ops of the HF router module of each family (bf16 F.linear unless HF upcasts)."""
    if spec.score_fn == "sigmoid":  # DeepseekV3TopkRouter: F.linear in fp32, sigmoid, group top-2
        logits = F.linear(x.float(), w.float())
        scores = logits.sigmoid()
        sfc = scores + bias
        T, E = sfc.shape
        G = spec.n_group
        gs = sfc.view(T, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        gidx = torch.topk(gs, k=spec.topk_group, dim=-1, sorted=False)[1]
        gmask = torch.zeros_like(gs).scatter_(1, gidx, 1)
        smask = gmask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E)
        sfc = sfc.masked_fill(~smask.bool(), float("-inf"))
        ids = torch.topk(sfc, k=spec.top_k, dim=-1, sorted=False)[1]
        wts = scores.gather(1, ids)
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, ids, wts * spec.scaling_factor
    if spec.score_fn == "sqrtsoftplus":  # DeepseekV4TopKRouter
        logits = F.linear(x, w)
        scores = F.softplus(logits).sqrt()
        ids = torch.topk(scores + bias, spec.top_k, dim=-1, sorted=False).indices
        wts = scores.gather(1, ids)
        wts = wts / (wts.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, ids, wts * spec.scaling_factor
    if spec.score_fn == "topk_softmax":  # GptOssTopKRouter
        logits = F.linear(x, w, rbias.to(x.dtype))
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return logits, ids, torch.softmax(top, dim=1, dtype=top.dtype)
    # MixtralSparseMoeBlock / Qwen3MoeSparseMoeBlock
    logits = F.linear(x, w)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    wts, ids = torch.topk(probs, spec.top_k, dim=-1)
    if spec.renorm:
        wts = wts / wts.sum(dim=-1, keepdim=True)
    return logits, ids, wts


# --------------------------------------------------------------------------- checks


def _check_logits(name, impl, logits, x, w, rbias) -> None:
    ref = x.double() @ w.double().T
    if rbias is not None:
        ref = ref + rbias.double()
    tol = 2e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    err = (logits.double() - ref).abs()
    if not bool((err <= tol).all()):
        raise SystemExit(f"{name} {impl}: logits off by {float(err.max()):.3e}: refusing to time it")


def _check_ids(name, impl, ids, wts, logits, spec, bias, *, max_bad_frac=0.005) -> int:
    """Ids against the torch reference on the same logits; near-tie rows (different score
    rounding) may differ, at most max_bad_frac of rows. Returns the number of differing rows."""
    from moeflow.routing.select import route_reference

    ref = route_reference(logits.float(), spec, bias=bias)
    a, b = ids.long(), ref.ids_TK.long()
    bad = int((a != b).any(dim=1).sum())
    if bad > max(1, max_bad_frac * ids.shape[0]):
        raise SystemExit(f"{name} {impl}: {bad} of {ids.shape[0]} rows pick other experts: refusing to time it")
    ok = ~(a != b).any(dim=1)
    d = (wts.float()[ok] - ref.weights_TK[ok]).abs() / ref.weights_TK[ok].abs().clamp_min(1e-30)
    if d.numel() and float(d.max()) > 1e-5:
        raise SystemExit(f"{name} {impl}: weights off by {float(d.max()):.3e} relative: refusing to time it")
    return bad


def _check_hf(name, ids, logits, spec, bias, *, max_bad_frac=0.01) -> int:
    """HF's picks hold the same multiset of selection keys as the reference's (bf16 logits tie
    often and HF's topk order among ties is undefined, so ids are compared through keys),
    with scores in HF's own precision (DeepSeek-V4: softplus of the bf16 logits in bf16);
    at most max_bad_frac of rows may differ (bf16 ties between different f32 keys)."""
    from moeflow.routing.grouped import group_mask_TS
    from moeflow.routing.scores import scores_TS, selection_key_TS
    from moeflow.routing.topk import stable_topk_indices

    if spec.score_fn == "sqrtsoftplus":  # HF scores the bf16 logits in bf16
        scores = F.softplus(logits).sqrt().float()
    else:  # HF's softmax / sigmoid / topk run on f32 (upcast) or compare the logits themselves
        scores = scores_TS(logits.float(), spec)
    key = selection_key_TS(scores, spec, bias)
    if spec.n_group > 1:
        key = group_mask_TS(key, spec)
    ref_ids = stable_topk_indices(key, spec.top_k)
    a = key.gather(1, ids.long()).sort(dim=1).values
    b = key.gather(1, ref_ids).sort(dim=1).values
    bad = int((a != b).any(dim=1).sum())
    if bad > max(1, max_bad_frac * ids.shape[0]):
        raise SystemExit(f"{name} hf: {bad} rows pick other keys than the reference: refusing to time it")
    return bad


# --------------------------------------------------------------------------- CPU rows


def cpu_rows(shapes, tokens, logits_max_T: int, reps: int) -> list[dict]:
    import moeflow

    rows = []
    for name in shapes:
        spec = shape_spec(name)
        s = STANDARD_SHAPES[name]
        for T in tokens:
            g = torch.Generator().manual_seed(T)
            logits = torch.randn(T, s["E"], generator=g)
            bias = torch.randn(s["E"], generator=g) * 0.05 if spec.use_bias else None
            t = time_cpu(lambda logits=logits, bias=bias, spec=spec: moeflow.route(logits, spec, bias=bias),
                         reps=reps, warmup=1)
            rows.append(dict(device="cpu", shape=name, T=T, impl="route", mode="eager", us=t * 1e6,
                             tokens_per_s=T / t))
            if T <= logits_max_T:
                x, w, _, _ = make_inputs(name, T, "cpu")
                t = time_cpu(lambda x=x, w=w: moeflow.router_logits(x, w), reps=max(2, reps // 4), warmup=1)
                rows.append(dict(device="cpu", shape=name, T=T, impl="router_logits", mode="eager",
                                 us=t * 1e6, tokens_per_s=T / t))
            print(f"cpu {name} T={T} done", flush=True)
    return rows


# --------------------------------------------------------------------------- GPU rows


def _variant_config(gpu, E, H, T):
    """Batch-variant tuning of the same kernel: the split shrinks as T grows (T-dependent)."""
    base = gpu.logits_config(E, H, False)
    m_tiles = -(-T // base.block_m)
    return gpu.logits_config(E, H, False, target_programs=max(1, gpu._TARGET_PROGRAMS // m_tiles))


def _impls(gpu, spec, x, w, bias, rbias, var_cfg) -> dict:
    """The timed callables of one (shape, T): each runs one router step."""

    def sep():
        logits = gpu.router_logits_cuda(x, w)
        if rbias is not None:
            logits = logits + rbias
        return gpu.route_cuda(logits, spec, bias=bias)

    return {
        "moeflow": lambda: gpu.router_step_cuda(x, w, spec, router_bias=rbias, bias=bias),
        "moeflow-fused": lambda: gpu.router_step_cuda(x, w, spec, router_bias=rbias, bias=bias, fused=True),
        "moeflow-2k": lambda: gpu.router_step_cuda(x, w, spec, router_bias=rbias, bias=bias, fused=False),
        "moeflow-sep": sep,
        "variant": lambda: gpu.router_step_cuda(x, w, spec, router_bias=rbias, bias=bias, config=var_cfg),
        "hf": lambda: hf_router(x, w, spec, bias, rbias),
    }


def gpu_rows(shapes, tokens, reps: int) -> tuple[list[dict], dict]:
    from moeflow.routing import gpu

    torch.backends.cuda.matmul.allow_tf32 = False
    hbm = hbm_roof_bytes_per_s()
    one = torch.zeros(1, device="cuda")
    launch = time_cuda_graph(lambda: one.add_(1), reps=reps)
    roofs = {"hbm_bytes_per_s": hbm, "graph_launch_us": launch * 1e6}
    print(f"HBM roof {hbm / 1e12:.2f} TB/s, one graph launch {launch * 1e6:.2f} us", flush=True)
    rows = []
    for name in shapes:
        spec = shape_spec(name)
        s = STANDARD_SHAPES[name]
        E, H = s["E"], s["H"]
        for T in tokens:
            x, w, bias, rbias = make_inputs(name, T, "cuda", seed=T)
            var_cfg = _variant_config(gpu, E, H, T)
            impls = _impls(gpu, spec, x, w, bias, rbias, var_cfg)
            # correctness before timing
            step = impls["moeflow"]()
            _check_logits(name, "moeflow", step.logits_TS, x, w, rbias)
            bad = {"moeflow": _check_ids(name, "moeflow", step.routing.ids_TK, step.routing.weights_TK,
                                         step.logits_TS, spec, bias)}
            step.routing.check()
            vstep = impls["variant"]()
            _check_logits(name, "variant", vstep.logits_TS, x, w, rbias)
            bad["variant"] = _check_ids(name, "variant", vstep.routing.ids_TK, vstep.routing.weights_TK,
                                        vstep.logits_TS, spec, bias)
            two, one = impls["moeflow-2k"](), impls["moeflow-fused"]()
            # the fused and the two-kernel step: the same bits (refuse to time otherwise)
            for other in (two, one):
                same = (torch.equal(other.logits_TS.view(torch.int32), step.logits_TS.view(torch.int32))
                        and torch.equal(other.routing.ids_TK, step.routing.ids_TK)
                        and torch.equal(other.routing.weights_TK.view(torch.int32),
                                        step.routing.weights_TK.view(torch.int32)))
                if not same:
                    raise SystemExit(f"{name} T={T}: fused and two-kernel steps differ: refusing to time them")
            bad["moeflow-2k"] = bad["moeflow-fused"] = bad["moeflow"]
            sep = impls["moeflow-sep"]()
            bad["moeflow-sep"] = _check_ids(name, "moeflow-sep", sep.ids_TK, sep.weights_TK, step.logits_TS,
                                            spec, bias)
            hl, hi, hw = impls["hf"]()
            bad["hf"] = _check_hf(name, hi, hl, spec, bias)
            # row 0 alone vs inside this batch: moeflow must keep its bits, the variant need not
            row0 = x[:1]
            inv = bool(torch.equal(gpu.router_logits_cuda(row0, w).view(torch.int32),
                                   gpu.router_logits_cuda(x, w)[:1].view(torch.int32)))
            vinv = bool(torch.equal(
                gpu.router_logits_cuda(row0, w, config=_variant_config(gpu, E, H, 1)).view(torch.int32),
                gpu.router_logits_cuda(x, w, config=var_cfg)[:1].view(torch.int32)))
            floor = E * H * 2 / hbm if T <= 8 else None
            times = {}
            for impl, fn in impls.items():
                for mode in ("eager", "graph"):
                    if mode == "eager":
                        t = time_cuda(fn, reps=reps, warmup=3, flush=True)
                    else:
                        t = time_cuda_graph(fn, reps=reps, flush=True)
                    times[(impl, mode)] = t
            for (impl, mode), t in times.items():
                hf_t = times[("hf", mode)]
                row = dict(device="cuda", shape=name, T=T, impl=impl, mode=mode, us=t * 1e6,
                           vs_peer=hf_t / t, rows_differing_from_ref=bad[impl])
                if floor is not None:
                    row["floor_us"] = floor * 1e6
                    row["roof_frac"] = floor / t
                    row["target_us"] = (1.5 * floor + launch) * 1e6
                if impl == "moeflow":
                    row["bit_invariant_T1_vs_T"] = inv
                    row["fused"] = step.fused
                if impl == "variant":
                    row["bit_invariant_T1_vs_T"] = vinv
                    row["variant_split"] = var_cfg.split
                if impl.startswith("moeflow"):
                    row["split"] = gpu.logits_config(E, H, False).split
                rows.append(row)
            print(f"gpu {name} T={T}: " + ", ".join(
                f"{i}/{m} {t * 1e6:.2f}us" for (i, m), t in times.items() if m == "graph"), flush=True)
    return rows, roofs


def sweep_rows(shapes, tokens, reps: int) -> list[dict]:
    """Graph-replay time of the logits GEMM alone for candidate tiles/splits (tuning data)."""
    from moeflow.routing import gpu

    cands = [
        dict(block_m=64, block_e=64, block_k=64, num_warps=4, num_stages=4, target_programs=128),  # first default
        dict(block_m=64, block_e=64, block_k=64, num_warps=4, num_stages=4, target_programs=256),
        dict(block_m=64, block_e=32, block_k=64, num_warps=4, num_stages=4, target_programs=256),
        dict(block_m=64, block_e=128, block_k=64, num_warps=4, num_stages=3, target_programs=128),
        dict(block_m=16, block_e=32, block_k=128, num_warps=4, num_stages=4, target_programs=256),
        dict(block_m=128, block_e=64, block_k=64, num_warps=8, num_stages=3, target_programs=128),
        dict(block_m=64, block_e=64, block_k=128, num_warps=4, num_stages=3, target_programs=64),  # default now
        dict(block_m=64, block_e=64, block_k=64, num_warps=4, num_stages=4, target_programs=256, min_chunk=64),
    ]
    rows = []
    for name in shapes:
        s = STANDARD_SHAPES[name]
        E, H = s["E"], s["H"]
        for T in tokens:
            x, w, _, _ = make_inputs(name, T, "cuda", seed=1)
            ref = gpu.router_logits_cuda(x, w)
            for i, c in enumerate(cands):
                cfg = gpu.logits_config(E, H, False, **c)
                out = gpu.router_logits_cuda(x, w, config=cfg)
                err = float((out - ref).abs().max())
                t = time_cuda_graph(lambda x=x, w=w, cfg=cfg: gpu.router_logits_cuda(x, w, config=cfg), reps=reps)
                rows.append(dict(shape=name, T=T, cand=i, split=cfg.split, us=t * 1e6, max_diff=err, **c))
            best = min((r for r in rows if r["shape"] == name and r["T"] == T), key=lambda r: r["us"])
            torch.cuda.synchronize()
            print(f"sweep {name} T={T}: best cand {best['cand']} {best['us']:.2f}us", flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="CPU rows")
    ap.add_argument("--gpu", action="store_true", help="GPU rows")
    ap.add_argument("--sweep", action="store_true", help="GPU GEMM config sweep")
    ap.add_argument("--shapes", default=",".join(STANDARD_SHAPES))
    ap.add_argument("--tokens", default=None, help="comma-separated T (default: CPU 1..8192, GPU 1..4096)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--cpu-logits-max-T", type=int, default=64)
    ap.add_argument("--out", default="out", help="directory for bench_routing*.json / .md")
    args = ap.parse_args(argv)
    if not (args.cpu or args.gpu or args.sweep):
        args.cpu = True
    shapes = args.shapes.split(",")
    out = Path(args.out)
    meta = env_info()
    tables = []
    if args.cpu:
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else CPU_TOKENS
        rows = cpu_rows(shapes, tokens, args.cpu_logits_max_T, args.reps or 5)
        write_json(out / "bench_routing_cpu.json", rows, meta)
        tables.append("### CPU\n\n" + format_table(rows, ["shape", "T", "impl", "us", "tokens_per_s"]))
    if args.gpu:
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else GPU_TOKENS
        rows, roofs = gpu_rows(shapes, tokens, args.reps or 30)
        write_json(out / "bench_routing_gpu.json", rows, {**meta, **roofs})
        cols = ["shape", "T", "impl", "mode", "us", "vs_peer", "floor_us", "roof_frac", "target_us",
                "fused", "bit_invariant_T1_vs_T", "rows_differing_from_ref"]
        head = (f"HBM roof {roofs['hbm_bytes_per_s'] / 1e12:.3f} TB/s; one CUDA-graph launch "
                f"{roofs['graph_launch_us']:.2f} us; target_us = 1.5 x floor + one launch\n\n")
        tables.append("### GPU\n\n" + head + format_table(rows, cols))
    if args.sweep:
        tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else (1, 8, 512, 4096)
        rows = sweep_rows(shapes, tokens, args.reps or 20)
        write_json(out / "bench_routing_sweep.json", rows, meta)
        tables.append("### GEMM sweep\n\n" + format_table(
            rows, ["shape", "T", "cand", "block_m", "block_e", "block_k", "num_warps", "num_stages",
                   "target_programs", "min_chunk", "split", "us", "max_diff"]))
    text = f"{meta}\n\n" + "\n\n".join(tables) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_routing.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
