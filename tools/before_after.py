"""A/B of two copies of moeflow's fused experts in one process, on one device: bits and speed (GPU).

Legend: T tokens, K slots, E experts, H hidden, I intermediate per expert.

Why: a refactor of the host side (which kernel runs, with which tile) must change neither the bits
nor the speed. This imports the current package (`moeflow`) and a copy of an earlier tree renamed
`moeflow_before` (its relative imports make the copy importable under that name), runs both impls
on the same weights and inputs at the standard shapes (shared/spec/benchmarks.md), checks the two
outputs are bitwise equal, and times both under CUDA-graph replay round-robin (L2 flushed before each
timing; benchmarks.common.time_cuda_graphs_interleaved), so clock drift falls on both alike.

    cp -r <old tree>/moeflow .before/moeflow_before
    PYTHONPATH=.:.before python tools/before_after.py --out ab.json [--shapes ...] [--tokens ...]

It also prints the current KernelPlan.explain() of each point listed by --explain.
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

from benchmarks.common import STANDARD_SHAPES, STANDARD_TOKENS, env_info, time_cuda_graphs_interleaved  # noqa: E402

FAMILY = {  # what each standard shape runs with (gpt-oss keeps its layout, interleaving, biases, clamp)
    "gpt-oss-120b": dict(activation="gptoss", layout="matmul", interleaved=True, bias=True, limit=7.0),
}
QUANT_POINTS = [  # (shape, format, tokens)
    ("deepseek-v3", "fp8", (1, 8, 64, 2048, 8192)),
    ("qwen3-30b-a3b", "fp8", (1, 64, 8192)),
    ("gpt-oss-120b", "mxfp4", (1, 8, 64, 2048)),
    ("deepseek-v3", "nvfp4", (1, 8, 2048)),
]


def shape_of(name: str) -> dict:
    s = dict(STANDARD_SHAPES[name])
    return {**s, **FAMILY.get(name, dict(activation="silu", layout="linear", interleaved=False, bias=False,
                                          limit=None))}


def build(pkg, s: dict, tensors: dict, quant=None):
    """(ExpertWeights, MoEConfig) of package `pkg` (moeflow or moeflow_before) over the same tensors."""
    import importlib

    config = importlib.import_module(f"{pkg}.config")
    spec = importlib.import_module(f"{pkg}.routing.spec")
    router = spec.RouterSpec(score_fn="softmax", num_experts=s["E"], top_k=s["K"])
    cfg = config.MoEConfig(hidden_size=s["H"], intermediate_size=s["I"], router=router, activation=s["activation"],
                           swiglu_limit=s["limit"], layout=s["layout"], interleaved=s["interleaved"],
                           expert_bias=s["bias"])
    w = config.ExpertWeights(quant=quant, layout=s["layout"], interleaved=s["interleaved"], **tensors)
    return w, cfg


def plain_tensors(s: dict, dev) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    E, H, I = s["E"], s["H"], s["I"]
    shp = ((E, 2 * I, H), (E, H, I)) if s["layout"] == "linear" else ((E, H, 2 * I), (E, I, H))
    t = dict(gate_up=torch.randn(*shp[0], device=dev, generator=g, dtype=torch.bfloat16) * 0.02,
             down=torch.randn(*shp[1], device=dev, generator=g, dtype=torch.bfloat16) * 0.02)
    if s["bias"]:
        t["gate_up_bias"] = torch.randn(E, 2 * I, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
        t["down_bias"] = torch.randn(E, H, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    return t


QUANT_FIELDS = ("gate_up", "down", "gate_up_bias", "down_bias", "gate_up_scale", "down_scale",
                "gate_up_scale_2", "down_scale_2")


def quantized_tensors(s: dict, plain: dict, spec, quantize_experts, chunk: int = 16) -> dict:
    """The quantized fields of `plain`, quantized `chunk` experts at a time: the quantizer's f32 temporaries
    for all of deepseek-v3's experts at once do not fit an 80 GB card. Every scale (FP8 blocks, MXFP4 / NVFP4
    blocks, NVFP4's per-tensor scale_2) is per expert, so chunking gives the same tensors."""
    parts: dict[str, list] = {}
    for e0 in range(0, s["E"], chunk):
        part = {f: t[e0:e0 + chunk] for f, t in plain.items()}
        n = part["gate_up"].shape[0]
        w, _ = build("moeflow", dict(s, E=n, K=min(s["K"], n)), part)
        q = quantize_experts(w, spec)
        for f in QUANT_FIELDS:
            if getattr(q, f, None) is not None:
                parts.setdefault(f, []).append(getattr(q, f))
        del w, q
    plain.clear()
    return {f: torch.cat(v, dim=0) for f, v in parts.items()}


def routing(T: int, E: int, K: int, dev, kind: str, seed: int = 1):
    g = torch.Generator(device="cpu").manual_seed(seed + T)
    if kind == "zipf":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
        ids = torch.stack([torch.multinomial(p, K, replacement=False, generator=g) for _ in range(T)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    wts = torch.rand(T, K, generator=g)
    return ids.to(dev, torch.int32), (wts / wts.sum(1, keepdim=True)).to(dev)


def point(name, fmt, T, kind, new_impl, old_impl, wn, cn, wo, co, H, E, K, dev, reps, explain):
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
    ids, wts = routing(T, E, K, dev, kind)
    a = new_impl.forward_tokens(x, ids, wts, wn, cn)
    b = old_impl.forward_tokens(x, ids, wts, wo, co)
    torch.cuda.synchronize()
    same = bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))
    diff = 0.0 if same else float((a.float() - b.float()).abs().max())
    times = time_cuda_graphs_interleaved({"after": lambda: new_impl.forward_tokens(x, ids, wts, wn, cn),
                                          "before": lambda: old_impl.forward_tokens(x, ids, wts, wo, co)},
                                         rounds=4, reps=max(2, reps // 4), flush=True)
    plan = new_impl.plan(wn, T, K, act_dtype=torch.bfloat16, activation=cn.activation)
    row = dict(shape=name, fmt=fmt, T=T, routing=kind, bitwise_equal=same, max_abs_diff=diff,
               before_us=times["before"] * 1e6, after_us=times["after"] * 1e6,
               after_over_before=times["after"] / times["before"],
               variants={st.stage: st.variant for st in plan.stages}, path=plan.path)
    if explain:
        row["explain"] = plan.explain()
    print(f"{name:14s} {fmt:6s} T={T:5d} {kind:7s} bits {'equal' if same else f'DIFFER {diff:.3g}'}  "
          f"before {row['before_us']:9.1f} us  after {row['after_us']:9.1f} us  x{row['after_over_before']:.3f}  "
          f"{row['variants']}", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(STANDARD_SHAPES))
    ap.add_argument("--tokens", default=",".join(str(t) for t in STANDARD_TOKENS))
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-quant", action="store_true")
    ap.add_argument("--quant", default="", help="only these quantized points, e.g. deepseek-v3:fp8 (default: all)")
    ap.add_argument("--explain", default="mixtral-8x7b,deepseek-v3", help="shapes whose plans are recorded")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=1e9)
    args = ap.parse_args(argv)
    import moeflow_before.experts.triton as OT
    import moeflow_before.experts.triton_quant as OQ

    from moeflow.experts.triton import TritonExperts
    from moeflow.experts.triton_quant import TritonQuantExperts

    dev = torch.device("cuda")
    t0 = time.time()
    explain = set(filter(None, args.explain.split(",")))
    rows = []
    new_p, old_p = TritonExperts(), OT.TritonExperts()
    for name in filter(None, args.shapes.split(",")):
        s = shape_of(name)
        tensors = plain_tensors(s, dev)
        wn, cn = build("moeflow", s, tensors)
        wo, co = build("moeflow_before", s, tensors)
        for T in (int(t) for t in args.tokens.split(",")):
            for kind in args.routing.split(","):
                if time.time() - t0 > args.budget_s:
                    break
                rows.append(point(name, "bf16", T, kind, new_p, old_p, wn, cn, wo, co, s["H"], s["E"], s["K"], dev,
                                  args.reps, name in explain and T in (1, 8192) and kind == "uniform"))
        del tensors, wn, wo
        torch.cuda.empty_cache()
    if not args.no_quant:
        from moeflow_before.quant import spec as old_spec

        from moeflow.quant.experts import quantize_experts
        from moeflow.quant.spec import MXFP4, NVFP4, fp8_block_spec

        new_q, old_q = TritonQuantExperts(), OQ.TritonQuantExperts()
        only = set(filter(None, args.quant.split(",")))
        for name, fmt, tokens in QUANT_POINTS:
            if time.time() - t0 > args.budget_s:
                break
            if only and f"{name}:{fmt}" not in only:
                continue
            s = shape_of(name)
            spec = {"fp8": fp8_block_spec((128, 128)), "mxfp4": MXFP4, "nvfp4": NVFP4}[fmt]
            ospec = {"fp8": old_spec.fp8_block_spec((128, 128)), "mxfp4": old_spec.MXFP4, "nvfp4": old_spec.NVFP4}[fmt]
            tensors = quantized_tensors(s, plain_tensors(s, dev), spec, quantize_experts)
            torch.cuda.empty_cache()
            wn, cn = build("moeflow", s, tensors, quant=spec)
            wo, co = build("moeflow_before", s, tensors, quant=ospec)
            for T in tokens:
                rows.append(point(name, fmt, T, "uniform", new_q, old_q, wn, cn, wo, co, s["H"], s["E"], s["K"], dev,
                                  args.reps, name in explain and T in (1, 8192)))
            del tensors, wn, wo
            torch.cuda.empty_cache()
    worst = max((r["after_over_before"] for r in rows), default=None)
    out = dict(env_info(), command=" ".join(sys.argv), rows=rows,
               all_bitwise_equal=all(r["bitwise_equal"] for r in rows), worst_after_over_before=worst)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{len(rows)} points; bitwise equal at all: {out['all_bitwise_equal']}; worst after/before x{worst:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
