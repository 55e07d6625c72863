"""Benchmark the quantized Triton experts (`triton_quant`) against the HBM roof and our bf16 kernels (GPU).

Legend: T tokens, K slots, E experts, H hidden, I intermediate per expert; fp8 = fp8_block 128x128
(W8A8, f32 scales), mxfp4 = gpt-oss MXFP4 (W4A16, interleaved gate/up, biases), nvfp4 = ModelOpt NVFP4
(W4A16: E2M1, e4m3 scales a 16 values, per-tensor weight_scale_2; gate and up quantized apart).

Shapes (shared/spec/benchmarks.md sizes):
    deepseek-v3    E=256 H=7168 I=2048 K=8   fp8     silu
    qwen3-30b-a3b-fp8  E=128 H=2048 I=768 K=8  fp8   silu (this and the next two: not in the default --shapes)
    qwen3-235b-a22b-fp8  E=128 H=4096 I=1536 K=8  fp8  silu
    glm-4.5-fp8    E=160 H=5120 I=1536 K=8   fp8     silu
    deepseek-v3-nvfp4  E=256 H=7168 I=2048 K=8  nvfp4  silu (this and the next: not in the default --shapes)
    qwen3-30b-a3b-nvfp4  E=128 H=2048 I=768 K=8  nvfp4  silu
    gpt-oss-120b   E=128 H=2880 I=2880 K=4   mxfp4   gptoss, layout "matmul", bf16 biases
Weights: random bf16 scaled like a trained layer, quantized per expert with moeflow.quant's
quantizers, stored contiguous [E, out, in] as checkpoints hold them. Routing: uniform, fixed seed.

Per shape:
    decode T in 1..64   TritonQuantExperts (and the _bi mode) under CUDA-graph replay and eager,
                        L2 flushed before every timed call (median of --reps); floor = quantized
                        bytes of the distinct experts touched (weights + scales + biases as stored,
                        `ExpertWeights.expert_bytes`) + x read + out written, over the HBM roof;
                        roof_frac = floor / graph time.
    prefill T=8192      TritonQuantExperts (and the _bi mode) against our bf16 TritonExperts on the bf16
                        weights the quantized ones were made from (same routing), each a CUDA graph,
                        timed round-robin in one rotation (benchmarks.common.time_cuda_graphs_interleaved:
                        the power-capped clocks of compute-bound steps drift between impls timed one
                        after another: on an H200 the eager, sequential FP8 row read 0.98x bf16 where one
                        rotation gave 0.75x); speedup = bf16 time / quantized time; compute floor
                        2*3*H*I*T*K FLOP over the bf16 mm roof.
    options             --tma / --pdl / --no-fast-launch / --pin STAGE=VARIANT (benchmarks.common.kernel_options)
                        choose the KernelOptions of the quantized impls (the bf16 one takes them without
                        the pins, whose names are the quantized variants': fp8_pointer, fp8_tma, fp8_gluon,
                        w4_pointer, w4_gemv). A/B of a variant: the same command with and without its pin;
                        a point where the pinned variant does not serve says why in its status.
    error               every timed point is checked first against the dequantized-f32 reference
                        (weight-only: `w.dequantize(float32)` on f32 rows, one expert at a time); fp8
                        also against the W8A8 reference (activations quantized per token per 128 as
                        the kernels do, moeflow.quant.formats.quantize_fp8_activations). A point over
                        the check threshold is reported WRONG and not timed.
Roofs measured in the same run: HBM = the larger of the read roof (benchmarks.common.hbm_read_roof_detail:
the fastest read-only stream over 2 GiB, its reader recorded as hbm_reader) and benchmarks.common's 2 GiB
device copy (read + write bytes / time); compute = 8192^3 bf16 mm.

    PYTHONPATH=. python benchmarks/bench_experts_quant.py --out benchmarks/results/bench_experts_quant_h200.json
    PYTHONPATH=. python benchmarks/bench_experts_quant.py --shapes deepseek-v3 --decode 1,8 --no-prefill
    PYTHONPATH=. python benchmarks/bench_experts_quant.py --shapes deepseek-v3 --decode '' --pin gate_up=fp8_tma
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_experts_quant.py --dry-run   # CPU check of the script
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    add_kernel_options_args,
    compute_roof_flops,
    env_info,
    format_table,
    hbm_read_roof_detail,
    hbm_roof_bytes_per_s,
    kernel_options,
    options_record,
    time_cpu,
    time_cuda,
    time_cuda_graph,
    time_cuda_graphs_interleaved,
)
from benchmarks.tune_experts import FAMILY, patch_interpreter_index, routing  # noqa: E402
from moeflow.config import ExpertWeights, MoEConfig  # noqa: E402
from moeflow.routing.spec import RouterSpec  # noqa: E402

# the families' activation and layout fields (benchmarks/tune_experts.FAMILY): one place for them
_SILU_LINEAR = FAMILY["deepseek-v3"]
_GPTOSS = FAMILY["gpt-oss-120b"]
SHAPES = {
    "deepseek-v3": dict(H=7168, I=2048, E=256, K=8, fmt="fp8", **_SILU_LINEAR),
    # Qwen3-30B-A3B-FP8 (128 x 128 blocks): small experts, the other FP8 prefill shape
    "qwen3-30b-a3b-fp8": dict(H=2048, I=768, E=128, K=8, fmt="fp8", **_SILU_LINEAR),
    # Qwen3-235B-A22B-FP8 and GLM-4.5-FP8: the FP8 shapes between those two in H (where the fp8 gate_up's
    # variant rule, moeflow.tuning.rules fp8_gluon_gate_up_min_hidden, sits)
    "qwen3-235b-a22b-fp8": dict(H=4096, I=1536, E=128, K=8, fmt="fp8", **_SILU_LINEAR),
    "glm-4.5-fp8": dict(H=5120, I=1536, E=160, K=8, fmt="fp8", **_SILU_LINEAR),
    # NVIDIA's NVFP4 (ModelOpt) checkpoints: DeepSeek-R1-FP4 (deepseek-v3's layer) and Qwen3-30B-A3B-FP4
    "deepseek-v3-nvfp4": dict(H=7168, I=2048, E=256, K=8, fmt="nvfp4", **_SILU_LINEAR),
    "qwen3-30b-a3b-nvfp4": dict(H=2048, I=768, E=128, K=8, fmt="nvfp4", **_SILU_LINEAR),
    "gpt-oss-120b": dict(H=2880, I=2880, E=128, K=4, fmt="mxfp4", **_GPTOSS),
    # --dry-run (CPU, Triton interpreter)
    "tiny-fp8": dict(H=256, I=128, E=8, K=2, fmt="fp8", **_SILU_LINEAR),
    "tiny-nvfp4": dict(H=128, I=96, E=6, K=2, fmt="nvfp4", **_SILU_LINEAR),
    "tiny-mxfp4": dict(H=128, I=96, E=6, K=2, fmt="mxfp4", **_GPTOSS),
}
DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_TOKENS = (8192,)
# Refuse to time a point whose rel-L2 exceeds this against its check reference (the W8A8 one for fp8).
CHECK_REL_L2 = 2e-2


# --------------------------------------------------------------------------- weights
def build_weights(spec: dict, device, act_dtype, seed: int = 0) -> tuple[MoEConfig, ExpertWeights, ExpertWeights]:
    """(config, quantized weights, the plain weights of act_dtype they were quantized from).

    One expert at a time (the quantizers work in f32: a whole layer at once would need several
    times its bf16 size), written into contiguous [E, out, in] storage.
    """
    from moeflow.quant.formats import quantize_fp8_block, quantize_mxfp4, quantize_nvfp4
    from moeflow.quant.spec import MXFP4, NVFP4, fp8_block_spec

    E, H, I = spec["E"], spec["H"], spec["I"]
    cfg = MoEConfig(hidden_size=H, intermediate_size=I,
                    router=RouterSpec(score_fn="softmax", num_experts=E, top_k=spec["K"]),
                    activation=spec["activation"], swiglu_limit=spec["limit"], layout=spec["layout"],
                    interleaved=spec["interleaved"], expert_bias=spec["bias"])
    g = torch.Generator(device=device).manual_seed(seed)
    gu_oi = torch.empty(E, 2 * I, H, dtype=act_dtype, device=device)  # [E, out, in] plain weights
    dn_oi = torch.empty(E, H, I, dtype=act_dtype, device=device)
    fp8, nvfp4 = spec["fmt"] == "fp8", spec["fmt"] == "nvfp4"
    g2 = d2 = None
    if fp8:
        qspec = fp8_block_spec((128, 128))
        bn, bk = qspec.block
        gq = torch.empty(E, 2 * I, H, dtype=torch.float8_e4m3fn, device=device)
        dq = torch.empty(E, H, I, dtype=torch.float8_e4m3fn, device=device)
        gs = torch.empty(E, 2 * -(-I // bn), -(-H // bk), dtype=torch.float32, device=device)
        ds = torch.empty(E, -(-H // bn), -(-I // bk), dtype=torch.float32, device=device)
    elif nvfp4:  # ModelOpt layout: e4m3 scales a 16 values, a per-tensor f32 weight_scale_2 (gate, up apart)
        qspec = NVFP4
        gq = torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, device=device)
        dq = torch.empty(E, H, I // 2, dtype=torch.uint8, device=device)
        gs = torch.empty(E, 2 * I, H // 16, dtype=torch.float8_e4m3fn, device=device)
        ds = torch.empty(E, H, I // 16, dtype=torch.float8_e4m3fn, device=device)
        g2 = torch.empty(E, 2, dtype=torch.float32, device=device)
        d2 = torch.empty(E, dtype=torch.float32, device=device)
    else:
        qspec = MXFP4
        gq = torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, device=device)
        dq = torch.empty(E, H, I // 2, dtype=torch.uint8, device=device)
        gs = torch.empty(E, 2 * I, H // 32, dtype=torch.uint8, device=device)
        ds = torch.empty(E, H, I // 32, dtype=torch.uint8, device=device)
    for e in range(E):
        gu_oi[e] = torch.randn(2 * I, H, device=device, generator=g).to(act_dtype) * (1.0 / math.sqrt(H))
        dn_oi[e] = torch.randn(H, I, device=device, generator=g).to(act_dtype) * (1.0 / math.sqrt(I))
        if fp8:
            # gate and up are two tensors (their own block grids), as checkpoints store them
            (q0, s0), (q1, s1) = (quantize_fp8_block(h, (bn, bk)) for h in (gu_oi[e, :I], gu_oi[e, I:]))
            gq[e] = torch.cat((q0, q1))
            gs[e] = torch.cat((s0, s1))
            dq[e], ds[e] = quantize_fp8_block(dn_oi[e], (bn, bk))
        elif nvfp4:
            (q0, s0, t0), (q1, s1, t1) = (quantize_nvfp4(h) for h in (gu_oi[e, :I], gu_oi[e, I:]))
            gq[e], gs[e], g2[e] = torch.cat((q0, q1)), torch.cat((s0, s1)), torch.stack((t0, t1))
            dq[e], ds[e], d2[e] = quantize_nvfp4(dn_oi[e])
        else:
            gq[e], gs[e] = quantize_mxfp4(gu_oi[e])
            dq[e], ds[e] = quantize_mxfp4(dn_oi[e])
    gb = db = None
    if spec["bias"]:
        gb = (torch.randn(E, 2 * I, device=device, generator=g) * 0.1).to(act_dtype)
        db = (torch.randn(E, H, device=device, generator=g) * 0.1).to(act_dtype)
    wq = ExpertWeights(gq, dq, gb, db, layout=spec["layout"], interleaved=spec["interleaved"], quant=qspec,
                       gate_up_scale=gs, down_scale=ds, gate_up_scale_2=g2, down_scale_2=d2)
    if spec["layout"] == "matmul":
        plain = ExpertWeights(gu_oi.transpose(1, 2).contiguous(), dn_oi.transpose(1, 2).contiguous(), gb, db,
                              layout="matmul", interleaved=spec["interleaved"])
        del gu_oi, dn_oi
    else:
        plain = ExpertWeights(gu_oi, dn_oi, gb, db, layout="linear", interleaved=spec["interleaved"])
    return cfg, wq, plain


# --------------------------------------------------------------------------- references
def _fake_quant_fp8(v, group=128):
    from moeflow.quant.formats import quantize_fp8_activations

    q, s = quantize_fp8_activations(v, group)
    return q.to(torch.float32) * s.repeat_interleave(group, dim=1)[:, : v.shape[1]]


def reference(x, ids, wts, wq: ExpertWeights, cfg: MoEConfig, *, w8a8: bool) -> torch.Tensor:
    """f32 out_TH from the dequantized-f32 weights, one used expert at a time (w8a8: activations
    fake-quantized per token / pair per 128 channels, as the FP8 kernels do)."""
    from moeflow.experts.activations import apply_activation
    from moeflow.experts.base import down_one, gate_up_one

    T, K = ids.shape
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    rows = _fake_quant_fp8(x.float()) if w8a8 else x.float()
    ids_l = ids.long()
    for e in torch.unique(ids_l).tolist():
        t_idx, k_idx = torch.nonzero(ids_l == e, as_tuple=True)
        we = wq.subset(range(e, e + 1)).dequantize(torch.float32)
        act = apply_activation(gate_up_one(rows[t_idx], we, 0), cfg)
        if w8a8:
            act = _fake_quant_fp8(act)
        y = down_one(act, we, 0)
        out.index_put_((t_idx,), y * wts[t_idx, k_idx, None].float(), accumulate=True)
    return out


def error_vs(out, ref) -> tuple[float, float]:
    d = out.double() - ref.double()
    return float(d.norm() / ref.double().norm().clamp_min(1e-30)), float(d.abs().max())


def patch_interpreter_fp8() -> None:
    """Dry runs only: the interpreter's f32 -> float8e4nv (and bf16) rounding as the GPU's
    (moeflow.testing.patch_interpreter_numerics), so the FP8 check means the same on the CPU as on the GPU."""
    from moeflow.testing import patch_interpreter_numerics

    patch_interpreter_numerics()


# --------------------------------------------------------------------------- one shape
def bench_shape(name: str, spec: dict, args, roofs: dict, timers: dict, dev, act_dtype, t0: float) -> list[dict]:
    from moeflow.experts.triton import TritonExperts
    from moeflow.experts.triton_quant import TritonQuantExperts

    tb = time.time()
    cfg, wq, plain = build_weights(spec, dev, act_dtype, seed=args.seed)
    print(f"[{time.time() - t0:6.1f}s] {name}: built {spec['fmt']} weights ({wq.nbytes / 2**30:.2f} GiB quantized, "
          f"{plain.nbytes / 2**30:.2f} GiB {str(act_dtype).split('.')[-1]}) in {time.time() - tb:.1f}s", flush=True)
    E, K, H, I = spec["E"], spec["K"], spec["H"], spec["I"]
    cpu = dev.type == "cpu"
    opts = args.options
    quant = TritonQuantExperts(allow_cpu=cpu, fp8=True, options=opts)
    quant_bi = TritonQuantExperts(batch_invariant=True, allow_cpu=cpu, fp8=True, options=opts)
    bf16 = TritonExperts(allow_cpu=cpu, options=dataclasses.replace(opts, pin=()))
    w8a8 = spec["fmt"] == "fp8"
    rows: list[dict] = []
    tokens = [("decode", T) for T in args.decode] + [("prefill", T) for T in args.prefill]
    for phase, T in tokens:
        if time.time() - t0 > args.budget_s:
            rows.append(dict(shape=name, fmt=spec["fmt"], T=T, phase=phase, status="skipped: time budget"))
            print(f"{name} T={T}: skipped (budget of {args.budget_s:.0f}s)", flush=True)
            continue
        ids, wts = routing(T, E, K, "uniform", dev, seed=args.seed)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dev, act_dtype)
        n_distinct = int(torch.unique(ids).numel())
        bytes_ = n_distinct * wq.expert_bytes + 2 * T * H * x.element_size()
        flops = 2 * 3 * H * I * T * K
        floor_hbm, floor_cmp = bytes_ / roofs["hbm"], flops / roofs["compute"]
        base = dict(shape=name, fmt=spec["fmt"], T=T, phase=phase, distinct_experts=n_distinct,
                    quant_bytes=bytes_, floor_hbm_s=floor_hbm, floor_compute_s=floor_cmp)
        ref_w = reference(x, ids, wts, wq, cfg, w8a8=False)
        ref_c = reference(x, ids, wts, wq, cfg, w8a8=True) if w8a8 else ref_w
        impls = [("triton_quant", quant), ("triton_quant_bi", quant_bi)]
        if phase == "prefill":
            impls.append(("triton_bf16", bf16))
        times: dict[str, float] = {}
        prefill_fns: dict = {}
        for impl_name, impl in impls:
            w_use = plain if impl_name == "triton_bf16" else wq

            def fn(impl=impl, w_use=w_use, x=x, ids=ids, wts=wts):
                return impl.forward_tokens(x, ids, wts, w_use, cfg)

            row = dict(base, impl=impl_name)
            try:
                out = fn()
                if impl_name == "triton_bf16":
                    # the bf16 weights are the unquantized originals: compared with the reference
                    # of the quantized ones this would count the quantization error; report only
                    row["rel_l2_vs_dequant_ref"], row["max_abs_vs_dequant_ref"] = error_vs(out.float(), ref_w)
                    check = 0.0
                else:
                    row["rel_l2_vs_dequant_ref"], row["max_abs_vs_dequant_ref"] = error_vs(out.float(), ref_w)
                    if w8a8:
                        row["rel_l2_vs_w8a8_ref"], row["max_abs_vs_w8a8_ref"] = error_vs(out.float(), ref_c)
                    check = row["rel_l2_vs_w8a8_ref"] if w8a8 else row["rel_l2_vs_dequant_ref"]
                if not math.isfinite(check) or check > args.check_rel_l2:
                    row["status"] = f"WRONG (rel-L2 {check:.3g} > {args.check_rel_l2}): not timed"
                    rows.append(row)
                    continue
                plan = impl.plan(w_use, T, K, act_dtype=act_dtype, activation=spec["activation"])
                row["variants"] = {st.stage: st.variant for st in plan.stages}  # what ran (the options' pins too)
                if plan.tiles is not None:  # the FP4 decode path runs GEMV kernels, not tiles
                    row["tiles"] = plan.tiles.to_dict()
                if impl_name != "triton_bf16":
                    row["path"] = "gemv" if plan.path == "gemv" else "mma"
                if phase == "prefill":
                    # timed below, all impls of the point in one rotation
                    prefill_fns[impl_name] = fn
                    row["status"] = "ok"
                    rows.append(row)
                    continue
                row["eager_s"] = timers["eager"](fn)
                if phase == "decode" and timers.get("graph") is not None:
                    row["graph_s"] = timers["graph"](fn)
                best = row.get("graph_s", row["eager_s"])
                times[impl_name] = row["eager_s"]
                floor = floor_hbm if phase == "decode" else floor_cmp
                row.update(roof_frac=floor / best, status="ok")
            except Exception as exc:  # a point that cannot run says so in the table
                row["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
        if prefill_fns:
            try:
                times.update(timers["rotation"](prefill_fns))
            except Exception as exc:  # e.g. a capture that fails: the point says so
                for r in rows[-len(impls):]:
                    if r.get("impl") in prefill_fns:
                        r["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            for r in rows[-len(impls):]:
                t = times.get(r.get("impl"))
                if t is not None and r.get("status") == "ok":
                    r.update(graph_s=t, roof_frac=floor_cmp / t, timing="graph replay, round-robin with the other impls")
        if "triton_bf16" in times and "triton_quant" in times:
            for r in rows[-len(impls):]:
                if r.get("impl") == "triton_quant":
                    r["speedup_vs_bf16"] = times["triton_bf16"] / times["triton_quant"]
        if phase == "decode" and "triton_quant_bi" in times:
            # batch invariance, checked where it is timed: token 0 alone == token 0 in this batch
            alone = quant_bi.forward_tokens(x[:1], ids[:1], wts[:1], wq, cfg)
            full = quant_bi.forward_tokens(x, ids, wts, wq, cfg)
            same = bool(torch.equal(alone.view(torch.int16), full[:1].view(torch.int16)))
            for r in rows[-len(impls):]:
                if r.get("impl") == "triton_quant_bi":
                    r["bi_bitwise_vs_T1"] = same
        pts = [r for r in rows[-len(impls):]]
        msg = " ".join(f"{r['impl']} {1e6 * r.get('graph_s', r.get('eager_s', float('nan'))):.1f}us"
                       f"(roof {r.get('roof_frac', float('nan')):.2f})" if "status" in r and r["status"] == "ok"
                       else f"{r['impl']} {r.get('status', '?')[:70]}" for r in pts)
        print(f"[{time.time() - t0:6.1f}s] {name} {phase} T={T:5d} floor {1e6 * (floor_hbm if phase == 'decode' else floor_cmp):.1f}us "
              f"{msg}", flush=True)
    del wq, plain
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """One line per (shape, phase, T)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        k = (r["shape"], r["phase"], r["T"])
        s = out.setdefault(k, dict(shape=r["shape"], fmt=r["fmt"], phase=r["phase"], T=r["T"]))
        if "quant_bytes" in r:
            s["quant_MB"] = r["quant_bytes"] / 1e6
            s["floor_us"] = 1e6 * (r["floor_hbm_s"] if r["phase"] == "decode" else r["floor_compute_s"])
        if r.get("status") != "ok":
            s.setdefault("notes", []).append(f"{r.get('impl', '')}: {r.get('status', '')[:60]}")
            continue
        if r["impl"] == "triton_quant":
            if "eager_s" in r:
                s["eager_us"] = 1e6 * r["eager_s"]
            s["path"] = r.get("path", "")
            if "graph_s" in r:
                s["graph_us"] = 1e6 * r["graph_s"]
            s["roof_frac"] = r["roof_frac"]
            s["rel_l2_deq"] = r["rel_l2_vs_dequant_ref"]
            if "rel_l2_vs_w8a8_ref" in r:
                s["rel_l2_w8a8"] = r["rel_l2_vs_w8a8_ref"]
            if "speedup_vs_bf16" in r:
                s["vs_bf16"] = r["speedup_vs_bf16"]
        elif r["impl"] == "triton_quant_bi":
            s["bi_us"] = 1e6 * r.get("graph_s", r.get("eager_s", float("nan")))
            if "bi_bitwise_vs_T1" in r:
                s["bi_bitwise"] = r["bi_bitwise_vs_T1"]
        elif r["impl"] == "triton_bf16":
            s["bf16_us"] = 1e6 * r.get("graph_s", r.get("eager_s", float("nan")))
    lines = []
    for s in out.values():
        s["notes"] = "; ".join(s.get("notes", []))
        lines.append(s)
    return lines


SUMMARY_COLUMNS = ["shape", "fmt", "phase", "T", "path", "quant_MB", "floor_us", "graph_us", "eager_us", "roof_frac",
                   "bi_us", "bi_bitwise", "bf16_us", "vs_bf16", "rel_l2_deq", "rel_l2_w8a8", "notes"]


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(v) for v in s.split(",") if v.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="deepseek-v3,gpt-oss-120b")
    ap.add_argument("--decode", type=_ints, default=DECODE_TOKENS, help="decode token counts (comma list)")
    ap.add_argument("--prefill", type=_ints, default=PREFILL_TOKENS, help="prefill token counts (comma list)")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new point after this many seconds")
    ap.add_argument("--check-rel-l2", type=float, default=CHECK_REL_L2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_experts_quant_h200.json; "
                    "out/bench_experts_quant_dry.json with --dry-run)")
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--dry-run", action="store_true", help="CPU + Triton interpreter, tiny shapes, fp16")
    add_kernel_options_args(ap)
    args = ap.parse_args(argv)
    args.options = kernel_options(args)
    t0 = time.time()
    if args.no_prefill:
        args.prefill = ()
    if args.dry_run:
        patch_interpreter_index()
        patch_interpreter_fp8()
        dev, act_dtype = torch.device("cpu"), torch.float16  # the interpreter has no bf16 dot
        names = ["tiny-fp8", "tiny-mxfp4"] if args.shapes == ap.get_default("shapes") else args.shapes.split(",")
        args.decode = tuple(t for t in args.decode if t <= 8) or (1,)
        args.prefill = tuple(min(t, 64) for t in args.prefill)
        roofs = {"hbm": 20e9, "hbm_copy": 20e9, "hbm_read": 20e9, "hbm_reader": "dry run (fixed)", "compute": 200e9}
        timers = {"eager": lambda fn: time_cpu(fn, reps=2, warmup=1), "graph": None,
                  "rotation": lambda fns: {k: time_cpu(f, reps=2, warmup=1) for k, f in fns.items()}}
    else:
        if not torch.cuda.is_available():
            print("bench_experts_quant: needs CUDA (or --dry-run under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        dev, act_dtype = torch.device("cuda"), torch.bfloat16
        names = [n.strip() for n in args.shapes.split(",") if n.strip()]
        copy, read = hbm_roof_bytes_per_s(), hbm_read_roof_detail()
        roofs = {"hbm": max(copy, read["bytes_per_s"]), "hbm_copy": copy, "hbm_read": read["bytes_per_s"],
                 "hbm_reader": read["reader"], "compute": compute_roof_flops()}
        timers = {"eager": lambda fn: time_cuda(fn, reps=args.reps, warmup=3, flush=True),
                  "graph": None if args.no_graph else (lambda fn: time_cuda_graph(fn, reps=args.reps, flush=True)),
                  # prefill: every impl of a point as a CUDA graph, timed round-robin (power-cap drift)
                  "rotation": lambda fns: time_cuda_graphs_interleaved(fns, rounds=5, reps=max(1, args.reps // 5))}
    for n in names:
        if n not in SHAPES:
            raise SystemExit(f"--shapes: {n!r} unknown, expected some of {tuple(SHAPES)}")
    meta = dict(env_info(), roofs=roofs, command=" ".join(sys.argv), shapes={n: SHAPES[n] for n in names},
                check_rel_l2=args.check_rel_l2, reps=args.reps, kernel_options=options_record(args.options))
    print(f"roofs: HBM {roofs['hbm'] / 1e12:.3f} TB/s (read {roofs['hbm_read'] / 1e12:.3f} by {roofs['hbm_reader']}, copy "
          f"{roofs['hbm_copy'] / 1e12:.3f}), compute {roofs['compute'] / 1e12:.1f} TFLOP/s", flush=True)
    rows: list[dict] = []
    out_path = Path(args.out or (ROOT / "out" / "bench_experts_quant_dry.json" if args.dry_run else
                                 ROOT / "benchmarks" / "results" / "bench_experts_quant_h200.json"))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    for n in names:
        rows += bench_shape(n, SHAPES[n], args, roofs, timers, dev, act_dtype, t0)
        out_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    summary = summarize(rows)
    table = format_table(summary, SUMMARY_COLUMNS)
    head = (f"device {meta['device']}, torch {meta['torch']}, triton {meta['triton']}; HBM roof "
            f"{roofs['hbm'] / 1e12:.3f} TB/s, compute roof {roofs['compute'] / 1e12:.1f} TFLOP/s; times in us, "
            f"median of {args.reps}; decode roof_frac = quantized-bytes floor / graph time, prefill roof_frac = "
            f"compute floor / graph time (prefill impls timed round-robin in one rotation), vs_bf16 = our bf16 "
            f"TritonExperts time / ours")
    out_path.write_text(json.dumps({"meta": meta, "rows": rows, "summary": summary}, indent=1))
    if args.md:
        Path(args.md).write_text(f"{head}\n\ncommand: `{meta['command']}`\n\n{table}\n")
    print(head)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
