"""Where a decode router step's time goes: GEMM vs selection, per config.

CUDA-graph replay times (L2 flushed) at T = 1 and 8 for each standard shape: the fused step,
the two-kernel step, the logits GEMM alone and the selection alone (on precomputed logits),
and the fused step / GEMM under candidate LogitsConfigs that spread the weight read over more
programs (smaller block_m / block_e, shorter chunks). Every candidate's step is checked for
batch invariance (row 0 alone vs inside the batch, bit for bit) and against the default
config's ids (a config changes the logits' f32 summation order, so ids may differ only on
near ties: the count is printed). Also: a trivial kernel's graph replay (the launch floor) and
the GEMM's cost at T = 2048 for each candidate (what a candidate would cost prefill).

    python3 tools/diag_router.py [--shapes qwen3-30b-a3b,deepseek-v3] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_routing import make_inputs, shape_spec  # noqa: E402
from benchmarks.common import STANDARD_SHAPES, env_info, hbm_roof_bytes_per_s, time_cuda_graph, write_json  # noqa: E402

CANDIDATES = {
    "m16 e32 k128 c128": dict(block_m=16, block_e=32, block_k=128, num_warps=4, num_stages=3,
                              target_programs=256, min_chunk=128),
    "m16 e64 k128 c128": dict(block_m=16, block_e=64, block_k=128, num_warps=4, num_stages=3,
                              target_programs=256, min_chunk=128),
    "m64 e64 k128 c128": dict(block_m=64, block_e=64, block_k=128, num_warps=4, num_stages=3,
                              target_programs=256, min_chunk=128),
    "m16 e32 k64 c256": dict(block_m=16, block_e=32, block_k=64, num_warps=4, num_stages=4,
                             target_programs=256, min_chunk=256),
    "m32 e32 k128 c256": dict(block_m=32, block_e=32, block_k=128, num_warps=4, num_stages=3,
                              target_programs=256, min_chunk=256),
}


def _case(gpu, name: str, spec, E: int, H: int, T: int, big_x, floor: float, target: float, reps: int) -> dict:
    """One (shape, T) row: default step times, then each candidate config (module doc)."""
    x, w, bias, rbias = make_inputs(name, T, "cuda", seed=T)
    base = gpu.logits_config(E, H, False)
    ref = gpu.router_step_cuda(x, w, spec, router_bias=rbias, bias=bias, fused=False)
    logits = ref.logits_TS

    def t(fn):
        return time_cuda_graph(fn, reps=reps) * 1e6

    r = dict(shape=name, T=T, floor_us=floor, target_us=target, default_split=base.split,
             default_programs=-(-E // base.block_e) * base.split)
    r["fused_us"] = t(lambda: gpu.router_step_cuda(x, w, spec, router_bias=rbias, bias=bias, fused=True))
    r["two_kernel_us"] = t(lambda: gpu.router_step_cuda(x, w, spec, router_bias=rbias, bias=bias,
                                                        fused=False))
    r["gemm_us"] = t(lambda: gpu.router_logits_cuda(x, w))
    r["select_us"] = t(lambda: gpu.route_cuda(logits, spec, bias=bias))
    print(f"{name} T={T}: floor {floor:.2f} target {target:.2f} | default (split {base.split}, "
          f"{r['default_programs']} programs): fused {r['fused_us']:.2f} 2k {r['two_kernel_us']:.2f} "
          f"gemm {r['gemm_us']:.2f} select {r['select_us']:.2f}")
    if T == 1:
        r["gemm_T2048_us"] = t(lambda: gpu.router_logits_cuda(big_x, w))
    for cname, c in CANDIDATES.items():
        cfg = gpu.logits_config(E, H, False, **c)
        step = gpu.router_step_cuda(x, w, spec, router_bias=rbias, bias=bias, fused=True, config=cfg)
        two = gpu.router_step_cuda(x, w, spec, router_bias=rbias, bias=bias, fused=False, config=cfg)
        same_paths = (torch.equal(step.logits_TS.view(torch.int32), two.logits_TS.view(torch.int32))
                      and torch.equal(step.routing.ids_TK, two.routing.ids_TK))
        row0 = gpu.router_logits_cuda(x[:1], w, config=cfg)
        inv = bool(torch.equal(row0.view(torch.int32), step.logits_TS[:1].view(torch.int32)))
        ids_diff = int((step.routing.ids_TK != ref.routing.ids_TK).any(-1).sum())
        max_dl = float((step.logits_TS - logits).abs().max())
        c_r = dict(fused_us=t(lambda cfg=cfg: gpu.router_step_cuda(
            x, w, spec, router_bias=rbias, bias=bias, fused=True, config=cfg)),
            gemm_us=t(lambda cfg=cfg: gpu.router_logits_cuda(x, w, config=cfg)),
            split=cfg.split, programs=-(-E // cfg.block_e) * cfg.split, fused_eq_2k=same_paths,
            invariant=inv, rows_ids_differ=ids_diff, max_logit_diff=max_dl)
        if T == 1:
            c_r["gemm_T2048_us"] = t(lambda cfg=cfg: gpu.router_logits_cuda(big_x, w, config=cfg))
        r[cname] = c_r
        print(f"   {cname:20} split {cfg.split:3d} programs {c_r['programs']:4d}: fused {c_r['fused_us']:.2f} "
              f"gemm {c_r['gemm_us']:.2f}" + (f" gemm@2048 {c_r['gemm_T2048_us']:.1f} (default "
                                               f"{r['gemm_T2048_us']:.1f})" if T == 1 else "")
              + f" | fused==2k {same_paths} invariant {inv} rows with other ids {ids_diff} "
              f"max|dlogit| {max_dl:.1e}")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b,gpt-oss-120b")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from moeflow.routing import gpu

    torch.backends.cuda.matmul.allow_tf32 = False
    hbm = hbm_roof_bytes_per_s()
    one = torch.zeros(1, device="cuda")
    launch = time_cuda_graph(lambda: one.add_(1), reps=args.reps) * 1e6
    print(f"HBM {hbm / 1e12:.2f} TB/s, one trivial kernel from a graph {launch:.2f} us")
    rows = []
    for name in args.shapes.split(","):
        spec = shape_spec(name)
        s = STANDARD_SHAPES[name]
        E, H = s["E"], s["H"]
        floor = E * H * 2 / hbm * 1e6
        target = 1.5 * floor + launch
        big_x = make_inputs(name, 2048, "cuda", seed=7)[0]
        for T in (1, 8):
            rows.append(_case(gpu, name, spec, E, H, T, big_x, floor, target, args.reps))
    if args.json:
        write_json(args.json, rows, {**env_info(), "launch_us": launch})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
