"""A/B of the expert pipeline's programmatic dependent launch at decode and small prefill points (GPU, one process).

Variants, each its own impl (re-captured in its own CUDA graph, L2 flushed before each replay):
    stream    KernelOptions(pdl=False): plain stream order between align, gate_up, down, combine
    pdl       KernelOptions() (the default): programmatic dependent launch (moeflow/kernels/pdl.py), the
              GEMMs' trigger as the tuning data says (moeflow.tuning.rules: pdl_gemm_trigger)
Shapes: bench_experts' bf16 shapes (tune_experts.shape_spec names) and the quantized ones of
bench_experts_quant (name + "-fp8" / "-mxfp4": deepseek-v3-fp8, gpt-oss-120b-mxfp4) through
TritonQuantExperts.
Every variant's output must equal the first's bit for bit (PDL changes when a kernel may start, not what
it computes); a mismatch is printed and the point's row says so.

    PYTHONPATH=. python tools/diag_pdl.py --shapes qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-fp8 --tokens 1,2,4,8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import env_info, hbm_read_roof_bytes_per_s, time_cuda_graph, write_json  # noqa: E402
from benchmarks.tune_experts import make_config, make_weights, routing, shape_spec  # noqa: E402
from moeflow.experts.options import KernelOptions  # noqa: E402

VARIANTS = (("stream", KernelOptions(pdl=False)), ("pdl", KernelOptions()))


def make_impl(name: str, options: KernelOptions | None = None):
    """The Triton experts impl of a bf16 or quantized shape name (module docstring), with `options`."""
    options = options or KernelOptions()
    if name.endswith(("-fp8", "-mxfp4")):
        from moeflow.experts.triton_quant import TritonQuantExperts

        return TritonQuantExperts(options=options)
    from moeflow.experts.triton import TritonExperts

    return TritonExperts(options=options)


def _shape(name: str, dev, options: KernelOptions | None = None):
    """(spec, MoEConfig, ExpertWeights, impl) of a bf16 or quantized shape name; the impl takes `options`."""
    if name.endswith(("-fp8", "-mxfp4")):
        from benchmarks.bench_experts_quant import SHAPES, build_weights

        spec = SHAPES[name.rsplit("-", 1)[0]]
        cfg, wq, _ = build_weights(spec, dev, torch.bfloat16)
        return spec, cfg, wq, make_impl(name, options)
    spec = shape_spec(name)
    return spec, make_config(spec), make_weights(spec, dev), make_impl(name, options)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,gpt-oss-120b,deepseek-v3,deepseek-v3-fp8,gpt-oss-120b-mxfp4")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the variants (best median kept)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    dev = torch.device("cuda")
    hbm = hbm_read_roof_bytes_per_s()
    print(f"HBM read roof {hbm / 1e12:.3f} TB/s; graph replay us (best of {args.rounds} medians of {args.reps})")
    rows = []
    for name in args.shapes.split(","):
        spec, cfg, w, _ = _shape(name, dev)
        impls = {vname: make_impl(name, opts) for vname, opts in VARIANTS}
        e_bytes = w.expert_bytes
        for T in [int(t) for t in args.tokens.split(",")]:
            x = torch.randn(T, spec["H"], device=dev, dtype=torch.bfloat16)
            ids, wts = routing(T, spec["E"], spec["K"], "uniform", dev)
            distinct = int(torch.unique(ids).numel())
            floor_s = distinct * e_bytes / hbm  # the weight-read floor of the distinct experts
            outs, best = {}, {}
            for _ in range(args.rounds):
                for vname, impl in impls.items():
                    out = {}

                    def step(out=out, x=x, ids=ids, wts=wts, w=w, cfg=cfg, impl=impl):
                        out["y"] = impl.forward_tokens(x, ids, wts, w, cfg)

                    t = time_cuda_graph(step, reps=args.reps) * 1e6
                    best[vname] = min(best.get(vname, float("inf")), t)
                    outs.setdefault(vname, out["y"].clone())
            ref = outs[VARIANTS[0][0]]
            bad = [v for v, y in outs.items() if not torch.equal(y, ref)]
            for v in bad:
                d = (outs[v].float() - ref.float()).abs()
                print(f"  MISMATCH {name} T={T} {v}: max-abs {d.max().item():.3e}")
            row = dict(shape=name, T=T, distinct_experts=distinct, floor_us=floor_s * 1e6,
                       bits_equal=not bad, **{f"{v}_us": best[v] for v, _ in VARIANTS})
            rows.append(row)
            base = best["stream"]
            cols = "  ".join(f"{v} {best[v]:7.1f} ({base / best[v]:.3f}x)" for v, _ in VARIANTS)
            print(f"{name:14} T={T:<5} floor {floor_s * 1e6:6.1f}  {cols}  bits {'equal' if not bad else 'DIFFER'}")
    if args.json:
        write_json(args.json, rows, {"env": env_info(), "hbm_read_Bps": hbm, "argv": sys.argv})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
