"""CUDA launchers of the router: batch-invariant logits, selection, next-layer prediction.

Legend: T tokens, H hidden size, E router outputs of a weight (routed + zero
experts: S = E + Z for the layer's own router), F outputs of the next layer's
router, K picks per token, W prediction width, V hash-table vocabulary.

Everything here is device work only: no `.item()`, no host synchronisation, no
data-dependent Python control flow, so every function can be captured in a CUDA
graph and replayed with new inputs written into the same buffers. Errors that
depend on tensor *values* (a NaN logit, an input id outside the hash table, a
table entry outside [0, S)) are reported through a per-row int32 status tensor
the selection kernel writes for every row (`RoutingStatus`); the caller checks
it when it chooses (`result.check()`, one host sync), so a decode step can run
many layers before looking. Values-independent errors (dtype, shape, device)
raise at once.

`router_step_cuda` (what the layer runs) is one launch for 1 <= T <= FUSED_MAX_T: the
GEMM's programs write split partials, and the last program of each row group (an
atomic ticket on a persistent per-device counter the kernel resets itself, so no memset
and CUDA-graph capturable) sums them and selects (moeflow/kernels/router_fused.py).
Above FUSED_MAX_T it is the GEMM kernel + the selection kernel. Both give the same bits
for a row, so the layer stays batch-invariant across the threshold.

Triton is imported here lazily by importing the private kernel modules; this
module is only imported when a CUDA tensor reaches moeflow.routing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .._triton import interpreted
from ..types import RoutingResult
from .spec import RouterSpec
from .validate import validate_route_inputs

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_SLOTS = 4096  # a row's logits live in registers of one program

# router_step_cuda runs the single-kernel step (moeflow/kernels/router_fused.py) for
# 1 <= T <= FUSED_MAX_T. Measured on an H200 by `python benchmarks/bench_routing.py --gpu` (its
# moeflow-fused and moeflow-2k rows; CUDA graph, L2 flushed, 5 standard shapes): fused beats the
# two-kernel step at T = 1 by 0.2-0.5 us (7.7-12.1 us) but loses at T = 8 (10-23 us vs 9-12.5 us)
# and badly at T = 64 (up to 117 vs 13 us): its last program selects the rows serially in chunks,
# where the selection kernel runs one program per row. Raise this once the fused tail is faster
# (same bits either way).
FUSED_MAX_T = 1
_TICKET_SLOTS = 1024  # row-group counters of the fused kernel per device (T <= 1024 * block_m)
_SELECT_TILE = 2048  # elements of the [rows, NGP, PP] tile the fused kernel's last program selects at once
_TICKETS: dict[tuple[str, int | None], torch.Tensor] = {}

_SCORE_CODES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2, "topk_softmax": 3, "topk_sigmoid": 4}
STATUS_OK, STATUS_NAN, STATUS_BAD_INPUT_ID, STATUS_BAD_TABLE = 0, 1, 2, 3


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class LogitsConfig:
    """Tile shape and H split of the router GEMM. A function of (E, H, dtype path) only:
    never of T, which is what makes a row's bits independent of its batch."""

    block_m: int
    block_e: int
    block_k: int
    chunk: int  # H per split (a multiple of block_k)
    split: int  # cdiv(H, chunk)
    num_warps: int
    num_stages: int


# Default tile shapes per dtype path; the split targets about this many programs
# at T <= block_m, enough to keep HBM busy when one decode token reads the weight.
# bf16: chosen by `benchmarks/bench_routing.py --sweep` on an H200 (of 8 candidates,
# within 0.6 us of the best at T = 1, 8 and the best at T = 4096 for deepseek-v3,
# qwen3-30b-a3b and gpt-oss-120b).
_TILE = {
    False: dict(block_m=64, block_e=64, block_k=128, num_warps=4, num_stages=3),  # bf16 / fp16 operands
    True: dict(block_m=32, block_e=32, block_k=32, num_warps=4, num_stages=3),  # fp32 or mixed operands
}
_TARGET_PROGRAMS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def logits_config(
    E: int, H: int, as_f32: bool, *, target_programs: int | None = None, min_chunk: int | None = None, **tile
) -> LogitsConfig:
    """The fixed config of the router GEMM for an [E, H] weight (overrides for benchmarks/tests).

    The H split aims at `target_programs` programs for one row group, with at least
    `min_chunk` (default 4 * block_k) of H per split: shorter chunks pipeline badly and
    multiply the partial-sum traffic at large T.
    """
    plain = target_programs is None and min_chunk is None and not tile
    if plain:
        # Called on every router step with the same few (E, H, dtype path): the config is a pure
        # function of them, so it is computed once (host time; the result is a frozen dataclass).
        hit = _LOGITS_CONFIGS.get((E, H, bool(as_f32)))
        if hit is not None:
            return hit
    params = dict(_TILE[bool(as_f32)])
    params.update(tile)
    bk = params["block_k"]
    n_e = _cdiv(E, params["block_e"])
    want = max(1, min(_cdiv(target_programs or _TARGET_PROGRAMS, n_e), _cdiv(H, bk)))
    chunk = max(_cdiv(_cdiv(H, want), bk) * bk, min_chunk or 4 * bk)
    chunk = min(chunk, _cdiv(H, bk) * bk)
    split = _cdiv(H, chunk)
    cfg = LogitsConfig(chunk=chunk, split=split, **params)
    if plain:
        _LOGITS_CONFIGS[(E, H, bool(as_f32))] = cfg
    return cfg


_LOGITS_CONFIGS: dict[tuple[int, int, bool], LogitsConfig] = {}


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class RoutingStatus:
    """Per-row status of a GPU selection, read only when the caller asks.

    status_T: int32 [T] on the device, written by the kernel for every row:
        0 ok, 1 NaN logit (that row's ids are 0..K-1 and its weights NaN),
        2 input id outside the hash table's vocabulary, 3 hash-table entry outside
        [0, S) (both: ids 0..K-1, weights NaN).
    `check()` is the one host synchronisation; `any_error()` stays on the device.
    In a CUDA graph the status tensor is a graph buffer: check after each replay.
    """

    status_T: torch.Tensor
    layer: int | None = None
    input_ids: torch.Tensor | None = field(default=None, repr=False)
    hash_table: torch.Tensor | None = field(default=None, repr=False)
    num_slots: int = 0

    def any_error(self) -> torch.Tensor:
        """bool scalar tensor on the device: True when some row failed (no host sync)."""
        if self.status_T.numel() == 0:
            return torch.zeros((), dtype=torch.bool, device=self.status_T.device)
        return self.status_T.amax() > 0

    def check(self) -> None:
        """Raise ValueError naming the first failed row (and layer); syncs the host once."""
        if self.status_T.numel() == 0:
            return
        bad_T = self.status_T != 0
        if not bool(bad_T.any()):
            return
        rows = bad_T.nonzero()[:, 0]
        row = int(rows[0])
        code = int(self.status_T[row])
        where = f" of layer {self.layer}" if self.layer is not None else ""
        if code == STATUS_NAN:
            n = int((self.status_T == STATUS_NAN).sum())
            raise ValueError(f"logits_TE: NaN logit in token row {row}{where} ({n} rows hold NaN)")
        if code == STATUS_BAD_INPUT_ID and self.input_ids is not None and self.hash_table is not None:
            bad = int(self.input_ids.reshape(-1)[row])
            raise ValueError(
                f"input_ids: id {bad} in token row {row}{where} out of the hash table's vocabulary "
                f"[0, {self.hash_table.shape[0]})"
            )
        if code == STATUS_BAD_TABLE and self.input_ids is not None and self.hash_table is not None:
            entry = self.hash_table[int(self.input_ids.reshape(-1)[row])]
            bad = [int(v) for v in entry.tolist() if not 0 <= int(v) < self.num_slots]
            raise ValueError(
                f"hash_table: expert id {bad[0] if bad else entry.tolist()} for token row {row}{where} "
                f"outside [0, {self.num_slots})"
            )
        raise ValueError(f"routing: token row {row}{where} failed with status code {code}")


@dataclass(frozen=True)
class CudaRoutingResult(RoutingResult):
    """A RoutingResult from the GPU kernels plus the device-side status of its rows.

    ids_TK / weights_TK as RoutingResult; `status` holds the per-row error codes.
    Nothing has been checked yet: call `check()` (one host sync) where you choose.
    """

    status: RoutingStatus | None = None

    def check(self) -> CudaRoutingResult:
        """Raise ValueError for a NaN logit / bad hash input (naming the row); returns self."""
        if self.status is not None:
            self.status.check()
        return self


@dataclass(frozen=True)
class PredictResult:
    """Next-layer prefetch keys, on the device, ready for the offload prefetcher.

    keys_TW2: int32 [T, W, 2], each (layer, expert), best first per token.
    ids_TW:   int32 [T, W] the expert column of keys_TW2 (contiguous).
    status:   per-row status of the prediction (NaN logits of the next router).
    """

    keys_TW2: torch.Tensor
    ids_TW: torch.Tensor
    status: RoutingStatus

    def check(self) -> PredictResult:
        self.status.check()
        return self


@dataclass(frozen=True)
class RouterStep:
    """The router step: logits, this layer's routing, and optionally the prediction.

    fused: True when one launch (router_fused.py) computed it, False for the two-kernel path.
    """

    logits_TS: torch.Tensor
    routing: CudaRoutingResult
    prediction: PredictResult | None = None
    fused: bool = False


# --------------------------------------------------------------------------- checks


def _check_device(name: str, t: torch.Tensor) -> None:
    # CPU tensors only under the Triton interpreter (tests, dry runs), which runs the same kernels on them
    if not (t.is_cuda or (t.device.type == "cpu" and interpreted())):
        raise ValueError(f"{name}: on {t.device}, expected a CUDA tensor")


def _check_matrix(name: str, t: torch.Tensor, dtypes=_FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype}, expected one of {tuple(str(d) for d in dtypes)}")
    if t.dim() != 2:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected 2-D")
    _check_device(name, t)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: strides {t.stride()}, expected unit stride along the last dim")


def _vector(name: str, t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    if t is None:
        return None
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device} (the logits' device)")
    return t if t.is_contiguous() else t.contiguous()


def _is_f32_path(*ts: torch.Tensor) -> bool:
    d = ts[0].dtype
    return not (d in (torch.bfloat16, torch.float16) and all(t.dtype == d for t in ts))


_DUMMIES: dict[tuple[str, int | None], torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    """A 1-element buffer for pointer arguments a kernel variant never touches.

    Never the same tensor as an output: aliasing is harmless on the GPU but the Triton
    interpreter copies every argument back after the launch.
    """
    key = (device.type, device.index)
    t = _DUMMIES.get(key)
    if t is None:
        t = _DUMMIES[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return t


def _next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


# --------------------------------------------------------------------------- logits


@dataclass(frozen=True)
class _Logits:
    """Where a launch left its logits: either final tensors or split partials."""

    out_TE: torch.Tensor | None
    out_TF: torch.Tensor | None
    part_STC: torch.Tensor | None  # [split, T, E + F] when split > 1
    E: int
    F: int
    split: int


@dataclass(frozen=True)
class _Gemm:
    """A validated router GEMM: sizes, dtype path and the fixed config (nothing launched)."""

    T: int
    H: int
    E: int
    F: int
    as_f32: bool
    cfg: LogitsConfig


def _plan_gemm(
    x_TH: torch.Tensor, weight_EH: torch.Tensor, next_weight_FH: torch.Tensor | None, config: LogitsConfig | None
) -> _Gemm:
    """Check the GEMM operands (dtype, shape, device, strides) and pick its config."""
    _check_matrix("x_TH", x_TH)
    _check_matrix("weight_EH", weight_EH)
    T, H = x_TH.shape
    E = weight_EH.shape[0]
    if weight_EH.shape[1] != H:
        raise ValueError(f"weight_EH: shape {tuple(weight_EH.shape)}, expected (E, {H}) to match x_TH {tuple(x_TH.shape)}")
    if weight_EH.device != x_TH.device:
        raise ValueError(f"weight_EH: on {weight_EH.device}, x_TH on {x_TH.device}: expected one device")
    F = 0
    if next_weight_FH is not None:
        _check_matrix("next_weight_EH", next_weight_FH)
        if next_weight_FH.shape[1] != H:
            raise ValueError(f"next_weight_EH: shape {tuple(next_weight_FH.shape)}, expected (E, {H})")
        if next_weight_FH.dtype != weight_EH.dtype:
            raise TypeError(
                f"next_weight_EH: dtype {next_weight_FH.dtype}, expected {weight_EH.dtype} (the same GEMM path as weight_EH)"
            )
        if next_weight_FH.device != x_TH.device:
            raise ValueError(f"next_weight_EH: on {next_weight_FH.device}, expected {x_TH.device}")
        F = next_weight_FH.shape[0]
    if H == 0:
        raise ValueError("x_TH: hidden size 0")
    as_f32 = _is_f32_path(x_TH, weight_EH)
    cfg = config or logits_config(E, H, as_f32)
    if cfg.split != _cdiv(H, cfg.chunk) or cfg.chunk % cfg.block_k:
        raise ValueError(f"config: {cfg} inconsistent with H={H}")
    return _Gemm(T=T, H=H, E=E, F=F, as_f32=as_f32, cfg=cfg)


def _partials(g: _Gemm, device: torch.device) -> torch.Tensor:
    """The split-partial buffer f32 [split, T, E + F] of a GEMM."""
    if g.cfg.split * g.T * (g.E + g.F) >= 2**31:
        raise ValueError(f"x_TH: T={g.T} too large for the split buffer ({g.cfg.split} x {g.T} x {g.E + g.F} f32)")
    return torch.empty(g.cfg.split, g.T, g.E + g.F, dtype=torch.float32, device=device)


def _launch_gemm(
    x_TH: torch.Tensor,
    weight_EH: torch.Tensor,
    next_weight_FH: torch.Tensor | None,
    config: LogitsConfig | None,
    *,
    want_final: bool,
    plan: _Gemm | None = None,
) -> _Logits:
    from ..kernels.router_logits import _reduce_splits_kernel, _router_logits_kernel

    # plan: the caller's _plan_gemm of these same operands (router_step_cuda checks them first)
    g = plan if plan is not None else _plan_gemm(x_TH, weight_EH, next_weight_FH, config)
    T, H, E, F, as_f32, cfg = g.T, g.H, g.E, g.F, g.as_f32, g.cfg
    dev = x_TH.device
    out_TE = torch.empty(T, E, dtype=torch.float32, device=dev)
    out_TF = torch.empty(T, F, dtype=torch.float32, device=dev) if F else None
    if T == 0:
        return _Logits(out_TE, out_TF, None, E, F, 1)
    w2 = next_weight_FH if F else weight_EH
    o2 = out_TF if F else _dummy(dev)
    part = _partials(g, dev) if cfg.split > 1 else None
    grid = (_cdiv(E, cfg.block_e) + _cdiv(F, cfg.block_e), _cdiv(T, cfg.block_m), cfg.split)
    _router_logits_kernel[grid](
        x_TH, weight_EH, w2, out_TE, o2, part if part is not None else _dummy(dev),
        T, E, F, H,
        x_TH.stride(0), weight_EH.stride(0), w2.stride(0), out_TE.stride(0), o2.stride(0) if F else 0,
        T * (E + F),
        CHUNK=cfg.chunk, SPLIT=cfg.split, BLOCK_M=cfg.block_m, BLOCK_E=cfg.block_e,
        BLOCK_K=cfg.block_k, AS_F32=as_f32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if part is not None and want_final:
        block = 1024
        _reduce_splits_kernel[(_cdiv(T * (E + F), block),)](
            part, out_TE, o2, T, E, F, T * (E + F), out_TE.stride(0), o2.stride(0) if F else 0,
            SPLIT=cfg.split, BLOCK=block, num_warps=4,
        )
        return _Logits(out_TE, out_TF, part, E, F, cfg.split)
    if part is not None:
        return _Logits(out_TE, out_TF, part, E, F, cfg.split)
    return _Logits(out_TE, out_TF, None, E, F, 1)


def router_logits_cuda(
    x_TH: torch.Tensor,
    weight_EH: torch.Tensor,
    next_weight_EH: torch.Tensor | None = None,
    *,
    config: LogitsConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant router logits on CUDA: f32 [T, E] = x_TH @ weight_EH.T.

    Args:
        x_TH: bf16/fp16/fp32 [T, H], unit stride along H (any row stride).
        weight_EH: bf16/fp16/fp32 [E, H], unit stride along H.
        next_weight_EH: optional [F, H] next layer's router weight (same dtype as
            weight_EH): its logits on the same input come from the same launch.
        config: override of the fixed tile/split config (benchmarks and tests).
    Returns:
        f32 [T, E], or (f32 [T, E], f32 [T, F]) with next_weight_EH.

    Row t is bit-identical for every T and every position of the row in the
    batch: the reduction order (moeflow/kernels/router_logits.py) is fixed by
    (E, H, dtypes). bf16/fp16 operands of one dtype use the tensor cores with f32
    accumulation; fp32 or mixed operands use exact f32 products (FMA, no tf32).
    One GEMM launch, plus one reduction launch when H is split. No host sync.
    """
    r = _launch_gemm(x_TH, weight_EH, next_weight_EH, config, want_final=True)
    return (r.out_TE, r.out_TF) if next_weight_EH is not None else r.out_TE


# --------------------------------------------------------------------------- selection


def _group_params(spec: RouterSpec, width: int, apply_groups: bool) -> tuple[int, int, int]:
    """(G, P, topk_group) of the row tile; G = 1 disables groups."""
    S = spec.num_slots
    if spec.n_group > 1 and apply_groups:
        return spec.n_group, S // spec.n_group, spec.topk_group
    return 1, S, 1


@dataclass(frozen=True)
class _SelectPlan:
    """One selection's outputs and its `_select_rows` arguments (router_select.py).

    The selection kernel and the fused router kernel take the same plan, so both run a
    selection with the same arguments: one place decides the constexprs of a family rule.
    """

    ids_TK: torch.Tensor
    weights_TK: torch.Tensor | None
    keys_TK2: torch.Tensor | None
    status: RoutingStatus
    ptrs: tuple  # rbias, logits_out, bias, scale, input_ids, table, ids, weights, keys, status
    ints: tuple  # S, E, V, stride_lo, stride_tv, layer, eps, scaling
    meta: dict  # constexprs of _select_rows but ROWS, SPLIT, PRECISE, CACHE (shared, never mutate)
    tile: int  # NGP * PP: elements of one row's register tile
    meta_key: tuple = ()  # what `meta` is a function of (it is cached under this key)


def _plan_select(
    dev: torch.device,
    *,
    T: int,
    spec: RouterSpec,
    K: int,
    apply_groups: bool,
    mask_zero: bool,
    hash_lookup: bool,
    table_width: int = 0,
    weights: bool,
    keys_layer: int | None,
    router_bias: torch.Tensor | None = None,
    logits_out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
    status_layer: int | None = None,
    status_out: torch.Tensor | None = None,
) -> _SelectPlan:
    """Allocate a selection's outputs (ids int32 [T, K], weights f32 [T, K] or keys int32
    [T, K, 2], status int32 [T], or `status_out` where given) and gather its kernel arguments;
    launches nothing."""
    S = spec.num_slots
    if S > _MAX_SLOTS:
        raise ValueError(f"spec.num_slots={S}: the GPU selection holds a row in registers, at most {_MAX_SLOTS}")
    # _select_meta's arguments (the table width matters only to hash lookups)
    meta_key = (spec, K, apply_groups, mask_zero, hash_lookup, table_width if hash_lookup else 0, weights,
                keys_layer is not None, router_bias is not None, logits_out is not None, bias is not None,
                expert_scale is not None)
    meta = _SELECT_META.get(meta_key)
    if meta is None:
        meta = _SELECT_META[meta_key] = _select_meta(*meta_key)
    ids_TK = torch.empty(T, K, dtype=torch.int32, device=dev)
    weights_TK = torch.empty(T, K, dtype=torch.float32, device=dev) if weights else None
    keys_TK2 = torch.empty(T, K, 2, dtype=torch.int32, device=dev) if keys_layer is not None else None
    status_T = status_out if status_out is not None else torch.empty(T, dtype=torch.int32, device=dev)
    ids_flat = None
    if hash_lookup:
        ids_flat = input_ids.reshape(-1)
        if not ids_flat.is_contiguous():
            ids_flat = ids_flat.contiguous()
        if hash_table.stride(1) != 1:
            hash_table = hash_table.contiguous()
    dummy = _dummy(dev)
    ptrs = (
        router_bias if router_bias is not None else dummy,
        logits_out if logits_out is not None else dummy,
        bias if bias is not None else dummy,
        expert_scale if expert_scale is not None else dummy,
        ids_flat if ids_flat is not None else dummy,
        hash_table if hash_lookup else dummy,
        ids_TK,
        weights_TK if weights_TK is not None else dummy,
        keys_TK2 if keys_TK2 is not None else dummy,
        status_T,
    )
    ints = (
        S, spec.num_experts,
        hash_table.shape[0] if hash_lookup else 0,
        logits_out.stride(0) if logits_out is not None else 0,
        hash_table.stride(0) if hash_lookup else 0,
        keys_layer if keys_layer is not None else 0,
        float(spec.renorm_eps),
        float(spec.scaling_factor),
    )
    status = RoutingStatus(
        status_T,
        layer=status_layer,
        input_ids=input_ids if hash_lookup else None,
        hash_table=hash_table if hash_lookup else None,
        num_slots=S,
    )
    return _SelectPlan(ids_TK, weights_TK, keys_TK2, status, ptrs, ints, meta, meta["NGP"] * meta["PP"], meta_key)


# _select_meta's results by their arguments (a family rule has a handful of them).
_SELECT_META: dict[tuple, dict] = {}


def _select_meta(spec: RouterSpec, K: int, apply_groups: bool, mask_zero: bool, hash_lookup: bool, table_width: int,
                 weights: bool, keys: bool, has_rbias: bool, write_logits: bool, has_bias: bool,
                 has_scale: bool) -> dict:
    """The constexprs of `_select_rows` for one selection kind (see _SelectPlan.meta)."""
    G, P, topk_group = _group_params(spec, K, apply_groups)
    return dict(
        SCORE=_SCORE_CODES[spec.score_fn],
        K=K,
        KP=_next_pow2(K),
        G=G,
        P=P,
        NGP=_next_pow2(G),
        PP=_next_pow2(P),
        TOPK_GROUP=topk_group,
        GROUP_TOP2=spec.group_score == "top2_sum",
        HAS_RBIAS=has_rbias,
        WRITE_LOGITS=write_logits,
        HAS_BIAS=has_bias,
        HAS_SCALE=has_scale,
        HASH=hash_lookup,
        KT=table_width if hash_lookup else 0,
        SELECT=not hash_lookup or K > table_width,
        START=table_width if hash_lookup else 0,
        RENORM=bool(spec.renorm),
        HAS_SCALING=spec.scaling_factor != 1.0,
        MASK_ZERO=mask_zero,
        WEIGHTS=weights,
        KEYS=keys,
    )


def _launch_select(
    src: torch.Tensor, plan: _SelectPlan, *, T: int, stride_row: int, stride_split: int, col0: int, split: int
) -> _SelectPlan:
    """The selection kernel on logits (or split partials) `src`: one program per row."""
    from ..kernels.router_select import _route_kernel

    if T:
        _route_kernel[(T,)](
            src, *plan.ptrs, T, *plan.ints[:3], stride_row, stride_split, col0, *plan.ints[3:],
            ROWS=1, SPLIT=split, PRECISE=src.device.type == "cuda", **plan.meta,
            num_warps=4 if plan.tile <= 1024 else 8,
        )
    return plan


def route_cuda(
    logits_TE: torch.Tensor,
    spec: RouterSpec,
    *,
    bias: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
    layer: int | None = None,
) -> CudaRoutingResult:
    """`moeflow.route` on CUDA: one Triton program per token row, one launch, no host sync.

    Args: as `moeflow.route` (logits_TE f32 [T, E + Z], unit stride along columns;
        bias / expert_scale float [E + Z]; input_ids int [T] and hash_table int [V, K]
        for hash layers); layer only names the layer in errors.
    Returns:
        CudaRoutingResult(ids_TK int32 [T, K], weights_TK f32 [T, K], status). Ids equal
        the CPU reference's on the same logits (key descending, ties to the lower
        index; hash layers: the table's order); weights agree to f32 rounding.
        NaN logits and out-of-range hash inputs are NOT raised here: they are in
        `status` (see RoutingStatus); call `.check()` where a sync is acceptable.
    """
    validate_route_inputs(
        logits_TE, spec, bias=bias, expert_scale=expert_scale, input_ids=input_ids, hash_table=hash_table,
        check_nan=False, layer=layer,
    )
    _check_device("logits_TE", logits_TE)
    if logits_TE.shape[1] > 1 and logits_TE.stride(1) != 1:
        raise ValueError(f"logits_TE: strides {logits_TE.stride()}, expected unit stride along the last dim")
    dev = logits_TE.device
    bias = _vector("bias", bias, dev)
    expert_scale = _vector("expert_scale", expert_scale, dev)
    if spec.hash_routing:
        input_ids = _vector("input_ids", input_ids, dev)
        hash_table = _vector("hash_table", hash_table, dev)
    T = logits_TE.shape[0]
    plan = _plan_select(
        dev, T=T, spec=spec, K=spec.top_k, apply_groups=True, mask_zero=False, hash_lookup=spec.hash_routing,
        table_width=spec.top_k, weights=True, keys_layer=None, bias=bias, expert_scale=expert_scale,
        input_ids=input_ids, hash_table=hash_table, status_layer=layer,
    )
    _launch_select(logits_TE, plan, T=T, stride_row=logits_TE.stride(0), stride_split=0, col0=0, split=1)
    return CudaRoutingResult(ids_TK=plan.ids_TK, weights_TK=plan.weights_TK, status=plan.status)


def _predict_plan(spec: RouterSpec, width: int | None, input_ids, hash_table) -> tuple[int, bool, bool]:
    """(W, apply_groups, hash_lookup) with the rules of moeflow.routing.predict.predict_next_ids."""
    E = spec.num_experts
    W = spec.top_k if width is None else width
    if not isinstance(W, int) or isinstance(W, bool) or W < 1 or W > E:
        raise ValueError(f"width: {W!r}, expected an int in [1, {E}] (the next layer's routed experts)")
    per_group = spec.num_slots // spec.n_group
    hash_lookup = spec.hash_routing and input_ids is not None
    # A hash layer ranks its extra picks (W > K) on the plain key, without groups.
    apply_groups = not hash_lookup and spec.n_group > 1 and W <= spec.topk_group * per_group
    return W, apply_groups, hash_lookup


def _validate_predict(logits_like: torch.Tensor, spec, bias, input_ids, hash_table, layer) -> None:
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise ValueError(f"layer: {layer!r}, expected an int >= 0")
    validate_route_inputs(
        logits_like, spec, bias=bias,
        # shape-only check: a meta tensor allocates nothing and launches nothing
        expert_scale=None if not spec.expert_scale else torch.ones(spec.num_slots, device="meta"),
        input_ids=input_ids, hash_table=hash_table, check_nan=False,
    )


def predict_next_cuda(
    x_TH: torch.Tensor,
    next_router_weight_EH: torch.Tensor,
    next_spec: RouterSpec,
    *,
    bias: torch.Tensor | None = None,
    width: int | None = None,
    layer: int,
    router_bias_E: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
    config: LogitsConfig | None = None,
) -> PredictResult:
    """Next-layer prefetch keys on CUDA: the next router on this layer's input, best W experts.

    Same rules as `moeflow.routing.predict.predict_next_ids` (zero experts never
    predicted; group limits while W fits in the kept groups; a hash layer with
    input_ids is its table lookup, a width above K appending the best other
    experts by the plain key). Two launches (GEMM, selection
    reading the GEMM's split partials), no host sync.
    Returns PredictResult(keys_TW2 int32 [T, W, 2] of (layer, expert), ids_TW, status).
    """
    W, apply_groups, hash_lookup = _predict_plan(next_spec, width, input_ids, hash_table)
    r = _launch_gemm(x_TH, next_router_weight_EH, None, config, want_final=False)
    if r.E != next_spec.num_slots:
        raise ValueError(
            f"next_router_weight_EH: {r.E} rows, expected next_spec.num_slots={next_spec.num_slots}"
        )
    _validate_predict(r.out_TE, next_spec, bias, input_ids, hash_table, layer)
    dev = x_TH.device
    bias = _vector("bias", bias, dev)
    router_bias_E = _vector("router_bias_E", router_bias_E, dev)
    if hash_lookup:
        input_ids = _vector("input_ids", input_ids, dev)
        hash_table = _vector("hash_table", hash_table, dev)
    return _predict_from(r, 0, x_TH.shape[0], next_spec, W, apply_groups, hash_lookup, layer,
                         bias=bias, router_bias=router_bias_E, input_ids=input_ids, hash_table=hash_table)


def _plan_predict(dev, T: int, spec, W, apply_groups, hash_lookup, layer, *, bias, router_bias, input_ids,
                  hash_table) -> _SelectPlan:
    """The selection plan of a next-layer prediction (keys, no weights; zero experts never predicted)."""
    return _plan_select(
        dev, T=T, spec=spec, K=W, apply_groups=apply_groups, mask_zero=spec.num_zero_experts > 0,
        hash_lookup=hash_lookup, table_width=min(W, spec.top_k), weights=False, keys_layer=layer,
        router_bias=router_bias, bias=bias, input_ids=input_ids, hash_table=hash_table, status_layer=layer,
    )


def _prediction(plan: _SelectPlan) -> PredictResult:
    return PredictResult(keys_TW2=plan.keys_TK2, ids_TW=plan.ids_TK, status=plan.status)


def _predict_from(r: _Logits, col0: int, T: int, spec, W, apply_groups, hash_lookup, layer, *,
                  bias, router_bias, input_ids, hash_table) -> PredictResult:
    if r.part_STC is not None:
        src, stride_row, stride_split, split = r.part_STC, r.E + r.F, T * (r.E + r.F), r.split
    else:
        src = r.out_TE if col0 == 0 else r.out_TF
        stride_row, stride_split, split, col0 = src.stride(0), 0, 1, 0
    plan = _plan_predict(src.device, T, spec, W, apply_groups, hash_lookup, layer, bias=bias,
                         router_bias=router_bias, input_ids=input_ids, hash_table=hash_table)
    _launch_select(src, plan, T=T, stride_row=stride_row, stride_split=stride_split, col0=col0, split=split)
    return _prediction(plan)


def _tickets(device: torch.device) -> torch.Tensor | None:
    """The fused kernel's per-device row-group counters: int32 [_TICKET_SLOTS], zero between launches.

    Zeroed once, when first asked for outside a CUDA-graph capture; every fused launch
    leaves them at zero (its last program per row group resets its counter), so no
    launch needs a memset. None while a capture is running and the buffer does not
    exist yet: a memset would only run at replay, so the caller takes the two-kernel
    path for that call (warm up once before capturing, as torch's graph docs ask anyway).
    """
    key = (device.type, device.index)
    t = _TICKETS.get(key)
    if t is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        t = _TICKETS[key] = torch.zeros(_TICKET_SLOTS, dtype=torch.int32, device=device)
    return t


def reserve_device(device: torch.device) -> None:
    """Allocate the per-device buffers the GPU router keeps across calls (the fused step's
    counters, the dummy pointer argument) now, outside any CUDA-graph memory pool: a first
    call inside torch.compile's cudagraph warm-up would otherwise take them from the pool,
    where nothing but a graph's outputs may stay alive."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _dummy(device)
    _tickets(device)


def _fused_rows(tile: int, T: int, block_m: int) -> int:
    """Rows the fused kernel's last program selects at once: 1 for a single token (the decode
    case, smallest tile), else a [rows, NGP, PP] tile of at most _SELECT_TILE elements and at
    most a row group. Two values per family rule only (each is a compiled variant); the bits
    do not depend on it (router_select.py)."""
    if min(T, block_m) == 1:
        return 1
    return max(1, min(_SELECT_TILE // tile, _next_pow2(block_m)))


def _launch_fused(
    x_TH: torch.Tensor,
    weight_EH: torch.Tensor,
    next_weight_FH: torch.Tensor | None,
    g: _Gemm,
    tickets: torch.Tensor,
    a: _SelectPlan,
    b: _SelectPlan | None,
) -> None:
    """One launch: GEMM partials, ticket, and the last program per row group selects (router_fused.py)."""
    from ..kernels.router_fused import _router_fused_kernel

    dev = x_TH.device
    cfg = g.cfg
    T, E, F = g.T, g.E, g.F
    part = _partials(g, dev)
    w2 = next_weight_FH if F else weight_EH
    tile = max(a.tile, b.tile) if b is not None else a.tile
    rows = _fused_rows(tile, T, cfg.block_m)
    dummy = _dummy(dev)
    # Without a prediction the B arguments are never read: dummies, never a's outputs
    # (the Triton interpreter copies every argument back after the launch).
    b_ptrs = b.ptrs if b is not None else (dummy,) * len(a.ptrs)
    b_ints = b.ints if b is not None else a.ints
    b_meta = b.meta if b is not None else a.meta
    grid = (_cdiv(E, cfg.block_e) + _cdiv(F, cfg.block_e), _cdiv(T, cfg.block_m), cfg.split)
    key = (a.meta_key, b.meta_key if b is not None else None, cfg, g.as_f32, rows, dev.type)
    consts = _FUSED_CONSTS.get(key)
    if consts is None:
        consts = _FUSED_CONSTS[key] = dict(
            CHUNK=cfg.chunk, SPLIT=cfg.split, BLOCK_M=cfg.block_m, BLOCK_E=cfg.block_e, BLOCK_K=cfg.block_k,
            AS_F32=g.as_f32, ROWS=rows, PREDICT=b is not None, PRECISE=dev.type == "cuda",
            **{f"A_{k}": v for k, v in a.meta.items()}, **{f"B_{k}": v for k, v in b_meta.items()},
            # the GEMM config's warps and stages: the partials' instructions are the GEMM kernel's
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    _router_fused_kernel[grid](
        x_TH, weight_EH, w2, part, tickets,
        T, E, F, g.H, x_TH.stride(0), weight_EH.stride(0), w2.stride(0), T * (E + F),
        *a.ptrs, *a.ints, *b_ptrs, *b_ints, **consts,
    )


# The fused launch's constexpr keywords by (selection kinds, GEMM config, rows, device type): built
# once each (48 keywords; a dict build per step was a visible share of the step's host time).
_FUSED_CONSTS: dict[tuple, dict] = {}


def router_step_cuda(
    x_TH: torch.Tensor,
    weight_EH: torch.Tensor,
    spec: RouterSpec,
    *,
    router_bias: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
    layer: int | None = None,
    next_weight_EH: torch.Tensor | None = None,
    next_spec: RouterSpec | None = None,
    next_bias: torch.Tensor | None = None,
    next_router_bias: torch.Tensor | None = None,
    width: int | None = None,
    next_layer: int | None = None,
    next_input_ids: torch.Tensor | None = None,
    next_hash_table: torch.Tensor | None = None,
    config: LogitsConfig | None = None,
    fused: bool | None = None,
    status_out: torch.Tensor | None = None,
) -> RouterStep:
    """The whole router of a layer: logits, selection and (optionally) the next layer's prediction.

    Args: x_TH [T, H] and weight_EH [E + Z, H] as router_logits_cuda; spec and bias /
        expert_scale / input_ids / hash_table / layer as route_cuda; router_bias f32-able
        [E + Z] (gpt-oss's linear bias, added to the f32 logits); next_* as
        predict_next_cuda (next_weight_EH of weight_EH's dtype); config as router_logits_cuda.
        fused: None picks the single-kernel step for 1 <= T <= FUSED_MAX_T and the
        two-kernel step above; True / False force one (tests, benchmarks).
        status_out: int32 [T] on x's device, contiguous: the routing status is written there
            (every row) instead of into a fresh tensor (a compiled step keeps it across calls
            in memory that no CUDA-graph pool owns: moeflow.hf.op).
    Returns:
        RouterStep(logits_TS f32 [T, E + Z] (+ router_bias), routing, prediction, fused).

    Fused (one launch, router_fused.py): the GEMM's programs write split partials and
    the last program of each row group (an atomic ticket) sums them and selects.
    Two-kernel: one GEMM launch computes this layer's logits (and, given
    next_weight_EH, the next layer's on the same input); the selection kernel adds the
    split partials in the fixed order, adds `router_bias`, writes the logits and
    selects; a prediction is a third launch. No host sync either way.
    Bits, both paths and every T: logits_TS equals router_logits_cuda(x, w) (+ router_bias
    as f32), routing equals route_cuda on those logits, prediction equals
    predict_next_cuda(x, next_weight_EH, ...). A row's results do not depend on T.
    """
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused: {fused!r}, expected None or a bool")
    g = _plan_gemm(x_TH, weight_EH, next_weight_EH, config)
    T, E, F = g.T, g.E, g.F
    if status_out is not None and (
        not isinstance(status_out, torch.Tensor) or status_out.dtype != torch.int32
        or status_out.shape != (T,) or status_out.device != x_TH.device or not status_out.is_contiguous()
    ):
        what = (f"{status_out.dtype} {tuple(status_out.shape)} on {status_out.device}"
                if isinstance(status_out, torch.Tensor) else type(status_out).__name__)
        raise ValueError(f"status_out: {what}, expected a contiguous int32 [{T}] tensor on {x_TH.device}")
    if E != spec.num_slots:
        raise ValueError(f"weight_EH: {E} rows, expected spec.num_slots={spec.num_slots}")
    logits_like = torch.empty(T, E, dtype=torch.float32, device="meta")  # shape-only validation
    validate_route_inputs(
        logits_like, spec, bias=bias, expert_scale=expert_scale, input_ids=input_ids, hash_table=hash_table,
        check_nan=False, layer=layer,
    )
    dev = x_TH.device
    router_bias = _vector("router_bias", router_bias, dev)
    if router_bias is not None and router_bias.shape != (E,):
        raise ValueError(f"router_bias: shape {tuple(router_bias.shape)}, expected ({E},)")
    bias = _vector("bias", bias, dev)
    expert_scale = _vector("expert_scale", expert_scale, dev)
    if spec.hash_routing:
        input_ids = _vector("input_ids", input_ids, dev)
        hash_table = _vector("hash_table", hash_table, dev)
    predict = None
    if next_weight_EH is not None:
        if next_spec is None or next_layer is None:
            raise ValueError("next_spec/next_layer: required with next_weight_EH")
        if F != next_spec.num_slots:
            raise ValueError(f"next_weight_EH: {F} rows, expected next_spec.num_slots={next_spec.num_slots}")
        W, apply_groups, hash_lookup = _predict_plan(next_spec, width, next_input_ids, next_hash_table)
        _validate_predict(torch.empty(T, F, dtype=torch.float32, device="meta"), next_spec, next_bias,
                          next_input_ids, next_hash_table, next_layer)
        next_bias = _vector("next_bias", next_bias, dev)
        next_router_bias = _vector("next_router_bias", next_router_bias, dev)
        if hash_lookup:
            next_input_ids = _vector("next_input_ids", next_input_ids, dev)
            next_hash_table = _vector("next_hash_table", next_hash_table, dev)
        predict = (W, apply_groups, hash_lookup)

    def plan_predict(rows: int) -> _SelectPlan | None:
        if predict is None:
            return None
        return _plan_predict(dev, rows, next_spec, *predict, next_layer, bias=next_bias,
                             router_bias=next_router_bias, input_ids=next_input_ids, hash_table=next_hash_table)

    def plan_routing(logits_out: torch.Tensor | None) -> _SelectPlan:
        return _plan_select(
            dev, T=T, spec=spec, K=spec.top_k, apply_groups=True, mask_zero=False, hash_lookup=spec.hash_routing,
            table_width=spec.top_k, weights=True, keys_layer=None, router_bias=router_bias, logits_out=logits_out,
            bias=bias, expert_scale=expert_scale, input_ids=input_ids, hash_table=hash_table, status_layer=layer,
            status_out=status_out,
        )

    if fused is None:
        fused = 1 <= T <= FUSED_MAX_T
    tickets = None
    if fused and T:
        n_groups = _cdiv(T, g.cfg.block_m)
        if n_groups > _TICKET_SLOTS:
            raise ValueError(
                f"x_TH: T={T} is {n_groups} row groups of {g.cfg.block_m}, the fused step counts at most "
                f"{_TICKET_SLOTS} (use fused=None or False)"
            )
        tickets = _tickets(dev)
    if tickets is not None:
        logits = torch.empty(T, E, dtype=torch.float32, device=dev)
        a = plan_routing(logits)
        b = plan_predict(T)
        _launch_fused(x_TH, weight_EH, next_weight_EH, g, tickets, a, b)
        routing = CudaRoutingResult(ids_TK=a.ids_TK, weights_TK=a.weights_TK, status=a.status)
        return RouterStep(logits_TS=logits, routing=routing, prediction=None if b is None else _prediction(b),
                          fused=True)

    r = _launch_gemm(x_TH, weight_EH, next_weight_EH, config, want_final=False, plan=g)
    logits = r.out_TE
    if r.part_STC is not None:
        src, stride_row, stride_split, split = r.part_STC, r.E + r.F, T * (r.E + r.F), r.split
        logits_out = logits
    else:
        src, stride_row, stride_split, split = logits, logits.stride(0), 0, 1
        logits_out = None
        if router_bias is not None:  # a fresh buffer: the weights re-read src without the bias
            logits = torch.empty_like(logits)
            logits_out = logits
    a = plan_routing(logits_out)
    _launch_select(src, a, T=T, stride_row=stride_row, stride_split=stride_split, col0=0, split=split)
    routing = CudaRoutingResult(ids_TK=a.ids_TK, weights_TK=a.weights_TK, status=a.status)
    prediction = None
    if predict is not None:
        prediction = _predict_from(
            r, r.E, T, next_spec, *predict, next_layer, bias=next_bias,
            router_bias=next_router_bias, input_ids=next_input_ids, hash_table=next_hash_table,
        )
    return RouterStep(logits_TS=logits, routing=routing, prediction=prediction, fused=False)
