"""Next-layer router prediction: (layer, expert) prefetch keys from this layer's input.

Legend: T tokens, H hidden size, E routed experts of the next layer, W width
(how many experts to predict per token; may exceed K).

Run the *next* layer's router weight on *this* layer's input and rank experts by the
next layer's selection key (s + bias, group-limited as its spec says), with moeflow's one
tie rule.
"""

from __future__ import annotations

import torch

from .grouped import group_mask_TS
from .logits import router_logits
from .scores import scores_TS, selection_key_TS
from .spec import RouterSpec
from .topk import stable_topk_indices
from .validate import validate_route_inputs


def predict_next_ids(
    x_TH: torch.Tensor,
    next_router_weight_EH: torch.Tensor,
    next_spec: RouterSpec,
    *,
    bias: torch.Tensor | None = None,
    width: int | None = None,
    router_bias_E: torch.Tensor | None = None,
    input_ids: torch.Tensor | None = None,
    hash_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 [T, W]: the W best experts of the next layer per token, best first (stays on x's device).

    Zero experts (ids >= E) are never predicted: they hold no weights to fetch.
    Group limits apply while W fits in the kept groups; a wider W ranks on the
    plain key (the extra picks are the next-best experts overall).
    A hash layer's prediction is its table lookup (exact) when input_ids are given;
    a width above K appends the next-best experts by score after the table's K.
    """
    E = next_spec.num_experts
    W = next_spec.top_k if width is None else width
    if not isinstance(W, int) or isinstance(W, bool) or W < 1 or W > E:
        raise ValueError(f"width: {W!r}, expected an int in [1, {E}] (the next layer's routed experts)")
    if x_TH.is_cuda:
        from .select import _gpu_module

        gpu = _gpu_module()
        if gpu is not None:
            # One fused GEMV + selection launch, no host sync.
            return gpu.predict_next_cuda(
                x_TH,
                next_router_weight_EH,
                next_spec,
                bias=bias,
                width=W,
                layer=0,
                router_bias_E=router_bias_E,
                input_ids=input_ids,
                hash_table=hash_table,
            ).ids_TW
    logits_TS = router_logits(x_TH, next_router_weight_EH)
    if router_bias_E is not None:
        logits_TS = logits_TS + router_bias_E.float()
    validate_route_inputs(
        logits_TS,
        next_spec,
        bias=bias,
        expert_scale=None if not next_spec.expert_scale else torch.ones(next_spec.num_slots, device=x_TH.device),
        input_ids=input_ids,
        hash_table=hash_table,
        check_nan=not x_TH.is_cuda,
    )
    key_TS = selection_key_TS(scores_TS(logits_TS, next_spec), next_spec, None if bias is None else bias.float())
    if next_spec.hash_routing and input_ids is not None:
        table_TK = hash_table[input_ids.reshape(-1).long()].long()
        if W <= next_spec.top_k:
            return table_TK[:, :W].to(torch.int32)
        # Wider than the table: its K picks (exact) first, then the best other experts by
        # score, so the width-W prediction extends the width-K one.
        key_TS = key_TS.scatter(1, table_TK, float("-inf"))
        key_TS[:, E:] = float("-inf")
        extra_TW = stable_topk_indices(key_TS, W - next_spec.top_k)
        return torch.cat([table_TK, extra_TW], dim=1).to(torch.int32)
    per_group = next_spec.num_slots // next_spec.n_group
    if next_spec.n_group > 1 and W <= next_spec.topk_group * per_group:
        key_TS = group_mask_TS(key_TS, next_spec)
    if next_spec.num_zero_experts:
        key_TS = key_TS.clone()
        key_TS[:, E:] = float("-inf")
    return stable_topk_indices(key_TS, W).to(torch.int32)


def predict_next(
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
) -> list[list[tuple[int, int]]]:
    """Per token, the predicted (layer, expert) cache keys of the next layer, best first.

    Args:
        x_TH: [T, H] this layer's router input (bf16/fp16/fp32).
        next_router_weight_EH: [E(+Z), H] the next layer's router weight.
        next_spec: the next layer's RouterSpec.
        bias: [E(+Z)] the next layer's selection bias, if it uses one.
        width: experts per token to predict (default K; wider raises recall).
        layer: the next layer's index, the first element of each key.
    Returns:
        T lists of `width` (layer, expert) tuples. This reads the ids to the host;
        the device form is `predict_next_ids` (CUDA: `moeflow.routing.gpu`).
    """
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise ValueError(f"layer: {layer!r}, expected an int >= 0")
    ids_TW = predict_next_ids(
        x_TH,
        next_router_weight_EH,
        next_spec,
        bias=bias,
        width=width,
        router_bias_E=router_bias_E,
        input_ids=input_ids,
        hash_table=hash_table,
    )
    return [[(layer, int(e)) for e in row] for row in ids_TW.cpu().tolist()]
