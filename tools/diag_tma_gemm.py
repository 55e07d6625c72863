"""Diagnostic (GPU): the aligned expert GEMMs with TMA weight tiles against the pointer kernels.

For each shape and T (bf16, linear layout, uniform routing), on the same alignment and inputs:
    base        moe_gemm.moe_gate_up_kernel / moe_down_kernel with the tuned tile configuration
    tma         moe_gemm_tma kernels (weights by TMA; down's activations too), same tiles
    tma+ws      the same with Triton's warp specialisation of the K loop
    pers        persistent (one program per SM over the grouped tile order), TMA
    pers+ws     persistent with the tile loop warp-specialised
and a few tile alternatives of the TMA kernels. Every variant's output is compared with base's
(used rows): max |diff| and whether the bits are equal; a variant off by more than bf16 rounding
(rel-L2 > 1e-2) is reported and not timed. Times: CUDA-graph replay, L2 flushed, median.
Roof: bf16 8192^3 torch.mm measured in the same run; frac = FLOP / time / roof.

    python3 tools/diag_tma_gemm.py --shapes mixtral,qwen3,deepseek --tokens 2048,8192
    TRITON_INTERPRET=1 python3 tools/diag_tma_gemm.py --dry-run      # CPU check (tiny shape)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ACT_SILU = 0  # the GEMM kernels' ACT code of silu (their constexpr contract, as the library's launchers pass it)
SHAPES = {  # name: (E, H, I, K)
    "mixtral": (8, 4096, 14336, 2),
    "qwen3": (128, 2048, 768, 8),
    "deepseek": (256, 7168, 2048, 8),
    "tiny": (4, 64, 64, 2),
}


def _variants(base_cfg, dry: bool):
    """(name, kernel, dict of tile/variant options) for the TMA kernels."""
    gu, dn = base_cfg.gate_up, base_cfg.down
    out = []
    for kern, t in (("gate_up", gu), ("down", dn)):
        same = dict(bn=t.block_n, bk=t.block_k, warps=t.num_warps, stages=t.num_stages, gm=t.group_m)
        out.append(("tma", kern, dict(same, pers=False, ws=False)))
        if dry:
            out.append(("pers", kern, dict(same, pers=True, ws=False)))
            continue
        out.append(("tma+ws", kern, dict(same, pers=False, ws=True)))
        out.append(("pers", kern, dict(same, pers=True, ws=False)))
        out.append(("pers+ws", kern, dict(same, pers=True, ws=True)))
        for bn, bk, stages in ((128, 64, 4), (256, 64, 3), (128, 128, 3)):
            if (bn, bk, stages) != (t.block_n, t.block_k, t.num_stages):
                out.append((f"tma bn{bn} bk{bk} s{stages}", kern, dict(same, bn=bn, bk=bk, stages=stages, pers=False,
                                                                        ws=False)))
                out.append((f"pers bn{bn} bk{bk} s{stages}", kern, dict(same, bn=bn, bk=bk, stages=stages, pers=True,
                                                                         ws=False)))
    return out


def _point(c, shape: str, T: int, gate_up, down, key) -> list[dict]:
    """Rows of one (shape, T): base, then every TMA variant (see the module docstring)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from moeflow.kernels.moe_align import align_launch
    from moeflow.kernels.moe_gemm import moe_down_kernel, moe_gate_up_kernel
    from moeflow.kernels.moe_gemm_tma import moe_down_tma_kernel, moe_gate_up_tma_kernel
    from moeflow.tuning import lookup

    E, H, I, K = SHAPES[shape]
    dev, dtype, g, timer, roof, sms, dev_name, dry = (c[k] for k in ("dev", "dtype", "g", "timer", "roof", "sms",
                                                                     "dev_name", "dry"))
    rows = []
    cfg = lookup(key, T, dev_name, sm_count=sms)
    BM = cfg.block_m
    N = T * K
    x = (torch.randn(T, H, device=dev, generator=g)).to(dtype)
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=-1).indices.to(torch.int32).reshape(-1)
    nb = -(-N // BM) + min(N, E)  # blocks after padding each expert to BM rows: a bound from N and E alone
    P = nb * BM
    sorted_P = torch.empty(P, dtype=torch.int32, device=dev)
    be_B = torch.empty(nb, dtype=torch.int32, device=dev)
    align_launch(ids, E, BM, sorted_P, be_B)
    used = (sorted_P < N)
    act_base = torch.zeros(P, I, dtype=dtype, device=dev)
    y_base = torch.zeros(N, H, dtype=dtype, device=dev)
    gu_t, dn_t = cfg.gate_up, cfg.down
    prec = "tf32" if dtype != torch.float32 else "ieee"

    def base_gate_up(act=act_base, t=gu_t):
        moe_gate_up_kernel[(nb * math.ceil(I / t.block_n),)](
            x, gate_up, gate_up, act, sorted_P, be_B, N, H, I, K, nb,
            x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), 0, act.stride(0), 0.0, 1.0,
            ACT=ACT_SILU, INTERLEAVED=False, HAS_BIAS=False, EVEN_K=H % t.block_k == 0,
            PRECISION=prec, BLOCK_M=BM, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
            num_warps=t.num_warps, num_stages=t.num_stages)

    def base_down(y=y_base, t=dn_t):
        moe_down_kernel[(nb * math.ceil(H / t.block_n), 1)](
            act_base, down, down, y, sorted_P, be_B, N, H, I, nb, math.ceil(I / t.block_k),
            act_base.stride(0), down.stride(0), down.stride(1), down.stride(2), 0, y.numel(), y.stride(0),
            HAS_BIAS=False, EVEN_K=I % t.block_k == 0, PRECISION=prec, BLOCK_M=BM, BLOCK_N=t.block_n,
            BLOCK_K=t.block_k, GROUP_M=t.group_m, num_warps=t.num_warps, num_stages=t.num_stages)

    base_gate_up()
    base_down()
    flops = {"gate_up": 2.0 * N * H * 2 * I, "down": 2.0 * N * I * H}
    t_base = {"gate_up": timer(base_gate_up), "down": timer(base_down)}
    for kern in ("gate_up", "down"):
        t = t_base[kern]
        row = dict(shape=shape, T=T, kernel=kern, variant="base", us=t * 1e6, tflops=flops[kern] / t / 1e12,
                   frac=flops[kern] / t / roof, vs_base=1.0, match="-",
                   tiles=dict(block_m=BM, **(gu_t if kern == "gate_up" else dn_t).__dict__))
        rows.append(row)
        print(f"{shape:9} {T:5} {kern:8} {'base':22} {row['us']:9.1f} {row['tflops']:8.1f} {row['frac']:6.3f} "
              f"{1.0:8.3f}  -")
    for name, kern, o in _variants(cfg, dry):
        bn, bk = o["bn"], o["bk"]
        if (I if kern == "gate_up" else H) % bn or (H if kern == "gate_up" else I) % bk:
            continue
        out = torch.zeros_like(act_base if kern == "gate_up" else y_base)
        progs = sms if o["pers"] else None
        if kern == "gate_up":
            wd = TensorDescriptor(gate_up, shape=[E * 2 * I, H], strides=[H, 1], block_shape=[bn, bk])
            tiles = nb * (I // bn)

            def fn(out=out, wd=wd, o=o, tiles=tiles, bn=bn, bk=bk, progs=progs):
                moe_gate_up_tma_kernel[(progs or tiles,)](
                    x, None, None, wd, out, sorted_P, be_B, N, H, I, K, nb, tiles, x.stride(0), out.stride(0), 0.0, 1.0,
                    ACT=ACT_SILU, PERSISTENT=o["pers"], WS=o["ws"], NUM_PROGS=progs or 1,
                    BLOCK_M=BM, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=o["gm"], num_warps=o["warps"],
                    num_stages=o["stages"])
            ref = act_base
        else:
            ad = TensorDescriptor(act_base, shape=[P, I], strides=[I, 1], block_shape=[BM, bk])
            wd = TensorDescriptor(down, shape=[E * H, I], strides=[I, 1], block_shape=[bn, bk])
            tiles = nb * (H // bn)

            def fn(out=out, ad=ad, wd=wd, o=o, tiles=tiles, bn=bn, bk=bk, progs=progs):
                moe_down_tma_kernel[(progs or tiles,)](
                    ad, ad, wd, out, sorted_P, be_B, N, H, I, nb, tiles, out.stride(0),
                    PERSISTENT=o["pers"], WS=o["ws"], NUM_PROGS=progs or 1, BLOCK_M=BM, BLOCK_N=bn,
                    BLOCK_K=bk, GROUP_M=o["gm"], num_warps=o["warps"], num_stages=o["stages"])
            ref = y_base
        row = dict(shape=shape, T=T, kernel=kern, variant=name, tiles=dict(block_m=BM, **o))
        try:
            fn()
            if dev == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result
            row.update(status=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            rows.append(row)
            print(f"{shape:9} {T:5} {kern:8} {name:22} {row['status']}")
            continue
        a, b = out, ref
        if kern == "gate_up":
            a, b = out[used], ref[used]
        a, b = a.float(), b.float()
        diff = (a - b).abs().max().item()
        rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        bits = bool(torch.equal(out[used] if kern == "gate_up" else out, ref[used] if kern == "gate_up" else ref))
        row.update(max_abs=diff, rel_l2=rel, bitwise=bits)
        if not rel <= 1e-2:
            row.update(status=f"wrong: rel-L2 {rel:.3g} vs base")
            rows.append(row)
            print(f"{shape:9} {T:5} {kern:8} {name:22} {row['status']}")
            continue
        t = timer(fn)
        row.update(status="ok", us=t * 1e6, tflops=flops[kern] / t / 1e12, frac=flops[kern] / t / roof,
                   vs_base=t_base[kern] / t)
        rows.append(row)
        print(f"{shape:9} {T:5} {kern:8} {name:22} {row['us']:9.1f} {row['tflops']:8.1f} {row['frac']:6.3f} "
              f"{row['vs_base']:8.3f}  {'bits' if bits else f'max {diff:.2g}'}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="mixtral,qwen3,deepseek")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--time-budget-s", type=float, default=400.0)
    ap.add_argument("--dry-run", action="store_true", help="tiny shape, one T (TRITON_INTERPRET=1 on CPU)")
    args = ap.parse_args(argv)

    from benchmarks.common import compute_roof_flops, env_info, time_cuda_graph
    from moeflow.tuning import ShapeKey

    dry = args.dry_run
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA: run with --dry-run and TRITON_INTERPRET=1")
        return 2
    if dev == "cpu":
        from moeflow.testing import patch_interpreter_index

        patch_interpreter_index()
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = ["tiny"] if dry else args.shapes.split(",")
    tokens = [16] if dry else [int(t) for t in args.tokens.split(",")]
    timer = (lambda fn: time_cuda_graph(fn, reps=args.reps)) if dev == "cuda" else (lambda fn: (fn(), float("nan"))[1])
    roof = compute_roof_flops() if dev == "cuda" else float("nan")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if dev == "cuda" else 4
    dev_name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    print(f"{env_info()}\nbf16 compute roof {roof / 1e12:.1f} TFLOP/s, {sms} SMs")
    print(f"{'shape':9} {'T':>5} {'kernel':8} {'variant':22} {'us':>9} {'TFLOP/s':>8} {'frac':>6} {'vs base':>8}  match")
    rows = []
    t_start = time.time()
    g = torch.Generator(device=dev).manual_seed(0)
    ctx = dict(dev=dev, dtype=dtype, g=g, timer=timer, roof=roof, sms=sms, dev_name=dev_name, dry=dry)
    for shape in shapes:
        E, H, I, K = SHAPES[shape]
        gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) * 0.02).to(dtype)
        down = (torch.randn(E, H, I, device=dev, generator=g) * 0.02).to(dtype)
        key = ShapeKey(num_experts=E, hidden_size=H, intermediate_size=I, top_k=K, layout="linear",
                       interleaved=False, dtype=str(dtype).replace("torch.", ""))
        for T in tokens:
            if time.time() - t_start > args.time_budget_s:
                print(f"time budget spent: stop before {shape} T={T}")
                break
            rows += _point(ctx, shape, T, gate_up, down, key)
        del gate_up, down
        if dev == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(dict(env=env_info(), roof_flops=roof, rows=rows), indent=1, default=str))
    bad = [r for r in rows if str(r.get("status", "ok")).startswith(("wrong", "error"))]
    # A dry run is a correctness check of the kernels (tests/test_experts_triton.py runs it); on the
    # GPU a variant that does not compile is a finding, reported in its row.
    return 1 if dry and bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
