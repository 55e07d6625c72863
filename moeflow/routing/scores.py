"""Score functions of the routing families, on f32 logits.

Legend: T tokens, S = E + Z logit columns (routed + zero experts).
Every function here is elementwise or row-wise, so row t of the result depends
only on row t of the input: the property batch invariance rests on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import RouterSpec


def sqrtsoftplus(logits_TS: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x)); softplus(x) = x for x > 20 (torch's threshold, as HF's ACT2FN uses)."""
    return F.softplus(logits_TS).sqrt()


def scores_TS(logits_TS: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """The per-expert score s that the weights are gathered from (f32 [T, S]).

    For the top-k-of-logits families (gpt-oss, llama4) the score is the logit
    itself: their weights are formed from the picked logits only.
    """
    fn = spec.score_fn
    if fn == "softmax":
        return torch.softmax(logits_TS, dim=-1)
    if fn == "sigmoid":
        return torch.sigmoid(logits_TS)
    if fn == "sqrtsoftplus":
        return sqrtsoftplus(logits_TS)
    return logits_TS  # topk_softmax / topk_sigmoid


def selection_key_TS(scores: torch.Tensor, spec: RouterSpec, bias_S: torch.Tensor | None) -> torch.Tensor:
    """The key experts are ranked by: s (+ bias). The bias never enters the weights."""
    if bias_S is None:
        return scores
    return scores + bias_S
