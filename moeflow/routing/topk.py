"""Top-k with a defined order: key descending, ties toward the lower index.

torch.topk leaves the order of equal values undefined; a stable descending sort
does not: equal keys keep their index order. This is the one tie rule of
moeflow (CPU reference, GPU kernels and prediction all follow it).
"""

from __future__ import annotations

import torch


def stable_topk_indices(key_TS: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [T, k]: columns of the k largest keys per row, ties to the lower index.

    -inf keys sort last; NaN must have been rejected by the caller.
    """
    return torch.sort(key_TS, dim=-1, descending=True, stable=True).indices[:, :k]
