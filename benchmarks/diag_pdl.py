"""A/B of the expert pipeline's launch options at decode and small prefill points (GPU, one process).

Variants (each re-captured in its own CUDA graph, L2 flushed before each replay):
    stream        MOEFLOW_PDL off: plain stream order between align, gate_up, down, combine
    pdl-early     programmatic dependent launch (moeflow/kernels/pdl.py), the GEMMs trigger their
                  successor right after their own wait (GEMM_TRIGGER "early")
    pdl-exit      the same, the GEMMs' successors launch as their programs exit ("exit")
    <v> no-small  the same with the small-N alignment kernel off (ALIGN_SMALL_MAX = 0)
Shapes: bench_experts' bf16 shapes (tune_experts.shape_spec names) and the quantized ones of
bench_experts_quant (name + "-fp8" / "-mxfp4": deepseek-v3-fp8, gpt-oss-120b-mxfp4) through
TritonQuantExperts.
Every variant's output must equal the first's bit for bit (PDL and the alignment schedule change no
arithmetic); a mismatch is printed and the point's row says so.

    PYTHONPATH=. python benchmarks/diag_pdl.py --shapes qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-fp8 --tokens 1,2,4,8
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import env_info, hbm_read_roof_bytes_per_s, time_cuda_graph, write_json  # noqa: E402
from benchmarks.tune_experts import make_config, make_weights, routing, shape_spec  # noqa: E402


def _variants(small: bool) -> list[tuple[str, bool, str, bool]]:
    """(name, pdl, GEMM trigger, small align on)."""
    out = [("stream", False, "early", True), ("pdl-early", True, "early", True), ("pdl-exit", True, "exit", True)]
    if small:
        out += [(name + " no-small", p, trig, False) for name, p, trig, _ in list(out)]
    return out


def _shape(name: str, dev):
    """(spec, MoEConfig, ExpertWeights, impl) of a bf16 or quantized shape name."""
    if name.endswith(("-fp8", "-mxfp4")):
        from benchmarks.bench_experts_quant import SHAPES, build_weights
        from moeflow.experts.triton_quant import TritonQuantExperts

        spec = SHAPES[name.rsplit("-", 1)[0]]
        cfg, wq, _ = build_weights(spec, dev, torch.bfloat16)
        return spec, cfg, wq, TritonQuantExperts()
    from moeflow.experts.triton import TritonExperts

    spec = shape_spec(name)
    return spec, make_config(spec), make_weights(spec, dev), TritonExperts()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-120b,deepseek-v3,deepseek-v3-fp8,gpt-oss-120b-mxfp4")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--no-small", action="store_true", help="also time every variant without the small align")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the variants (best median kept)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import moeflow.kernels.moe_align as A
    import moeflow.kernels.pdl as P
    dev = torch.device("cuda")
    hbm = hbm_read_roof_bytes_per_s()
    print(f"HBM read roof {hbm / 1e12:.3f} TB/s; graph replay us (best of {args.rounds} medians of {args.reps})")
    variants = _variants(args.no_small)
    saved = (P.ENABLED, os.environ.get("MOEFLOW_PDL_TRIGGER"), A.ALIGN_SMALL_MAX)
    rows = []
    try:
        for name in args.shapes.split(","):
            spec, cfg, w, impl = _shape(name, dev)
            e_bytes = w.expert_bytes
            for T in [int(t) for t in args.tokens.split(",")]:
                x = torch.randn(T, spec["H"], device=dev, dtype=torch.bfloat16)
                ids, wts = routing(T, spec["E"], spec["K"], "uniform", dev)
                distinct = int(torch.unique(ids).numel())
                floor_s = distinct * e_bytes / hbm  # the weight-read floor of the distinct experts
                outs, best = {}, {}
                for _ in range(args.rounds):
                    for vname, pdl, trig, small in variants:
                        P.ENABLED = pdl
                        os.environ["MOEFLOW_PDL_TRIGGER"] = trig
                        A.ALIGN_SMALL_MAX = saved[2] if small else 0
                        out = {}

                        def step(out=out, x=x, ids=ids, wts=wts, w=w, cfg=cfg, impl=impl):
                            out["y"] = impl.forward_tokens(x, ids, wts, w, cfg)

                        t = time_cuda_graph(step, reps=args.reps) * 1e6
                        best[vname] = min(best.get(vname, float("inf")), t)
                        outs.setdefault(vname, out["y"].clone())
                ref = outs[variants[0][0]]
                bad = [v for v, y in outs.items() if not torch.equal(y, ref)]
                for v in bad:
                    d = (outs[v].float() - ref.float()).abs()
                    print(f"  MISMATCH {name} T={T} {v}: max-abs {d.max().item():.3e}")
                row = dict(shape=name, T=T, distinct_experts=distinct, floor_us=floor_s * 1e6,
                           bits_equal=not bad, **{f"{v}_us": best[v] for v, *_ in variants})
                rows.append(row)
                base = best["stream"]
                cols = "  ".join(f"{v} {best[v]:7.1f} ({base / best[v]:.3f}x)" for v, *_ in variants)
                print(f"{name:14} T={T:<5} floor {floor_s * 1e6:6.1f}  {cols}  bits {'equal' if not bad else 'DIFFER'}")
    finally:
        P.ENABLED, A.ALIGN_SMALL_MAX = saved[0], saved[2]
        if saved[1] is None:
            os.environ.pop("MOEFLOW_PDL_TRIGGER", None)
        else:
            os.environ["MOEFLOW_PDL_TRIGGER"] = saved[1]
    if args.json:
        write_json(args.json, rows, {"env": env_info(), "hbm_read_Bps": hbm, "argv": sys.argv})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
