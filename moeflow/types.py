"""Typed results passed between the MoE pipeline stages.

Legend: T tokens, H hidden size, E routed experts, K experts per token,
N (token, slot) pairs after dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingResult:
    """The router's selection for T tokens.

    ids_TK:     int32 [T, K]. Distinct within a row, ordered by selection key
                descending, ties toward the lower expert index. An id >= E names a
                LongCat zero expert (identity, no compute).
    weights_TK: float32 [T, K]. The combine weight of each pick, after renorm
                and scaling (llama4: the weight multiplies the expert *input*).
    """

    ids_TK: torch.Tensor
    weights_TK: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.ids_TK.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.ids_TK.shape[1])
