"""Quantized experts' tiles (GPU): MXFP4 GEMV vs MMA tiles (gpt-oss-120b) and FP8 decode tile widths
(deepseek-v3, --shape deepseek-v3).

Legend: T tokens, K slots, N = T*K pairs, E experts, H hidden, I intermediate, BM/BN/BK tiles,
S split-K parts of the down GEMM.

Why: which kernel form and which tiles serve each T: the FP4 GEMV (no alignment, each weight byte decoded
once per pair) against the MMA tiles, and the FP8 decode tiles' widths, all against the roofs of this run.

Per T (gpt-oss-120b: E=128 H=I=2880 K=4, interleaved gate/up, biases; uniform routing, fixed seed):
    default     TritonQuantExperts(), the plan's choice (the GEMV up to moeflow.tuning.rules
                fp4_gemv_max_pairs pairs)
    gemv        both GEMMs pinned to the GEMV (KernelOptions(pin={"gate_up": "w4_gemv", "down": "w4_gemv"}));
                decode T only
    mma         the MMA kernels (pinned to "w4_pointer"), the heuristic tiles of T
    mma:*       other MMA tiles (--sweep)
deepseek-v3 (fp8_block W8A8), decode T only:
    default     TritonQuantExperts(fp8=True) with its heuristic tiles
    gu<BN>      gate_up BN forced (BN < 128 = narrower than a quant group: the separate
                quantization pass), dn<BN>s<S> down tile / split forced
All under CUDA-graph replay, L2 flushed before each replay (median of --reps). floor = quantized
bytes of the distinct experts touched + x + out over the read-only HBM roof (decode);
2*3*H*I*T*K FLOP over the bf16 mm roof (prefill). Every variant's output is checked against the
dequantized-f32 reference (rel-L2) before it is timed.

    PYTHONPATH=. python tools/diag_quant_tiles.py --json out/diag_mxfp4.json
    PYTHONPATH=. python tools/diag_quant_tiles.py --tokens 1,8 --sweep
    PYTHONPATH=. python tools/diag_quant_tiles.py --shape deepseek-v3 --tokens 1,2,4,8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_experts_quant import SHAPES, build_weights, error_vs, reference  # noqa: E402
from benchmarks.common import compute_roof_flops, env_info, hbm_read_roof_bytes_per_s, time_cuda_graph  # noqa: E402
from benchmarks.tune_experts import routing  # noqa: E402
from moeflow.experts.options import KernelOptions  # noqa: E402
from moeflow.tuning import GemmTile, MoETileConfig  # noqa: E402


def _variants(base: MoETileConfig, rows: float) -> list[tuple[str, MoETileConfig]]:
    """Tile variants around the heuristic `base` (decode: narrower / wider BN, longer BK, split)."""
    dn = base.down
    out = []
    if rows <= 16:
        for bn, bk, st in ((16, 256, 4), (32, 256, 3), (64, 256, 3), (32, 128, 4), (64, 128, 4), (128, 128, 3)):
            out.append((f"gu{bn}x{bk}", dataclasses.replace(base, gate_up=GemmTile(block_n=bn, block_k=bk, num_warps=4, num_stages=st))))
        for bn, bk, s in ((32, 256, dn.split_k), (64, 256, dn.split_k), (32, 128, 1), (64, 128, 1),
                          (32, 128, 2 * dn.split_k), (128, 128, dn.split_k)):
            out.append((f"dn{bn}x{bk}s{s}", dataclasses.replace(base, down=GemmTile(block_n=bn, block_k=bk, num_warps=4, num_stages=4, split_k=s))))
    else:
        for bm, bn, bk, w, st in ((128, 64, 128, 8, 3), (128, 128, 64, 8, 3), (64, 128, 128, 4, 3),
                                  (128, 128, 128, 8, 2)):
            out.append((f"bm{bm}gu{bn}x{bk}w{w}",
                        MoETileConfig(block_m=bm, gate_up=GemmTile(block_n=bn, block_k=bk, num_warps=w, num_stages=st),
                                      down=GemmTile(block_n=128, block_k=bk, num_warps=8, num_stages=st))))
    return out


def _fp4_variants(args, T, K, E, base, wq, plain, sweep_T, decode) -> list[tuple]:
    """(name, impl, weights) of the MXFP4 comparison at T (module docstring)."""
    from moeflow.experts.triton import TritonExperts
    from moeflow.experts.triton_quant import TritonQuantExperts

    mma_pin = KernelOptions(pin={"gate_up": "w4_pointer", "down": "w4_pointer"})
    out = [("default", TritonQuantExperts(), wq)]
    if decode:
        out.append(("gemv", TritonQuantExperts(options=KernelOptions(pin={"gate_up": "w4_gemv", "down": "w4_gemv"})),
                    wq))
    out.append(("mma", TritonQuantExperts(tile_config=base, options=mma_pin), wq))
    if args.sweep and T in sweep_T:
        out += [(f"mma:{n}", TritonQuantExperts(tile_config=c, options=mma_pin), wq)
                for n, c in _variants(base, T * K / min(T * K, E))]
    if not decode:
        out.append(("bf16", TritonExperts(), plain))
    return out


def _fp8_variants(base: MoETileConfig) -> list[tuple[str, MoETileConfig]]:
    """FP8 decode: gate_up BN 128 / 64 / 32 (whole group or narrower), down BN / split around base."""
    out = [(f"gu{bn}", dataclasses.replace(base, gate_up=dataclasses.replace(base.gate_up, block_n=bn)))
           for bn in (128, 64, 32) if bn != base.gate_up.block_n]
    # Bytes in flight per SM (pipeline depth, warps issuing loads): the weight stream's other knobs.
    gu = base.gate_up
    for st, w in ((gu.num_stages + 2, gu.num_warps), (gu.num_stages, 2 * gu.num_warps),
                  (gu.num_stages + 2, 2 * gu.num_warps)):
        out.append((f"gu{gu.block_n}st{st}w{w}",
                    dataclasses.replace(base, gate_up=dataclasses.replace(gu, num_stages=st, num_warps=w))))
    dn = base.down
    for bn, s in ((64, dn.split_k), (32, dn.split_k), (dn.block_n, max(1, dn.split_k // 2)), (dn.block_n, 2 * dn.split_k)):
        if (bn, s) != (dn.block_n, dn.split_k) and s <= 16:
            out.append((f"dn{bn}s{s}", dataclasses.replace(base, down=dataclasses.replace(dn, block_n=bn, split_k=s))))
    out.append((f"dn{dn.block_n}s{dn.split_k}st{dn.num_stages + 2}",
                dataclasses.replace(base, down=dataclasses.replace(dn, num_stages=dn.num_stages + 2))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gpt-oss-120b", choices=("gpt-oss-120b", "deepseek-v3"))
    ap.add_argument("--tokens", default="1,2,4,8,16,64,512,8192")
    ap.add_argument("--sweep", action="store_true", help="also time MMA tile variants (MXFP4)")
    ap.add_argument("--sweep-tokens", default="1,4,8,8192")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_quant_tiles: needs CUDA", file=sys.stderr)
        return 2
    from moeflow.experts.triton_quant import TritonQuantExperts, quant_group, quant_tile_config

    t0 = time.time()
    dev, dt = torch.device("cuda"), torch.bfloat16
    spec = SHAPES[args.shape]
    fp8 = spec["fmt"] == "fp8"
    cfg, wq, plain = build_weights(spec, dev, dt)
    E, K, H, I = spec["E"], spec["K"], spec["H"], spec["I"]
    hbm, flops_roof = hbm_read_roof_bytes_per_s(), compute_roof_flops()
    print(f"[{time.time() - t0:5.1f}s] weights built; HBM read roof {hbm / 1e12:.3f} TB/s, compute "
          f"{flops_roof / 1e12:.1f} TFLOP/s", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sweep_T = {int(t) for t in args.sweep_tokens.split(",")}
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        if time.time() - t0 > args.budget_s:
            print(f"T={T}: skipped (budget)", flush=True)
            continue
        ids, wts = routing(T, E, K, "uniform", dev)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dev, dt)
        decode = T <= 64
        n_distinct = int(torch.unique(ids).numel())
        floor = ((n_distinct * wq.expert_bytes + 2 * T * H * 2) / hbm) if decode else (2 * 3 * H * I * T * K / flops_roof)
        ref = reference(x, ids, wts, wq, cfg, w8a8=fp8)
        base = quant_tile_config(wq.quant.format, quant_group(wq.quant), E, H, I, K, T, sm_count=sms)
        variants = []
        if fp8:
            variants.append(("default", TritonQuantExperts(fp8=True), wq))
            variants += [(n, TritonQuantExperts(fp8=True, tile_config=c), wq) for n, c in _fp8_variants(base)]
        else:
            variants += _fp4_variants(args, T, K, E, base, wq, plain, sweep_T, decode)
        outs = {}
        for name, impl, w in variants:
            row = dict(T=T, variant=name, floor_s=floor, phase="decode" if decode else "prefill")
            try:
                def fn(impl=impl, w=w, x=x, ids=ids, wts=wts):
                    return impl.forward_tokens(x, ids, wts, w, cfg)

                out = fn()
                torch.cuda.synchronize()
                outs[name] = out
                row["rel_l2"], row["max_abs"] = error_vs(out.float(), ref)
                if name != "bf16" and not (row["rel_l2"] <= 2e-2):
                    row["status"] = "WRONG: not timed"
                else:
                    row["s"] = time_cuda_graph(fn, reps=args.reps)
                    row["roof_frac"] = floor / row["s"]
                    row["status"] = "ok"
            except Exception as exc:  # a variant that does not compile / run says so
                row["status"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            if name != "default" and name != "bf16" and name in outs and "default" in outs:
                row["bitwise_vs_default"] = bool(torch.equal(outs["default"].view(torch.int16),
                                                             outs[name].view(torch.int16)))
            rows.append(row)
            extra = f" bitwise_vs_default={row['bitwise_vs_default']}" if "bitwise_vs_default" in row else ""
            t_us = f"{1e6 * row['s']:8.1f} us roof {row['roof_frac']:.3f}" if "s" in row else row["status"][:160]
            print(f"[{time.time() - t0:5.1f}s] T={T:5d} {name:22s} {t_us} rel_l2 {row.get('rel_l2', float('nan')):.2e}"
                  f"{extra}", flush=True)
        bf = next((r for r in rows if r["T"] == T and r["variant"] == "bf16" and "s" in r), None)
        if bf:
            for r in rows:
                if r["T"] == T and "s" in r and r["variant"] != "bf16":
                    r["speedup_vs_bf16"] = bf["s"] / r["s"]
            best = min((r for r in rows if r["T"] == T and "s" in r and r["variant"] != "bf16"), key=lambda r: r["s"])
            print(f"   T={T}: best {best['variant']} {best['speedup_vs_bf16']:.2f}x our bf16", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(env=env_info(), hbm_read_roof=hbm, compute_roof=flops_roof,
                                                   rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
