"""FP8 (W8A8 block 128x128) GEMMs at prefill, round-robin A/B of their variants and tiles on the GPU.

Legend: T tokens, K slots, E experts, H hidden, I intermediate, BM/BN tiles; "pointer" / "TMA" / "Gluon" the
kernel forms of the fp8 GEMMs (moeflow.kernels.moe_gemm_quant / moe_gemm_fp8_tma / moe_gemm_fp8_ws).

Variants, all of one (shape, T) captured as CUDA graphs and timed round-robin in one process
(benchmarks.common.time_cuda_graphs_interleaved, L2 flushed before every replay), so the power-capped
clock drift of compute-bound steps falls on all of them alike; each is an impl with its KernelOptions:
    bf16           our TritonExperts on the bf16 weights the fp8 ones were quantized from (the denominator)
    fp8_ptr        the pointer kernels (KernelOptions(tma=False): variants fp8_pointer)
    fp8            TritonQuantExperts() as it runs by default (the plan's variants: TMA kernels on Hopper where
                   the tiles allow, the Gluon gate_up from the hidden size in moeflow.tuning.rules)
    fp8_tma        fp8 with the gate_up pinned to the Triton TMA kernel (pin={"gate_up": "fp8_tma"})
    fp8_gluon      fp8 with the gate_up pinned to the warp-specialised Gluon kernel (pin={"gate_up": "fp8_gluon"};
                   GPU only: the interpreter runs no Gluon)
    fp8_bi         TritonQuantExperts(batch_invariant=True): its fp8 dots restart the wgmma accumulation every
                   moeflow.tuning.rules fp8_batch_invariant_imprecise_acc products
    t:<name>       forced tiles (TMA where allowed): see _TILES; with t:bm64 come t:bm64_ptr (those tiles through
                   the pointer kernels) and t:bm64_tma (those tiles, the gate_up pinned to fp8_tma)
Every fp8 variant is checked against the W8A8 reference (rel-L2, max-abs) before it is timed; fp8 and
t:bm64 are compared bit for bit with their "_ptr" twin (the same tiles through the pointer kernels:
bitwise_vs_ptr), fp8_tma / fp8_gluon with fp8 and t:bm64_tma with t:bm64 (the gate_up variants give the
same bits: bitwise_vs_base). The pinned TMA variants need TMA tiles (BM >= 64): prefill T on the GPU; the
dry run's T = 40 takes BM 16 by default, so it pins fp8_tma only with the forced bm64 tiles (t:bm64_tma).

    PYTHONPATH=. python tools/diag_fp8_prefill.py --shapes deepseek-v3 --tokens 2048,8192 --json out.json
    PYTHONPATH=. python tools/diag_fp8_prefill.py --dry-run     # CPU: Triton interpreter, tiny shape
"""

from __future__ import annotations

import argparse
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
from moeflow.experts.options import KernelOptions  # noqa: E402
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


def run_point(name, spec, T, cfg, wq, plain, impls, dev, args) -> list[dict]:
    E, K, H, I = spec["E"], spec["K"], spec["H"], spec["I"]
    ids, wts = routing(T, E, K, args.dist, dev, seed=args.seed)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dev, torch.bfloat16)
    ref = reference(x, ids, wts, wq, cfg, w8a8=True)
    flops = 2 * 3 * H * I * T * K
    rows, fns, outs = [], {}, {}
    for vname, (impl, w_use) in impls.items():
        def fn(impl=impl, w_use=w_use):
            return impl.forward_tokens(x, ids, wts, w_use, cfg)

        row = dict(shape=name, T=T, dist=args.dist, variant=vname)
        try:
            out = fn()
            if not vname.startswith("bf16"):  # the bf16 rows are the denominator, not W8A8
                row["rel_l2_vs_w8a8_ref"], row["max_abs_vs_w8a8_ref"] = error_vs(out.float(), ref)
                row["tiles"] = impl.tile_config_for(w_use, K, T).to_dict()
                if not row["rel_l2_vs_w8a8_ref"] <= args.check_rel_l2:
                    row["status"] = f"WRONG (rel-L2 {row['rel_l2_vs_w8a8_ref']:.3g}): not timed"
                    rows.append(row)
                    continue
            outs[vname] = out
            fns[vname] = fn
            row["status"] = "ok"
        except Exception as exc:  # a variant that cannot run says so
            row["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
        rows.append(row)
    for r in rows:  # "X" against "X_ptr" (the same tiles through the pointer kernels), the pinned gate_ups against fp8
        v = r["variant"]
        base = {"fp8_tma": "fp8", "fp8_gluon": "fp8", "t:bm64_tma": "t:bm64"}.get(v)
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


# The variants of the CPU dry run (the Gluon gate_up is GPU only; fp8_tma needs BM >= 64: t:bm64_tma)
DRY_VARIANTS = "bf16,fp8_ptr,fp8,fp8_bi"
# Each fixed-name variant: (fp8 or the bf16 weights, batch-invariant mode, KernelOptions fields; tma=None
# becomes True in the dry run: the interpreter takes TMA kernels only when asked)
VARIANTS = {
    "bf16": (False, False, dict(tma=None)),
    "fp8_ptr": (True, False, dict(tma=False)),
    "fp8": (True, False, dict(tma=None)),
    "fp8_tma": (True, False, dict(tma=None, pin={"gate_up": "fp8_tma"})),
    "fp8_gluon": (True, False, dict(tma=None, pin={"gate_up": "fp8_gluon"})),
    "fp8_bi": (True, True, dict(tma=None)),
}


def make_impls(variants: list[str], wq, plain, tiles: dict, dry: bool) -> dict:
    """{variant: (impl, weights)} of the named variants (module docstring)."""
    from moeflow.experts.triton import TritonExperts
    from moeflow.experts.triton_quant import TritonQuantExperts

    def opts(tma=None, pin=None):
        return KernelOptions(tma=True if (dry and tma is None) else tma, pin=pin or {})

    impls = {}
    for v in variants:
        if v in VARIANTS:
            fp8, bi, kw = VARIANTS[v]
            impl = (TritonQuantExperts(allow_cpu=dry, fp8=True, batch_invariant=bi, options=opts(**kw)) if fp8
                    else TritonExperts(allow_cpu=dry, options=opts(**kw)))
            impls[v] = (impl, wq if fp8 else plain)
        elif v.startswith("t:") and v[2:] in tiles:
            impls[v] = (TritonQuantExperts(allow_cpu=dry, fp8=True, tile_config=tiles[v[2:]], options=opts()), wq)
            if v[2:] == "bm64":  # the same tiles through the pointer kernels, and with the Triton TMA gate_up pinned
                impls["t:bm64_ptr"] = (TritonQuantExperts(allow_cpu=dry, fp8=True, tile_config=tiles["bm64"],
                                                          options=opts(tma=False)), wq)
                impls["t:bm64_tma"] = (TritonQuantExperts(allow_cpu=dry, fp8=True, tile_config=tiles["bm64"],
                                                          options=opts(pin={"gate_up": "fp8_tma"})), wq)
        else:
            raise SystemExit(f"unknown variant {v!r}: expected one of {sorted(VARIANTS)} or t:<{'|'.join(tiles)}>")
    return impls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="deepseek-v3")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--variants", default="bf16,fp8_ptr,fp8,fp8_tma,fp8_gluon," + ",".join(f"t:{k}" for k in _TILES))
    ap.add_argument("--dist", default="uniform", choices=("uniform", "zipf"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-rel-l2", type=float, default=2e-2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shape, no timing")
    args = ap.parse_args(argv)

    dry = args.dry_run
    if dry:
        from benchmarks.bench_experts_quant import patch_interpreter_fp8
        from benchmarks.tune_experts import patch_interpreter_index

        patch_interpreter_fp8()
        patch_interpreter_index()
        args.shapes, args.tokens = "tiny-fp8", "40"
        args.variants = DRY_VARIANTS + "," + ",".join(f"t:{k}" for k in _TILES_DRY)
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
        impls = make_impls(args.variants.split(","), wq, plain, tiles, dry)
        for T in (int(t) for t in args.tokens.split(",")):
            rows += run_point(name, spec, T, cfg, wq, plain, impls, dev, args)
        del wq, plain, impls
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    bad = [r for r in rows if r["status"] != "ok"]
    print(f"{len(rows) - len(bad)} ok, {len(bad)} not: " + "; ".join(f"{r['variant']} {r['status'][:60]}" for r in bad))
    # A variant that errs or is wrong fails the run (the dry run is a CPU test); timings never do.
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
