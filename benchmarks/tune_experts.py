"""Tune the Triton experts' tile configurations and write them to moeflow/tuning/ (GPU).

Legend: T tokens, K slots, N = T*K pairs, E experts, H hidden, I intermediate, BM block rows,
S split-K parts of the down GEMM.

For each shape and each T, every candidate of each stage is timed on its own (CUDA events,
L2 flushed before each run, median of --reps): align(BM), gate_up(BM, tile), down(BM, tile, S),
combine(S). A configuration's time is the sum of its stages; the best per T goes to the file,
and the batch-invariant entry is the single configuration with the smallest worst-case ratio
to the per-T best over all tuned T (one tile set for every T).

Compilation dominates a sweep, so it runs first in parallel worker processes that warm
Triton's on-disk cache (`--workers`); the timing pass then only loads cubins.

    PYTHONPATH=. python benchmarks/tune_experts.py --shapes all --out-dir moeflow/tuning
    PYTHONPATH=. python benchmarks/tune_experts.py --shapes qwen3-30b-a3b --tokens 1,8,64 --dry-run
    PYTHONPATH=. python benchmarks/tune_experts.py --shapes mixtral-8x7b --tma   # the TMA kernels (Hopper)

The kernels timed are the ones the kernel plan runs on this device (moeflow.experts.plan): the TMA
kernels on Hopper, the pointer kernels elsewhere; --no-tma times the pointer kernels
(KernelOptions(tma=False)); --tma forces the TMA kernels (KernelOptions(tma=True), the interpreter too)
and also tries their persistent form. The tiles of a table still run on the pointer kernels (which
ignore `persistent`), though not tuned for them.

The measured thresholds of the plan (moeflow/tuning/rules.json) are written here too:
    PYTHONPATH=. python benchmarks/tune_experts.py --write-rules gather_x_min_pairs=8192,flat_down_max_k_steps=16
records the values an A/B chose (the figures and commands are in moeflow.tuning.rules.KernelRules).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import STANDARD_SHAPES, STANDARD_TOKENS  # noqa: E402
from moeflow.config import ExpertWeights, MoEConfig  # noqa: E402
from moeflow.experts.options import KernelOptions  # noqa: E402
from moeflow.routing.spec import RouterSpec  # noqa: E402
from moeflow.testing import patch_interpreter_index  # noqa: E402,F401 - re-exported for the other benchmarks
from moeflow.tuning import GemmTile, MoETileConfig, ShapeKey, load_table, mixes_k_steps, write_table  # noqa: E402

# --------------------------------------------------------------------------- shapes
# The family details each standard shape is benchmarked with (shared/spec/benchmarks.md gives
# the sizes; gpt-oss keeps its own layout, interleaving, biases and clamp).
FAMILY = {
    "mixtral-8x7b": dict(activation="silu", layout="linear", interleaved=False, bias=False, limit=None),
    "qwen3-30b-a3b": dict(activation="silu", layout="linear", interleaved=False, bias=False, limit=None),
    "deepseek-v3": dict(activation="silu", layout="linear", interleaved=False, bias=False, limit=None),
    "gpt-oss-120b": dict(activation="gptoss", layout="matmul", interleaved=True, bias=True, limit=7.0),
    "ds-v4.1-like": dict(activation="silu", layout="linear", interleaved=False, bias=False, limit=None),
}


# Tiny shapes for a CPU dry run of the scripts under the Triton interpreter (--dry-run).
TINY_SHAPES = {
    "tiny-silu": dict(H=64, I=32, E=8, K=2, activation="silu", layout="linear", interleaved=False, bias=False,
                      limit=None),
    "tiny-gptoss": dict(H=40, I=24, E=4, K=2, activation="gptoss", layout="matmul", interleaved=True, bias=True,
                        limit=7.0),
}


def shape_spec(name: str) -> dict:
    if name in TINY_SHAPES:
        return dict(name=name, **TINY_SHAPES[name])
    if name not in STANDARD_SHAPES:
        raise ValueError(f"shape {name!r}: expected one of {tuple(STANDARD_SHAPES) + tuple(TINY_SHAPES)}")
    s = STANDARD_SHAPES[name]
    return dict(name=name, H=s["H"], I=s["I"], E=s["E"], K=s["K"], **FAMILY[name])


def parse_shapes(arg: str) -> list[str]:
    names = list(STANDARD_SHAPES) if arg == "all" else [a.strip() for a in arg.split(",") if a.strip()]
    for n in names:
        shape_spec(n)
    return names


def make_config(spec: dict, num_experts: int | None = None) -> MoEConfig:
    E = num_experts or spec["E"]
    return MoEConfig(hidden_size=spec["H"], intermediate_size=spec["I"],
                     router=RouterSpec(score_fn="softmax", num_experts=E, top_k=min(spec["K"], E)),
                     activation=spec["activation"], swiglu_limit=spec["limit"], layout=spec["layout"],
                     interleaved=spec["interleaved"], expert_bias=spec["bias"])


def make_weights(spec: dict, device, dtype=torch.bfloat16, num_experts: int | None = None, seed: int = 0):
    """Random weights scaled like a trained layer (unit-variance activations), never zeros."""
    E, H, I = num_experts or spec["E"], spec["H"], spec["I"]
    g = torch.Generator(device=torch.device(device)).manual_seed(seed)
    if spec["layout"] == "linear":
        gu = torch.randn(E, 2 * I, H, device=device, dtype=dtype, generator=g) * (1.0 / math.sqrt(H))
        dn = torch.randn(E, H, I, device=device, dtype=dtype, generator=g) * (1.0 / math.sqrt(I))
    else:
        gu = torch.randn(E, H, 2 * I, device=device, dtype=dtype, generator=g) * (1.0 / math.sqrt(H))
        dn = torch.randn(E, I, H, device=device, dtype=dtype, generator=g) * (1.0 / math.sqrt(I))
    gb = db = None
    if spec["bias"]:
        gb = torch.randn(E, 2 * I, device=device, dtype=dtype, generator=g) * 0.1
        db = torch.randn(E, H, device=device, dtype=dtype, generator=g) * 0.1
    return ExpertWeights(gu, dn, gb, db, layout=spec["layout"], interleaved=spec["interleaved"])


def shape_key(spec: dict, dtype=torch.bfloat16) -> ShapeKey:
    return ShapeKey(num_experts=spec["E"], hidden_size=spec["H"], intermediate_size=spec["I"], top_k=spec["K"],
                    layout=spec["layout"], interleaved=spec["interleaved"], dtype=str(dtype).split(".")[-1])


def routing(T: int, E: int, K: int, dist: str, device, seed: int = 0):
    """ids [T, K] int32 (distinct per row) and weights [T, K] f32 from a fixed seed.

    uniform: every expert equally likely; zipf: p(expert of rank r) ~ 1 / (r + 1)^1.2 over a
    fixed random ranking, K drawn without replacement (Gumbel top-k); balanced: pair (t, k) goes to
    expert (t * K + k) % E (K <= E), so every expert gets T * K / E rows, +-1: no tile is padding when
    that is a multiple of BM. It separates a kernel's own speed from the padding of random routing,
    and an expert of exactly BM rows is one tile, whose weights no other tile reads.
    """
    if dist == "balanced":
        if K > E:
            raise ValueError(f"routing dist 'balanced': top_k {K} > num_experts {E}")
        pair = torch.arange(T * K, dtype=torch.int64).view(T, K)
        g = torch.Generator().manual_seed(seed * 1000003 + T * 31 + 13)
        wts = torch.softmax(torch.randn(T, K, generator=g), dim=1)
        return (pair % E).to(torch.int32).to(device), wts.to(device)
    g = torch.Generator().manual_seed(seed * 1000003 + T * 31 + (0 if dist == "uniform" else 7))
    if dist == "uniform":
        keys = torch.rand(T, E, generator=g)
    elif dist == "zipf":
        rank = torch.randperm(E, generator=torch.Generator().manual_seed(seed))
        logp = -1.2 * torch.log(rank.double() + 1.0)
        u = torch.rand(T, E, generator=g, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
        keys = logp[None, :] - torch.log(-torch.log(u))
    else:
        raise ValueError(f"routing dist {dist!r}: expected 'uniform', 'zipf' or 'balanced'")
    ids = keys.topk(K, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    return ids.to(device), wts.to(device)


# --------------------------------------------------------------------------- candidates
def _t(bn, bk, warps, stages):
    return GemmTile(block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)


GATE_UP = {
    16: [_t(32, 128, 4, 4), _t(64, 128, 4, 4), _t(64, 64, 4, 5), _t(128, 64, 4, 4), _t(32, 256, 4, 3),
         _t(64, 256, 4, 3), _t(16, 256, 4, 3), _t(32, 64, 4, 6)],
    32: [_t(64, 128, 4, 4), _t(64, 64, 4, 4), _t(128, 64, 4, 4)],
    64: [_t(64, 64, 4, 4), _t(128, 64, 4, 3), _t(64, 128, 4, 3), _t(128, 64, 8, 3), _t(128, 64, 8, 4),
         _t(64, 64, 4, 5)],
    128: [_t(64, 64, 4, 4), _t(128, 64, 8, 3), _t(64, 64, 8, 4), _t(128, 32, 8, 4), _t(128, 64, 8, 4),
          _t(64, 64, 8, 3), _t(64, 128, 8, 3)],
}
DOWN = {
    16: [_t(32, 128, 4, 4), _t(64, 128, 4, 4), _t(64, 64, 4, 5), _t(128, 64, 4, 4), _t(32, 256, 4, 3),
         _t(64, 256, 4, 3), _t(32, 64, 4, 6)],
    32: [_t(64, 128, 4, 4), _t(64, 64, 4, 4), _t(128, 64, 4, 4)],
    64: [_t(64, 64, 4, 4), _t(128, 64, 4, 3), _t(128, 64, 8, 3), _t(64, 128, 4, 3), _t(128, 64, 8, 4),
         _t(256, 64, 8, 3)],
    128: [_t(128, 64, 8, 3), _t(128, 64, 8, 4), _t(64, 64, 4, 4), _t(256, 64, 8, 3), _t(128, 64, 4, 4),
          _t(128, 128, 8, 3), _t(64, 128, 4, 3)],
}
SPLITS = {16: (1, 2, 4, 8), 32: (1, 2, 4), 64: (1, 2), 128: (1,)}
# Block heights the batch-invariant configuration is chosen among (timed at every T).
BI_BMS = (64,)


# With --tma: block heights whose tiles are also tried in the TMA kernels' persistent form (the
# prefill heights; 2026-12-03 diag_tma_gemm: persistent won 1.05-1.10x on some down GEMMs, lost elsewhere).
PERSISTENT_BMS: tuple[int, ...] = ()


def with_split(t: GemmTile, s: int) -> GemmTile:
    return dataclasses.replace(t, split_k=s)


def stage_tiles(table: dict, bm: int, quick: bool) -> list[GemmTile]:
    """Candidate tiles of one GEMM (GATE_UP or DOWN) at block height bm: the first two with --quick,
    then their persistent forms where PERSISTENT_BMS asks for them."""
    tiles = table[bm][:2] if quick else table[bm]
    if bm in PERSISTENT_BMS:
        tiles = tiles + [dataclasses.replace(t, persistent=True) for t in tiles]
    return tiles


# The KernelOptions this run times the kernels with (--tma / --no-tma set it; the compile workers get it
# as an argument).
OPTIONS = KernelOptions()


def tma_wanted(dev: torch.device, options: KernelOptions | None = None) -> bool:
    """Whether this tuning times the TMA kernels: what the plan runs on `dev` with these options."""
    from moeflow.experts.devices import device_facts

    t = (options or OPTIONS).tma
    return (device_facts(dev).capability >= 9) if t is None else t


def staged(w, x, T: int, K: int, tc: MoETileConfig, dev: torch.device, options: KernelOptions | None = None,
           num_experts: int | None = None, buffers=None):
    """(plan, buffers) of one step with tiles tc, for launching its stages one by one
    (moeflow.experts.fused.run_stage). buffers: reuse these (the same BM and split: the same sizes);
    num_experts: the E the alignment and combine kernels are compiled for (proxy weights of the real E)."""
    from moeflow.experts.fused import StepBuffers
    from moeflow.experts.triton import TritonExperts

    impl = TritonExperts(allow_cpu=dev.type == "cpu", tile_config=tc, options=options or OPTIONS)
    plan = impl.plan(w, T, K)
    if buffers is None:
        ids = torch.zeros(T * K, dtype=torch.int32, device=dev)
        buffers = StepBuffers(plan, x, ids, torch.ones(T * K, device=dev), T, K, w, False, True)
        if num_experts is not None:
            buffers.E = num_experts
    return plan, buffers


def bm_range(T: int, K: int, E: int, quick: bool) -> list[int]:
    """Block heights worth trying for T tokens (rows per used expert decides)."""
    rows = T * K / min(T * K, E)
    if quick:
        return [16] if rows <= 16 else ([64] if rows <= 96 else [128])
    if rows <= 8:
        return [16]
    if rows <= 24:
        return [16, 32]
    if rows <= 48:
        return [16, 32, 64]
    if rows <= 96:
        # BM 128 too: with half tiles (refine_best's with_half) an expert of 64 +- a few rows runs
        # one 128-row tile or one 64-row half tile, reading its weights once (vLLM 0.33 runs BM 128
        # at deepseek-v3 T = 2048, 64 rows per expert, and led us there by 1-4%, 2026-12-04)
        return [16, 32, 64, 128]
    if rows <= 256:
        return [32, 64, 128]
    return [64, 128]


# --------------------------------------------------------------------------- precompile
def _compile_worker(task) -> list[str]:
    """Run each config once on 2-expert proxy weights with the real H, I, K and E (E matters to
    the alignment kernel's constants): warms Triton's disk cache. Returns error strings."""
    spec, cfg_dicts, options = task
    import torch  # noqa: F401  (fresh process)

    from moeflow.experts.fused import run_stage

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: interpreter dry run
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w = make_weights(spec, dev, dtype=dt, num_experts=2)
    cfg = make_config(spec, num_experts=2)
    K, E = spec["K"], spec["E"]
    errors = []
    for d in cfg_dicts:
        tc = MoETileConfig.from_dict(d)
        for T in (3, 4097 // K + 1):  # fused and multi-kernel alignment paths
            try:
                x = torch.randn(T, spec["H"], device=dev, dtype=dt)
                # the alignment kernel's E_PAD and the combine's E as the real shape has them
                plan, b = staged(w, x, T, K, tc, dev, options, num_experts=E)
                b.ids_N.copy_(torch.arange(T * K, device=dev, dtype=torch.int32) % 2)
                for stage in ("align", "gate_up", "down", "combine"):
                    run_stage(plan, stage, b, w, cfg)
                for s in SPLITS[tc.block_m]:  # the combine's SPLIT is a compile-time constant
                    b.y_SNH = torch.zeros(s, T * K, spec["H"], device=dev, dtype=dt if s == 1 else torch.float32)
                    run_stage(plan, "combine", b, w, cfg)
            except Exception as e:  # a candidate the compiler refuses (shared memory, registers)
                errors.append(f"{spec['name']} {d}: {type(e).__name__}: {str(e)[:200]}")
                break
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return errors


def precompile(tasks: list[tuple[dict, list[dict]]], workers: int) -> list[str]:
    """Compile every (shape, config) in parallel processes; returns the compile errors."""
    chunks = []
    for spec, cfgs in tasks:
        per = max(1, math.ceil(len(cfgs) / max(1, workers)))
        chunks += [(spec, cfgs[i : i + per], OPTIONS) for i in range(0, len(cfgs), per)]
    if workers <= 1:
        return [e for c in chunks for e in _compile_worker(c)]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        results = pool.map(_compile_worker, chunks, chunksize=1)
    return [e for r in results for e in r]


def all_candidates(quick: bool) -> list[MoETileConfig]:
    """Configs that cover every (BM, gate_up tile) and (BM, down tile) pair, zipped (one compile each)."""
    out = []
    for bm in (16, 32, 64, 128):
        gus, dns = stage_tiles(GATE_UP, bm, quick), stage_tiles(DOWN, bm, quick)
        for i in range(max(len(gus), len(dns))):
            out.append(MoETileConfig(block_m=bm, gate_up=gus[i % len(gus)],
                                     down=with_split(dns[i % len(dns)], max(SPLITS[bm]))))
    return out


# --------------------------------------------------------------------------- timing
_FLUSH = {}


def _flush():
    buf = _FLUSH.get("b")
    if buf is None:
        buf = _FLUSH["b"] = torch.empty(64 * 1024 * 1024, dtype=torch.float32, device="cuda")
    buf.zero_()


def time_launch(fn, reps: int) -> float:
    """Median seconds of fn() by CUDA events, L2 flushed before each run (CPU: wall clock)."""
    if not torch.cuda.is_available():
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        _flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def bi_families(tuned: list[int], combos: list, best: dict, total, to_cfg) -> list[tuple]:
    """Batch-invariant families, best worst ratio first: [(table {T: cfg}, worst ratio, ratios, label)].

    Each takes per T the fastest one-split combo (stage-sum total(T, *combo)) among those sharing one BK
    per GEMM (a family for each (gate_up BK, down BK) pair), and one ("free BK") lets BK follow T too:
    every k16 step joins one f32 accumulator in order whatever BK, so its bits should not depend on BK.
    Whether a family's bits hold across T is verify_family's call, on the device.
    """
    families = []
    bks = sorted({(to_cfg(*c).gate_up.block_k, to_cfg(*c).down.block_k) for c in combos})
    for bk in [*bks, None]:
        table, ratios = {}, []
        for T in tuned:
            cands = []
            for c in combos:
                tc = to_cfg(*c)
                if c[3] == 1 and (bk is None or (tc.gate_up.block_k, tc.down.block_k) == bk):
                    t = total(T, *c)
                    if t is not None:
                        cands.append((t, c))
            if not cands or T not in best:
                table = None
                break
            t, c = min(cands)
            table[T] = to_cfg(*c)
            ratios.append(t / best[T][1])
        if table:
            families.append((table, max(ratios), ratios, "free BK" if bk is None else f"BK {bk[0]} / {bk[1]}"))
    return sorted(families, key=lambda f: f[1])


def tune_shape(spec: dict, tokens: list[int], reps: int, quick: bool, deadline: float, log,
               dtype=torch.bfloat16) -> dict:
    """{'best': {T: (cfg, t)}, 'bi': (cfg, worst_ratio, ratios), 'tuned': [T], 'ranked': {T: [(t, cfg)]}} for one shape.

    t is the sum of the stages' times, each launched alone after an L2 flush; 'ranked' holds the
    RANKED best (stage-sum, config) per T for refine_best, which times them whole.
    """
    from moeflow.experts.fused import run_stage

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w = make_weights(spec, dev, dtype=dtype)
    cfg = make_config(spec)
    K, E, H = spec["K"], spec["E"], spec["H"]
    # stage times: align[(T,bm)], gu[(T,bm,i)], dn[(T,bm,i,s)], comb[(T,s)]
    align_t, gu_t, dn_t, comb_t = {}, {}, {}, {}
    bms_all = sorted({bm for T in tokens for bm in bm_range(T, K, E, quick)} | set(BI_BMS))
    for T in tokens:
        if time.time() > deadline:
            log(f"  deadline reached before T={T}; tuned T so far only")
            break
        ids, wts = routing(T, E, K, "uniform", dev)
        x = torch.randn(T, H, device=dev, dtype=dtype)
        ids_N, wts_N = ids.reshape(-1).contiguous(), wts.reshape(-1).contiguous()
        # the BMs worth trying at this T, plus the batch-invariant candidates (timed at every T)
        for bm in sorted(set(bm_range(T, K, E, quick)) | set(BI_BMS)):
            gus, dns = stage_tiles(GATE_UP, bm, quick), stage_tiles(DOWN, bm, quick)
            base = MoETileConfig(block_m=bm, gate_up=gus[0], down=dns[0])
            plan, b = staged(w, x, T, K, base, dev)
            b.ids_N, b.wts_N, b.combine_wts = ids_N, wts_N, wts_N
            align_t[(T, bm)] = time_launch(lambda p=plan, b=b: run_stage(p, "align", b, w, cfg), reps)
            for i, g in enumerate(gus):
                p, _ = staged(w, x, T, K, MoETileConfig(block_m=bm, gate_up=g, down=dns[0]), dev, buffers=b)
                try:
                    gu_t[(T, bm, i)] = time_launch(lambda p=p, b=b: run_stage(p, "gate_up", b, w, cfg), reps)
                except Exception as e:
                    log(f"  gate_up {bm} {g}: {type(e).__name__} {str(e)[:120]}")
            for s in SPLITS[bm]:
                b.y_SNH = torch.empty(s, T * K, H, device=dev, dtype=dtype if s == 1 else torch.float32)
                for i, d in enumerate(dns):
                    p, _ = staged(w, x, T, K, MoETileConfig(block_m=bm, gate_up=gus[0], down=with_split(d, s)), dev,
                                  buffers=b)
                    try:
                        dn_t[(T, bm, i, s)] = time_launch(lambda p=p, b=b: run_stage(p, "down", b, w, cfg), reps)
                    except Exception as e:
                        log(f"  down {bm} {d} s={s}: {type(e).__name__} {str(e)[:120]}")
                if (T, s) not in comb_t:
                    comb_t[(T, s)] = time_launch(lambda p=plan, b=b: run_stage(p, "combine", b, w, cfg), reps)
        log(f"  T={T}: timed")

    def total(T, bm, gi, di, s):
        parts = [align_t.get((T, bm)), gu_t.get((T, bm, gi)), dn_t.get((T, bm, di, s)), comb_t.get((T, s))]
        return None if any(p is None for p in parts) else sum(parts)

    tuned = sorted({T for (T, _) in align_t})
    best, parts = {}, {}
    combos = [(bm, gi, di, s) for bm in bms_all
              for gi in range(len(stage_tiles(GATE_UP, bm, quick)))
              for di in range(len(stage_tiles(DOWN, bm, quick))) for s in SPLITS[bm]]

    def to_cfg(bm, gi, di, s):
        gus, dns = stage_tiles(GATE_UP, bm, quick), stage_tiles(DOWN, bm, quick)
        return MoETileConfig(block_m=bm, gate_up=gus[gi], down=with_split(dns[di], s))

    ranked = {}
    for T in tuned:
        cands = [(total(T, *c), c) for c in combos]
        cands = sorted((t, c) for t, c in cands if t is not None)
        if cands:
            ranked[T] = [(t, to_cfg(*c)) for t, c in cands[:RANKED]]
            t, c = cands[0]
            best[T] = (to_cfg(*c), t)
            bm, gi, di, sp = c
            parts[T] = {"align": align_t[(T, bm)], "gate_up": gu_t[(T, bm, gi)], "down": dn_t[(T, bm, di, sp)],
                        "combine": comb_t[(T, sp)]}
    # batch invariant: one config for every tuned T, minimising the worst ratio to the per-T best
    bi = None
    for c in combos:
        if c[0] not in BI_BMS:
            continue
        ratios = []
        for T in tuned:
            t = total(T, *c)
            if t is None or T not in best:
                ratios = None
                break
            ratios.append(t / best[T][1])
        if ratios and (bi is None or max(ratios) < bi[1]):
            bi = (to_cfg(*c), max(ratios), ratios)
    families = bi_families(tuned, combos, best, total, to_cfg)
    return {"best": best, "bi": bi, "family": families[0] if families else None, "families": families,
            "tuned": tuned, "parts": parts, "ranked": ranked}


# How many of the stage-sum ranking's best configs per T refine_best times as whole steps.
RANKED = 6
# Batch-invariant families checked bit for bit on the device, best worst ratio first, until one holds.
FAMILIES_VERIFIED = 3


# Block heights whose candidates refine_best also times with half tiles (MoETileConfig.half_tail):
# the prefill heights, where an expert's last block is often at most half full.
HALF_BMS = (64, 128)


def with_half(cands: list) -> list:
    """cands [(stage-sum s, cfg)] plus, after them, each HALF_BMS config with half_tail (the stage sums
    cannot rank those: they time one block height's kernels over every block)."""
    return list(cands) + [(t, dataclasses.replace(c, half_tail=True)) for t, c in cands
                          if c.block_m in HALF_BMS and not c.half_tail]


def with_flat(cands: list, spec: dict) -> list:
    """cands plus, after them, each one-split candidate with the other choice of down GEMM form than
    the plan's rule gives it (MoETileConfig.flat_down; the flattened persistent down, same bits). Only
    shapes whose down takes TMA tiles (linear, no bias). Why: the rule was fixed from a few points
    (+2..7% or -3..9% by tiles and T; moeflow.tuning.rules.KernelRules.flat_down_max_k_steps)."""
    if spec["layout"] != "linear" or spec["interleaved"] or spec["bias"]:
        return list(cands)
    return list(cands) + [(t, dataclasses.replace(c, flat_down=not _flat_by_rule(c, spec["I"]))) for t, c in cands
                          if c.down.split_k == 1 and c.flat_down is None]


def _flat_by_rule(c: MoETileConfig, I: int) -> bool:
    """Whether the plan's rule runs tiles c's down flat at intermediate size I."""
    from moeflow.tuning.rules import load_rules

    steps = -(-I // c.down.block_k)
    return c.block_m >= 128 and not c.half_tail and steps <= load_rules().flat_down_max_k_steps


def time_many(fns: dict, reps: int, log) -> dict:
    """{name: median s of one CUDA-graph replay} of each fn, timed round-robin (benchmarks.common.
    time_cuda_graphs_interleaved: the GPU's clocks drift under a power cap, so candidates timed one
    after another are not comparable at prefill); CPU: time_launch each. A fn that raises when run
    once (a tile the compiler refuses) is logged and left out."""
    ok = {}
    for k, fn in fns.items():
        try:
            fn()
        except Exception as e:
            log(f"  {k}: {type(e).__name__} {str(e)[:120]}")
            continue
        ok[k] = fn
    if not torch.cuda.is_available():
        return {k: time_launch(fn, reps) for k, fn in ok.items()}
    from benchmarks.common import time_cuda_graphs_interleaved

    return time_cuda_graphs_interleaved(ok, rounds=max(2, reps // 2), reps=2)


def refine_best(spec: dict, ranked: dict, reps: int, log, dtype=torch.bfloat16, half: bool = True,
                flat: bool = True) -> dict:
    """{T: (cfg, replay s, stage-sum choice's replay s)}: the fastest of `ranked[T]` timed whole.

    The stage sums time each kernel alone after its own L2 flush, launched eagerly. A step runs
    them back to back from a CUDA graph, the kernels overlapping at their edges (programmatic
    dependent launch) and down finding part of its input in L2. Near a tie the two orders differ:
    on the H200 ds-v4.1-like T = 1 had kept BM = 64 tiles (97.2 us a step) by its stage sums. So the few best by stage sum are timed again as whole steps (`time_many`, graph
    replays round-robin) and the fastest is kept. half: also time each BM 64 / 128 candidate with
    half tiles (`with_half`); flat: also each with the other down GEMM form (`with_flat`, TMA only).
    """
    from moeflow.experts.triton import TritonExperts

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w, cfg = make_weights(spec, dev, dtype=dtype), make_config(spec)
    K, E, H = spec["K"], spec["E"], spec["H"]
    tma = tma_wanted(dev)
    out = {}
    for T, cands in sorted(ranked.items()):
        cands = with_half(cands) if half else list(cands)
        cands = with_flat(cands, spec) if flat and tma else cands
        ids, wts = routing(T, E, K, "uniform", dev)
        x = torch.randn(T, H, device=dev, dtype=dtype)
        impls = [TritonExperts(allow_cpu=dev.type == "cpu", tile_config=c, options=OPTIONS) for _, c in cands]
        fns = {i: (lambda m=m, x=x, ids=ids, wts=wts: m.forward_tokens(x, ids, wts, w, cfg))
               for i, m in enumerate(impls)}
        times = time_many(fns, reps, lambda m, T=T: log(f"  refine T={T} candidate{m}"))
        if not times:
            continue
        i_best = min(times, key=times.get)
        c, t, first = cands[i_best][1], times[i_best], times.get(0)
        out[T] = (c, t, first)
        if first is not None and i_best != 0:
            log(f"  refine T={T}: whole step {t * 1e6:.1f} us against {first * 1e6:.1f} us for the stage-sum choice"
                + (" (half tiles)" if c.half_tail else "") + ("" if c.flat_down is None else f" (flat_down={c.flat_down})"))
    return out


def verify_family(spec: dict, table: dict, dtype=torch.bfloat16) -> tuple[bool, str]:
    """Bitwise check on the device: tokens computed with each T's family config, inside batches of
    that T, must equal the same tokens computed inside the largest batch (its own config)."""
    from moeflow.experts.triton import TritonExperts

    dev = torch.device("cuda")
    w, cfg = make_weights(spec, dev, dtype=dtype), make_config(spec)
    Ts = sorted(table)
    Tmax = Ts[-1]
    ids, wts = routing(Tmax, spec["E"], spec["K"], "zipf", dev, seed=5)
    x = torch.randn(Tmax, spec["H"], device=dev, dtype=dtype)
    full = TritonExperts(tile_config=table[Tmax]).forward_tokens(x, ids, wts, w, cfg)
    for T in Ts[:-1]:
        part = TritonExperts(tile_config=table[T]).forward_tokens(x[:T], ids[:T], wts[:T], w, cfg)
        eq = torch.equal(part.view(torch.int16), full[:T].view(torch.int16))
        if not eq:
            bad = int((part.view(torch.int16) != full[:T].view(torch.int16)).sum())
            return False, f"T={T} config {table[T].to_dict()} differs from T={Tmax} in {bad} elements"
    return True, f"bitwise equal at T={Ts}"


def merge_into(old: dict | None, configs: dict, bi, bi_by_t, *,
               replace_bi: bool = False) -> tuple[dict, object, object]:
    """(configs, batch_invariant, batch_invariant_by_T) of a table updated by a run over some T.

    old: moeflow.tuning.load_table's dict of the existing table (None: nothing to merge). The run's
    entries replace old ones at the T it tuned; old entries at other T stay. The old batch-invariant
    entries stay when present: one tile set for every T is judged over every T, which a partial run did
    not time. replace_bi: the run's batch-invariant entries replace the old ones where it has them (a run
    over every T).
    """
    if old is None:
        return configs, bi, bi_by_t
    merged_cfg = {**{T: c for T, c in old["configs"].items() if T not in configs}, **configs}
    if replace_bi:
        return merged_cfg, bi or old["batch_invariant"], bi_by_t or old["batch_invariant_by_T"]
    return merged_cfg, old["batch_invariant"] or bi, old["batch_invariant_by_T"] or bi_by_t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--tokens", default=",".join(str(t) for t in STANDARD_TOKENS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--quick", action="store_true", help="two candidates per stage, one BM per T")
    ap.add_argument("--out-dir", default=str(ROOT / "moeflow" / "tuning"))
    ap.add_argument("--log-json", default=None, help="write the per-T choices and worst BI ratios here")
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop timing new T after this many seconds")
    ap.add_argument("--skip-precompile", action="store_true")
    tma = ap.add_mutually_exclusive_group()
    tma.add_argument("--tma", action="store_true",
                     help="force the TMA kernels (KernelOptions(tma=True), for this process and its compile "
                          "workers; the default on Hopper anyway) and also try the persistent form of the BM 64 / "
                          "128 tiles")
    tma.add_argument("--no-tma", action="store_true", help="time the pointer kernels (KernelOptions(tma=False))")
    ap.add_argument("--write-rules", default=None, metavar="NAME=VALUE,...",
                    help="write these measured thresholds into moeflow/tuning/rules.json (the others kept) and "
                         "stop; names are moeflow.tuning.rules.KernelRules fields")
    ap.add_argument("--merge-from", default=None,
                    help="a tuning directory (e.g. moeflow/tuning) whose table for each shape this run updates: "
                         "entries of the T tuned now replace its entries, the others are kept, and so are its "
                         "batch-invariant entries (a partial run cannot judge one tile set for every T)")
    ap.add_argument("--no-refine", dest="refine", action="store_false",
                    help=f"keep the best stage sum per T instead of timing the {RANKED} best as whole steps "
                         "(CUDA-graph replay) and keeping the fastest")
    ap.add_argument("--no-half", dest="half", action="store_false",
                    help="do not time the BM 64 / 128 candidates with half tiles (MoETileConfig.half_tail) in "
                         "the whole-step refinement")
    ap.add_argument("--no-flat", dest="flat", action="store_false",
                    help="do not time the other down GEMM form (MoETileConfig.flat_down) of the one-split "
                         "candidates in the whole-step refinement (TMA shapes only)")
    ap.add_argument("--replace-bi", action="store_true",
                    help="with --merge-from: write this run's batch-invariant entries (checked bit for bit) "
                         "instead of keeping the old ones; run it over every T the table serves")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, fp32, under TRITON_INTERPRET=1 (set it yourself): checks the script, times nothing real")
    args = ap.parse_args(argv)
    if args.write_rules is not None:
        return write_rules_arg(args.write_rules)
    dtype = torch.bfloat16
    if args.dry_run:
        dtype = torch.float32
        args.skip_precompile = True
        patch_interpreter_index()
    elif not torch.cuda.is_available():
        print("tune_experts: needs CUDA (or --dry-run under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    global OPTIONS, PERSISTENT_BMS
    if args.tma:
        OPTIONS = KernelOptions(tma=True)  # the compile workers get it with their task
        PERSISTENT_BMS = (64, 128)
    elif args.no_tma:
        OPTIONS = KernelOptions(tma=False)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    deadline = t0 + args.budget_s
    names = parse_shapes(args.shapes)
    tokens = [int(t) for t in args.tokens.split(",")]

    def log(msg):
        print(f"[{time.time() - t0:7.1f}s] {msg}", flush=True)

    if not args.skip_precompile:
        cands = [c.to_dict() for c in all_candidates(args.quick)]
        errors = precompile([(shape_spec(n), cands) for n in names], args.workers)
        log(f"precompiled {len(cands)} configs x {len(names)} shapes with {args.workers} workers; "
            f"{len(errors)} refused")
        for e in errors[:20]:
            log("  " + e)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    report = {"device": device, "shapes": {}}
    for n in names:
        spec = shape_spec(n)
        log(f"tuning {n}")
        res = tune_shape(spec, tokens, args.reps, args.quick, deadline, log, dtype=dtype)
        if not res["best"]:
            log(f"  {n}: nothing tuned")
            continue
        fam, fam_note = res["family"], "not tried"
        if fam is not None and not args.dry_run:
            # the best families first, each checked bit for bit on the device until one holds
            fam = None
            for cand in res["families"][:FAMILIES_VERIFIED]:
                ok, note = verify_family(spec, cand[0], dtype)
                log(f"  batch-invariant family, {cand[3]} (worst ratio {cand[1]:.3f}): "
                    f"{'kept' if ok else 'DROPPED'}: {note}")
                fam_note = note
                if ok:
                    fam = cand
                    break
        if fam is not None and args.half and not args.dry_run:
            # half tiles give the same bits, so each T's family tiles may take them where faster
            halved = refine_best(spec, {T: [(0.0, c)] for T, c in fam[0].items()}, args.reps, log, dtype=dtype,
                                 flat=args.flat)
            table = {T: halved[T][0] if T in halved else c for T, c in fam[0].items()}
            if table != fam[0]:
                ok, note = verify_family(spec, table, dtype)
                log(f"  batch-invariant family with half tiles at T={sorted(T for T in table if table[T].half_tail)}: "
                    f"{'kept' if ok else 'DROPPED'}: {note}")
                if ok:
                    fam = (table, *fam[1:])
        if args.refine:
            refined = refine_best(spec, res["ranked"], args.reps, log, dtype=dtype, half=args.half, flat=args.flat)
            res["refined"] = {str(T): {"cfg": c.to_dict(), "replay_us": t * 1e6,
                                       "stage_sum_choice_replay_us": None if t0_ is None else t0_ * 1e6}
                              for T, (c, t, t0_) in refined.items()}
            res["best"] = {T: (refined[T][0], refined[T][1]) if T in refined else ct for T, ct in res["best"].items()}
        configs = {T: c for T, (c, _) in res["best"].items()}
        bi, bi_by_t = (res["bi"][0] if res["bi"] else None), (fam[0] if fam else None)
        if args.merge_from:
            old = load_table(shape_key(spec, dtype), device, Path(args.merge_from), siblings=False)
            configs, bi, bi_by_t = merge_into(old, configs, bi, bi_by_t, replace_bi=args.replace_bi)
        # a family whose BK follows T reaches here only checked bit for bit on the device (this run's
        # verify_family, or the run that wrote the merged table)
        path = write_table(shape_key(spec, dtype), device, configs, bi, directory=Path(args.out_dir),
                           batch_invariant_by_T=bi_by_t, batch_invariant_mixed_bk=bool(bi_by_t) and mixes_k_steps(bi_by_t))
        report["shapes"][n] = {
            "file": path.name,
            "best": {str(T): {"cfg": c.to_dict(), "us": t * 1e6,
                              # the stages of the stage-sum choice (refine_best may have kept another)
                              "parts_us": {k: v * 1e6 for k, v in res["parts"][T].items()}}
                     for T, (c, t) in res["best"].items()},
            "batch_invariant": None if res["bi"] is None else
            {"cfg": res["bi"][0].to_dict(), "worst_ratio": res["bi"][1], "ratios": res["bi"][2]},
            "batch_invariant_family": None if res["family"] is None else
            {"kept": fam is not None, "note": fam_note, "label": (fam or res["family"])[3],
             "worst_ratio": (fam or res["family"])[1], "ratios": (fam or res["family"])[2],
             "by_T": {str(T): c.to_dict() for T, c in (fam or res["family"])[0].items()}},
            "refined": res.get("refined"),
        }
        for T, (c, t) in res["best"].items():
            gp, dp = (",P" if c.gate_up.persistent else ""), (",P" if c.down.persistent else "")
            log(f"  T={T:5d} {t * 1e6:9.1f} us  BM={c.block_m} gu=({c.gate_up.block_n},{c.gate_up.block_k},"
                f"{c.gate_up.num_warps},{c.gate_up.num_stages}{gp}) dn=({c.down.block_n},{c.down.block_k},"
                f"{c.down.num_warps},{c.down.num_stages},S{c.down.split_k}{dp})"
                + (" half tiles" if c.half_tail else "") + ("" if c.flat_down is None else f" flat_down={c.flat_down}"))
        if res["bi"]:
            log(f"  batch-invariant: worst ratio {res['bi'][1]:.3f} cfg {res['bi'][0].to_dict()}")
        if args.log_json:
            Path(args.log_json).write_text(json.dumps(report, indent=1))
    log("done")
    return 0


def write_rules_arg(text: str) -> int:
    """--write-rules NAME=VALUE,...: update moeflow/tuning/rules.json (ints; pdl_gemm_trigger a word)."""
    from moeflow.tuning.rules import load_rules, write_rules

    kw = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            print(f"tune_experts: --write-rules item {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        kw[name.strip()] = value.strip() if name.strip() == "pdl_gemm_trigger" else int(value)
    try:
        rules = dataclasses.replace(load_rules(), **kw)
    except (TypeError, ValueError) as exc:
        print(f"tune_experts: --write-rules: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {write_rules(rules)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
