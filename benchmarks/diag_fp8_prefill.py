"""FP8 (W8A8 block 128x128) GEMMs at prefill, round-robin A/B on the GPU (issue 15 item 6: FP8 prefill
>= 1.3x our bf16).

Legend: T tokens, K slots, E experts, H hidden, I intermediate, BM/BN tiles; "pointer" / "TMA" the two
kernel forms of the fp8 GEMMs (moeflow.kernels.moe_gemm_quant / moe_gemm_fp8_tma).

Variants, all of one (shape, T) captured as CUDA graphs and timed round-robin in one process
(benchmarks.common.time_cuda_graphs_interleaved, L2 flushed before every replay), so the power-capped
clock drift of compute-bound steps falls on all of them alike:
    bf16           our TritonExperts on the bf16 weights the fp8 ones were quantized from (the target's
                   denominator)
    fp8_percol     the fp8 pointer kernels with per-column weight scales, (dot * sa) * sw (FP8_SCALAR_WS
                   = False: the kernels before 2026-12-04's fourth session), default tiles
    fp8_ptr        pointer kernels, one weight scale a tile and K step, scales loaded a step ahead
    fp8            TritonQuantExperts() as it runs by default (TMA kernels on Hopper where the tiles allow)
    fp8_2dot       fp8 with the TMA gate_up's two-dot form (experts.triton.FUSED_GATE_UP = False)
    bf16_2dot      bf16 with the same (moeflow.kernels.moe_gemm_tma.py: FUSED)
    fp8_flatdn     fp8 with the down GEMM as one flattened persistent loop over (tile, K step)
                   (experts.triton.FLAT_DOWN = True; moe_gemm_fp8_tma._fp8_down_flat)
    fp8_flat       fp8 with both GEMMs flattened (FLAT_GATE_UP too: _fp8_gate_up_flat)
    bf16_flat      bf16 with the same (moe_gemm_tma._down_flat)
    fp8_tri        fp8 with the Triton kernels only (FP8_WS_GATE_UP = False: its rule off)
    fp8_wsdn       fp8 with the down GEMM by the warp-specialised Gluon kernel (FP8_WS_DOWN;
                   moeflow/kernels/moe_gemm_fp8_ws.py; on the CPU dry run the flag changes nothing),
                   one persistent CTA an SM (experts.triton_ws.WS_TILE_GRID = False)
    fp8_wsgu       the same for the gate_up (FP8_WS_GATE_UP = True); fp8_ws both
    fp8_ws_grid    fp8_ws with one CTA a tile, not one persistent CTA an SM (experts.triton_ws.WS_TILE_GRID,
                   the default); fp8_wsgu_grid / fp8_wsdn_grid: that GEMM alone
    fp8_wsdn_dyn   fp8_wsdn with the down's tiles claimed at run time (experts.triton_ws.WS_DYNAMIC_TILES)
    fp8_bi         TritonQuantExperts(batch_invariant=True, fp8=True): its fp8 dots restart the wgmma
                   accumulation every FP8_BI_IMPRECISE_ACC products (64)
    fp8_bi32       the same every 32 products
    fp8_bi_acc     the same with Triton's default accumulation (FP8_BI_IMPRECISE_ACC = None)
    t:<name>       forced tiles (TMA where allowed): see _TILES
Every fp8 variant is checked against the W8A8 reference (rel-L2, max-abs) before it is timed; fp8 and
each "X" is compared bit for bit with "X_ptr" (the same tiles through the pointer kernels), and each
"X_2dot" / "X_flat" / "X_flatdn" / "X_ws*" / "X_tri" with "X" (the fused and the two-dot gate_up, the flat and the tiled down give the
same bits: bitwise_vs_base).

    PYTHONPATH=. python benchmarks/diag_fp8_prefill.py --shapes deepseek-v3 --tokens 2048,8192 --json out.json
    PYTHONPATH=. python benchmarks/diag_fp8_prefill.py --dry-run     # CPU: Triton interpreter, tiny shape
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_experts_quant import SHAPES, build_weights, error_vs, reference  # noqa: E402
from benchmarks.common import compute_roof_flops, env_info, time_cuda_graphs_interleaved  # noqa: E402
from benchmarks.tune_experts import routing  # noqa: E402
from moeflow.tuning import GemmTile, MoETileConfig  # noqa: E402


def _cfg(bm, gu, dn) -> MoETileConfig:
    return MoETileConfig(block_m=bm, gate_up=GemmTile(**gu), down=GemmTile(**dn))


_GU = dict(block_n=128, block_k=128, num_warps=8, num_stages=3)
_DN = dict(block_n=128, block_k=128, num_warps=8, num_stages=4)
# Forced tiles (GPU). BM 128 gate_up holds 2 x [128, 128] f32 sums plus the dot results: it spills
# in the TMA form (sm_90 compile: 255 registers + 228 B) and nearly fits in the pointer form.
_TILES = {
    "bm64": _cfg(64, _GU, _DN),
    "bm64_gu4": _cfg(64, dict(_GU, num_stages=4), _DN),
    "bm64_pers": _cfg(64, dict(_GU, persistent=True), dict(_DN, persistent=True)),
    "bm64_dnpers": _cfg(64, _GU, dict(_DN, persistent=True)),
    "bm64_g16": _cfg(64, dict(_GU, group_m=16), dict(_DN, group_m=16)),
    "bm64_g32": _cfg(64, dict(_GU, group_m=32), dict(_DN, group_m=32)),
    "bm64_gu4_g16": _cfg(64, dict(_GU, num_stages=4, group_m=16), dict(_DN, group_m=16)),
    "bm64_dn3": _cfg(64, _GU, dict(_DN, num_stages=3)),
    "bm64_dn4w": _cfg(64, _GU, dict(_DN, num_warps=4)),
    "bm64_gu4_g16_dn4w": _cfg(64, dict(_GU, num_stages=4, group_m=16), dict(_DN, num_warps=4, group_m=16)),
    "bm128": _cfg(128, _GU, _DN),
    "bm128_dnpers": _cfg(128, _GU, dict(_DN, persistent=True)),
}
_TILES_DRY = {"bm64": _cfg(64, dict(block_n=128, block_k=128, num_stages=1), dict(block_n=128, block_k=128,
                                                                                     num_stages=1)),
              "bm64_pers": _cfg(64, dict(block_n=128, block_k=128, num_stages=1, persistent=True),
                                dict(block_n=128, block_k=128, num_stages=1, persistent=True))}


def _setting(module: str, name: str, value):
    """A context factory: module.name = value while the body runs (capture time), then the value it had."""
    import importlib
    from unittest import mock

    return functools.partial(mock.patch.object, importlib.import_module(module), name, value)


# fp8_percol: the pointer kernels with per-column weight scales; *_2dot: the TMA gate_up's two-dot form;
# fp8_bi32 / fp8_bi_acc: the batch-invariant mode's fp8 accumulation restarted every 32 products / never
_percol = _setting("moeflow.experts.triton_quant", "FP8_SCALAR_WS", False)
_two_dot = _setting("moeflow.experts.triton", "FUSED_GATE_UP", False)
_flat = _setting("moeflow.experts.triton", "FLAT_DOWN", True)
_wsdn = _setting("moeflow.experts.triton_quant", "FP8_WS_DOWN", True)
_wsgu = _setting("moeflow.experts.triton_quant", "FP8_WS_GATE_UP", True)
_triton_only = _setting("moeflow.experts.triton_quant", "FP8_WS_GATE_UP", False)


@contextlib.contextmanager
def _ws_both():
    with _wsdn(), _wsgu():
        yield


def _with(ctx, grid: bool):
    """ctx with the Gluon kernels launched one CTA a tile (grid) or one persistent CTA an SM
    (experts.triton_ws.WS_TILE_GRID)."""
    flag = _setting("moeflow.experts.triton_ws", "WS_TILE_GRID", grid)

    @contextlib.contextmanager
    def both():
        with ctx(), flag():
            yield
    return both


@contextlib.contextmanager
def _flat_both():
    with _flat(), _setting("moeflow.experts.triton", "FLAT_GATE_UP", True)():
        yield


def run_point(name, spec, T, cfg, wq, plain, impls, dev, args) -> list[dict]:
    E, K, H, I = spec["E"], spec["K"], spec["H"], spec["I"]
    ids, wts = routing(T, E, K, args.dist, dev, seed=args.seed)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dev, torch.bfloat16)
    ref = reference(x, ids, wts, wq, cfg, w8a8=True)
    flops = 2 * 3 * H * I * T * K
    rows, fns, outs = [], {}, {}
    for vname, (impl, w_use, ctx) in impls.items():
        def fn(impl=impl, w_use=w_use):
            return impl.forward_tokens(x, ids, wts, w_use, cfg)

        row = dict(shape=name, T=T, dist=args.dist, variant=vname)
        try:
            with ctx():
                out = fn()
            if not vname.startswith("bf16"):  # the bf16 rows are the denominator, not W8A8
                row["rel_l2_vs_w8a8_ref"], row["max_abs_vs_w8a8_ref"] = error_vs(out.float(), ref)
                row["tiles"] = impl.tile_config_for(w_use, K, T).to_dict()
                if not row["rel_l2_vs_w8a8_ref"] <= args.check_rel_l2:
                    row["status"] = f"WRONG (rel-L2 {row['rel_l2_vs_w8a8_ref']:.3g}): not timed"
                    rows.append(row)
                    continue
            outs[vname] = out

            def captured(fn=fn, ctx=ctx):  # the flag a variant sets is read while its graph is captured
                with ctx():
                    return fn()

            fns[vname] = captured
            row["status"] = "ok"
        except Exception as exc:  # a variant that cannot run says so
            row["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
    for r in rows:  # "X" against "X_ptr" (the same tiles through the pointer kernels), "X_2dot" / "X_flat" against "X"
        v = r["variant"]
        if v.endswith(("_grid", "_dyn")):  # fp8_ws*_grid / _dyn: other Gluon schedules, against the Triton kernels
            base = "fp8"
        else:
            base = v.rsplit("_", 1)[0] if v.endswith(("_2dot", "_flat", "_flatdn", "_wsdn", "_wsgu", "_ws", "_tri")) else None
        for key, twin in (("bitwise_vs_ptr", outs.get(v + "_ptr")),
                          ("bitwise_vs_base", outs.get(base) if base else None)):
            if v in outs and twin is not None:
                r[key] = bool(torch.equal(outs[v].view(torch.int16), twin.view(torch.int16)))
    if fns and dev.type == "cuda":
        times = time_cuda_graphs_interleaved(fns, rounds=args.rounds, reps=args.reps)
        base = times.get("bf16")
        for r in rows:
            t = times.get(r["variant"])
            if t is not None:
                r["us"] = 1e6 * t
                r["tflops"] = flops / t / 1e12
                if base:
                    r["speedup_vs_bf16"] = base / t
    for r in rows:
        extra = "" if "us" not in r else (f"{r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s "
                                          f"x{r.get('speedup_vs_bf16', float('nan')):.3f} vs bf16")
        err = f" rel-L2 {r['rel_l2_vs_w8a8_ref']:.2e}" if "rel_l2_vs_w8a8_ref" in r else ""
        bit = "".join(f" {k}={r[k]}" for k in ("bitwise_vs_ptr", "bitwise_vs_base") if k in r)
        print(f"{name:18s} T={T:5d} {r['variant']:14s} {r['status'][:80]:4s} {extra}{err}{bit}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="deepseek-v3")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--variants", default="bf16,bf16_2dot,fp8_percol,fp8_ptr,fp8,fp8_2dot,"
                    + ",".join(f"t:{k}" for k in _TILES))
    ap.add_argument("--dist", default="uniform", choices=("uniform", "zipf"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-rel-l2", type=float, default=2e-2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shape, no timing")
    args = ap.parse_args(argv)
    from moeflow.experts.triton import TritonExperts
    from moeflow.experts.triton_quant import TritonQuantExperts

    dry = args.dry_run
    if dry:
        from benchmarks.bench_experts_quant import patch_interpreter_fp8
        from benchmarks.tune_experts import patch_interpreter_index

        patch_interpreter_fp8()
        patch_interpreter_index()
        args.shapes, args.tokens = "tiny-fp8", "40"
        args.variants = ("bf16,bf16_2dot,bf16_flat,fp8_percol,fp8_ptr,fp8,fp8_2dot,fp8_flatdn,fp8_flat,fp8_wsdn,fp8_wsgu,fp8_ws,fp8_ws_grid,fp8_wsdn_dyn,fp8_tri,"
                         "fp8_bi,"
                         "fp8_bi32,fp8_bi_acc,"
                         + ",".join(f"t:{k}" for k in _TILES_DRY))
    dev = torch.device("cpu" if dry else "cuda")
    tiles = _TILES_DRY if dry else _TILES
    meta = env_info()
    if not dry:
        meta["compute_roof_tflops"] = compute_roof_flops() / 1e12
    t0 = time.time()
    rows = []
    for name in args.shapes.split(","):
        spec = SHAPES[name]
        cfg, wq, plain = build_weights(spec, dev, torch.bfloat16, seed=args.seed)
        print(f"[{time.time() - t0:6.1f}s] {name}: weights built", flush=True)
        kw = dict(allow_cpu=dry, fp8=True)
        impls = {}
        for v in args.variants.split(","):
            if v == "bf16":
                impls[v] = (TritonExperts(allow_cpu=dry, tma=True if dry else None), plain, contextlib.nullcontext)
            elif v == "bf16_2dot":
                impls[v] = (TritonExperts(allow_cpu=dry, tma=True if dry else None), plain, _two_dot)
            elif v == "fp8_percol":
                impls[v] = (TritonQuantExperts(tma=False, **kw), wq, _percol)
            elif v == "fp8_ptr":
                impls[v] = (TritonQuantExperts(tma=False, **kw), wq, contextlib.nullcontext)
            elif v == "fp8":
                impls[v] = (TritonQuantExperts(tma=True if dry else None, **kw), wq, contextlib.nullcontext)
            elif v == "fp8_2dot":
                impls[v] = (TritonQuantExperts(tma=True if dry else None, **kw), wq, _two_dot)
            elif v == "fp8_flatdn":
                impls[v] = (TritonQuantExperts(tma=True if dry else None, **kw), wq, _flat)
            elif v == "fp8_tri":
                impls[v] = (TritonQuantExperts(tma=True if dry else None, **kw), wq, _triton_only)
            elif v in ("fp8_wsdn", "fp8_wsgu", "fp8_ws", "fp8_wsdn_grid", "fp8_wsgu_grid", "fp8_ws_grid"):
                ctx = {"fp8_wsdn": _wsdn, "fp8_wsgu": _wsgu, "fp8_ws": _ws_both}[v.removesuffix("_grid")]
                ctx = _with(ctx, grid=v.endswith("_grid"))
                impls[v] = (TritonQuantExperts(tma=True if dry else None, **kw), wq, ctx)
            elif v == "fp8_wsdn_dyn":
                dyn = _setting("moeflow.experts.triton_ws", "WS_DYNAMIC_TILES", True)

                @contextlib.contextmanager
                def _dyn_down(dyn=dyn):
                    with _wsdn(), dyn():
                        yield
                impls[v] = (TritonQuantExperts(tma=True if dry else None, **kw), wq, _dyn_down)
            elif v == "fp8_flat":
                impls[v] = (TritonQuantExperts(tma=True if dry else None, **kw), wq, _flat_both)
            elif v == "bf16_flat":
                impls[v] = (TritonExperts(allow_cpu=dry, tma=True if dry else None), plain, _flat)
            elif v in ("fp8_bi", "fp8_bi32", "fp8_bi_acc"):
                acc = {"fp8_bi32": 32, "fp8_bi_acc": None}
                ctx = (_setting("moeflow.experts.triton_quant", "FP8_BI_IMPRECISE_ACC", acc[v]) if v in acc
                       else contextlib.nullcontext)
                impls[v] = (TritonQuantExperts(batch_invariant=True, tma=True if dry else None, **kw), wq, ctx)
            elif v.startswith("t:"):
                impls[v] = (TritonQuantExperts(tile_config=tiles[v[2:]], tma=True if dry else None, **kw), wq,
                            contextlib.nullcontext)
                if v[2:] == "bm64":  # the same tiles through the pointer kernels
                    impls["t:bm64_ptr"] = (TritonQuantExperts(tile_config=tiles["bm64"], tma=False, **kw), wq,
                                           contextlib.nullcontext)
            else:
                raise SystemExit(f"unknown variant {v!r}")
        for T in (int(t) for t in args.tokens.split(",")):
            rows += run_point(name, spec, T, cfg, wq, plain, impls, dev, args)
        del wq, plain
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    bad = [r for r in rows if r["status"] != "ok"]
    print(f"{len(rows) - len(bad)} ok, {len(bad)} not: " + "; ".join(f"{r['variant']} {r['status'][:60]}" for r in bad))
    # A variant that errs or is wrong fails the run (the dry run is a CPU test); timings never do.
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
