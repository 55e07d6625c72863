"""Group-limited selection (DeepSeek-V2/V3 style): mask experts outside the best groups.

Legend: T tokens, S experts (columns of the key), G groups, P = S // G per group.
"""

from __future__ import annotations

import torch

from .spec import RouterSpec
from .topk import stable_topk_indices


def group_mask_TS(key_TS: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """The key with experts outside the `topk_group` best groups set to -inf.

    Group score: "top2_sum" = sum of the two largest keys in the group (DeepSeek-V3),
    "max" = largest key (DeepSeek-V2 group_limited_greedy). Kept groups are chosen
    with ties toward the lower group index; the masked value is -inf so a kept
    key that a bias made negative still wins over a masked one (the -inf vs 0.0
    difference of older ports).
    """
    T, S = key_TS.shape
    G = spec.n_group
    key_TGP = key_TS.view(T, G, S // G)
    if spec.group_score == "top2_sum":
        top2_TG2 = torch.sort(key_TGP, dim=-1, descending=True).values[..., :2]
        # Summing in a fixed order (largest + second) matches torch.topk(2).sum(-1).
        group_TG = top2_TG2[..., 0] + top2_TG2[..., 1]
    else:
        group_TG = key_TGP.max(dim=-1).values
    keep_TG = stable_topk_indices(group_TG, spec.topk_group)
    keep_mask_TG = torch.zeros(T, G, dtype=torch.bool, device=key_TS.device)
    keep_mask_TG.scatter_(1, keep_TG, True)
    keep_mask_TS = keep_mask_TG.unsqueeze(-1).expand(T, G, S // G).reshape(T, S)
    return key_TS.masked_fill(~keep_mask_TS, float("-inf"))
