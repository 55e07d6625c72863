"""Thresholds of the kernel plan that a measurement chose, as data (`rules.json` beside this module).

The kernel plan (`moeflow.experts.plan`) reads these through `load_rules()`; the values are written
by `benchmarks/tune_experts.py --write-rules` (after the A/B that justifies them), never read from the
environment or flipped as module globals. Each field says what it decides and the figures behind it;
the command that re-measures a figure is named with it.

Figures are H100 SXM (700 W) times of one MoE layer, bf16 activations, uniform / Zipf(1.2) routing,
unless said otherwise.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

RULES_PATH = Path(__file__).resolve().parent / "rules.json"


@dataclass(frozen=True, kw_only=True)
class KernelRules:
    """The plan's measured thresholds.

    gather_x_min_intermediate, gather_x_min_pairs:
        the bf16 TMA gate_up reads its activation rows from a pair-ordered copy (variant
        "tma_gather_x": one gather pass writes x_PH [P, H], then TMA boxes read it) at I >= the first
        and T * K >= the second. The copy costs a read and a write of P x H against gate_up's 4 P H I
        FLOPs, so it pays only where I is large. A/B (`python benchmarks/bench_experts.py --shapes
        mixtral-8x7b,deepseek-v3,qwen3-30b-a3b --tokens 2048,8192` with and without `--pin gate_up=tma_gather_x`): mixtral (I 14336) T 8192
        x1.033 / x1.037, T 2048 x1.002 / x1.004; deepseek-v3 (I 2048) T 8192 x0.968 / x1.011; qwen3
        (I 768) T 8192 x0.916 / x0.917. Same bits either way.
    flat_down_max_k_steps:
        the bf16 TMA down runs as one flattened persistent loop (variant "tma_flat") on full 128-row tiles
        (BM >= 128, no half tiles) with at most this many K steps, unless the tuned entry says otherwise
        (MoETileConfig.flat_down). Flat won 4-7% at qwen3 (I 768: 12 steps of BK 64, T 2048 / 8192), lost
        0-3% on the BM 16-64 tiles of T 16-512 and 5-9% at deepseek-v3 T 2048 (32 steps).
    fp8_gluon_gate_up_min_hidden:
        the fp8 gate_up runs the warp-specialised Gluon kernel (variant "fp8_gluon") from this hidden size
        (long K loops): deepseek-v3 (H 7168, 56 K steps) T 8192 9226 against 9867 us for the whole fp8
        layer; level at H 4096-5120 (qwen3-235b, glm-4.5); slower at H 2048 (qwen3-30b-a3b: 1181 against
        1143), where its per-tile prologue and epilogue weigh more (`python benchmarks/bench_experts_quant.py
        --shapes deepseek-v3,qwen3-30b-a3b-fp8 --no-graph --decode 1 --prefill 8192`, with and without
        `--pin gate_up=fp8_tma`).
    fp8_batch_invariant_imprecise_acc:
        the batch-invariant fp8 dots restart the wgmma's reduced-precision (~13-bit) accumulation every this
        many products with an f32 sum in between; without it a requantized activation sitting at an e4m3
        rounding tie flips code (rel-L2 2.6e-2 at T 1 against the W8A8 reference; with 64: <= 6.4e-3,
        +10% time at deepseek-v3 T 8192).
    pdl_gemm_trigger:
        how a GEMM of the chain lets its successor start under programmatic dependent launch: "exit"
        (the successor launches as this grid's programs exit) or "early" (right after its own wait).
        "early" lost up to 6% where gate_up's grid is under a wave (gpt-oss-120b T 2: down's programs,
        resident early, crowd a few SMs); "exit" lost nowhere beyond noise (0.994-1.036x stream order at
        20 decode points, bf16 / FP8 / MXFP4, CUDA graph, L2 flushed; `python tools/diag_pdl.py` times a
        trigger against stream order, `python benchmarks/bench_experts.py --tokens 1,2,4,8 --pdl off` against
        the default).
    fp4_gemv_max_pairs:
        FP4 layers with at most this many (token, slot) pairs run the GEMV path (no alignment, each weight
        byte decoded once per pair). gpt-oss-120b (H200): the GEMV beat the MMA tiles 1.7x at T 16 and
        1.3x at T 32 (N 64, 128); its cost grows with pairs, the MMA tiles' with distinct experts.
    fp4_gemv_long_k_min_hidden, fp4_gemv_few_pairs, fp4_gemv_tiles_*:
        GEMV tiles (BN outputs per program, BK reduction elements a step, warps). From the long-K hidden
        size the narrow tile with a long K step; else up to few_pairs pairs the narrow tile (more programs),
        above it the wider one. deepseek-v3-nvfp4 (H 7168) T 1 / 2 / 8: 106.2 / 186.3 / 628.5 us against
        119.1 / 210.9 / 664.0 with the earlier tiles; gpt-oss-120b (H 2880) gained nothing from BK 1024
        (T 2 73.0 against 70.3 us), so below the threshold the earlier tiles stay. The interpreter tiles
        keep the CPU tests small.
    fp8_quant_groups_per_program, fp8_quant_warps:
        the fp8 activation-quantization pass: groups of G channels per program, and warps. 8 groups on 2
        warps against 4 on 4: 23.8 / 29.1 us at 8192 x 2048, 66.6 / 86.3 at 8192 x 7168 (same bits: a
        group's numbers do not depend on the split).
    """

    gather_x_min_intermediate: int = 8192
    gather_x_min_pairs: int = 8192
    flat_down_max_k_steps: int = 16
    fp8_gluon_gate_up_min_hidden: int = 4096
    fp8_batch_invariant_imprecise_acc: int = 64
    pdl_gemm_trigger: str = "exit"
    fp4_gemv_max_pairs: int = 128
    fp4_gemv_long_k_min_hidden: int = 4096
    fp4_gemv_few_pairs: int = 8
    fp4_gemv_tiles_long_k: tuple[int, int, int] = (16, 1024, 4)
    fp4_gemv_tiles_few: tuple[int, int, int] = (16, 512, 4)
    fp4_gemv_tiles: tuple[int, int, int] = (32, 256, 4)
    fp4_gemv_tiles_interpreter: tuple[int, int, int] = (16, 64, 4)
    fp8_quant_groups_per_program: int = 8
    fp8_quant_warps: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "pdl_gemm_trigger":
                if v not in ("early", "exit"):
                    raise ValueError(f"KernelRules.pdl_gemm_trigger={v!r}: expected 'early' or 'exit'")
            elif f.name.startswith("fp4_gemv_tiles"):
                ok = (isinstance(v, tuple) and len(v) == 3 and all(isinstance(x, int) and x > 0 for x in v)
                      and all(x & (x - 1) == 0 for x in v))
                if not ok:
                    raise ValueError(f"KernelRules.{f.name}={v!r}: expected (block_n, block_k, num_warps), powers "
                                     "of two")
            elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"KernelRules.{f.name}={v!r}: expected an int >= 1")

    @classmethod
    def from_dict(cls, d: dict) -> KernelRules:
        """Rules from rules.json's object: tiles as {"block_n", "block_k", "num_warps"}; unknown keys refused."""
        if not isinstance(d, dict):
            raise ValueError(f"rules: expected a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"rules: unknown keys {sorted(extra)} (expected a subset of {sorted(known)})")
        kw = {}
        for k, v in d.items():
            if k.startswith("fp4_gemv_tiles"):
                if not isinstance(v, dict) or set(v) != {"block_n", "block_k", "num_warps"}:
                    raise ValueError(f"rules.{k}={v!r}: expected {{block_n, block_k, num_warps}}")
                v = (v["block_n"], v["block_k"], v["num_warps"])
            kw[k] = v
        return cls(**kw)

    def to_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if k.startswith("fp4_gemv_tiles"):
                d[k] = {"block_n": v[0], "block_k": v[1], "num_warps": v[2]}
        return d


@lru_cache(maxsize=4)
def _load(path: str) -> KernelRules:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"kernel rules: {p} is missing (the package's tuning data)")
    return KernelRules.from_dict(json.loads(p.read_text()))


def load_rules(path: Path | None = None) -> KernelRules:
    """The kernel plan's rules: rules.json beside this module (or `path`), cached."""
    return _load(str(path or RULES_PATH))


def write_rules(rules: KernelRules, path: Path | None = None) -> Path:
    """Write `rules` as JSON (what benchmarks/tune_experts.py --write-rules does)."""
    if not isinstance(rules, KernelRules):
        raise TypeError(f"write_rules: expected KernelRules, got {type(rules).__name__}")
    p = path or RULES_PATH
    p.write_text(json.dumps(rules.to_dict(), indent=1) + "\n")
    _load.cache_clear()
    return p
