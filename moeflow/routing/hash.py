"""Hash-routing tables (DeepSeek-V4 hash layers, `tid2eid`): validation.

Legend: V vocabulary size, K picks per token, T tokens, E + Z logit columns.

A hash layer's ids come from `table_VK[input_ids]` instead of a top-K: each row
must name K distinct experts in [0, E + Z), or the layer would run one expert
twice for a token (double its weight) and skip another, a silent wrong answer.
"""

from __future__ import annotations

import torch


def _first_bad_row(rows_NK: torch.Tensor) -> int | None:
    """Index of the first row of int [N, K] holding a repeated id (None: all distinct)."""
    if rows_NK.shape[0] == 0 or rows_NK.shape[1] < 2:
        return None
    sorted_NK, _ = rows_NK.sort(dim=1)
    dup_N = (sorted_NK[:, 1:] == sorted_NK[:, :-1]).any(dim=1)
    if not bool(dup_N.any()):
        return None
    return int(dup_N.nonzero()[0, 0])


def check_hash_table(table_VK: torch.Tensor, num_experts: int, *, top_k: int | None = None,
                     name: str = "hash_table_VK") -> None:
    """Raise TypeError/ValueError naming the row and value if `table_VK` is not a valid hash table.

    Args:
        table_VK: int [V, K] token id -> expert ids (any device; read on the host once,
            so call it at construction, not per forward).
        num_experts: logit columns the ids index (E routed + Z zero experts).
        top_k: K the table must have as its second dimension (None: not checked).
        name: the field named in errors.

    Checks: an integer (non-bool) tensor, 2-D, K columns, every id in [0, num_experts),
    and the K ids of each row distinct.
    """
    if not isinstance(table_VK, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(table_VK).__name__}")
    if table_VK.dtype.is_floating_point or table_VK.dtype.is_complex or table_VK.dtype == torch.bool:
        raise TypeError(f"{name}: dtype {table_VK.dtype}, expected an integer dtype")
    if table_VK.dim() != 2 or (top_k is not None and table_VK.shape[1] != top_k):
        want = "(V, K)" if top_k is None else f"(V, K={top_k})"
        raise ValueError(f"{name}: shape {tuple(table_VK.shape)}, expected {want}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r}: expected an int >= 1")
    if table_VK.numel() == 0:
        return
    t = table_VK.detach().cpu()
    bad_VK = (t < 0) | (t >= num_experts)
    if bool(bad_VK.any()):
        v, k = (int(i) for i in bad_VK.nonzero()[0])
        raise ValueError(f"{name}: row {v} holds expert id {int(t[v, k])} outside [0, {num_experts})")
    check_distinct_rows(t, name=name)


def check_distinct_rows(rows_NK: torch.Tensor, *, name: str, row_ids: torch.Tensor | None = None) -> None:
    """ValueError naming the row if a row of int [N, K] repeats an id.

    row_ids: int [N], the table row each of rows_NK came from (the token ids of a
    lookup), so the error names the table row rather than the token position.
    """
    bad = _first_bad_row(rows_NK)
    if bad is None:
        return
    row = bad if row_ids is None else int(row_ids.reshape(-1)[bad])
    raise ValueError(f"{name}: row {row} repeats an expert id: {rows_NK[bad].tolist()} "
                     f"(expected K distinct experts per token)")
