"""Half tiles and batch-invariant candidates against a sustained compute roof, timed round-robin (GPU).

Legend: T tokens, K slots, E experts. At each (shape, T, routing) point the step is timed
(CUDA-graph replay, 256 MB write flush before each, median) with several tile configurations,
round-robin (benchmarks.common.time_cuda_graphs_interleaved):
    table     what TritonExperts() runs there (the tuned table)
    half      table with half_tail on (MoETileConfig.half_tail: a 128-row block holding at most 64
              pairs runs as a 64-row tile in the same kernel)
    full      table with half_tail off
    bi        what TritonExperts(batch_invariant=True) runs there
    bi_half   bi with half_tail flipped (128-row bi tiles only)
    bi_pers   bi with both GEMMs in the persistent TMA form (same tiles, same bits)
    gather_x  table with the TMA gate_up's activation rows copied into pair order first and read by TMA
              (pinned: KernelOptions(pin={"gate_up": "tma_gather_x"}); moe_gemm_tma.gather_rows_kernel);
              no_gather_x: the gate_up pinned to "tma" (the plan takes gather_x by its rule,
              moeflow.tuning.rules gather_x_*)
    gu_pers   table with the gate_up persistent (one program per SM); gu_pers_gather_x: pinned to
              tma_gather_x too
    flat_down table with the down GEMM pinned to one flattened persistent loop over (tile, K step)
              ("tma_flat"; moe_gemm_tma._down_flat; no half tiles in down); tiled_down: pinned to the tiled
              TMA down ("tma"; the plan runs the bf16 down flat at short K on full 128-row tiles, rules
              flat_down_max_k_steps: table is flat_down there)
    heuristic moeflow.tuning.default_config: what a card with no table of its own (and no Hopper
              sibling's, moeflow.tuning.table_device) runs (its K steps may differ: bits need not match)
    other_bk  table with both GEMMs' BK switched 64 <-> 128 (stages cut to fit): whether BK changes the
              bits of the wgmma kernels (each k16 step joins one accumulator in order, so it should
              not; if it does not, the batch-invariant mode need not fix BK)
    vl_tiles  our kernels on the tiles vLLM 0.33 picks at this T (benchmarks/peers/vllm_fused_moe.config_for)
    bm32/bm64 the table's tiles on 32 / 64-row alignment blocks (GPU only, where the table's BM differs)
    roof      bf16 torch.mm 8192^3, repeated to last about as long as the step: timed in the
              same rotation, so at the same clocks
    vllm      (--vllm) vLLM 0.33's fused MoE (benchmarks/peers/vllm_fused_moe.py), same weights and
              routing, checked against our table's output (rel-L2 <= 2e-2) before it is timed
    gmm       (--gmm) torch's grouped GEMM (F.grouped_mm: CUTLASS's sm90 grouped kernel on Hopper) for
              gate_up and down plus the activation, on rows already sorted by expert (no sort, no
              combine: less work than a step; benchmarks/bench_experts.torch_gmm_runner), checked
              against our output after its unpermute and combine (rel-L2 <= 2e-2). It answers the
              question: is another existing kernel faster at this point?
Each variant's output is compared with its base bit for bit ("bits": = or !=; table for half /
full, bi for bi_*): a row's dot products take the same K steps whatever the tile height or
schedule, so the bits must match.

Why the roof in the rotation: a prefill step runs the H200 at its 700 W power cap, where its SM
clock drops from 1980 MHz to 1300-1700 MHz (nvidia-smi during this tool's run); torch.mm timed alone
for a few milliseconds runs before the cap bites. "compute" = 2*3*T*K*H*I FLOP / our time / that
sustained roof's FLOP/s; "compute_burst" divides by benchmarks.common.compute_roof_flops.

    PYTHONPATH=. python tools/diag_half_tiles.py --json OUT.json
    PYTHONPATH=. python tools/diag_half_tiles.py --points deepseek-v3:8192 --routing uniform
    TRITON_INTERPRET=1 PYTHONPATH=. python tools/diag_half_tiles.py --dry-run
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.tune_experts import make_config, make_weights, routing, shape_key, shape_spec  # noqa: E402
from moeflow.tuning import GemmTile, MoETileConfig, default_config  # noqa: E402

DEFAULT_POINTS = ("qwen3-30b-a3b:2048,qwen3-30b-a3b:8192,deepseek-v3:2048,deepseek-v3:8192,gpt-oss-120b:2048,"
                  "gpt-oss-120b:8192,mixtral-8x7b:2048,mixtral-8x7b:8192,ds-v4.1-like:2048,ds-v4.1-like:8192")


def variants(table: MoETileConfig, bi: MoETileConfig, heuristic: MoETileConfig | None = None
             ) -> dict[str, MoETileConfig]:
    """Named configurations of one point (module docstring); half tiles only for blocks of >= 64 rows."""
    out = {"table": table}
    if heuristic is not None:
        out["heuristic"] = heuristic
    if table.block_m >= 64:
        out["half"] = dataclasses.replace(table, half_tail=True)
        out["full"] = dataclasses.replace(table, half_tail=False)
    out["bi"] = bi
    if bi.block_m >= 64:
        out["bi_half"] = dataclasses.replace(bi, half_tail=not bi.half_tail)
    out["bi_pers"] = dataclasses.replace(bi, gate_up=dataclasses.replace(bi.gate_up, persistent=True),
                                         down=dataclasses.replace(bi.down, persistent=True))
    out["gather_x"] = table
    out["no_gather_x"] = table
    gu_pers = dataclasses.replace(table, gate_up=dataclasses.replace(table.gate_up, persistent=True))
    out["gu_pers"] = out["gu_pers_gather_x"] = gu_pers
    out["flat_down"] = table
    out["tiled_down"] = table
    out["other_bk"] = dataclasses.replace(table, gate_up=_other_bk(table.gate_up, table.block_m, 2),
                                          down=_other_bk(table.down, table.block_m, 1))
    return out


# shared memory a Triton GEMM's stages may take (Hopper: 227 KB a block, less the compiler's scratch)
_STAGE_BYTES = 200 * 1024


def _other_bk(t: GemmTile, block_m: int, b_tiles: int) -> GemmTile:
    """t with BK switched 64 <-> 128 and as many of its stages as still fit _STAGE_BYTES (bf16: a stage
    holds a BM x BK tile and b_tiles BN x BK ones; BK 128 at 3 stages can need 384 KB)."""
    bk = {64: 128, 128: 64}.get(t.block_k, 64)
    stage = (block_m + b_tiles * t.block_n) * bk * 2
    return dataclasses.replace(t, block_k=bk, num_stages=max(1, min(t.num_stages, _STAGE_BYTES // stage)))


# variants that are their tiles run with a variant pinned (KernelOptions.pin)
PINS = {"gather_x": {"gate_up": "tma_gather_x"}, "no_gather_x": {"gate_up": "tma"},
        "gu_pers_gather_x": {"gate_up": "tma_gather_x"}, "flat_down": {"down": "tma_flat"},
        "tiled_down": {"down": "tma"}}


def mm_roof(step_s: float, dev) -> tuple[object, float]:
    """(fn, FLOP): bf16 8192^3 torch.mm repeated to last about step_s (at the burst roof's rate)."""
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=dev)
    reps = max(1, round(step_s / 1.5e-3))  # one mm is ~1.4 ms on the H200

    def fn():
        for _ in range(reps):
            torch.mm(a, b, out=c)

    return fn, 2.0 * n**3 * reps


def gmm_step(x, ids, wts, w, cfg, ours, where: str):
    """torch's grouped GEMMs on rows pre-sorted by expert (gate_up, activation, down), checked against
    `ours` [T, H] after unpermute + combine; returns the timed fn (GEMMs and activation only)."""
    from benchmarks.bench_experts import torch_gmm_runner

    runner, why = torch_gmm_runner(x, ids, w, cfg)
    if runner is None:
        raise SystemExit(f"{where}: --gmm: {why}")
    run, unpermute = runner
    y = (unpermute(run()).float() * wts.float()[..., None]).sum(1)
    err = float((y - ours.float()).norm() / ours.float().norm())
    if not err <= 2e-2:
        raise SystemExit(f"{where}: torch grouped_mm is off our output by rel-L2 {err:.3g}")
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=DEFAULT_POINTS, help="shape:T,... (standard shapes)")
    ap.add_argument("--routing", default="uniform,zipf")
    ap.add_argument("--rounds", type=int, default=5, help="round-robin passes over the variants")
    ap.add_argument("--reps", type=int, default=3, help="timed replays of each variant per pass")
    ap.add_argument("--json", default=None)
    ap.add_argument("--vllm", action="store_true", help="time the vLLM peer in the same rotation")
    ap.add_argument("--gmm", action="store_true",
                    help="time torch's grouped GEMM (CUTLASS) on pre-sorted rows in the same rotation")
    ap.add_argument("--variants", default=None, help="comma list of the variants to run (table always runs)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny shape, under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)

    from moeflow.experts.options import KernelOptions
    from moeflow.experts.triton import TritonExperts

    if args.dry_run:
        from moeflow.testing import patch_interpreter_index

        patch_interpreter_index()
        dev, dtype, points, roof = torch.device("cpu"), torch.float32, [("tiny-silu", 70)], 1e12

        def timer(fns):
            for fn in fns.values():
                fn()
            return {**{k: 1e-3 for k in fns}, "roof_flops": roof}
    else:
        from benchmarks.common import compute_roof_flops, env_info, time_cuda_graphs_interleaved

        dev, dtype = torch.device("cuda"), torch.bfloat16
        points = [(p.split(":")[0], int(p.split(":")[1])) for p in args.points.split(",")]
        roof = compute_roof_flops()
        print(f"{env_info()}\ncompute roof {roof / 1e12:.1f} TFLOP/s")

        def timer(fns):
            fns = dict(fns)
            # size the roof's mm chain by a first look at the step (the table's config)
            first = time_cuda_graphs_interleaved({"table": fns["table"]}, rounds=1, reps=2)["table"]
            roof_fn, roof_flop = mm_roof(first, dev)
            fns["roof"] = roof_fn
            times = time_cuda_graphs_interleaved(fns, rounds=args.rounds, reps=args.reps)
            times["roof_flops"] = roof_flop / times["roof"]
            return times
    rows = []
    cpu = dev.type == "cpu"
    for name, T in points:
        spec = shape_spec(name)
        w, cfg = make_weights(spec, dev, dtype=dtype), make_config(spec)
        K, E, H, I = spec["K"], spec["E"], spec["H"], spec["I"]
        table = TritonExperts(allow_cpu=cpu).tile_config_for(w, K, T)
        bi = TritonExperts(allow_cpu=cpu, batch_invariant=True).tile_config_for(w, K, T)
        if cpu:  # tiny tiles the interpreter runs quickly, 32-row blocks (so half tiles of 16 rows)
            t = GemmTile(block_n=16, block_k=16, num_stages=1)
            table = bi = MoETileConfig(block_m=32, gate_up=t, down=t)
        heuristic = None if cpu else default_config(shape_key(spec, dtype), T,
                                                    torch.cuda.get_device_properties(dev).multi_processor_count)
        named = variants(table, bi, heuristic)
        if not cpu:  # our kernels on the tiles vLLM picks at this T, and the table's tiles on 32 / 64-row blocks
            from benchmarks.peers.vllm_fused_moe import config_for

            vc = config_for(T, E, I)[0]
            vt = GemmTile(block_n=vc["BLOCK_SIZE_N"], block_k=vc["BLOCK_SIZE_K"], num_warps=vc["num_warps"],
                          num_stages=vc["num_stages"], group_m=max(1, vc["GROUP_SIZE_M"]))
            named["vl_tiles"] = MoETileConfig(block_m=vc["BLOCK_SIZE_M"], gate_up=vt, down=vt)
            for bm in (32, 64):
                if bm != table.block_m:
                    named[f"bm{bm}"] = dataclasses.replace(table, block_m=bm)
        if args.variants:
            keep = {"table", *args.variants.split(",")}
            unknown = keep - set(named) - {"half", "bi_half", "vl_tiles", "bm32", "bm64"}
            if unknown:
                raise SystemExit(f"--variants: unknown {sorted(unknown)}; known {sorted(named)}")
            named = {k: v for k, v in named.items() if k in keep}
        peer = None
        if args.vllm:  # its vLLM-layout copy of the weights, once per point
            from benchmarks.peers.vllm_fused_moe import VllmFusedMoE

            peer = VllmFusedMoE(w, spec["activation"], spec.get("limit"))
        if cpu:
            named["half"] = dataclasses.replace(table, half_tail=True)
            if "bi" in named:
                named["bi_half"] = dataclasses.replace(bi, half_tail=True)
        for dist in args.routing.split(","):
            ids, wts = routing(T, E, K, dist, dev)
            x = torch.randn(T, H, device=dev, dtype=dtype)
            # the interpreter takes the TMA kernels only when asked (tma=True), the GPU by default
            impls = {v: TritonExperts(allow_cpu=cpu, tile_config=c,
                                      options=KernelOptions(tma=True if cpu else None, pin=PINS.get(v, {})))
                     for v, c in named.items()}
            outs = {}
            for v, impl in list(impls.items()):
                try:
                    outs[v] = impl.forward_tokens(x, ids, wts, w, cfg).clone()
                except Exception as exc:  # a pinned variant the plan refuses here says why; the rest run
                    if v == "table":
                        raise
                    print(f"{name:14s} T={T:5d} {dist:7s} {v:8s} refused: {type(exc).__name__}: {str(exc)[:200]}",
                          flush=True)
                    rows.append(dict(shape=name, T=T, routing=dist, variant=v, status=f"refused: {exc}"[:300]))
                    del impls[v]
            fns = {v: (lambda impl=impl, a=(x, ids, wts, w, cfg): impl.forward_tokens(*a)) for v, impl in impls.items()}
            if peer is not None:
                err = float((peer(x, ids, wts).float() - outs["table"].float()).norm() / outs["table"].float().norm())
                if not err <= 2e-2:
                    raise SystemExit(f"{name} T={T} {dist}: the vLLM peer is off our output by rel-L2 {err:.3g}")
                fns["vllm"] = lambda peer=peer, a=(x, ids, wts): peer(*a)
            if args.gmm:
                fns["gmm"] = gmm_step(x, ids, wts, w, cfg, outs["table"], f"{name} T={T} {dist}")
            times = timer(fns)
            flop = 2 * 3 * T * K * H * I
            print(f"{name:14s} T={T:5d} {dist:7s} sustained roof {times['roof_flops'] / 1e12:.1f} TFLOP/s "
                  f"(burst {roof / 1e12:.1f})", flush=True)
            for v, c in named.items():
                if v not in outs:
                    continue
                base = "bi" if v.startswith("bi_") else "table"  # full: same bits as half
                row = dict(shape=name, T=T, routing=dist, variant=v, us=times[v] * 1e6,
                           compute_frac=flop / times[v] / times["roof_flops"], compute_burst=flop / times[v] / roof,
                           sustained_roof_flops=times["roof_flops"], burst_roof_flops=roof,
                           vs_table=times["table"] / times[v], base=base,
                           bits="=" if torch.equal(outs[v], outs[base]) else "!=", cfg=c.to_dict())
                rows.append(row)
                print(f"{name:14s} T={T:5d} {dist:7s} {v:8s} {row['us']:9.1f} us  x{row['vs_table']:.3f} vs table"
                      f"  compute {row['compute_frac']:.3f} (burst {row['compute_burst']:.3f})  bits {row['bits']} "
                      f"vs {base}", flush=True)
            for peer_name in ("vllm", "gmm"):
                if peer_name not in times:
                    continue
                t_v = times[peer_name]
                rows.append(dict(shape=name, T=T, routing=dist, variant=peer_name, us=t_v * 1e6,
                                 compute_frac=flop / t_v / times["roof_flops"], compute_burst=flop / t_v / roof,
                                 vs_table=times["table"] / t_v, peer_over_table=t_v / times["table"]))
                print(f"{name:14s} T={T:5d} {dist:7s} {peer_name:8s} {t_v * 1e6:9.1f} us  peer / table "
                      f"x{t_v / times['table']:.3f}  compute {rows[-1]['compute_frac']:.3f}", flush=True)
    if args.json:
        from benchmarks.common import write_json

        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
