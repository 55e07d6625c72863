"""`route`: the family's selection rule on f32 router logits (CPU reference; CUDA dispatch).

Legend: T tokens, E routed experts, Z zero experts, S = E + Z logit columns,
K picks per token, V vocabulary size.

Contract (docs/routing.md): ids within a row are distinct and ordered by
selection key descending, ties toward the lower expert index; row t of the
result depends only on row t of the inputs (batch invariance); a NaN logit is
an error naming the row; bad shapes/dtypes are errors naming the field.
"""

from __future__ import annotations

import importlib

import torch

from .._triton import triton_available
from ..types import RoutingResult
from .grouped import group_mask_TS
from .scores import log_scores_TK, scores_TS, selection_key_TS, sigmoid, softmax_rows
from .spec import RouterSpec
from .topk import stable_topk_indices
from .validate import validate_route_inputs


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
        # Picks that all underflowed to 0 (sigmoid of logits below -88.7) with renorm_eps = 0
        # make 0 / 0: the ratio s_i / sum s_j is computed from the log-scores instead (finite,
        # and what exact arithmetic gives). HF's renormalising families either add 1e-20
        # (DeepSeek/GLM/dots1: weights 0 there, kept) or cannot reach a zero sum (softmax
        # without a selection bias), so rows HF keeps finite are unchanged.
        zero_T1 = denom_T1 == 0
        if weights_TK.is_cuda or bool(zero_T1.any()):
            exact_TK = softmax_rows(log_scores_TK(logits_TS, ids_TK, spec))
            renormed_TK = torch.where(zero_T1, exact_TK, renormed_TK)
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
    if not triton_available():
        return None
    return importlib.import_module("moeflow.routing.gpu")
