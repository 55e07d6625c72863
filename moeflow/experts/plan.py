"""The kernel plan of one fused expert step: which kernel, tile and path each stage launches, and why.

Legend: T tokens, K slots per token, N = T*K (token, slot) pairs, E experts held, H hidden, I
intermediate per expert, P padded pair positions (every expert's rows padded to BM), BM/BN/BK tiles,
S split-K parts of the down GEMM, G the quantization group along a GEMM's reduction axis.

    VARIANTS                                       the registry: one row per kernel variant
    plan_step(shape, device, options, tuning)      pure: -> KernelPlan (frozen)
    KernelPlan.explain()                           what will launch, and why the others will not
    moeflow.experts.fused.run_plan(plan, ...)      the launchers execute a plan; they never decide

A step is a chain of stages. The aligned path (every format):
    align     ids -> sorted_P, block_expert_B         pairs grouped by expert, padded to BM
    quant_x   x rows -> e4m3 + f32 scales             fp8_block only (W8A8)
    gate_up   act = act(x @ W_gu[e] (+ b))            fp8: the epilogue quantizes act
    quant_act act -> e4m3 + scales                    fp8_block with a gate_up tile narrower than G
    down      y_SNH = act @ W_d[e] (+ b)              split-K partials for decode shapes
    combine   out_TH = sum_k w[t, k] * sum_s y        slot order, no atomics
The GEMV path (FP4 weights, few pairs): gate_up and down one program per (pair, BN outputs), no align.

Each GEMM stage has variants in preference order. A variant's `supports` says whether it can run the
step (layout, divisibility, device, ...); its `rule` whether the measured rules choose it there (the
thresholds are `moeflow.tuning.rules.KernelRules`, data). The plan takes the first variant that
supports the step and whose rule holds, or the one `KernelOptions.pin` names (an error naming the
reason if that one cannot run). A variant whose kernel failed to compile on this device (shared
memory) is passed to `plan_step` as `compile_refused` and shows in the plan as a refusal.

This module imports neither Triton nor CUDA: plans are computed and explained on any machine
(`moeflow info PATH --kernels`, the CPU tests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..tuning import GemmTile, MoETileConfig, ShapeKey, lookup
from ..tuning.quant_tiles import check_tile_config, quant_tile_config
from ..tuning.rules import KernelRules, load_rules
from .options import DEFAULT_OPTIONS, KernelOptions

FORMATS = ("plain", "fp8_block", "mxfp4", "nvfp4")
FP4 = ("mxfp4", "nvfp4")
ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_clamp", "gptoss")
# The fp8 Gluon gate_up's tile (moeflow/kernels/moe_gemm_fp8_gluon.py): 64 rows, one 128-column
# quantization group, BK 128; a ring of up to 6 stages of (64 + 256) x BK bytes in 200 KB.
_GLUON_TILE_M, _GLUON_SMEM, _GLUON_MAX_STAGES, _GLUON_MIN_STAGES = 64, 200 * 1024, 6, 4


@dataclass(frozen=True, kw_only=True)
class DeviceFacts:
    """What the plan needs to know about the device the step runs on.

    type: "cuda" or "cpu" (CPU: only under the Triton interpreter); name: the CUDA device name (the
    tuning tables' key), "cpu" otherwise; capability: compute capability major (0 on CPU); sm_count:
    streaming multiprocessors (132 on CPU: the tables' heuristics then match an H100); interpreted:
    the Triton interpreter runs the kernels; gluon: this Triton ships Gluon's Hopper warp specialisation.
    """

    type: str
    name: str
    capability: int = 0
    sm_count: int = 132
    interpreted: bool = False
    gluon: bool = False

    @property
    def hopper(self) -> bool:
        return self.type == "cuda" and self.capability >= 9 and not self.interpreted


# Devices a plan can be computed for without one at hand (moeflow info --kernels --device NAME).
NAMED_DEVICES = {
    "h100": DeviceFacts(type="cuda", name="NVIDIA H100 80GB HBM3", capability=9, sm_count=132, gluon=True),
    "h200": DeviceFacts(type="cuda", name="NVIDIA H200", capability=9, sm_count=132, gluon=True),
    "a100": DeviceFacts(type="cuda", name="NVIDIA A100-SXM4-80GB", capability=8, sm_count=108),
    "cpu": DeviceFacts(type="cpu", name="cpu", interpreted=True),
}


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """Everything the choice depends on: shapes, dtypes and layouts (never tensor values).

    fmt: "plain" (bf16 / fp16 / fp32 weights) or the QuantSpec format; dtype: the weights' dtype name
    (plain) or the activations' (quantized); num_experts: E held (the kernels' grid); tiling_experts: the
    E tiles are looked up by (an offload slot pool runs the resident layer's tiles); tokens, top_k: the
    tile lookup's T and K; pairs: rows the step computes (T*K, or N for forward_pairs); layout / interleaved:
    moeflow.config.ExpertWeights'; group: G; scale_block_n: fp8 weight-scale block along N (bn); scale_f32:
    fp8 weight scales stored as f32 (not UE8M0 bytes); gate_up_dense / down_dense: that weight contiguous
    with a 16-byte aligned base and 16-byte rows (what a TMA descriptor over it needs); gemv_rows_ok: FP4 weight rows readable as
    int32 words; batch_invariant: the impl's mode; forced_tiles: a caller's MoETileConfig.
    """

    fmt: str
    dtype: str
    num_experts: int
    tiling_experts: int
    hidden_size: int
    intermediate_size: int
    top_k: int
    tokens: int
    pairs: int
    layout: str = "linear"
    interleaved: bool = False
    gate_up_bias: bool = False
    down_bias: bool = False
    activation: str = "silu"
    group: int = 0
    scale_block_n: int = 0
    scale_f32: bool = True
    gate_up_dense: bool = True
    down_dense: bool = True
    gemv_rows_ok: bool = True
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"StepShape.fmt={self.fmt!r}: expected one of {FORMATS}")
        if self.layout not in ("linear", "matmul"):
            raise ValueError(f"StepShape.layout={self.layout!r}: expected 'linear' or 'matmul'")
        for name in ("num_experts", "tiling_experts", "hidden_size", "intermediate_size", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"StepShape.{name}={v!r}: expected an int >= 1")
        for name in ("tokens", "pairs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"StepShape.{name}={v!r}: expected an int >= 0")

    @property
    def quantized(self) -> bool:
        return self.fmt != "plain"

    def shape_key(self) -> ShapeKey:
        return ShapeKey(num_experts=self.tiling_experts, hidden_size=self.hidden_size,
                        intermediate_size=self.intermediate_size, top_k=self.top_k, layout=self.layout,
                        interleaved=self.interleaved, dtype=self.dtype)


@dataclass(frozen=True)
class Ctx:
    """What a variant's supports / rule / params read: the step, the device, the options, the chosen tiles
    (None on the GEMV path) and the rules."""

    shape: StepShape
    device: DeviceFacts
    options: KernelOptions
    tiles: MoETileConfig | None
    rules: KernelRules

    @property
    def tma(self) -> bool:
        """TMA descriptors allowed: options.tma True (the interpreter runs them too), or None on Hopper."""
        t = self.options.tma
        return (self.device.type == "cuda" and self.device.capability >= 9) if t is None else t


Check = Callable[[Ctx], tuple[bool, str]]


@dataclass(frozen=True)
class Variant:
    """One kernel variant of one stage.

    name: unique, what KernelOptions.pin and the plan name; stage; formats / layouts it runs; kernel:
    the @triton.jit (or Gluon) entry point(s); launch: the launcher, "module:function" under
    moeflow.experts (resolved at run time, so this registry imports no Triton); supports(ctx) -> (ok,
    reason); rule(ctx) -> (chosen, reason): the measured rule, passed over when pinned; params(ctx) ->
    the launch choices a launcher reads (tuple of (name, value)); summary: one line for explain(); path:
    the step's path the variant belongs to ("gemv": a path of its own, without alignment, chosen before
    the stages; never a candidate on the aligned path).
    """

    name: str
    stage: str
    formats: tuple[str, ...]
    kernel: str
    launch: str
    summary: str
    layouts: tuple[str, ...] = ("linear", "matmul")
    path: str = "aligned"
    supports: Check = field(default=lambda ctx: (True, ""))
    rule: Check = field(default=lambda ctx: (True, ""))
    params: Callable[[Ctx], tuple] = field(default=lambda ctx: ())


def _all(*checks: Check) -> Check:
    def check(ctx: Ctx) -> tuple[bool, str]:
        for c in checks:
            ok, why = c(ctx)
            if not ok:
                return False, why
        return True, ""
    return check


# ---------------------------------------------------------------------------------------- shared checks
def _tma_allowed(ctx: Ctx) -> tuple[bool, str]:
    if ctx.tma:
        return True, ""
    if ctx.options.tma is False:
        return False, "KernelOptions(tma=False)"
    return False, f"no TMA on {ctx.device.name} (compute capability {ctx.device.capability} < 9)"


def _linear(ctx: Ctx) -> tuple[bool, str]:
    s = ctx.shape
    if s.layout != "linear" or s.interleaved:
        return False, f"layout {s.layout}{' interleaved' if s.interleaved else ''} (TMA boxes need linear)"
    return True, ""


def _linear_down(ctx: Ctx) -> tuple[bool, str]:
    """down's layout for TMA boxes (gate/up interleaving does not concern it)."""
    s = ctx.shape
    return (True, "") if s.layout == "linear" else (False, f"layout {s.layout} (TMA boxes need linear)")


def _gate_up_dense(ctx: Ctx) -> tuple[bool, str]:
    return (True, "") if ctx.shape.gate_up_dense else (False, "gate_up not contiguous / 16-byte aligned")


def _down_dense(ctx: Ctx) -> tuple[bool, str]:
    return (True, "") if ctx.shape.down_dense else (False, "down not contiguous / 16-byte aligned")


def _divides(what: str, n: int, b: int) -> tuple[bool, str]:
    return (True, "") if n % b == 0 else (False, f"{what} {b} does not divide {n}")


def _gate_up_tma(ctx: Ctx) -> tuple[bool, str]:
    s, t = ctx.shape, ctx.tiles.gate_up
    if s.gate_up_bias:
        return False, "gate_up bias"
    ok, why = _divides("BN", s.intermediate_size, t.block_n)
    if ok:
        ok, why = _divides("BK", s.hidden_size, t.block_k)
    return ok, why


def _down_tma(ctx: Ctx) -> tuple[bool, str]:
    s, t = ctx.shape, ctx.tiles.down
    if s.down_bias:
        return False, "down bias"
    if t.split_k != 1:
        return False, f"split_k {t.split_k} (TMA down runs one split)"
    ok, why = _divides("BN", s.hidden_size, t.block_n)
    if ok:
        ok, why = _divides("BK", s.intermediate_size, t.block_k)
    return ok, why


def _persistent_programs(ctx: Ctx, t: GemmTile, flat: bool = False) -> int:
    """Programs of a persistent TMA GEMM (one per SM; a few under the interpreter); 0: one per tile."""
    if not (t.persistent or flat):
        return 0
    return ctx.device.sm_count if ctx.device.type == "cuda" else 4


def _fused_gate_up(ctx: Ctx) -> bool:
    """The TMA gate_up's [BM, 2BN] dot over gate and up rows interleaved 8 by 8 (one box a K step)."""
    bn = ctx.tiles.gate_up.block_n
    return bn % 8 == 0 and ctx.shape.intermediate_size % bn == 0


def _fp8_scalar_ws(ctx: Ctx, t: GemmTile) -> bool:
    """An fp8 tile whose BN columns lie in one weight-scale block: one scale a K step."""
    return ctx.shape.scale_block_n % t.block_n == 0


def _imprecise(ctx: Ctx, t: GemmTile) -> int | None:
    """The fp8 dots' max_num_imprecise_acc: the rules' restart interval in batch-invariant mode where it is
    below BK; None (Triton's default: one restart a K tile) otherwise."""
    acc = ctx.rules.fp8_batch_invariant_imprecise_acc
    return acc if ctx.shape.batch_invariant and acc < t.block_k else None


def _fp4_asm(ctx: Ctx, rows: int, t: GemmTile | None = None) -> bool:
    """FP4 E2M1 decode by inline PTX: CUDA, not the interpreter; an MMA tile's packed block must give every
    thread a multiple of 4 bytes (narrower tiles keep the Triton decode, the same numbers)."""
    if ctx.device.type != "cuda" or ctx.device.interpreted:
        return False
    return t is None or rows * (t.block_k // 2) % (4 * 32 * t.num_warps) == 0


def _quant_out(ctx: Ctx) -> bool:
    """The fp8 gate_up epilogue quantizes whole G-groups of act (BN a multiple of G); else a separate pass."""
    return ctx.tiles.gate_up.block_n % ctx.shape.group == 0


# ---------------------------------------------------------------------------------------- bf16 / fp16 / fp32
def _gather_x_rule(ctx: Ctx) -> tuple[bool, str]:
    s, r = ctx.shape, ctx.rules
    if s.intermediate_size < r.gather_x_min_intermediate:
        return False, f"rule: I {s.intermediate_size} < {r.gather_x_min_intermediate}"
    if s.pairs < r.gather_x_min_pairs:
        return False, f"rule: T*K {s.pairs} < {r.gather_x_min_pairs}"
    return True, f"rule: I >= {r.gather_x_min_intermediate} and T*K >= {r.gather_x_min_pairs}"


def _flat_down_rule(ctx: Ctx) -> tuple[bool, str]:
    cfg, r = ctx.tiles, ctx.rules
    if cfg.flat_down is not None:
        return cfg.flat_down, f"tuned entry: flat_down={cfg.flat_down}"
    steps = -(-ctx.shape.intermediate_size // cfg.down.block_k)
    if cfg.block_m < 128 or cfg.half_tail:
        return False, "rule: flat only on full 128-row tiles"
    if steps > r.flat_down_max_k_steps:
        return False, f"rule: {steps} K steps > {r.flat_down_max_k_steps}"
    return True, f"rule: BM 128 tiles and {steps} <= {r.flat_down_max_k_steps} K steps"


def _plain_gate_up_params(ctx: Ctx, gather_x: bool) -> tuple:
    return (("fused", _fused_gate_up(ctx)), ("programs", _persistent_programs(ctx, ctx.tiles.gate_up)),
            ("gather_x", gather_x))


_PLAIN = ("plain",)
_TMA_GATE_UP = _all(_tma_allowed, _linear, _gate_up_dense, _gate_up_tma)
_TMA_DOWN = _all(_tma_allowed, _linear_down, _down_dense, _down_tma)

# ---------------------------------------------------------------------------------------- fp8_block
def _fp8_tma_common(ctx: Ctx, t: GemmTile) -> tuple[bool, str]:
    if ctx.tiles.block_m < 64:
        return False, f"BM {ctx.tiles.block_m} < 64 (decode tiles keep the pointer kernels they were tuned with)"
    if not _fp8_scalar_ws(ctx, t):
        return False, f"BN {t.block_n} spans several weight-scale blocks ({ctx.shape.scale_block_n})"
    return True, ""


def _fp8_gate_up_tma(ctx: Ctx) -> tuple[bool, str]:
    if not _quant_out(ctx):
        return False, "gate_up BN narrower than G (act quantized by a separate pass)"
    ok, why = _fp8_tma_common(ctx, ctx.tiles.gate_up)
    return (ok, why) if not ok else _gate_up_tma(ctx)


def _fp8_down_tma(ctx: Ctx) -> tuple[bool, str]:
    ok, why = _fp8_tma_common(ctx, ctx.tiles.down)
    return (ok, why) if not ok else _down_tma(ctx)


def gluon_gate_up_stages(ctx: Ctx) -> int | None:
    """Ring stages of the fp8 Gluon gate_up for the plan's tiles, or None where it does not serve: BM 64,
    BN = BK = 128 (one quantization group a tile, one scale a K step), 128 | I, BK | H, 128 | bn."""
    s, cfg = ctx.shape, ctx.tiles
    t = cfg.gate_up
    if (cfg.block_m != _GLUON_TILE_M or t.block_n != 128 or t.block_k != 128 or s.intermediate_size % 128
            or s.hidden_size % t.block_k or s.scale_block_n % 128):
        return None
    stages = min(_GLUON_MAX_STAGES, _GLUON_SMEM // ((_GLUON_TILE_M + 256) * t.block_k))  # e4m3: a byte a value
    return stages if stages >= _GLUON_MIN_STAGES else None


def _fp8_gluon_supports(ctx: Ctx) -> tuple[bool, str]:
    s, d = ctx.shape, ctx.device
    if not (d.hopper and d.gluon):
        return False, "needs sm_90+ and Gluon's Hopper warp specialisation"
    if ctx.options.tma is False:
        return False, "KernelOptions(tma=False)"
    if s.batch_invariant:
        return False, "batch-invariant mode (restarted fp8 accumulation)"
    if not s.scale_f32:
        return False, "UE8M0 weight scales"
    if s.gate_up_bias or s.layout != "linear" or s.interleaved or not s.gate_up_dense:
        return False, "needs linear, dense weights without bias"
    if not _quant_out(ctx):
        return False, "gate_up BN narrower than G"
    if s.hidden_size % 16:
        return False, f"H {s.hidden_size} rows not 16-byte aligned for cp.async"
    if gluon_gate_up_stages(ctx) is None:
        return False, "tiles are not BM 64 x BN 128 x BK 128 with 128 | I, bn"
    return True, ""


def _fp8_gluon_rule(ctx: Ctx) -> tuple[bool, str]:
    h, m = ctx.shape.hidden_size, ctx.rules.fp8_gluon_gate_up_min_hidden
    return (h >= m, f"rule: H {h} {'>=' if h >= m else '<'} {m}")


def _fp8_params(ctx: Ctx, t: GemmTile) -> tuple:
    return (("scalar_ws", _fp8_scalar_ws(ctx, t)), ("imprecise", _imprecise(ctx, t)))


# ---------------------------------------------------------------------------------------- FP4 GEMV
def gemv_tiles(ctx: Ctx) -> tuple[int, int, int]:
    """(BN, BK, warps) of the GEMV kernels (KernelRules.fp4_gemv_*)."""
    s, r = ctx.shape, ctx.rules
    if ctx.device.type != "cuda":
        return r.fp4_gemv_tiles_interpreter
    if s.hidden_size >= r.fp4_gemv_long_k_min_hidden:
        return r.fp4_gemv_tiles_long_k
    return r.fp4_gemv_tiles_few if s.pairs <= r.fp4_gemv_few_pairs else r.fp4_gemv_tiles


def _gemv_supports(ctx: Ctx) -> tuple[bool, str]:
    s = ctx.shape
    if s.batch_invariant:
        return False, "batch-invariant mode (one arithmetic for every T)"
    if not s.gemv_rows_ok:
        return False, "weight rows not readable as int32 words"
    return True, ""


def _gemv_rule(ctx: Ctx) -> tuple[bool, str]:
    n, m = ctx.shape.pairs, ctx.rules.fp4_gemv_max_pairs
    return (0 < n <= m, f"rule: T*K {n} {'<=' if n <= m else '>'} {m}")


def _gemv_params(ctx: Ctx) -> tuple:
    bn, bk, nw = gemv_tiles(ctx)
    return (("block_n", bn), ("block_k", bk), ("num_warps", nw), ("asm", _fp4_asm(ctx, 0)))


_FP8 = ("fp8_block",)


def _quant_pass_params(ctx: Ctx) -> tuple:
    """The fp8 row-quantization pass's launch: groups of G per program and warps (KernelRules.fp8_quant_*)."""
    return (("groups_per_program", ctx.rules.fp8_quant_groups_per_program), ("num_warps", ctx.rules.fp8_quant_warps))

VARIANTS: tuple[Variant, ...] = (
    Variant("align", "align", FORMATS, "moe_align.align_launch (small / fused / count+place by N)",
            "fused:launch_align", "pairs grouped by expert, each expert padded to BM rows"),
    Variant("fp8_quant_rows", "quant_x", _FP8, "moe_gemm_quant.fp8_quant_rows_kernel", "fused:launch_quant_x",
            "x rows to e4m3, one f32 scale per row per G channels", params=lambda ctx: _quant_pass_params(ctx)),
    # ---- gate_up, preference order per format
    Variant("tma_gather_x", "gate_up", _PLAIN, "moe_gemm_tma.gather_rows_kernel + moe_gate_up_tma_kernel",
            "fused:launch_gate_up_tma", "rows copied into pair order, then weight and row tiles by TMA",
            layouts=("linear",), supports=_TMA_GATE_UP, rule=_gather_x_rule,
            params=lambda ctx: _plain_gate_up_params(ctx, True)),
    Variant("tma", "gate_up", _PLAIN, "moe_gemm_tma.moe_gate_up_tma_kernel", "fused:launch_gate_up_tma",
            "weight tiles by TMA, rows gathered by pointer loads", layouts=("linear",), supports=_TMA_GATE_UP,
            params=lambda ctx: _plain_gate_up_params(ctx, False)),
    Variant("pointer", "gate_up", _PLAIN, "moe_gemm.moe_gate_up_kernel", "fused:launch_gate_up_pointer",
            "pointer loads; every layout, interleaving and bias"),
    Variant("fp8_gluon", "gate_up", _FP8, "moe_gemm_fp8_gluon.moe_gate_up_fp8_ws_kernel",
            "fused:launch_gate_up_fp8_gluon", "warp-specialised Gluon: TMA producer warp, two consumer groups",
            layouts=("linear",), supports=_fp8_gluon_supports, rule=_fp8_gluon_rule,
            params=lambda ctx: (("stages", gluon_gate_up_stages(ctx)),)),
    Variant("fp8_tma", "gate_up", _FP8, "moe_gemm_fp8_tma.moe_gate_up_fp8_tma_kernel",
            "fused:launch_gate_up_fp8_tma", "weight tiles by TMA, act quantized in the epilogue",
            layouts=("linear",), supports=_all(_tma_allowed, _linear, _gate_up_dense, _fp8_gate_up_tma),
            params=lambda ctx: (("fused", _fused_gate_up(ctx)),
                                ("programs", _persistent_programs(ctx, ctx.tiles.gate_up)))
            + _fp8_params(ctx, ctx.tiles.gate_up)),
    Variant("fp8_pointer", "gate_up", _FP8, "moe_gemm_quant.moe_gate_up_fp8_kernel",
            "fused:launch_gate_up_fp8_pointer", "pointer loads; every layout and bias",
            params=lambda ctx: (("quant_out", _quant_out(ctx)),) + _fp8_params(ctx, ctx.tiles.gate_up)),
    Variant("w4_gemv", "gate_up", FP4, "moe_gemm_quant.moe_gate_up_w4_gemv_kernel", "fused:launch_gate_up_gemv",
            "GEMV: one program per (pair, BN outputs), each weight byte decoded once per pair",
            path="gemv", supports=_gemv_supports, rule=_gemv_rule, params=_gemv_params),
    Variant("w4_pointer", "gate_up", FP4, "moe_gemm_quant.moe_gate_up_w4_kernel", "fused:launch_gate_up_w4",
            "MMA tiles, E2M1 decoded in the load path to the activations' dtype",
            params=lambda ctx: (("asm", _fp4_asm(ctx, ctx.tiles.gate_up.block_n * (2 if ctx.shape.interleaved
                                                                                    else 1), ctx.tiles.gate_up)),)),
    Variant("fp8_quant_act", "quant_act", _FP8, "moe_gemm_quant.fp8_quant_rows_kernel", "fused:launch_quant_act",
            "act rows (f32) to e4m3 where gate_up's tile is narrower than G", params=lambda ctx: _quant_pass_params(ctx)),
    # ---- down
    Variant("tma_flat", "down", _PLAIN, "moe_gemm_tma.moe_down_tma_kernel (FLAT)", "fused:launch_down_tma",
            "act and weight tiles by TMA, one flattened persistent loop over (tile, K step)",
            layouts=("linear",), supports=_TMA_DOWN, rule=_flat_down_rule,
            params=lambda ctx: (("flat", True), ("programs", _persistent_programs(ctx, ctx.tiles.down, True)))),
    Variant("tma", "down", _PLAIN, "moe_gemm_tma.moe_down_tma_kernel", "fused:launch_down_tma",
            "act and weight tiles by TMA", layouts=("linear",), supports=_TMA_DOWN,
            params=lambda ctx: (("flat", False), ("programs", _persistent_programs(ctx, ctx.tiles.down)))),
    Variant("pointer", "down", _PLAIN, "moe_gemm.moe_down_kernel", "fused:launch_down_pointer",
            "pointer loads; split-K partials; every layout and bias"),
    Variant("fp8_tma", "down", _FP8, "moe_gemm_fp8_tma.moe_down_fp8_tma_kernel", "fused:launch_down_fp8_tma",
            "act and weight tiles by TMA", layouts=("linear",),
            supports=_all(_tma_allowed, _linear_down, _down_dense, _fp8_down_tma),
            params=lambda ctx: (("programs", _persistent_programs(ctx, ctx.tiles.down)),)
            + _fp8_params(ctx, ctx.tiles.down)),
    Variant("fp8_pointer", "down", _FP8, "moe_gemm_quant.moe_down_fp8_kernel", "fused:launch_down_fp8_pointer",
            "pointer loads; split-K partials; every layout and bias",
            params=lambda ctx: _fp8_params(ctx, ctx.tiles.down)),
    Variant("w4_gemv", "down", FP4, "moe_gemm_quant.moe_down_w4_gemv_kernel", "fused:launch_down_gemv",
            "GEMV: one program per (pair, BN outputs)", path="gemv", supports=_gemv_supports, rule=_gemv_rule,
            params=_gemv_params),
    Variant("w4_pointer", "down", FP4, "moe_gemm_quant.moe_down_w4_kernel", "fused:launch_down_w4",
            "MMA tiles, E2M1 decoded in the load path; split-K partials",
            params=lambda ctx: (("asm", _fp4_asm(ctx, ctx.tiles.down.block_n, ctx.tiles.down)),)),
    Variant("combine", "combine", FORMATS, "moe_gemm.moe_combine_kernel", "fused:launch_combine",
            "out = sum over slots (and splits) of weight * y, slot order"),
)


def variants_for(stage: str, fmt: str) -> tuple[Variant, ...]:
    """The registry rows of `stage` that run format `fmt`, in preference order."""
    return tuple(v for v in VARIANTS if v.stage == stage and fmt in v.formats)


# ---------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class StagePlan:
    """One launch (or two, for a gather + GEMM) of the step: the variant, its tile and launch params."""

    stage: str
    variant: str
    kernel: str
    launch: str
    tile: GemmTile | None
    params: tuple[tuple[str, object], ...]
    why: str

    def get(self, name: str, default=None):
        return dict(self.params).get(name, default)


@dataclass(frozen=True)
class KernelPlan:
    """Every kernel, tile and path one expert step launches (frozen; `explain()` prints it).

    path: "aligned" or "gemv"; tiles: the MoETileConfig of the aligned path (None on the GEMV path) and
    tile_source where it came from; max_blocks / padded: the alignment's BM-row blocks and P (a bound from
    shapes alone: no host sync); pdl / pdl_gemm: programmatic dependent launch, and the GEMMs' mode
    (moeflow.kernels.pdl: 0 off, 1 early trigger, 2 at exit); refused: (stage, variant, reason) for each
    variant passed over, in order.
    """

    impl: str
    shape: StepShape
    device: DeviceFacts
    options: KernelOptions
    path: str
    tiles: MoETileConfig | None
    tile_source: str
    stages: tuple[StagePlan, ...]
    refused: tuple[tuple[str, str, str], ...]
    max_blocks: int
    padded: int
    pdl: bool
    pdl_gemm: int

    def stage(self, name: str) -> StagePlan | None:
        return next((s for s in self.stages if s.stage == name), None)

    def explain(self) -> str:
        """A readable account: the step, each launch with its tile and why, and every refusal."""
        s, d = self.shape, self.device
        head = (f"{self.impl}: {s.fmt} {s.dtype} E={s.num_experts} H={s.hidden_size} I={s.intermediate_size} "
                f"K={s.top_k} T={s.tokens} (pairs {s.pairs}), {s.layout}{' interleaved' if s.interleaved else ''}"
                f"{', batch-invariant' if s.batch_invariant else ''} on {d.name}")
        lines = [head, f"  path {self.path}; tiles: {self.tile_source}"
                 + (f"; P = {self.padded} padded rows in {self.max_blocks} blocks" if self.tiles else "")
                 + f"; PDL {'on' if self.pdl else 'off'}"]
        for st in self.stages:
            tile = ""
            if st.tile is not None:
                t = st.tile
                bm = f"BM {self.tiles.block_m}{'(+half)' if self.tiles.half_tail else ''} x " if self.tiles else ""
                tile = (f" [{bm}BN {t.block_n} x BK {t.block_k}, {t.num_warps} warps, {t.num_stages} stages"
                        + (f", split {t.split_k}" if t.split_k > 1 else "") + (", persistent" if t.persistent else "")
                        + "]")
            extra = ", ".join(f"{k}={v}" for k, v in st.params if v not in (None, False, 0))
            lines.append(f"  {st.stage:<9} {st.variant:<14} {st.kernel}{tile}" + (f" {{{extra}}}" if extra else "")
                         + (f"  <- {st.why}" if st.why else ""))
        for stage, name, why in self.refused:
            lines.append(f"    not {stage}.{name}: {why}")
        return "\n".join(lines)


class PlanError(ValueError):
    """A plan cannot be made as asked (a pinned variant that does not support the step, a tile configuration
    the format cannot run); the message names the variant or field and the reason."""


def choose_tiles(shape: StepShape, device: DeviceFacts, forced: MoETileConfig | None) -> tuple[MoETileConfig, str]:
    """The aligned path's tile configuration and where it came from (a caller's, the tuned table nearest T,
    or the heuristics)."""
    s = shape
    if forced is not None:
        if s.quantized:
            try:
                check_tile_config(forced, s.fmt, s.group)
            except ValueError as exc:
                raise PlanError(str(exc)) from exc
        return forced, "forced by the caller (tile_config)"
    T = max(1, s.tokens)
    if s.quantized:
        cfg = quant_tile_config(s.fmt, s.group, s.tiling_experts, s.hidden_size, s.intermediate_size, s.top_k, T,
                                batch_invariant=s.batch_invariant, sm_count=device.sm_count,
                                small=device.type == "cpu")
        return cfg, "quantized heuristics (moeflow.tuning.quant_tiles)"
    from ..tuning import load_table, nearest_key, table_device

    key = s.shape_key()
    cfg = lookup(key, T, device.name, batch_invariant=s.batch_invariant, sm_count=device.sm_count)
    table = load_table(key, device.name)
    if table is None:
        return cfg, "heuristics (no tuned table for this shape and device)"
    src = table_device(key, device.name)
    if s.batch_invariant:
        by_t = table["batch_invariant_by_T"]
        if by_t:
            return cfg, f"tuned table {key.file_name(src)}, batch_invariant_by_T[{nearest_key(by_t, T)}]"
        return cfg, f"tuned table {key.file_name(src)}, batch_invariant"
    return cfg, f"tuned table {key.file_name(src)}, configs[{nearest_key(table['configs'], T)}]"


def refusal_key(stage: str, variant: str, tiles: MoETileConfig | None) -> str:
    """The compile_refused key of a variant at these tiles: a kernel that does not compile (shared memory)
    at one tiling may at another."""
    if tiles is None:
        return f"{stage}.{variant}"
    t = getattr(tiles, stage, None)
    tile = "" if t is None else f" BN{t.block_n} BK{t.block_k} w{t.num_warps} s{t.num_stages}"
    return f"{stage}.{variant} @BM{tiles.block_m}{'h' if tiles.half_tail else ''}{tile}"


def _pick(stage: str, ctx: Ctx, refused: list, compile_refused: Mapping[str, str]) -> StagePlan:
    """The stage's variant: the pinned one (checked), else the first that supports the step and whose rule
    holds; each variant passed over is recorded in `refused`."""
    s = ctx.shape
    cands = [v for v in variants_for(stage, s.fmt) if s.layout in v.layouts and v.path == "aligned"]
    pinned = ctx.options.pinned(stage)
    if pinned is not None:
        names = [v.name for v in variants_for(stage, s.fmt)]
        if pinned not in names:
            raise PlanError(f"KernelOptions.pin[{stage!r}]={pinned!r}: no such {s.fmt} variant (have {names})")
        v = next(v for v in variants_for(stage, s.fmt) if v.name == pinned)
        if v.path != "aligned":
            raise PlanError(f"KernelOptions.pin[{stage!r}]={pinned!r}: a {v.path} path variant, and this step runs "
                            f"the aligned path (tiles forced by the caller, or the other stage pinned otherwise)")
        if s.layout not in v.layouts:
            raise PlanError(f"KernelOptions.pin[{stage!r}]={pinned!r}: does not run layout {s.layout!r}")
        ok, why = v.supports(ctx)
        key = refusal_key(stage, v.name, ctx.tiles)
        if ok and key in compile_refused:
            ok, why = False, f"did not compile here: {compile_refused[key]}"
        if not ok:
            raise PlanError(f"KernelOptions.pin[{stage!r}]={pinned!r} cannot run this step: {why}")
        return _stage(stage, v, ctx, "pinned by KernelOptions")
    for v in cands:
        ok, why = v.supports(ctx)
        key = refusal_key(stage, v.name, ctx.tiles)
        if ok and key in compile_refused:
            ok, why = False, f"did not compile here: {compile_refused[key]}"
        if ok:
            chosen, rule_why = v.rule(ctx)
            if chosen:
                return _stage(stage, v, ctx, rule_why)
            why = rule_why
        refused.append((stage, v.name, why))
    raise PlanError(f"no {s.fmt} variant of stage {stage!r} runs this step: "
                    + "; ".join(f"{n}: {w}" for st, n, w in refused if st == stage))


def _stage(stage: str, v: Variant, ctx: Ctx, why: str) -> StagePlan:
    tile = None
    if ctx.tiles is not None and stage in ("gate_up", "down"):
        tile = getattr(ctx.tiles, stage)
    return StagePlan(stage=stage, variant=v.name, kernel=v.kernel, launch=v.launch, tile=tile,
                     params=tuple(v.params(ctx)), why=why)


def max_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on BM-row blocks after padding each expert to BM (no host sync needed)."""
    return -(-num_pairs // block_m) + min(num_pairs, num_experts)


def plan_step(shape: StepShape, device: DeviceFacts, *, impl: str = "triton",
              options: KernelOptions = DEFAULT_OPTIONS, tile_config: MoETileConfig | None = None,
              rules: KernelRules | None = None, compile_refused: Mapping[str, str] | None = None) -> KernelPlan:
    """The KernelPlan of one step (pure: the same arguments give the same plan).

    Args:
        shape: the step's shapes, dtypes and layouts (StepShape).
        device: DeviceFacts of the device the tensors live on.
        impl: the impl's name (for explain()).
        options: the caller's KernelOptions (tma / pdl / pinned variants).
        tile_config: a caller's MoETileConfig for the aligned path (tests, the tuner); None: tuned table or
            heuristics (choose_tiles).
        rules: the measured thresholds; None: moeflow/tuning/rules.json.
        compile_refused: {refusal_key(...): reason} for variants whose kernel did not compile on this device.
    Raises:
        PlanError: a pinned variant that cannot run the step; tiles the format cannot run.
    """
    if not isinstance(options, KernelOptions):
        raise TypeError(f"options: expected KernelOptions, got {type(options).__name__}")
    rules = rules or load_rules()
    compile_refused = compile_refused or {}
    refused: list[tuple[str, str, str]] = []
    s = shape
    if device.type == "cuda" and device.capability >= 9 and not device.interpreted and options.pdl is not False:
        pdl, pdl_gemm = True, 1 if rules.pdl_gemm_trigger == "early" else 2
    else:
        pdl, pdl_gemm = False, 0
    common = dict(impl=impl, shape=s, device=device, options=options, refused=(), pdl=pdl, pdl_gemm=pdl_gemm)
    if s.fmt in FP4 and tile_config is None:
        ctx = Ctx(s, device, options, None, rules)
        pin_gu, pin_dn = options.pinned("gate_up"), options.pinned("down")
        gemv_ok, gemv_why = _gemv_supports(ctx)
        rule_ok, rule_why = _gemv_rule(ctx)
        if (pin_gu == "w4_gemv") != (pin_dn == "w4_gemv") and "w4_gemv" in (pin_gu, pin_dn):
            raise PlanError("KernelOptions.pin: 'w4_gemv' is a path (no alignment); pin it for both gate_up and down")
        if pin_gu == "w4_gemv" and not gemv_ok:
            raise PlanError(f"KernelOptions.pin['gate_up']='w4_gemv' cannot run this step: {gemv_why}")
        if pin_gu == "w4_gemv" or (pin_gu is None and pin_dn is None and gemv_ok and rule_ok):
            why = "pinned by KernelOptions" if pin_gu else rule_why
            gu = next(v for v in variants_for("gate_up", s.fmt) if v.name == "w4_gemv")
            dn = next(v for v in variants_for("down", s.fmt) if v.name == "w4_gemv")
            comb = variants_for("combine", s.fmt)[0]
            stages = (_stage("gate_up", gu, ctx, why), _stage("down", dn, ctx, why), _stage("combine", comb, ctx, ""))
            return KernelPlan(**{**common, "path": "gemv", "tiles": None, "stages": stages,
                                 "tile_source": "GEMV tiles (moeflow.tuning.rules)", "max_blocks": 0, "padded": 0})
        refused.append(("path", "gemv", gemv_why if not gemv_ok else rule_why))
    elif s.fmt in FP4:
        refused.append(("path", "gemv", "tiles forced by the caller (the aligned path)"))
    tiles, source = choose_tiles(s, device, tile_config)
    ctx = Ctx(s, device, options, tiles, rules)
    stages = [_pick("align", ctx, refused, compile_refused)]
    if s.fmt == "fp8_block":
        stages.append(_pick("quant_x", ctx, refused, compile_refused))
    stages.append(_pick("gate_up", ctx, refused, compile_refused))
    if s.fmt == "fp8_block" and not _quant_out(ctx):
        stages.append(_pick("quant_act", ctx, refused, compile_refused))
    stages.append(_pick("down", ctx, refused, compile_refused))
    stages.append(_pick("combine", ctx, refused, compile_refused))
    mb = max_blocks_for(s.pairs, s.num_experts, tiles.block_m)
    return KernelPlan(**{**common, "path": "aligned", "tiles": tiles, "tile_source": source, "stages": tuple(stages),
                         "refused": tuple(refused), "max_blocks": mb, "padded": mb * tiles.block_m})
