"""Nsight Compute driver: one hot-kernel case per process, profiled between cudaProfilerStart/Stop (GPU).

Legend: T tokens, K slots, E experts, H hidden, I intermediate per expert; "forward" = one call of
the case's entry point (router step or experts forward_tokens), all its kernel launches.

    python3 tools/ncu_kernels.py --list                      # the cases, in profiling order
    python3 tools/ncu_kernels.py CASE [--info-json PATH]     # set up, warm up, profile one forward
    python3 tools/ncu_kernels.py CASE --compile-only         # set up and warm up only (Triton's cache)
    python3 tools/ncu_kernels.py CASE --no-pdl               # the same with KernelOptions(pdl=False)
    python3 tools/ncu_kernels.py summarize OUTDIR            # ncu_*.txt in OUTDIR -> table + ncu_summary.md
    TRITON_INTERPRET=1 python3 tools/ncu_kernels.py --tiny CASE   # CPU smoke run at tiny shapes

A case builds random bf16 weights on CUDA at the real shape with the benchmarks' own builders
(tune_experts.make_weights / routing, bench_experts_quant.build_weights, bench_routing.make_inputs),
runs the forward `--warmup` times (Triton compiles here, outside the profiled range), times it with
CUDA events (L2 flushed, median of 5: the un-profiled reference for ncu's durations), then calls
cudaProfilerStart, runs the forward `--reps` times (default 1), synchronizes and calls
cudaProfilerStop. Run it under `ncu --profile-from-start off` (tools/ncu_profile.sh) so only
those launches are profiled. `--info-json` writes the case's facts (shape, T, kernel options, tiles,
bytes and FLOP of the forward, the un-profiled time, and every compiled Triton kernel's registers /
spills / shared memory) for the summary.

An experts case runs the library's defaults unless it pins a variant (Case.pin, passed as
KernelOptions(pin=...)); --no-pdl adds pdl=False (ncu_profile.sh's retry of a case that hangs under
ncu's replay with programmatic dependent launch on).

The summariser parses ncu's default text output (per kernel: "name (grid)x(block), Context ..,
Stream .." then "Section: <title>" tables of Metric Name / Metric Unit / Metric Value and OPT/INF
rule text) and prints one line per profiled kernel: duration, DRAM / memory / compute (SM)
throughput % of peak (SpeedOfLight), achieved DRAM bandwidth and L2 hit rate
(MemoryWorkloadAnalysis), tensor-pipe % (when ncu_profile.sh could add that metric), achieved /
theoretical occupancy, registers per thread, waves per SM (LaunchStats), spills (Triton's), and the
top warp stall (WarpStateStats rule text). It imports neither torch nor triton.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "experts" | "gmm" | "quant" | "router_fused" | "router_2k"
    shape: str  # a standard shape (benchmarks/common.py STANDARD_SHAPES / bench_experts_quant.SHAPES)
    T: int
    what: str
    tiny_T: int = 0  # T under --tiny (0: the same T)
    # experts cases: every token's row is one row of x (a stride-0 view: the gate_up's gathered rows always
    # hit L2), so ncu's DRAM bytes against the same case without it split weight from row traffic
    x_one_row: bool = False
    # experts cases: tune_experts.routing's distribution ("balanced": every expert T * K / E rows, so at
    # deepseek-v3 T=4096 each expert is one 128-row tile whose weights no other tile reads)
    dist: str = "uniform"
    # experts and quant cases: variants forced for this case, (stage, variant) pairs (KernelOptions.pin;
    # names in moeflow.experts.plan.VARIANTS); () runs the plan's own choice
    pin: tuple[tuple[str, str], ...] = ()

    @property
    def tiny_shape(self) -> str:
        if self.kind == "quant":
            if self.shape.endswith("-nvfp4"):
                return "tiny-nvfp4"
            return "tiny-fp8" if self.shape in ("deepseek-v3", "qwen3-30b-a3b-fp8", "qwen3-235b-a22b-fp8") else "tiny-mxfp4"
        if self.kind in ("experts", "gmm"):
            return "tiny-gptoss" if self.shape == "gpt-oss-120b" else "tiny-silu"
        return self.shape  # router: the real spec and E, H cut down (see _router_inputs)

    def options(self, *, tiny: bool, pdl: bool = True):
        """The KernelOptions of the case's experts. Under --tiny a pinned case asks for TMA (the
        interpreter runs TMA kernels only when asked; the pinned variants are TMA ones)."""
        from moeflow.experts.options import KernelOptions

        return KernelOptions(tma=True if (tiny and self.pin) else None, pdl=None if pdl else False,
                             pin=dict(self.pin))


# In profiling order (a run cut short by its time budget loses the last): the bf16 expert kernels,
# the router step (cheap), then the quantized experts (the heaviest setups).
CASES: tuple[Case, ...] = (
    Case("experts_decode_t1_qwen3", "experts", "qwen3-30b-a3b", 1,
         "TritonExperts() default path, T=1 (align, gate_up, down, combine)"),
    Case("experts_decode_t8_qwen3", "experts", "qwen3-30b-a3b", 8, "TritonExperts() default path, T=8"),
    Case("experts_decode_t1_gpt_oss", "experts", "gpt-oss-120b", 1,
         "TritonExperts() default path, T=1, gpt-oss (matmul layout, interleaved, biases, clamp)"),
    Case("experts_prefill_t8192_qwen3", "experts", "qwen3-30b-a3b", 8192,
         "TritonExperts() T=8192 (multi-kernel alignment)", tiny_T=64),
    Case("experts_prefill_t8192_mixtral", "experts", "mixtral-8x7b", 8192, "TritonExperts() T=8192", tiny_T=64),
    Case("experts_prefill_t2048_deepseek_v3", "experts", "deepseek-v3", 2048, "TritonExperts() T=2048",
         tiny_T=64),
    Case("experts_prefill_t8192_deepseek_v3", "experts", "deepseek-v3", 8192, "TritonExperts() T=8192", tiny_T=64),
    Case("experts_prefill_t2048_mixtral", "experts", "mixtral-8x7b", 2048, "TritonExperts() T=2048", tiny_T=64),
    Case("experts_prefill_t512_gpt_oss", "experts", "gpt-oss-120b", 512, "TritonExperts() T=512, gpt-oss",
         tiny_T=64),
    Case("experts_prefill_t8192_gpt_oss", "experts", "gpt-oss-120b", 8192, "TritonExperts() T=8192, gpt-oss",
         tiny_T=64),
    Case("experts_prefill_t8192_ds_v41", "experts", "ds-v4.1-like", 8192, "TritonExperts() T=8192, ds-v4.1-like",
         tiny_T=64),
    Case("experts_prefill_t2048_qwen3", "experts", "qwen3-30b-a3b", 2048, "TritonExperts() T=2048", tiny_T=64),
    # torch's grouped GEMM (CUTLASS's sm90 grouped kernel) at the same points: what another existing
    # kernel's tensor pipe reaches there
    Case("gmm_prefill_t8192_qwen3", "gmm", "qwen3-30b-a3b", 8192,
         "torch grouped_mm gate_up + act + down on rows pre-sorted by expert, T=8192", tiny_T=64),
    Case("gmm_prefill_t8192_deepseek_v3", "gmm", "deepseek-v3", 8192,
         "torch grouped_mm gate_up + act + down on rows pre-sorted by expert, T=8192", tiny_T=64),
    # x one row (x_one_row): which operand the kernels re-read from DRAM, weights or activation rows
    Case("experts_prefill_t8192_deepseek_v3_x1", "experts", "deepseek-v3", 8192,
         "as experts_prefill_t8192_deepseek_v3, every token the same row of x", tiny_T=64, x_one_row=True),
    # balanced routing (Case.dist): every expert exactly 128 (T=4096) or 256 (T=8192) rows, no padding: the
    # kernels' own speed, each weight read once
    Case("experts_prefill_t4096_deepseek_v3_bal", "experts", "deepseek-v3", 4096,
         "TritonExperts() T=4096, balanced routing (128 rows an expert)", tiny_T=64, dist="balanced"),
    Case("experts_prefill_t8192_deepseek_v3_bal", "experts", "deepseek-v3", 8192,
         "TritonExperts() T=8192, balanced routing (256 rows an expert)", tiny_T=64, dist="balanced"),
    Case("experts_prefill_t8192_deepseek_v3_zipf_x1", "experts", "deepseek-v3", 8192,
         "TritonExperts() T=8192, Zipf routing, every token the same row of x", tiny_T=64, dist="zipf",
         x_one_row=True),
    # Zipf routing (tune_experts.routing's "zipf"): its padding and its few hot experts (many 128-row tiles
    # of one expert) against the uniform cases above
    Case("experts_prefill_t8192_qwen3_zipf", "experts", "qwen3-30b-a3b", 8192, "TritonExperts() T=8192, Zipf routing",
         tiny_T=64, dist="zipf"),
    Case("experts_prefill_t8192_deepseek_v3_zipf", "experts", "deepseek-v3", 8192,
         "TritonExperts() T=8192, Zipf routing", tiny_T=64, dist="zipf"),
    Case("experts_prefill_t8192_gpt_oss_zipf", "experts", "gpt-oss-120b", 8192, "TritonExperts() T=8192, Zipf routing",
         tiny_T=64, dist="zipf"),
    Case("experts_prefill_t8192_ds_v41_zipf", "experts", "ds-v4.1-like", 8192, "TritonExperts() T=8192, Zipf routing",
         tiny_T=64, dist="zipf"),
    Case("experts_prefill_t8192_mixtral_zipf", "experts", "mixtral-8x7b", 8192, "TritonExperts() T=8192, Zipf routing",
         tiny_T=64, dist="zipf"),
    Case("experts_prefill_t2048_mixtral_zipf", "experts", "mixtral-8x7b", 2048, "TritonExperts() T=2048, Zipf routing",
         tiny_T=64, dist="zipf"),
    # the gate_up's rows copied into pair order and read by TMA (variant tma_gather_x), pinned: the plan takes it
    # at mixtral T=8192 by its rule (moeflow.tuning.rules gather_x_*); at T=2048 the pointer-gathered gate_up is
    # L1/L2-bound, and these two cases show what the copy changes there
    Case("experts_prefill_t8192_mixtral_zipf_gx", "experts", "mixtral-8x7b", 8192,
         "TritonExperts() T=8192, Zipf routing, gate_up pinned to tma_gather_x", tiny_T=64, dist="zipf",
         pin=(("gate_up", "tma_gather_x"),)),
    Case("experts_prefill_t2048_mixtral_gx", "experts", "mixtral-8x7b", 2048,
         "TritonExperts() T=2048, gate_up pinned to tma_gather_x", tiny_T=64, pin=(("gate_up", "tma_gather_x"),)),
    Case("experts_prefill_t2048_qwen3_zipf", "experts", "qwen3-30b-a3b", 2048, "TritonExperts() T=2048, Zipf routing",
         tiny_T=64, dist="zipf"),
    Case("experts_prefill_t2048_deepseek_v3_zipf", "experts", "deepseek-v3", 2048,
         "TritonExperts() T=2048, Zipf routing", tiny_T=64, dist="zipf"),
    Case("experts_prefill_t2048_gpt_oss", "experts", "gpt-oss-120b", 2048, "TritonExperts() T=2048, gpt-oss",
         tiny_T=64),
    Case("experts_prefill_t2048_gpt_oss_zipf", "experts", "gpt-oss-120b", 2048,
         "TritonExperts() T=2048, gpt-oss, Zipf routing", tiny_T=64, dist="zipf"),
    Case("experts_prefill_t2048_ds_v41", "experts", "ds-v4.1-like", 2048, "TritonExperts() T=2048, ds-v4.1-like",
         tiny_T=64),
    Case("experts_prefill_t2048_ds_v41_zipf", "experts", "ds-v4.1-like", 2048,
         "TritonExperts() T=2048, ds-v4.1-like, Zipf routing", tiny_T=64, dist="zipf"),
    Case("experts_decode_t1_ds_v41", "experts", "ds-v4.1-like", 1, "TritonExperts() default path, T=1, ds-v4.1-like"),
    Case("router_fused_t1_deepseek_v3", "router_fused", "deepseek-v3", 1,
         "router_step_cuda(fused=True) T=1: one launch (GEMM partials + last-program select)"),
    Case("router_fused_t1_qwen3", "router_fused", "qwen3-30b-a3b", 1, "router_step_cuda(fused=True) T=1"),
    Case("router_2k_t8_deepseek_v3", "router_2k", "deepseek-v3", 8,
         "router_step_cuda(fused=False) T=8: logits GEMM + selection kernel"),
    Case("quant_mxfp4_gemv_t1_gpt_oss", "quant", "gpt-oss-120b", 1,
         "TritonQuantExperts MXFP4 W4A16, T=1 (the GEMV path)"),
    Case("quant_mxfp4_gemv_t8_gpt_oss", "quant", "gpt-oss-120b", 8,
         "TritonQuantExperts MXFP4 W4A16, T=8 (the GEMV path, 32 pairs)"),
    *(Case(f"quant_mxfp4_gemv_t{t}_gpt_oss", "quant", "gpt-oss-120b", t,
           f"TritonQuantExperts MXFP4 W4A16, T={t} (the GEMV path)") for t in (2, 4, 16, 32)),
    Case("quant_mxfp4_t64_gpt_oss", "quant", "gpt-oss-120b", 64, "TritonQuantExperts MXFP4 W4A16, T=64 (the MMA path)"),
    Case("quant_mxfp4_prefill_t8192_gpt_oss", "quant", "gpt-oss-120b", 8192,
         "TritonQuantExperts MXFP4 W4A16, T=8192", tiny_T=64),
    # NVFP4 (ModelOpt layout) at deepseek-v3's layer
    Case("quant_nvfp4_gemv_t1_deepseek_v3", "quant", "deepseek-v3-nvfp4", 1,
         "TritonQuantExperts NVFP4 W4A16, T=1 (the GEMV path)"),
    Case("quant_nvfp4_t64_deepseek_v3", "quant", "deepseek-v3-nvfp4", 64,
         "TritonQuantExperts NVFP4 W4A16, T=64 (the MMA path)"),
    *(Case(f"quant_nvfp4_gemv_t{t}_deepseek_v3", "quant", "deepseek-v3-nvfp4", t,
           f"TritonQuantExperts NVFP4 W4A16, T={t} (the GEMV path)") for t in (2, 8, 16, 4)),
    Case("quant_fp8_decode_t1_deepseek_v3", "quant", "deepseek-v3", 1,
         "TritonQuantExperts(fp8=True) FP8 block W8A8, T=1"),
    Case("quant_fp8_prefill_t8192_deepseek_v3", "quant", "deepseek-v3", 8192,
         "TritonQuantExperts(fp8=True) FP8 block W8A8, T=8192", tiny_T=64),
    Case("quant_fp8_decode_t2_deepseek_v3", "quant", "deepseek-v3", 2,
         "TritonQuantExperts(fp8=True) FP8 block W8A8, T=2"),
    Case("quant_fp8_prefill_t8192_qwen3", "quant", "qwen3-30b-a3b-fp8", 8192,
         "TritonQuantExperts(fp8=True) FP8 block W8A8, T=8192, qwen3", tiny_T=64),
    Case("quant_fp8_prefill_t8192_qwen3_235b", "quant", "qwen3-235b-a22b-fp8", 8192,
         "TritonQuantExperts(fp8=True) FP8 block W8A8, T=8192, qwen3-235b", tiny_T=64),
    # the same with the Triton fp8 gate_up pinned (the plan takes the Gluon one from H = 4096; the two are level
    # in time there). Under ncu's kernel replay with PDL on, the Gluon gate_up at this shape can hang
    # (ncu_profile.sh then retries with --no-pdl); this case profiles the shape without it.
    Case("quant_fp8tri_prefill_t8192_qwen3_235b", "quant", "qwen3-235b-a22b-fp8", 8192,
         "TritonQuantExperts(fp8=True), gate_up pinned to fp8_tma (Triton), T=8192, qwen3-235b", tiny_T=64,
         pin=(("gate_up", "fp8_tma"),)),
)
CASE_BY_NAME = {c.name: c for c in CASES}
TINY_ROUTER_H = 256  # router hidden size under --tiny (the interpreter is slow)


# --------------------------------------------------------------------------- setup (torch from here on)
def _compiled_triton_kernels() -> list[dict]:
    """Every Triton kernel compiled in this process (moeflow.kernels.*): name, registers, spills, smem."""
    out = []
    for mod_name, mod in sorted(sys.modules.items()):
        if not mod_name.startswith("moeflow.kernels") or mod is None:
            continue
        for attr in vars(mod).values():
            fn = attr
            for _ in range(4):  # Autotuner / Heuristics wrappers hold the JITFunction in .fn
                if hasattr(fn, "device_caches") or not hasattr(fn, "fn"):
                    break
                fn = fn.fn
            caches = getattr(fn, "device_caches", None)
            if not isinstance(caches, dict):
                continue
            for entry in list(caches.values()):
                kernel_cache = entry[0] if isinstance(entry, tuple) else {}
                for k in list(kernel_cache.values()):
                    md = getattr(k, "metadata", None)
                    out.append(dict(name=getattr(k, "name", getattr(fn, "__name__", "?")),
                                    n_regs=getattr(k, "n_regs", None), n_spills=getattr(k, "n_spills", None),
                                    num_warps=getattr(md, "num_warps", None),
                                    num_stages=getattr(md, "num_stages", None),
                                    shared_bytes=getattr(md, "shared", None)))
    return out


def _env() -> dict:
    """Date, device and versions (benchmarks.common.env_info without importing transformers: slow)."""
    import datetime
    import importlib.metadata as md

    import torch

    info = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                torch=torch.__version__, device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    try:
        info["triton"] = md.version("triton")
    except md.PackageNotFoundError:
        info["triton"] = "not installed"
    return info


def _expert_inputs(case: Case, tiny: bool, dev) -> dict:
    """The bf16 experts' inputs of a case (f32 under --tiny: the interpreter has no bf16 dot): its shape's
    spec, weights, config, uniform routing (seed 0), x, and the facts every experts case reports."""
    import torch

    from benchmarks.tune_experts import make_config, make_weights, routing, shape_spec

    spec = shape_spec(case.tiny_shape if tiny else case.shape)
    dtype = torch.float32 if tiny else torch.bfloat16
    T = (case.tiny_T or case.T) if tiny else case.T
    E, K, H, I = spec["E"], spec["K"], spec["H"], spec["I"]
    w = make_weights(spec, dev, dtype=dtype)
    ids, wts = routing(T, E, K, case.dist, dev, seed=0)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dev, dtype)
    if case.x_one_row:  # [T, H] view of one row (stride 0): the experts accept it (unit stride along H)
        x = x[:1].expand(T, H)
    n_distinct = int(torch.unique(ids).numel())
    bias_el = (2 * I + H) if spec["bias"] else 0
    facts = dict(shape=spec["name"], T=T, E=E, K=K, H=H, I=I, dtype=str(dtype), distinct_experts=n_distinct,
                 bytes=n_distinct * (3 * H * I + bias_el) * w.dtype.itemsize
                 + ((1 if case.x_one_row else T) + T) * H * w.dtype.itemsize,  # x read, y written
                 flops=2 * 3 * H * I * T * K, x_one_row=case.x_one_row, routing=case.dist)
    return dict(spec=spec, w=w, cfg=make_config(spec), ids=ids, wts=wts, x=x, facts=facts)


def _options_facts(options) -> dict:
    return dict(options=dict(tma=options.tma, pdl=options.pdl, fast_launch=options.fast_launch,
                             pin=dict(options.pin)))


def _plan_facts(impl, w, K: int, T: int, info: dict, *, act_dtype, activation: str) -> None:
    """What the case's forward launches, from the impl's KernelPlan (`impl.plan(...)`: path, each stage's
    variant, tiles, its explain() text) into info: facts, never a reason not to profile."""
    try:
        plan = impl.plan(w, T, K, act_dtype=act_dtype, activation=activation)
        info["path"] = plan.path
        info["variants"] = {st.stage: st.variant for st in plan.stages}
        if plan.tiles is not None:
            info["tiles"] = plan.tiles.to_dict()
        info["plan"] = plan.explain()
    except Exception as e:  # a fact we could not get is reported, not fatal
        info["plan_error"] = f"{type(e).__name__}: {e}"[:200]


def _setup_experts(case: Case, tiny: bool, dev, pdl: bool = True):
    from moeflow.experts.triton import TritonExperts

    a = _expert_inputs(case, tiny, dev)
    x, ids, wts, w, cfg = a["x"], a["ids"], a["wts"], a["w"], a["cfg"]
    T, K = a["facts"]["T"], a["facts"]["K"]
    options = case.options(tiny=tiny, pdl=pdl)
    impl = TritonExperts(allow_cpu=tiny, options=options)
    info = dict(impl=repr(impl), **a["facts"], **_options_facts(options))
    _plan_facts(impl, w, K, T, info, act_dtype=x.dtype, activation=a["spec"]["activation"])

    def fn():
        return impl.forward_tokens(x, ids, wts, w, cfg)

    return fn, info


def _setup_gmm(case: Case, tiny: bool, dev, pdl: bool = True):
    import torch

    from benchmarks.bench_experts import torch_gmm_runner

    a = _expert_inputs(case, tiny, dev)
    runner, why = torch_gmm_runner(a["x"], a["ids"], a["w"], a["cfg"])
    if runner is None:
        raise SystemExit(f"ncu_kernels: {case.name}: torch grouped_mm unusable: {why}")
    # the rows are already sorted by expert: x's bytes are read once, as by our step
    info = dict(impl=f"torch grouped_mm (torch {torch.__version__})", **a["facts"], path="grouped_mm")
    return runner[0], info


def _setup_quant(case: Case, tiny: bool, dev, pdl: bool = True):
    import torch

    from benchmarks.bench_experts_quant import SHAPES, build_weights
    from benchmarks.tune_experts import routing
    from moeflow.experts.triton_quant import TritonQuantExperts

    name = case.tiny_shape if tiny else case.shape
    spec = SHAPES[name]
    act_dtype = torch.float16 if tiny else torch.bfloat16  # the interpreter has no bf16 dot
    T = (case.tiny_T or case.T) if tiny else case.T
    E, K, H, I = spec["E"], spec["K"], spec["H"], spec["I"]
    cfg, wq, plain = build_weights(spec, dev, act_dtype, seed=0)
    del plain  # only the quantized bytes stay resident
    ids, wts = routing(T, E, K, "uniform", dev, seed=0)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dev, act_dtype)
    options = case.options(tiny=tiny, pdl=pdl)
    # under --tiny the CPU's tiles are 16-row ones, which keep the pointer kernels: a case pinning a TMA
    # variant forces 64-row tiles there so the pinned kernel is what runs
    tiles = _tiny_tma_tiles() if (tiny and case.pin) else None
    impl = TritonQuantExperts(allow_cpu=tiny, fp8=True, options=options, tile_config=tiles)
    n_distinct = int(torch.unique(ids).numel())
    info = dict(impl=repr(impl), shape=name, fmt=spec["fmt"], T=T, E=E, K=K, H=H, I=I, dtype=str(act_dtype),
                distinct_experts=n_distinct,
                bytes=n_distinct * wq.expert_bytes + 2 * T * H * x.element_size(), flops=2 * 3 * H * I * T * K,
                **_options_facts(options))
    _plan_facts(impl, wq, K, T, info, act_dtype=act_dtype, activation=spec["activation"])

    def fn():
        return impl.forward_tokens(x, ids, wts, wq, cfg)

    return fn, info


def _tiny_tma_tiles():
    """64-row tiles the TMA fp8 GEMMs take at the tiny shapes (one stage: the interpreter)."""
    from moeflow.tuning import GemmTile, MoETileConfig

    t = GemmTile(block_n=128, block_k=128, num_stages=1)
    return MoETileConfig(block_m=64, gate_up=t, down=t)


def _router_inputs(shape: str, T: int, tiny: bool, dev):
    """bench_routing.make_inputs (bf16, the real H); under --tiny its first TINY_ROUTER_H columns in f32."""
    from benchmarks.bench_routing import make_inputs

    x, w, bias, rbias = make_inputs(shape, T, str(dev), seed=T)
    if tiny:
        x = x[:, :TINY_ROUTER_H].float().contiguous()
        w = w[:, :TINY_ROUTER_H].float().contiguous()
    return x, w, bias, rbias


def _setup_router(case: Case, tiny: bool, dev, pdl: bool = True):
    from benchmarks.bench_routing import shape_spec as router_spec
    from moeflow.routing import gpu

    spec = router_spec(case.shape)
    T = case.T
    x, w, bias, rbias = _router_inputs(case.shape, T, tiny, dev)
    fused = case.kind == "router_fused"
    E, H = int(w.shape[0]), int(w.shape[1])
    info = dict(shape=case.shape, T=T, E=E, H=H, K=spec.top_k, dtype=str(x.dtype), fused=fused,
                split=gpu.logits_config(E, H, False).split if hasattr(gpu, "logits_config") else None,
                bytes=E * H * w.element_size() + T * H * x.element_size(), flops=2 * T * E * H)

    def fn():
        return gpu.router_step_cuda(x, w, spec, router_bias=rbias, bias=bias, fused=fused)

    return fn, info


SETUP = {"experts": _setup_experts, "gmm": _setup_gmm, "quant": _setup_quant, "router_fused": _setup_router,
         "router_2k": _setup_router}


def run_case(case: Case, *, tiny: bool, warmup: int, reps: int, info_json: str | None, time_reps: int,
             compile_only: bool = False, pdl: bool = True) -> int:
    import torch

    t0 = time.time()
    if tiny:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("ncu_kernels: --tiny runs the kernels under the Triton interpreter: set TRITON_INTERPRET=1",
                  file=sys.stderr)
            return 2
        from benchmarks.bench_experts_quant import patch_interpreter_fp8
        from benchmarks.tune_experts import patch_interpreter_index

        patch_interpreter_index()
        patch_interpreter_fp8()
        dev = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("ncu_kernels: needs CUDA (or --tiny under TRITON_INTERPRET=1)", file=sys.stderr)
            return 2
        dev = torch.device("cuda")
    fn, info = SETUP[case.kind](case, tiny, dev, pdl)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # builders' temporaries: ncu saves the memory a kernel can reach
    t_setup = time.time() - t0
    for _ in range(max(1, warmup)):  # the first call compiles (Triton), outside the profiled range
        out = fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t_warm = time.time() - t0 - t_setup
    if compile_only:
        print(f"ncu_kernels: {case.name} compiled (setup {t_setup:.1f}s, warmup {t_warm:.1f}s)", flush=True)
        return 0
    info.update(case=case.name, kind=case.kind, what=case.what, tiny=tiny, setup_s=round(t_setup, 2),
                warmup_s=round(t_warm, 2), reps_profiled=reps)
    if dev.type == "cuda":
        from benchmarks.common import time_cuda

        if time_reps > 0:
            info["time_us"] = 1e6 * time_cuda(fn, reps=time_reps, warmup=0, flush=True)
        info["env"] = _env()
        try:
            info["triton_kernels"] = _compiled_triton_kernels()
        except Exception as e:  # Triton internals: a fact we could not get is reported, not fatal
            info["triton_kernels_error"] = f"{type(e).__name__}: {e}"[:200]
        torch.cuda.synchronize()
        torch.cuda.profiler.start()  # cudaProfilerStart: ncu --profile-from-start off begins here
        for _ in range(reps):
            out = fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    else:
        for _ in range(reps):
            out = fn()
    if hasattr(out, "fused"):
        info["fused_ran"] = bool(out.fused)  # the router step says which path it took
    res = out.routing.ids_TK if hasattr(out, "routing") else out
    info["output_finite"] = bool(torch.isfinite(res.float()).all()) if res.dtype.is_floating_point else True
    info["total_s"] = round(time.time() - t0, 2)
    if info_json:
        Path(info_json).parent.mkdir(parents=True, exist_ok=True)
        Path(info_json).write_text(json.dumps(info, indent=1, default=str))
    extra = f" path={info['path']}" if "path" in info else ""
    t_us = f" time {info['time_us']:.1f}us" if "time_us" in info else ""
    print(f"ncu_kernels: {case.name}{extra} T={info['T']} setup {t_setup:.1f}s warmup {t_warm:.1f}s{t_us} "
          f"total {info['total_s']:.1f}s output_finite={info['output_finite']}", flush=True)
    if tiny:
        print(f"PASS {case.name}")
    return 0


# --------------------------------------------------------------------------- ncu text parsing (no torch)
_KERNEL_RE = re.compile(r"^\s*(?P<name>\S.*?) \((?P<grid>\d+, \d+, \d+)\)x\((?P<block>\d+, \d+, \d+)\), "
                        r"Context (?P<ctx>\d+), Stream (?P<stream>\d+)")
_SECTION_RE = re.compile(r"^\s*Section: (?P<title>.+?)\s*$")
_DASHES_RE = re.compile(r"^\s*-{3,}( +-{3,})+\s*$")
_RULE_RE = re.compile(r"^\s*(OPT|INF|WRN|ERR)\s{2,}(.*)$")
_TIME_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6,
            "second": 1e6}
_RATE_GBPS = {"byte/s": 1e-9, "Kbyte/s": 1e-6, "Mbyte/s": 1e-3, "Gbyte/s": 1.0, "Tbyte/s": 1e3,
              "byte/second": 1e-9, "Kbyte/second": 1e-6, "Mbyte/second": 1e-3, "Gbyte/second": 1.0,
              "Tbyte/second": 1e3}


def _num(v: str) -> float | None:
    v = v.strip().replace(",", "")
    try:
        return float(v)
    except ValueError:
        return None


def _spans(dash_line: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"-+", dash_line)]


def _row(line: str, spans: list[tuple[int, int]]) -> tuple[str, str, str] | None:
    """(name, unit, value) of a table row, by the columns of its dash line (units and names may be blank)."""
    if len(spans) >= 3 and len(line) >= spans[2][0]:
        name = line[spans[0][0]: spans[1][0]].strip()
        unit = line[spans[1][0]: spans[2][0]].strip()
        value = line[spans[2][0]:].strip()
        if name and value and " " not in value:
            return name, unit, value
    parts = re.split(r"\s{2,}", line.strip())  # fallback: columns split by runs of spaces
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    if len(parts) == 2:
        return parts[0], "", parts[1]
    return None


def parse_ncu_text(text: str) -> list[dict]:
    """Kernels of one ncu text report: [{name, grid, block, sections: {title: {metric: (unit, value)}},
    rules: {title: [rule text]}}], in launch order."""
    kernels: list[dict] = []
    cur = None
    section = None
    spans: list[tuple[int, int]] = []
    dash_count = 0  # dash lines seen in this section: header after the 1st, rows after the 2nd, end at the 3rd
    rule = None  # the rule (OPT/INF text) being read; once one starts, the section's tables are over
    in_rules = False
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.startswith("=="):  # ==PROF== / ==WARNING== / ==ERROR== lines of ncu itself
            continue
        m = _KERNEL_RE.match(line)
        if m:
            cur = dict(name=m["name"].strip(), grid=m["grid"], block=m["block"], sections={}, rules={})
            kernels.append(cur)
            section, rule, in_rules, dash_count = None, None, False, 0
            continue
        if cur is None:
            continue
        m = _SECTION_RE.match(line)
        if m:
            section = m["title"]
            cur["sections"].setdefault(section, {})
            rule, in_rules, dash_count = None, False, 0
            continue
        if section is None:
            continue
        m = _RULE_RE.match(line)
        if m:
            rule, in_rules = [m.group(2).strip()], True
            cur["rules"].setdefault(section, []).append(rule)
            continue
        if in_rules:
            if rule is not None and line.strip() and not _DASHES_RE.match(line):
                rule.append(line.strip())  # a rule's continuation line
            continue
        if _DASHES_RE.match(line):
            dash_count += 1
            spans = _spans(line)
            continue
        if dash_count % 3 == 2 and line.strip():
            r = _row(line, spans)
            if r and r[0] != "Metric Name":
                cur["sections"][section][r[0]] = (r[1], r[2])
    for k in kernels:
        k["rules"] = {s: [" ".join(parts) for parts in rs] for s, rs in k["rules"].items()}
    return kernels


def _metric(k: dict, section_prefix: str, name: str) -> tuple[str, str] | None:
    for title, rows in k["sections"].items():
        if title.startswith(section_prefix) and name in rows:
            return rows[name]
    return None


def _pct(k: dict, section_prefix: str, name: str) -> float | None:
    m = _metric(k, section_prefix, name)
    return _num(m[1]) if m else None


def _any_metric(k: dict, prefix: str) -> float | None:
    """The first metric whose name starts with prefix, in any section (--metrics ones land in
    "Command line profiler metrics")."""
    for rows in k["sections"].values():
        for name, (_unit, value) in rows.items():
            if name.startswith(prefix):
                return _num(value)
    return None


# ncu's byte units -> GB
_BYTES_GB = {"byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0, "Tbyte": 1e3}


def _bytes_gb(k: dict, name: str) -> float | None:
    """A byte-count metric (--metrics, e.g. dram__bytes_read.sum) in GB, in any section."""
    for rows in k["sections"].values():
        if name in rows:
            unit, value = rows[name]
            v = _num(value)
            return v * _BYTES_GB[unit] if v is not None and unit in _BYTES_GB else None
    return None


def short_name(name: str) -> str:
    """A kernel's short name: Triton kernels keep theirs; C++ ones lose return type, namespaces,
    template arguments and parameters (void at::native::foo<...>(...) -> foo)."""
    n = re.sub(r"^void\s+", "", name.strip()).replace("(anonymous namespace)::", "")
    n = re.split(r"[<(]", n, maxsplit=1)[0]
    parts = [p for p in n.split("::") if p.strip()]
    return parts[-1].strip() if parts else name[:40]


def _top_stall(k: dict) -> str:
    for title, rules in k["rules"].items():
        if not title.startswith("Warp State"):
            continue
        for r in rules:
            m = re.search(r"spends ([\d.,]+) cycles being stalled (.+?)(?:\. |\.$)", r)
            if m:
                share = re.search(r"represents about ([\d.]+)% of the total", r)
                what = m.group(2)
                what = re.sub(r"^(waiting for|waiting on|on)\s+", "", what)
                return f"{what[:70]} ({m.group(1)} cyc" + (f", {share.group(1)}%)" if share else ")")
    return ""


def kernel_row(case: str, k: dict, spills: dict[str, int]) -> dict:
    dur = _metric(k, "GPU Speed Of Light", "Duration")
    dur_us = _num(dur[1]) * _TIME_US.get(dur[0], float("nan")) if dur and _num(dur[1]) is not None else None
    bw = _metric(k, "Memory Workload Analysis", "Memory Throughput")
    bw_gbps = _num(bw[1]) * _RATE_GBPS[bw[0]] if bw and bw[0] in _RATE_GBPS and _num(bw[1]) is not None else None
    tensor = [v for v in (_any_metric(k, "sm__pipe_tensor_op_gmma_cycles_active"),
                          _any_metric(k, "sm__pipe_tensor_op_hmma_cycles_active")) if v is not None]
    short = short_name(k["name"])
    row = dict(
        case=case, kernel=short, grid=k["grid"].replace(" ", ""), block=k["block"].split(",")[0],
        duration_us=dur_us,
        dram_pct=_pct(k, "GPU Speed Of Light", "DRAM Throughput"),
        mem_pct=_pct(k, "GPU Speed Of Light", "Memory Throughput"),
        sm_pct=_pct(k, "GPU Speed Of Light", "Compute (SM) Throughput"),
        tensor_pct=max(tensor) if tensor else None,
        dram_GBps=bw_gbps,
        dram_read_GB=_bytes_gb(k, "dram__bytes_read.sum"),
        dram_write_GB=_bytes_gb(k, "dram__bytes_write.sum"),
        l2_hit_pct=_pct(k, "Memory Workload Analysis", "L2 Hit Rate"),
        occ_achieved_pct=_pct(k, "Occupancy", "Achieved Occupancy"),
        occ_theoretical_pct=_pct(k, "Occupancy", "Theoretical Occupancy"),
        regs=_pct(k, "Launch Statistics", "Registers Per Thread"),
        spills=spills.get(short),
        waves=_pct(k, "Launch Statistics", "Waves Per SM"),
        smem_KB=_smem_kb(k),
        top_stall=_top_stall(k),
    )
    row["limiter"] = limiter(row)
    return row


def limiter(r: dict) -> str:
    """A first reading of SpeedOfLight (ncu's own rule of thumb: a unit >= 60% of peak bounds the kernel;
    all < 40%: latency): DRAM / L1-L2 / compute-bound, else latency with its most likely cause."""
    d, m, s = r.get("dram_pct"), r.get("mem_pct"), r.get("sm_pct")
    if d is None or m is None or s is None:
        return ""
    if max(d, m, s) >= 60:
        if s >= m:
            t = r.get("tensor_pct")
            return "compute" + (f" (tensor {t:.0f}%)" if t is not None else "")
        return "DRAM" if d >= m - 5 else "L1/L2"
    if max(d, m, s) >= 40:
        return "mixed (no unit >= 60%)"
    waves, occ = r.get("waves"), r.get("occ_achieved_pct")
    if waves is not None and waves < 1:
        return f"latency: {waves:.2g} waves"
    if occ is not None and occ < 25:
        return f"latency: occupancy {occ:.0f}%"
    return "latency: stalls"


def _smem_kb(k: dict) -> float | None:
    m = _metric(k, "Launch Statistics", "Dynamic Shared Memory Per Block")
    if not m or _num(m[1]) is None:
        return None
    scale = {"byte/block": 1e-3, "Kbyte/block": 1.0, "Mbyte/block": 1e3}.get(m[0])
    return _num(m[1]) * scale if scale else None


COLUMNS = ["case", "kernel", "grid", "block", "duration_us", "limiter", "dram_pct", "mem_pct", "sm_pct", "tensor_pct",
           "dram_GBps", "dram_read_GB", "dram_write_GB", "l2_hit_pct", "occ_achieved_pct", "occ_theoretical_pct", "regs", "spills", "waves",
           "smem_KB", "top_stall"]


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if not math.isfinite(v):
            return ""
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v).replace("|", "/")


def _status_of(outdir: Path) -> dict[str, dict]:
    """ncu_runs.tsv (written by ncu_profile.sh): case -> {rc, wall_s, note}."""
    out = {}
    p = outdir / "ncu_runs.tsv"
    if p.exists():
        for line in p.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 3 and parts[0] != "case":
                out[parts[0]] = dict(rc=parts[1], wall_s=parts[2], note=parts[3] if len(parts) > 3 else "")
    return out


def summarize(outdir: str | Path, *, quiet: bool = False) -> list[dict]:
    """Parse OUTDIR/ncu_*.txt; print the table; write OUTDIR/ncu_summary.md. Returns the kernel rows."""
    outdir = Path(outdir)
    status = _status_of(outdir)
    rows: list[dict] = []
    case_lines: list[str] = []
    txts = {p.stem[len("ncu_"):]: p for p in outdir.glob("ncu_*.txt") if p.stem != "ncu_version"}
    order = [c.name for c in CASES if c.name in txts or c.name in status]
    order += sorted(n for n in set(txts) | set(status) if n not in order)
    for case in order:
        info = {}
        ip = outdir / f"info_{case}.json"
        if ip.exists():
            try:
                info = json.loads(ip.read_text())
            except ValueError:
                info = {}
        spills: dict[str, int] = {}
        for tk in info.get("triton_kernels", []):
            if tk.get("n_spills") is not None:
                spills[tk["name"]] = max(spills.get(tk["name"], 0), int(tk["n_spills"]))
        kernels = parse_ncu_text(txts[case].read_text(errors="replace")) if case in txts else []
        krows = [kernel_row(case, k, spills) for k in kernels]
        rows += krows
        st = status.get(case, {})
        total = sum(r["duration_us"] for r in krows if r["duration_us"] is not None)
        bits = [f"**{case}**"]
        for key in ("shape", "fmt", "T", "path", "distinct_experts"):
            if key in info:
                bits.append(f"{key}={info[key]}")
        if info.get("variants"):
            bits.append("variants " + ",".join(f"{k}={v}" for k, v in info["variants"].items()))
        if st:
            bits.append(f"rc={st['rc']} wall={st['wall_s']}s" + (f" ({st['note']})" if st.get("note") else ""))
        bits.append(f"{len(krows)} kernels, sum of ncu durations {total:.1f} us")
        if info.get("time_us"):
            bits.append(f"un-profiled forward {info['time_us']:.1f} us (CUDA events, L2 flushed)")
        if total > 0 and info.get("bytes"):
            bits.append(f"{info['bytes'] / (total * 1e-6) / 1e9:.0f} GB/s of weights+io")
        if total > 0 and info.get("flops"):
            bits.append(f"{info['flops'] / (total * 1e-6) / 1e12:.1f} TFLOP/s")
        if info.get("tiles"):
            bits.append(f"tiles `{json.dumps(info['tiles'], separators=(',', ':'))}`")
        if not krows and case in txts:
            errs = [ln.strip() for ln in txts[case].read_text(errors="replace").splitlines()
                    if "==ERROR==" in ln or "==WARNING==" in ln or "Error" in ln][:3]
            if errs:
                bits.append("ncu: " + " / ".join(e[:160] for e in errs))
        case_lines.append("- " + "; ".join(bits))
    head = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table = head + ["| " + " | ".join(_cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    ver = (outdir / "ncu_version.txt").read_text().strip() if (outdir / "ncu_version.txt").exists() else "?"
    gpu = (outdir / "gpu.txt").read_text().strip().splitlines() if (outdir / "gpu.txt").exists() else []
    legend = ("duration from SpeedOfLight (replayed under ncu, clocks not locked, caches flushed per pass); "
              "limiter = a first reading of SpeedOfLight (a unit >= 60% of peak bounds the kernel: DRAM, L1/L2 or "
              "compute; all < 40%: latency, with waves < 1 or achieved occupancy < 25% named); "
              "dram/mem/sm_pct = DRAM / Memory / Compute (SM) Throughput, % of peak (SpeedOfLight); "
              "tensor_pct = tensor pipe cycles active, % of peak (gmma or hmma, when ncu_profile.sh found the "
              "metric); dram_read_GB / dram_write_GB = dram__bytes_read / _write.sum (when ncu_profile.sh found "
              "them); dram_GBps and l2_hit_pct from MemoryWorkloadAnalysis; occupancy from Occupancy; regs, "
              "waves, smem_KB (dynamic shared memory per block) from LaunchStats; spills = Triton's n_spills of "
              "that kernel name (max over its compiled variants); top_stall = WarpStateStats' rule text")
    gpu_line = [f"GPU (nvidia-smi): {' '.join(gpu[1:])} [{gpu[0]}]", ""] if len(gpu) > 1 else []
    cmd = (outdir / "ncu_command.txt").read_text().strip() if (outdir / "ncu_command.txt").exists() else ""
    if cmd:
        gpu_line += [f"command: `{cmd}`", ""]
    md = "\n".join([f"# Nsight Compute summary ({ver})", "", *gpu_line, legend, "", *case_lines, "", *table, ""])
    (outdir / "ncu_summary.md").write_text(md)
    (outdir / "ncu_summary.json").write_text(json.dumps(rows, indent=1))
    if not quiet:
        print(md)
    return rows


# --------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "summarize":
        if len(argv) != 2:
            print("usage: ncu_kernels.py summarize OUTDIR", file=sys.stderr)
            return 2
        summarize(argv[1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", nargs="?", help="a case name (see --list)")
    ap.add_argument("--list", action="store_true", help="print the cases (name, then what) and exit")
    ap.add_argument("--names", action="store_true", help="print the case names only, one a line")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--warmup", type=int, default=2, help="forwards before the profiled range (compiles)")
    ap.add_argument("--reps", type=int, default=1, help="forwards inside the profiled range")
    ap.add_argument("--time-reps", type=int, default=5, help="CUDA-event timings before profiling (0: none)")
    ap.add_argument("--info-json", default=None, help="write the case's facts here (JSON)")
    ap.add_argument("--compile-only", action="store_true",
                    help="set up and run the warm-up forwards only: fills Triton's cache (no timing, no profiling)")
    ap.add_argument("--no-pdl", action="store_true",
                    help="the experts with KernelOptions(pdl=False): plain stream order between their launches")
    args = ap.parse_args(argv)
    if args.names:
        print("\n".join(c.name for c in CASES))
        return 0
    if args.list:
        w = max(len(c.name) for c in CASES)
        for c in CASES:
            print(f"{c.name:<{w}}  {c.shape:<14} T={c.T:<5} {c.what}")
        return 0
    if not args.case:
        ap.print_usage(sys.stderr)
        return 2
    case = CASE_BY_NAME.get(args.case)
    if case is None:
        print(f"ncu_kernels: unknown case {args.case!r}; --list shows them", file=sys.stderr)
        return 2
    return run_case(case, tiny=args.tiny, warmup=1 if args.compile_only else args.warmup, reps=args.reps,
                    info_json=args.info_json, time_reps=args.time_reps, compile_only=args.compile_only,
                    pdl=not args.no_pdl)


if __name__ == "__main__":
    raise SystemExit(main())
