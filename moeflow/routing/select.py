"""`route`: the family's selection rule on f32 router logits (CPU reference; CUDA dispatch).

Legend: T tokens, E routed experts, Z zero experts, S = E + Z logit columns,
K picks per token, V vocabulary size.

Contract (shared/spec/routing.md): ids within a row are distinct and ordered by
selection key descending, ties toward the lower expert index; row t of the
result depends only on row t of the inputs (batch invariance); a NaN logit is
an error naming the row; bad shapes/dtypes are errors naming the field.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ..types import RoutingResult
from .grouped import group_mask_TS
from .scores import scores_TS, selection_key_TS, sigmoid, softmax_rows
from .spec import RouterSpec
from .topk import stable_topk_indices


def _check_vector(name: str, t: torch.Tensor | None, length: int, spec: RouterSpec) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected ({length},) for {spec.num_slots} logit columns")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name}: dtype {t.dtype}, expected a floating dtype")
    if not t.is_cuda and t.numel() and bool(torch.isnan(t).any()):
        # A NaN here would rank (or weigh) experts as silently as a NaN logit.
        e = int(torch.isnan(t).nonzero()[0, 0])
        raise ValueError(f"{name}: NaN at expert {e}")


def validate_route_inputs(
    logits_TS: torch.Tensor,
    spec: RouterSpec,
    *,
    bias: torch.Tensor | None,
    expert_scale: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    hash_table: torch.Tensor | None,
    check_nan: bool = True,
    layer: int | None = None,
) -> None:
    """Raise TypeError/ValueError naming the field for every input `route` refuses.

    `check_nan` reads the logits on the host (one sync on CUDA); the GPU path
    passes False and uses a device-side flag instead.
    """
    if not isinstance(spec, RouterSpec):
        raise TypeError(f"spec: expected RouterSpec, got {type(spec).__name__}")
    if not isinstance(logits_TS, torch.Tensor):
        raise TypeError(f"logits_TE: expected a torch.Tensor, got {type(logits_TS).__name__}")
    if logits_TS.dtype != torch.float32:
        raise TypeError(f"logits_TE: dtype {logits_TS.dtype}, expected torch.float32 (router logits are f32)")
    if logits_TS.dim() != 2 or logits_TS.shape[1] != spec.num_slots:
        raise ValueError(
            f"logits_TE: shape {tuple(logits_TS.shape)}, expected (T, {spec.num_slots}) "
            f"(num_experts={spec.num_experts} + num_zero_experts={spec.num_zero_experts})"
        )
    if spec.use_bias and bias is None:
        raise ValueError("bias: None, but spec.use_bias=True (pass e_score_correction_bias)")
    if bias is not None and not spec.use_bias:
        raise ValueError("bias: given, but spec.use_bias=False")
    _check_vector("bias", bias, spec.num_slots, spec)
    if spec.expert_scale and expert_scale is None:
        raise ValueError("expert_scale: None, but spec.expert_scale=True")
    if expert_scale is not None and not spec.expert_scale:
        raise ValueError("expert_scale: given, but spec.expert_scale=False")
    _check_vector("expert_scale", expert_scale, spec.num_slots, spec)
    T = logits_TS.shape[0]
    if spec.hash_routing:
        if hash_table is None or input_ids is None:
            raise ValueError(
                f"hash_table/input_ids: spec.hash_routing=True needs both, got "
                f"hash_table={'None' if hash_table is None else 'tensor'}, input_ids={'None' if input_ids is None else 'tensor'}"
            )
        for n, t in (("hash_table", hash_table), ("input_ids", input_ids)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
        if hash_table.dim() != 2 or hash_table.shape[1] != spec.top_k:
            raise ValueError(f"hash_table: shape {tuple(hash_table.shape)}, expected (vocab, K={spec.top_k})")
        if hash_table.dtype.is_floating_point or hash_table.dtype == torch.bool:
            raise TypeError(f"hash_table: dtype {hash_table.dtype}, expected an integer dtype")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids: dtype {input_ids.dtype}, expected an integer dtype")
        if input_ids.numel() != T:
            raise ValueError(f"input_ids: {input_ids.numel()} ids for T={T} logit rows")
        if check_nan and T:
            vocab = hash_table.shape[0]
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(f"input_ids: id {bad} out of the hash table's vocabulary [0, {vocab})")
            tlo, thi = int(hash_table.min()), int(hash_table.max())
            if tlo < 0 or thi >= spec.num_slots:
                raise ValueError(f"hash_table: expert id {tlo if tlo < 0 else thi} outside [0, {spec.num_slots})")
    if check_nan and T:
        nan_rows = torch.isnan(logits_TS).any(dim=1)
        if bool(nan_rows.any()):
            row = int(nan_rows.nonzero()[0, 0])
            where = f" of layer {layer}" if layer is not None else ""
            raise ValueError(f"logits_TE: NaN logit in token row {row}{where} ({int(nan_rows.sum())} rows hold NaN)")


def route_reference(
    logits_TS: torch.Tensor,
    spec: RouterSpec,
    *,
    bias: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
) -> RoutingResult:
    """The torch reference of the selection (no validation; see `route`)."""
    K = spec.top_k
    scores = scores_TS(logits_TS, spec)
    if spec.hash_routing:
        ids_TK = hash_table[input_ids.reshape(-1).long()].long()
    else:
        key = selection_key_TS(scores, spec, None if bias is None else bias.float())
        if spec.n_group > 1:
            key = group_mask_TS(key, spec)
        ids_TK = stable_topk_indices(key, K)
    picked_TK = scores.gather(1, ids_TK)
    if spec.score_fn == "topk_softmax":
        weights_TK = softmax_rows(picked_TK)
    elif spec.score_fn == "topk_sigmoid":
        weights_TK = sigmoid(picked_TK)
    else:
        weights_TK = picked_TK
    if spec.renorm:
        denom_T1 = weights_TK.sum(dim=-1, keepdim=True)
        if spec.renorm_eps:
            denom_T1 = denom_T1 + spec.renorm_eps
        renormed_TK = weights_TK / denom_T1
        # An infinite pick (sqrtsoftplus of a +inf logit) makes IEEE's inf / inf a NaN:
        # take the limit instead, the infinite picks sharing the weight equally.
        inf_TK = torch.isinf(weights_TK)
        if weights_TK.is_cuda or bool(inf_TK.any()):
            inf_f_TK = inf_TK.to(weights_TK.dtype)
            limit_TK = inf_f_TK / inf_f_TK.sum(dim=-1, keepdim=True).clamp_min(1.0)
            renormed_TK = torch.where(inf_TK.any(dim=-1, keepdim=True), limit_TK, renormed_TK)
        weights_TK = renormed_TK
    if expert_scale is not None:
        weights_TK = weights_TK * expert_scale.float()[ids_TK]
    if spec.scaling_factor != 1.0:
        weights_TK = weights_TK * spec.scaling_factor
    return RoutingResult(ids_TK=ids_TK.to(torch.int32), weights_TK=weights_TK.to(torch.float32).contiguous())


def route(
    logits_TE: torch.Tensor,
    spec: RouterSpec,
    *,
    bias: torch.Tensor | None = None,
    expert_scale: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
    layer: int | None = None,
) -> RoutingResult:
    """Select K experts per token from f32 router logits.

    Args:
        logits_TE: float32 [T, E + Z]; already includes any router-linear bias (gpt-oss).
        spec: the layer's RouterSpec.
        bias: float [E + Z] selection bias (e_score_correction_bias); never in the weights.
        expert_scale: float [E + Z] per-expert weight multiplier (gemma4).
        input_ids: int [T] token ids, for hash layers.
        hash_table: int [V, K] token id -> expert ids, for hash layers (tid2eid).
        layer: layer index, only used to name the layer in errors.

    Returns:
        RoutingResult(ids_TK int32 [T, K], weights_TK float32 [T, K]); ids ordered by
        key descending, ties to the lower index (hash layers: the table's order).

    On CPU the NaN check reads the logits; on CUDA the selection runs in a kernel
    without a host sync and NaN is reported through a device flag
    (`moeflow.routing.gpu`), checked where the caller chooses.
    """
    if isinstance(logits_TE, torch.Tensor) and logits_TE.is_cuda:
        gpu = _gpu_module()
        if gpu is not None:
            return gpu.route_cuda(
                logits_TE,
                spec,
                bias=bias,
                expert_scale=expert_scale,
                input_ids=input_ids,
                hash_table=hash_table,
                layer=layer,
            )
    validate_route_inputs(
        logits_TE, spec, bias=bias, expert_scale=expert_scale, input_ids=input_ids, hash_table=hash_table, layer=layer
    )
    return route_reference(
        logits_TE, spec, bias=bias, expert_scale=expert_scale, input_ids=input_ids, hash_table=hash_table
    )


def _gpu_module():
    """moeflow.routing.gpu when Triton is installed, else None (the torch reference runs on CUDA too).

    Only a missing Triton falls back: an error inside moeflow's own kernels surfaces.
    """
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("moeflow.routing.gpu") is None:
        return None
    return importlib.import_module("moeflow.routing.gpu")
