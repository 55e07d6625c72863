"""Score functions of the routing families, on f32 logits.

Legend: T tokens, S = E + Z logit columns (routed + zero experts), P = S padded.
Every function here is elementwise or row-wise, so row t of the result depends
only on row t of the input: the property batch invariance rests on.

Elementwise is not enough on CPU: torch runs a transcendental op (sigmoid,
softplus) through a SIMD path for whole vector chunks and a scalar path for the
tail of each call (and of each thread's share), and the two differ in the last
bit. A row's scores would then depend on where the row sits in the batch (a row
routed alone is all tail). `elementwise_rows` therefore runs these ops on rows
padded to a multiple of `_VEC_PAD` columns, in calls too small to be split across
threads: every element takes the SIMD path, which is also the path HF's
full-batch call takes for all but its last few elements.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .spec import RouterSpec

# A multiple of every CPU SIMD loop's chunk (2 x vector width: 32 f32 on AVX-512).
_VEC_PAD = 64
# ATen runs an elementwise op on one thread below at::internal::GRAIN_SIZE elements.
_SERIAL_ELEMS = 32768 - 1


def elementwise_rows(fn: Callable[[torch.Tensor], torch.Tensor], x_TS: torch.Tensor) -> torch.Tensor:
    """fn(x_TS) for an elementwise `fn`, with each element's bits independent of T (see module doc).

    CUDA kernels compute every element the same way: `fn` runs directly there.
    """
    if x_TS.is_cuda or x_TS.dim() != 2 or x_TS.numel() == 0:
        return fn(x_TS)
    T, S = x_TS.shape
    P = -(-S // _VEC_PAD) * _VEC_PAD
    rows = max(1, _SERIAL_ELEMS // P)
    out_TS = torch.empty(T, S, dtype=x_TS.dtype, device=x_TS.device)
    for start in range(0, T, rows):
        chunk = x_TS[start : start + rows]
        buf_TP = torch.zeros(chunk.shape[0], P, dtype=x_TS.dtype, device=x_TS.device)
        buf_TP[:, :S] = chunk
        out_TS[start : start + rows] = fn(buf_TP)[:, :S]
    return out_TS


def sigmoid(logits_TS: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid, batch-invariant on CPU."""
    return elementwise_rows(torch.sigmoid, logits_TS)


def sqrtsoftplus(logits_TS: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x)); softplus(x) = x for x > 20 (torch's threshold, as HF's ACT2FN uses)."""
    return elementwise_rows(lambda x: F.softplus(x).sqrt(), logits_TS)


def softmax_rows(logits_TS: torch.Tensor) -> torch.Tensor:
    """softmax over the last axis (f32), defined on rows whose max is infinite.

    IEEE arithmetic turns a row holding +inf, or a row of only -inf, into NaN
    (inf - inf). moeflow takes softmax's limit instead, its shift invariance carried
    to infinity: the logits equal to the row's max share the probability equally
    (+inf logits: 1/n each, the rest 0; an all -inf row: 1/S each). Finite rows are
    torch.softmax's own bits, so HF's results are unchanged.
    """
    probs_TS = torch.softmax(logits_TS, dim=-1)
    if logits_TS.shape[-1] == 0:
        return probs_TS
    max_T1 = logits_TS.amax(dim=-1, keepdim=True)
    inf_T1 = torch.isinf(max_T1)
    # CPU: skip the fix-up when no row needs it; CUDA: no host sync, always blend.
    if not logits_TS.is_cuda and not bool(inf_T1.any()):
        return probs_TS
    share_TS = (logits_TS == max_T1).to(probs_TS.dtype)
    limit_TS = share_TS / share_TS.sum(dim=-1, keepdim=True)
    return torch.where(inf_T1, limit_TS, probs_TS)


def scores_TS(logits_TS: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """The per-expert score s that the weights are gathered from (f32 [T, S]).

    For the top-k-of-logits families (gpt-oss, llama4) the score is the logit
    itself: their weights are formed from the picked logits only.
    """
    fn = spec.score_fn
    if fn == "softmax":
        return softmax_rows(logits_TS)
    if fn == "sigmoid":
        return sigmoid(logits_TS)
    if fn == "sqrtsoftplus":
        return sqrtsoftplus(logits_TS)
    return logits_TS  # topk_softmax / topk_sigmoid


def log_scores_TK(logits_TS: torch.Tensor, ids_TK: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """log of the picked scores up to a constant per row (f32 [T, K]), finite where the scores underflow.

    What renormalising needs when every picked score has underflowed to 0 (sigmoid below
    -88.7): s_i / sum_j s_j is the softmax of these over the K picks, exactly.
    softmax / topk_softmax: the logit (the row's normaliser cancels); sigmoid / topk_sigmoid:
    log sigmoid(x) = -softplus(-x); sqrtsoftplus: log(softplus(x)) / 2, with
    log(softplus(x)) = x below -30 (softplus(x) = e^x (1 - e^x / 2 + ...): x to f32 precision).
    """
    picked_TK = logits_TS.gather(1, ids_TK)
    fn = spec.score_fn
    if fn in ("sigmoid", "topk_sigmoid"):
        return elementwise_rows(F.logsigmoid, picked_TK)
    if fn == "sqrtsoftplus":
        return elementwise_rows(lambda x: torch.where(x < -30.0, x, torch.log(F.softplus(x))) * 0.5, picked_TK)
    return picked_TK


def selection_key_TS(scores: torch.Tensor, spec: RouterSpec, bias_S: torch.Tensor | None) -> torch.Tensor:
    """The key experts are ranked by: s (+ bias). The bias never enters the weights."""
    if bias_S is None:
        return scores
    return scores + bias_S
