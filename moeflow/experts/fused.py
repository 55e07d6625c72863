"""The fused Triton expert impls' one base: plan a step (moeflow.experts.plan), then run the plan.

Legend: T tokens, K slots per token, N = T*K (token, slot) pairs (pair n = t*K + k), H hidden, I
intermediate per expert, E experts held, P padded positions, S split-K parts of the down GEMM, G the
quantization group along a GEMM's reduction axis.

`FusedExperts` holds what the bf16 (`TritonExperts`) and the quantized (`TritonQuantExperts`) impls
share: the argument checks, the plan cache (a plan is computed once per (shapes, layout, dtype,
device, T) and reused: no table lookup on a layer step), and `run_plan`, which launches a plan's
stages in order. Each stage's launcher (`launch_*` below, named by the registry row) reads only the
plan and the step's buffers: the plan decided everything (variant, tile, persistent programs, PDL,
fused gate/up box, ...).

No launcher syncs the host, so a step can be captured in a CUDA graph and replayed. Triton is
imported only inside the launchers: importing this module needs neither Triton nor CUDA.

A variant whose kernel does not compile on this device (Triton's OutOfResources: shared memory) is
recorded on the impl (`compile_refused`), the step is re-planned without it, and the plan's
explain() names the refusal; nothing is launched twice (compilation fails before anything is
enqueued).

Ids are expected in [0, E) (zero experts and EP sentinels never reach these impls); checking that on
CUDA would cost a device sync, so instead a pair with an id outside the range is never computed and
turns its token's output row to NaN (loud, not a silent clamp).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import replace

import torch

from .._triton import triton_available
from ..config import ExpertWeights, MoEConfig
from ..kernels.launch import FastKernel
from ..tuning import MoETileConfig
from .base import check_token_devices, check_tokens, flat_pairs, tiling_experts
from .devices import device_facts
from .options import DEFAULT_OPTIONS, KernelOptions
from .plan import ACTIVATIONS, KernelPlan, PlanError, StagePlan, StepShape, plan_step, refusal_key

ACT_CODES = {"silu": 0, "gelu_tanh": 1, "swiglu_clamp": 2, "gptoss": 3}
assert tuple(ACT_CODES) == ACTIVATIONS
_FORMAT_CODES = {"fp8_block": 0, "mxfp4": 1, "nvfp4": 2}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
# Combine pass: columns per program (narrowed as K*S grows, see launch_combine).
_COMBINE_BLOCK_H = 1024
# Columns of x_PH one program of the row gather copies (it takes a block's BM rows; H splits over grid
# axis 1): 128 keeps a BM 128 program at 128 values a thread on 4 warps.
_GATHER_BLOCK_H = 128


class FusedExperts:
    """Base of the fused Triton impls (see the module docstring).

    batch_invariant: one arithmetic for every T (no split-K, one K step per GEMM): a token's output bits
                     do not depend on the batch it runs in.
    tile_config:     force this MoETileConfig for every call (tests, the tuner).
    allow_cpu:       accept CPU tensors (only meaningful under the Triton interpreter; the CPU suite).
    options:         KernelOptions (tma / pdl / fast_launch / pinned variants).
    tma:             shorthand for options.tma (kept for callers that pass it alone).
    """

    name = "fused"
    graph_capturable = True  # no host sync; the GPU tests replay it from CUDA graphs
    device_types = ("cuda",)

    def __init__(self, *, batch_invariant: bool = False, tile_config: MoETileConfig | None = None,
                 allow_cpu: bool = False, options: KernelOptions | None = None, tma: bool | None = None) -> None:
        cls = type(self).__name__
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"{cls}.batch_invariant={batch_invariant!r}: expected a bool")
        if tile_config is not None and not isinstance(tile_config, MoETileConfig):
            raise TypeError(f"{cls}.tile_config: expected a MoETileConfig, got {type(tile_config).__name__}")
        if options is not None and not isinstance(options, KernelOptions):
            raise TypeError(f"{cls}.options: expected a KernelOptions, got {type(options).__name__}")
        if tma is not None and not isinstance(tma, bool):
            raise TypeError(f"{cls}.tma={tma!r}: expected None or a bool")
        options = options or DEFAULT_OPTIONS
        if tma is not None:
            if options.tma is not None and options.tma != tma:
                raise ValueError(f"{cls}: tma={tma} contradicts options.tma={options.tma}")
            options = replace(options, tma=tma)
        self.batch_invariant = batch_invariant
        self.tile_config = tile_config
        self.allow_cpu = allow_cpu
        self.options = options
        if allow_cpu:
            self.device_types = ("cuda", "cpu")
        self._plans: dict[tuple, KernelPlan] = {}
        # {"stage.variant": reason} for kernels that did not compile on this impl's devices
        self.compile_refused: dict[str, str] = {}
        # set on copies made by experts.base.tiled_as: tiles (and the path) chosen as for a layer of this
        # many experts, whatever E the weights handed in have (an offload slot pool)
        self.tiling_experts: int | None = None

    @property
    def tma(self) -> bool | None:
        return self.options.tma

    def __repr__(self) -> str:
        return f"{type(self).__name__}(batch_invariant={self.batch_invariant})"

    # ------------------------------------------------------------------ selection
    def supports(self, config: MoEConfig) -> tuple[bool, str]:
        if not isinstance(config, MoEConfig):
            return False, f"config: expected MoEConfig, got {type(config).__name__}"
        if not triton_available():
            return False, "the triton package is not installed"
        if not self.allow_cpu and not torch.cuda.is_available():
            return False, "needs a CUDA device (torch.cuda.is_available() is False)"
        if config.activation not in ACT_CODES:
            return False, f"activation {config.activation!r} has no fused kernel (have {tuple(ACT_CODES)})"
        return True, self._supports_what

    _supports_what = ""

    # ------------------------------------------------------------------ plans
    def step_shape(self, w: ExpertWeights, tokens: int, top_k: int, pairs: int, act_dtype: torch.dtype,
                   activation: str) -> StepShape:
        """The StepShape of a call (shapes, dtypes, layout and alignment facts of w; no tensor values)."""
        q = w.quant
        fmt = "plain" if q is None else q.format
        dtype = _DTYPE_NAMES[w.dtype] if q is None else _DTYPE_NAMES[act_dtype]
        gu, dn = w.gate_up, w.down
        if fmt == "fp8_block":
            group, sbn = q.block[1], q.block[0]
        else:
            group, sbn = {"plain": 0, "mxfp4": 32, "nvfp4": 16}[fmt], 0
        return StepShape(
            fmt=fmt, dtype=dtype, num_experts=w.num_experts, tiling_experts=tiling_experts(self, w),
            hidden_size=w.hidden_size, intermediate_size=w.intermediate_size, top_k=top_k, tokens=tokens,
            pairs=pairs, layout=w.layout, interleaved=bool(w.interleaved), gate_up_bias=w.gate_up_bias is not None,
            down_bias=w.down_bias is not None, activation=activation, group=group, scale_block_n=sbn,
            scale_f32=fmt != "fp8_block" or w.gate_up_scale.dtype == torch.float32,
            gate_up_dense=_dense(gu, w.hidden_size), down_dense=_dense(dn, w.intermediate_size),
            gemv_rows_ok=all(t.stride(-1) == 1 and t.stride(1) % 4 == 0 and t.stride(0) % 4 == 0
                             and t.data_ptr() % 4 == 0 for t in (gu, dn)),
            batch_invariant=self.batch_invariant)

    def plan(self, w: ExpertWeights, num_tokens: int, top_k: int, *, pairs: int | None = None,
             act_dtype: torch.dtype | None = None, activation: str = "silu") -> KernelPlan:
        """The KernelPlan a call of num_tokens tokens with top_k slots runs (cached per shape, dtype, layout,
        device and T).

        pairs: rows computed (default num_tokens * top_k; forward_pairs: N); act_dtype: the activations'
        dtype (default: the weights' for plain weights, bfloat16 for quantized); activation: the layer's.
        """
        K = top_k
        N = num_tokens * K if pairs is None else pairs
        adt = act_dtype or (w.dtype if w.quant is None else torch.bfloat16)
        gu, dn = w.gate_up, w.down
        # every fact the plan reads (StepShape), cheaply: this lookup runs on every layer step
        gs = w.gate_up_scale
        key = (self.tiling_experts, gu.shape, dn.shape, gu.dtype, gu.device, K, num_tokens, N, w.layout,
               w.interleaved, adt, w.quant, gu.data_ptr() % 16, dn.data_ptr() % 16, gu.stride(), dn.stride(),
               w.gate_up_bias is None, w.down_bias is None, activation, None if gs is None else gs.dtype)
        hit = self._plans.get(key)
        if hit is None:
            shape = self.step_shape(w, num_tokens, K, N, adt, activation)
            hit = self._plans[key] = plan_step(shape, device_facts(w.device), impl=self.name, options=self.options,
                                               tile_config=self.tile_config, compile_refused=self.compile_refused)
        return hit

    def _replan(self, plan: KernelPlan, st: StagePlan, exc: Exception) -> KernelPlan:
        """Record that st's kernel did not compile here, and the plan without it."""
        key = refusal_key(st.stage, st.variant, plan.tiles)
        self.compile_refused[key] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        self._plans.clear()
        return plan_step(plan.shape, plan.device, impl=self.name, options=self.options, tile_config=self.tile_config,
                         compile_refused=self.compile_refused)

    # ------------------------------------------------------------------ entry points
    def forward_tokens(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                       w: ExpertWeights, config: MoEConfig) -> torch.Tensor:
        """out_TH [T, H] (x's dtype) = sum over k in slot order of weights[t,k] * expert_{ids[t,k]}(x[t]).

        With config.router.weight_on_input (llama4) the weight scales the expert's input instead (rounded
        to x's dtype, as the HF module does) and the combine weight is 1.

        Args:
            x_TH: [T, H] on the weights' device, unit stride along H (dtype: see the impl).
            ids_TK: int [T, K], every id in [0, E) (an id outside gives a NaN row).
            weights_TK: float [T, K] combine weights (f32 in moeflow's routing).
            w: the experts' tensors (views of the model's parameters).
            config: the layer's MoEConfig.
        """
        self._check_common(w, config)
        T, K = check_tokens(x_TH, ids_TK, weights_TK, w.hidden_size)
        self._check_x(x_TH, w, "x_TH")
        check_token_devices(x_TH, ids_TK, weights_TK)
        if T == 0 or K == 0:
            return torch.zeros_like(x_TH)
        ids_N, wts_N = flat_pairs(ids_TK, weights_TK)
        on_input = bool(getattr(config.router, "weight_on_input", False))
        plan = self.plan(w, T, K, act_dtype=x_TH.dtype, activation=config.activation)
        return self._run(plan, x_TH, ids_N, wts_N, T, K, w, config, weight_on_input=on_input,
                         combine_weights=not on_input)

    def forward_pairs(self, x_NH: torch.Tensor, expert_N: torch.Tensor, w: ExpertWeights,
                      config: MoEConfig) -> torch.Tensor:
        """y_NH [N, H] (x's dtype): row n through expert expert_N[n], unweighted, rows in input order.

        Bits of a row depend on the tile configuration, which follows N unless batch_invariant=True (then
        they depend on the row alone).
        """
        self._check_common(w, config)
        self._check_pairs(x_NH, expert_N, w, config)
        N = int(x_NH.shape[0])
        if N == 0:
            return torch.empty_like(x_NH)
        ids_N = expert_N.to(torch.int32).contiguous()
        # Tiles are tuned by tokens of a K-slot layer: N pairs are N / K such tokens.
        plan = self.plan(w, max(1, N // config.top_k), config.top_k, pairs=N, act_dtype=x_NH.dtype,
                         activation=config.activation)
        return self._run(plan, x_NH, ids_N, None, N, 1, w, config, weight_on_input=False, combine_weights=False)

    def _run(self, plan: KernelPlan, x_MH, ids_N, wts_N, T, K, w, config, *, weight_on_input: bool,
             combine_weights: bool) -> torch.Tensor:
        b = StepBuffers(plan, x_MH, ids_N, wts_N, T, K, w, weight_on_input, combine_weights)
        return run_plan(plan, b, w, config, self)

    # ------------------------------------------------------------------ checks (impls add theirs)
    def _check_common(self, w: ExpertWeights, config: MoEConfig) -> None:
        if not isinstance(w, ExpertWeights):
            raise TypeError(f"w: expected ExpertWeights, got {type(w).__name__}")
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected MoEConfig, got {type(config).__name__}")
        ok, reason = self.supports(config)
        if not ok:
            raise ValueError(f"experts impl {self.name!r} refuses this config: {reason}")
        self._check_weights(w)
        w.check_config(config)
        if w.device.type not in self.device_types:
            raise ValueError(f"ExpertWeights on {w.device}: experts impl {self.name!r} runs on {self.device_types}")

    def _check_weights(self, w: ExpertWeights) -> None:
        raise NotImplementedError

    def _check_pairs(self, x_NH, expert_N, w, config) -> None:
        """forward_pairs' argument checks (x_NH included)."""
        raise NotImplementedError

    @staticmethod
    def _check_x(x: torch.Tensor, w: ExpertWeights, name: str) -> None:
        raise NotImplementedError


def _dense(W: torch.Tensor, k: int) -> bool:
    """A weight [E, n, k] a TMA descriptor over [E*n, k] can serve: contiguous, 16-byte base and rows."""
    return W.is_contiguous() and W.data_ptr() % 16 == 0 and (k * W.element_size()) % 16 == 0


class StepBuffers:
    """The tensors of one step: inputs and the buffers between stages (sizes from the plan: no host sync).

    x_rows [M, H] and top_k_div: the row of pair n is x_rows[n // top_k_div] (llama4's weight-on-input
    rows are made here, one per pair); ids_N int32 [N]; wts_N [N] combine weights or None; sorted_P /
    block_expert_B int32 [P] / [B] (aligned path); act_PI [P, I] (x's dtype; fp8: f32, only where a
    separate pass quantizes it); aq_PI e4m3 [P, I] and as_PG f32 [P, I/G] (fp8); y_SNH [S, N, H] (x's dtype
    for one part, f32 partials for S > 1); out_TH [T, H].
    """

    def __init__(self, plan: KernelPlan, x_MH: torch.Tensor, ids_N: torch.Tensor, wts_N: torch.Tensor | None,
                 T: int, K: int, w: ExpertWeights, weight_on_input: bool, combine_weights: bool) -> None:
        dev, dt = x_MH.device, x_MH.dtype
        self.T, self.K, self.N = T, K, T * K
        self.H, self.I, self.E = w.hidden_size, w.intermediate_size, w.num_experts
        self.ids_N, self.wts_N = ids_N, wts_N
        self.combine_wts = wts_N if combine_weights else None
        if weight_on_input:
            # llama4: the expert's input is (w * x) rounded to x's dtype, made once before the GEMMs.
            self.x_rows = (x_MH.unsqueeze(1) * wts_N.view(T, K, 1).to(dt)).reshape(self.N, self.H)
            self.top_k_div = 1
        else:
            self.x_rows, self.top_k_div = x_MH, K
        self.out_TH = torch.empty(T, self.H, dtype=dt, device=dev)
        self.act_PI = self.aq_PI = self.as_PG = self.sorted_P = self.block_expert_B = None
        fmt = plan.shape.fmt
        if plan.path == "gemv":
            if not (self.x_rows.data_ptr() % 4 == 0 and self.x_rows.stride(0) % 2 == 0):
                # an odd row stride or storage offset: the GEMV reads rows as int32 pairs; a fresh copy
                # starts aligned
                self.x_rows = torch.empty_like(self.x_rows, memory_format=torch.contiguous_format).copy_(self.x_rows)
            self.act_PI = torch.empty(self.N, self.I, dtype=dt, device=dev)
            self.y_SNH = torch.empty(1, self.N, self.H, dtype=dt, device=dev)
            return
        cfg, P = plan.tiles, plan.padded
        self.sorted_P = torch.empty(P, dtype=torch.int32, device=dev)
        self.block_expert_B = torch.empty(plan.max_blocks, dtype=torch.int32, device=dev)
        if fmt == "fp8_block":
            G = plan.shape.group
            # The intermediate activation goes from gate_up to down already quantized; a gate_up tile
            # narrower than a group leaves it in f32 for the row-quantization pass first.
            self.aq_PI = torch.empty(P, self.I, dtype=torch.float8_e4m3fn, device=dev)
            self.as_PG = torch.empty(P, -(-self.I // G), dtype=torch.float32, device=dev)
            if plan.stage("quant_act") is not None:
                self.act_PI = torch.empty(P, self.I, dtype=torch.float32, device=dev)
        else:
            self.act_PI = torch.empty(P, self.I, dtype=w.dtype if fmt == "plain" else dt, device=dev)
        S = cfg.down.split_k
        # A single part is the expert's output itself: kept in x's dtype (what the HF modules round to);
        # split-K partials stay f32 so the split adds no rounding.
        ydt = (w.dtype if fmt == "plain" else dt) if S == 1 else torch.float32
        self.y_SNH = torch.empty(S, self.N, self.H, dtype=ydt, device=dev)
        self.precision = "ieee" if w.dtype == torch.float32 else "tf32"
        self.xq = self.xs = None


_LAUNCHERS: dict[str, object] = {}


def _launcher(name: str):
    fn = _LAUNCHERS.get(name)
    if fn is None:
        mod, _, attr = name.partition(":")
        fn = _LAUNCHERS[name] = getattr(importlib.import_module(f"moeflow.experts.{mod}"), attr)
    return fn


def run_plan(plan: KernelPlan, b: StepBuffers, w: ExpertWeights, config: MoEConfig,
             impl: FusedExperts | None = None) -> torch.Tensor:
    """Launch the plan's stages in order; out_TH [T, H].

    impl: where a compile refusal is recorded (and the step re-planned); None: a refusal raises.
    """
    from triton.runtime.errors import OutOfResources

    i = 0
    while i < len(plan.stages):
        st = plan.stages[i]
        try:
            _launcher(st.launch)(plan, st, b, w, config)
        except OutOfResources as exc:  # raised while compiling, before anything is enqueued
            if impl is None or st.variant in ("pointer", "fp8_pointer", "w4_pointer", "w4_gemv"):
                raise
            plan = impl._replan(plan, st, exc)
            continue  # the same index: the stage's next variant
        i += 1
    return b.out_TH


def run_stage(plan: KernelPlan, stage: str, b: StepBuffers, w: ExpertWeights, config: MoEConfig) -> None:
    """Launch one stage of `plan` on the step's buffers (the tuner times stages one by one)."""
    st = plan.stage(stage)
    if st is None:
        raise PlanError(f"the plan has no stage {stage!r} (have {[s.stage for s in plan.stages]})")
    _launcher(st.launch)(plan, st, b, w, config)


def _k(kernel, plan: KernelPlan):
    """The kernel as this plan launches it: the fast launcher (moeflow.kernels.launch) or Triton's JIT (a kernel
    not wrapped by fast_kernel is launched by the JIT either way)."""
    return kernel.fn if not plan.options.fast_launch and isinstance(kernel, FastKernel) else kernel


def _u8(t: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as bytes (Triton reads float8_e8m0fnu storage as uint8)."""
    return t.view(torch.uint8) if (_E8M0 is not None and t.dtype == _E8M0) else t


def _weight_strides(w: ExpertWeights) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """((stride_e, stride_out, stride_in) of gate_up, same of down): out = the GEMM's N axis."""
    gu, dn = w.gate_up, w.down
    if w.layout == "linear":  # gate_up [E, 2I, H], down [E, H, I]
        return (gu.stride(0), gu.stride(1), gu.stride(2)), (dn.stride(0), dn.stride(1), dn.stride(2))
    # "matmul": gate_up [E, H, 2I], down [E, I, H]
    return (gu.stride(0), gu.stride(2), gu.stride(1)), (dn.stride(0), dn.stride(2), dn.stride(1))


def _act_args(config: MoEConfig) -> tuple[float, float]:
    return float(config.swiglu_limit or 0.0), float(config.gptoss_alpha)


# ------------------------------------------------------------------------------------ align / combine
def launch_align(plan: KernelPlan, st: StagePlan, b: StepBuffers, w, config) -> None:
    from ..kernels.moe_align import align_launch

    align_launch(b.ids_N, b.E, plan.tiles.block_m, b.sorted_P, b.block_expert_B, pdl=plan.pdl,
                 fast=plan.options.fast_launch)


def launch_combine(plan: KernelPlan, st: StagePlan, b: StepBuffers, w, config) -> None:
    combine_launch(b.y_SNH, b.combine_wts, b.ids_N, b.out_TH, b.K, b.E, pdl=plan.pdl, fast=plan.options.fast_launch)


def combine_launch(y_SNH: torch.Tensor, wts_N: torch.Tensor | None, ids_N: torch.Tensor, out_TH: torch.Tensor,
                   K: int, E: int, *, pdl: bool = False, fast: bool = True) -> None:
    """out_TH [T, H] = sum over the K slots (and the S split parts of y_SNH [S, T*K, H]) of y, weighted by
    wts_N [T*K] when given, in slot order (moe_gemm.moe_combine_kernel).

    pdl: launched with programmatic dependent launch (moeflow/kernels/pdl.py; the plan decided it).
    """
    from ..kernels.moe_gemm import moe_combine_kernel

    T, H = out_TH.shape
    S = y_SNH.shape[0]
    # Each program keeps K*S loads of BLOCK_H in flight: narrow the block as K*S grows (no spills, and
    # more programs when T is small).
    bh = max(128, min(_COMBINE_BLOCK_H, 4096 // (K * S)))
    bh = 1 << (bh.bit_length() - 1)
    bh = min(bh, 1 << max(0, (H - 1).bit_length()))
    kernel = moe_combine_kernel if fast or not isinstance(moe_combine_kernel, FastKernel) else moe_combine_kernel.fn
    kernel[(T, math.ceil(H / bh))](
        y_SNH, wts_N if wts_N is not None else ids_N, ids_N, out_TH, H, E, y_SNH.stride(0), y_SNH.stride(1),
        out_TH.stride(0), K=K, SPLIT=S, HAS_W=wts_N is not None, BLOCK_H=bh, num_warps=4, PDL=pdl, launch_pdl=pdl,
    )


# ------------------------------------------------------------------------------------ bf16 / fp16 / fp32
def launch_gate_up_pointer(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    """act_PI from x_rows by pointer loads (every layout, interleaving and bias)."""
    from ..kernels.moe_gemm import moe_gate_up_kernel

    t = st.tile
    (gse, gsn, gsk), _ = _weight_strides(w)
    has_bias = w.gate_up_bias is not None
    gub = w.gate_up_bias if has_bias else w.gate_up  # dummy pointer when no bias
    limit, alpha = _act_args(config)
    _k(moe_gate_up_kernel, plan)[(plan.max_blocks * math.ceil(b.I / t.block_n),)](
        b.x_rows, w.gate_up, gub, b.act_PI, b.sorted_P, b.block_expert_B,
        b.N, b.H, b.I, b.top_k_div, plan.max_blocks,
        b.x_rows.stride(0), gse, gsn, gsk, gub.stride(0), b.act_PI.stride(0), limit, alpha,
        ACT=ACT_CODES[config.activation], INTERLEAVED=bool(w.interleaved), HAS_BIAS=has_bias,
        EVEN_K=b.H % t.block_k == 0, PRECISION=b.precision,
        BLOCK_M=plan.tiles.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        HALF_TAIL=plan.tiles.half_tail, num_warps=t.num_warps, num_stages=t.num_stages, PDL=plan.pdl_gemm,
        launch_pdl=plan.pdl,
    )


def gate_up_descriptor(W_ENK: torch.Tensor, block_n: int, block_k: int, fused: bool):
    """TensorDescriptor over a contiguous gate_up W_ENK [E, 2I, H] (linear layout, gate rows then up rows).

    fused: the 5D view [E, I/8, 2, 8, H] (strides 2IH, 8H, IH, H, 1), block [1, BN/8, 2, 8, BK]: BN gate
    rows and their BN up rows, interleaved 8 by 8, in one copy. Else [E*2I, H], block [BN, BK].
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    E, N2, H = W_ENK.shape
    I = N2 // 2
    if not fused:
        return TensorDescriptor(W_ENK, shape=[E * N2, H], strides=[H, 1], block_shape=[block_n, block_k])
    return TensorDescriptor(W_ENK, shape=[E, I // 8, 2, 8, H], strides=[N2 * H, 8 * H, I * H, H, 1],
                            block_shape=[1, block_n // 8, 2, 8, block_k])


def launch_gate_up_tma(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    """act_PI with the weight tiles by TMA; with gather_x the rows are first copied into pair order
    (x_PH [P, H], zeros at padding) and read by TMA boxes too: the same bits (a padding row is zero
    either way); the copy lives for the call (P x H)."""
    from ..kernels.moe_gemm_tma import moe_gate_up_tma_kernel

    t = st.tile
    fused, progs = st.get("fused"), st.get("programs")
    wd = gate_up_descriptor(w.gate_up, t.block_n, t.block_k, fused)
    tiles = plan.max_blocks * (b.I // t.block_n)
    xd, xd_half = _gathered_x_descriptors(plan, b) if st.get("gather_x") else (None, None)
    limit, alpha = _act_args(config)
    _k(moe_gate_up_tma_kernel, plan)[(progs or tiles,)](
        b.x_rows, xd, xd_half, wd, b.act_PI, b.sorted_P, b.block_expert_B,
        b.N, b.H, b.I, b.top_k_div, plan.max_blocks, tiles, b.x_rows.stride(0), b.act_PI.stride(0), limit, alpha,
        ACT=ACT_CODES[config.activation], PERSISTENT=progs > 0, WS=False, NUM_PROGS=max(1, progs),
        BLOCK_M=plan.tiles.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        HALF_TAIL=plan.tiles.half_tail, num_warps=t.num_warps, num_stages=t.num_stages, PDL=plan.pdl_gemm,
        FUSED=fused, A_TMA=xd is not None, launch_pdl=plan.pdl,
    )


def _gathered_x_descriptors(plan: KernelPlan, b: StepBuffers):
    """(xd, xd_half): x_rows copied into pair order (x_PH [P, H], moe_gemm_tma.gather_rows_kernel) and
    TensorDescriptors over it with blocks [BM, BK] and [BM/2, BK] (xd_half is xd without half tiles)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ..kernels.moe_gemm_tma import gather_rows_kernel

    BM, BK, H, P = plan.tiles.block_m, plan.tiles.gate_up.block_k, b.H, plan.padded
    x = b.x_rows
    x_PH = torch.empty(P, H, dtype=x.dtype, device=x.device)
    _k(gather_rows_kernel, plan)[(plan.max_blocks, -(-H // _GATHER_BLOCK_H))](
        x, x_PH, b.sorted_P, b.block_expert_B, b.N, H, b.top_k_div, x.stride(0), x_PH.stride(0),
        BLOCK_M=BM, BLOCK_H=_GATHER_BLOCK_H, num_warps=4, PDL=plan.pdl_gemm, launch_pdl=plan.pdl)
    xd = TensorDescriptor(x_PH, shape=[P, H], strides=[H, 1], block_shape=[BM, BK])
    xd_half = (TensorDescriptor(x_PH, shape=[P, H], strides=[H, 1], block_shape=[BM // 2, BK])
               if plan.tiles.half_tail else xd)
    return xd, xd_half


def launch_down_pointer(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    """y_SNH from act_PI by pointer loads (split-K parts over I; every layout and bias)."""
    from ..kernels.moe_gemm import moe_down_kernel

    t = st.tile
    _, (dse, dsn, dsk) = _weight_strides(w)
    has_bias = w.down_bias is not None
    db = w.down_bias if has_bias else w.down  # dummy pointer when no bias
    S = t.split_k
    k_tiles_per_split = math.ceil(math.ceil(b.I / t.block_k) / S)
    y = b.y_SNH
    _k(moe_down_kernel, plan)[(plan.max_blocks * math.ceil(b.H / t.block_n), S)](
        b.act_PI, w.down, db, y, b.sorted_P, b.block_expert_B,
        b.N, b.H, b.I, plan.max_blocks, k_tiles_per_split,
        b.act_PI.stride(0), dse, dsn, dsk, db.stride(0), y.stride(0), y.stride(1),
        HAS_BIAS=has_bias, EVEN_K=b.I % t.block_k == 0, PRECISION=b.precision,
        BLOCK_M=plan.tiles.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        HALF_TAIL=plan.tiles.half_tail, num_warps=t.num_warps, num_stages=t.num_stages, PDL=plan.pdl_gemm,
        launch_pdl=plan.pdl,
    )


def launch_down_tma(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    """y_SNH with weight and activation tiles by TMA (one split); flat: one flattened persistent loop
    over (tile, K step), one program per SM, no half tiles (the same bits)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ..kernels.moe_gemm_tma import moe_down_tma_kernel

    t = st.tile
    E, H, I, BM, P = w.down.shape[0], b.H, b.I, plan.tiles.block_m, plan.padded
    ad = TensorDescriptor(b.act_PI, shape=[P, I], strides=[I, 1], block_shape=[BM, t.block_k])
    # the half tiles' activation rows (HALF_TAIL): the same buffer in [BM/2, BK] boxes
    ad_half = (TensorDescriptor(b.act_PI, shape=[P, I], strides=[I, 1], block_shape=[BM // 2, t.block_k])
               if plan.tiles.half_tail else ad)
    wd = TensorDescriptor(w.down, shape=[E * H, I], strides=[I, 1], block_shape=[t.block_n, t.block_k])
    tiles = plan.max_blocks * (H // t.block_n)
    progs, flat = st.get("programs"), st.get("flat")
    y = b.y_SNH
    _k(moe_down_tma_kernel, plan)[(progs or tiles,)](
        ad, ad_half, wd, y, b.sorted_P, b.block_expert_B, b.N, H, I, plan.max_blocks, tiles, y.stride(1),
        PERSISTENT=progs > 0, WS=False, NUM_PROGS=max(1, progs), BLOCK_M=BM, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUP_M=t.group_m, HALF_TAIL=plan.tiles.half_tail and not flat, num_warps=t.num_warps,
        num_stages=t.num_stages, PDL=plan.pdl_gemm, FLAT=flat, launch_pdl=plan.pdl,
    )


# ------------------------------------------------------------------------------------ fp8_block (W8A8)
def fp8_quant_launch(x_MH: torch.Tensor, G: int, out: tuple[torch.Tensor, torch.Tensor] | None = None, *,
                     pdl: bool = False, groups_per_program: int = 8, num_warps: int = 2,
                     fast: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq_MH float8_e4m3fn, xs_MG f32) of x rows, per row per G channels (quantize_fp8_activations).

    x_MH: bf16 / fp16 / f32 rows; out: the two buffers to fill (allocated if None); pdl: launched with
    programmatic dependent launch; groups_per_program / num_warps: KernelRules.fp8_quant_*.
    """
    from ..kernels.moe_gemm_quant import fp8_quant_rows_kernel

    M, H = x_MH.shape
    ng = -(-H // G)
    if out is not None:
        xq, xs = out
    else:
        xq = torch.empty(M, H, dtype=torch.float8_e4m3fn, device=x_MH.device)
        xs = torch.empty(M, ng, dtype=torch.float32, device=x_MH.device)
    kernel = (fp8_quant_rows_kernel if fast or not isinstance(fp8_quant_rows_kernel, FastKernel)
              else fp8_quant_rows_kernel.fn)
    kernel[(M, -(-ng // groups_per_program))](
        x_MH, xq, xs, M, H, x_MH.stride(0), xq.stride(0), xs.stride(0), G=G, GPP=groups_per_program,
        num_warps=num_warps, PDL=pdl, launch_pdl=pdl)
    return xq, xs


def _quant_pass(plan: KernelPlan, st: StagePlan, x_MH: torch.Tensor, out=None):
    return fp8_quant_launch(x_MH, plan.shape.group, out, pdl=plan.pdl, groups_per_program=st.get("groups_per_program"),
                            num_warps=st.get("num_warps"), fast=plan.options.fast_launch)


def launch_quant_x(plan: KernelPlan, st: StagePlan, b: StepBuffers, w, config) -> None:
    b.xq, b.xs = _quant_pass(plan, st, b.x_rows)


def launch_quant_act(plan: KernelPlan, st: StagePlan, b: StepBuffers, w, config) -> None:
    # Every placed row, padding rows included (their values are never stored by down).
    _quant_pass(plan, st, b.act_PI, out=(b.aq_PI, b.as_PG))


def _fp8_common(plan: KernelPlan, st: StagePlan, config: MoEConfig, has_bias: bool) -> dict:
    t = st.tile
    return dict(HAS_BIAS=has_bias, BLOCK_M=plan.tiles.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
                GROUP_M=t.group_m, num_warps=t.num_warps, num_stages=t.num_stages, PDL=plan.pdl_gemm,
                launch_pdl=plan.pdl)


def launch_gate_up_fp8_pointer(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    from ..kernels.moe_gemm_quant import moe_gate_up_fp8_kernel

    t = st.tile
    gu, ws, sbn = w.gate_up, _u8(w.gate_up_scale), w.quant.block[0]
    has_bias = w.gate_up_bias is not None
    gub = w.gate_up_bias if has_bias else gu  # dummy pointer when no bias
    quant_out = st.get("quant_out")
    act = b.act_PI if b.act_PI is not None else b.aq_PI  # dummy pointer when quantized in place
    limit, alpha = _act_args(config)
    _k(moe_gate_up_fp8_kernel, plan)[(plan.max_blocks * math.ceil(b.I / t.block_n),)](
        b.xq, b.xs, gu, ws, gub, b.aq_PI, b.as_PG, act, b.sorted_P, b.block_expert_B,
        b.N, b.H, b.I, b.top_k_div, plan.max_blocks, sbn, -(-b.I // sbn),
        b.xq.stride(0), b.xs.stride(0), *gu.stride(), *ws.stride(), gub.stride(0),
        b.aq_PI.stride(0), b.as_PG.stride(0), act.stride(0), limit, alpha,
        SCALE_E8M0=ws.dtype == torch.uint8, EVEN_K=b.H % t.block_k == 0, QUANT_OUT=quant_out,
        SCALAR_WS=st.get("scalar_ws"), IMPRECISE=st.get("imprecise"), ACT=ACT_CODES[config.activation],
        **_fp8_common(plan, st, config, has_bias),
    )


def launch_gate_up_fp8_tma(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    """The fp8 gate_up with TMA weight tiles: aq_PI / as_PG."""
    from ..kernels.moe_gemm_fp8_tma import moe_gate_up_fp8_tma_kernel

    t = st.tile
    ws, sbn = _u8(w.gate_up_scale), w.quant.block[0]
    fused, progs = st.get("fused"), st.get("programs")
    wd = gate_up_descriptor(w.gate_up, t.block_n, t.block_k, fused)
    tiles = plan.max_blocks * (b.I // t.block_n)
    limit, alpha = _act_args(config)
    _k(moe_gate_up_fp8_tma_kernel, plan)[(progs or tiles,)](
        b.xq, b.xs, wd, ws, b.aq_PI, b.as_PG, b.sorted_P, b.block_expert_B,
        b.N, b.H, b.I, b.top_k_div, plan.max_blocks, tiles, sbn, -(-b.I // sbn),
        b.xq.stride(0), b.xs.stride(0), *ws.stride(), b.aq_PI.stride(0), b.as_PG.stride(0), limit, alpha,
        ACT=ACT_CODES[config.activation], SCALE_E8M0=ws.dtype == torch.uint8, PERSISTENT=progs > 0,
        NUM_PROGS=max(1, progs), BLOCK_M=plan.tiles.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        GROUP_M=t.group_m, num_warps=t.num_warps, num_stages=t.num_stages, PDL=plan.pdl_gemm, FUSED=fused,
        IMPRECISE=st.get("imprecise"), launch_pdl=plan.pdl,
    )


def launch_gate_up_fp8_gluon(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    """The fp8 gate_up by the warp-specialised Gluon kernel: one CTA a tile (every tile the used blocks could
    have; the ones past them exit at once), so the hardware hands tiles out in order as CTAs finish and the
    CTAs that share a weight box run together."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ..kernels.moe_gemm_fp8_gluon import CONSUMER_WARPS, moe_gate_up_fp8_ws_kernel

    t = st.tile
    W, ws, sbn = w.gate_up, w.gate_up_scale, w.quant.block[0]
    E, I2, H = W.shape
    block = [64, t.block_k]  # 64 gate (or up) rows, the kernel's tile M: a stage holds four
    W2 = W.view(E * I2, H)
    wd = TensorDescriptor(W2, list(W2.shape), [W2.stride(0), 1], block,
                          gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv))
    progs = max(1, plan.max_blocks * -(-(I2 // 2) // 128))
    limit, alpha = _act_args(config)
    moe_gate_up_fp8_ws_kernel[(progs,)](
        b.xq, b.xs, wd, ws, b.aq_PI, b.as_PG, b.sorted_P, b.block_expert_B, b.N, H, I2 // 2, b.top_k_div,
        plan.max_blocks, sbn, -(-(I2 // 2) // sbn), b.xq.stride(0), b.xs.stride(0), *ws.stride(),
        b.aq_PI.stride(0), b.as_PG.stride(0), limit, alpha, ACT=ACT_CODES[config.activation], NUM_PROGS=progs,
        GROUP_M=t.group_m, STAGES=st.get("stages"), num_warps=CONSUMER_WARPS.value,
    )


def launch_down_fp8_pointer(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    from ..kernels.moe_gemm_quant import moe_down_fp8_kernel

    t = st.tile
    dn, ws, sbn = w.down, _u8(w.down_scale), w.quant.block[0]
    has_bias = w.down_bias is not None
    db = w.down_bias if has_bias else dn  # dummy pointer when no bias
    S = t.split_k
    k_tiles_per_split = math.ceil(math.ceil(b.I / t.block_k) / S)
    y = b.y_SNH
    _k(moe_down_fp8_kernel, plan)[(plan.max_blocks * math.ceil(b.H / t.block_n), S)](
        b.aq_PI, b.as_PG, dn, ws, db, y, b.sorted_P, b.block_expert_B,
        b.N, b.H, b.I, plan.max_blocks, k_tiles_per_split, sbn,
        b.aq_PI.stride(0), b.as_PG.stride(0), *dn.stride(), *ws.stride(),
        db.stride(0), y.stride(0), y.stride(1),
        SCALE_E8M0=ws.dtype == torch.uint8, SCALAR_WS=st.get("scalar_ws"), IMPRECISE=st.get("imprecise"),
        EVEN_K=b.I % t.block_k == 0, **_fp8_common(plan, st, config, has_bias),
    )


def launch_down_fp8_tma(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    """The fp8 down GEMM with TMA activation and weight tiles (one split)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from ..kernels.moe_gemm_fp8_tma import moe_down_fp8_tma_kernel

    t = st.tile
    ws = _u8(w.down_scale)
    E, H, I, BM, P = w.down.shape[0], b.H, b.I, plan.tiles.block_m, plan.padded
    ad = TensorDescriptor(b.aq_PI, shape=[P, I], strides=[I, 1], block_shape=[BM, t.block_k])
    wd = TensorDescriptor(w.down, shape=[E * H, I], strides=[I, 1], block_shape=[t.block_n, t.block_k])
    tiles = plan.max_blocks * (H // t.block_n)
    progs = st.get("programs")
    y = b.y_SNH
    _k(moe_down_fp8_tma_kernel, plan)[(progs or tiles,)](
        ad, b.as_PG, wd, ws, y, b.sorted_P, b.block_expert_B, b.N, H, I, plan.max_blocks, tiles,
        w.quant.block[0], b.as_PG.stride(0), *ws.stride(), y.stride(1),
        SCALE_E8M0=ws.dtype == torch.uint8, PERSISTENT=progs > 0, NUM_PROGS=max(1, progs), BLOCK_M=BM,
        BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, num_warps=t.num_warps,
        num_stages=t.num_stages, PDL=plan.pdl_gemm, IMPRECISE=st.get("imprecise"), launch_pdl=plan.pdl,
    )


# ------------------------------------------------------------------------------------ FP4 (W4A16)
def _w4_scales(scale: torch.Tensor, scale_2: torch.Tensor | None):
    s = scale.view(torch.uint8)  # E8M0 / e4m3 bytes, decoded in the kernel
    return s, (scale_2 if scale_2 is not None else s)  # dummy pointer for mxfp4


def launch_gate_up_w4(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    from ..kernels.moe_gemm_quant import moe_gate_up_w4_kernel

    t = st.tile
    gu = w.gate_up
    has_bias = w.gate_up_bias is not None
    gub = w.gate_up_bias if has_bias else gu  # dummy pointer when no bias
    s, s2 = _w4_scales(w.gate_up_scale, w.gate_up_scale_2)
    limit, alpha = _act_args(config)
    _k(moe_gate_up_w4_kernel, plan)[(plan.max_blocks * math.ceil(b.I / t.block_n),)](
        b.x_rows, gu, s, s2, gub, b.act_PI, b.sorted_P, b.block_expert_B,
        b.N, b.H, b.I, b.top_k_div, plan.max_blocks,
        b.x_rows.stride(0), *gu.stride(), *s.stride(), s2.stride(0), s2.stride(1) if s2.dim() > 1 else 0,
        gub.stride(0), b.act_PI.stride(0), limit, alpha,
        FMT=_FORMAT_CODES[plan.shape.fmt], G=plan.shape.group, INTERLEAVED=bool(w.interleaved),
        EVEN_K=b.H % t.block_k == 0, ASM=st.get("asm"), ACT=ACT_CODES[config.activation],
        **_fp8_common(plan, st, config, has_bias),
    )


def launch_down_w4(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    from ..kernels.moe_gemm_quant import moe_down_w4_kernel

    t = st.tile
    dn = w.down
    has_bias = w.down_bias is not None
    db = w.down_bias if has_bias else dn  # dummy pointer when no bias
    s, s2 = _w4_scales(w.down_scale, w.down_scale_2)
    S = t.split_k
    k_tiles_per_split = math.ceil(math.ceil(b.I / t.block_k) / S)
    y = b.y_SNH
    _k(moe_down_w4_kernel, plan)[(plan.max_blocks * math.ceil(b.H / t.block_n), S)](
        b.act_PI, dn, s, s2, db, y, b.sorted_P, b.block_expert_B,
        b.N, b.H, b.I, plan.max_blocks, k_tiles_per_split,
        b.act_PI.stride(0), *dn.stride(), *s.stride(), s2.stride(0), db.stride(0),
        y.stride(0), y.stride(1),
        FMT=_FORMAT_CODES[plan.shape.fmt], G=plan.shape.group, ASM=st.get("asm"), EVEN_K=b.I % t.block_k == 0,
        **_fp8_common(plan, st, config, has_bias),
    )


def launch_gate_up_gemv(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    """FP4 decode: act_NI [N, I] by the GEMV kernel, one program per (pair, BN outputs), no align."""
    from ..kernels.moe_gemm_quant import moe_gate_up_w4_gemv_kernel

    bn, bk, nw = st.get("block_n"), st.get("block_k"), st.get("num_warps")
    gu = w.gate_up
    s, s2 = _w4_scales(w.gate_up_scale, w.gate_up_scale_2)
    gub = w.gate_up_bias if w.gate_up_bias is not None else gu  # dummy pointer without bias
    limit, alpha = _act_args(config)
    x, act = b.x_rows, b.act_PI
    _k(moe_gate_up_w4_gemv_kernel, plan)[(b.N, math.ceil(b.I / bn))](
        x, gu, s, s2, gub, act, b.ids_N, b.H, b.I, b.E, b.top_k_div,
        x.stride(0), gu.stride(0), gu.stride(1), *s.stride(), s2.stride(0),
        s2.stride(1) if s2.dim() > 1 else 0, gub.stride(0), act.stride(0), limit, alpha,
        FMT=_FORMAT_CODES[plan.shape.fmt], G=plan.shape.group, ACT=ACT_CODES[config.activation],
        INTERLEAVED=bool(w.interleaved), HAS_BIAS=w.gate_up_bias is not None, BLOCK_N=bn, BLOCK_K=bk,
        ASM=st.get("asm"), num_warps=nw, PDL=plan.pdl_gemm, launch_pdl=plan.pdl,
    )


def launch_down_gemv(plan: KernelPlan, st: StagePlan, b: StepBuffers, w: ExpertWeights, config) -> None:
    """FP4 decode: y_1NH [1, N, H] (rows by pair) by the GEMV kernel."""
    from ..kernels.moe_gemm_quant import moe_down_w4_gemv_kernel

    bn, bk, nw = st.get("block_n"), st.get("block_k"), st.get("num_warps")
    dn = w.down
    s, s2 = _w4_scales(w.down_scale, w.down_scale_2)
    db = w.down_bias if w.down_bias is not None else dn
    act, y = b.act_PI, b.y_SNH
    _k(moe_down_w4_gemv_kernel, plan)[(b.N, math.ceil(b.H / bn))](
        act, dn, s, s2, db, y, b.ids_N, b.H, b.I, b.E,
        act.stride(0), dn.stride(0), dn.stride(1), *s.stride(), s2.stride(0), db.stride(0), y.stride(1),
        FMT=_FORMAT_CODES[plan.shape.fmt], G=plan.shape.group, HAS_BIAS=w.down_bias is not None, BLOCK_N=bn,
        BLOCK_K=bk, ASM=st.get("asm"), num_warps=nw, PDL=plan.pdl_gemm, launch_pdl=plan.pdl,
    )
