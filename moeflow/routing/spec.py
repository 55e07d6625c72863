"""RouterSpec: the exact selection rule of one MoE layer's router.

One frozen value describes every family of `docs/routing.md`; the only
module that maps model names onto it is `moeflow.routing.families`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

ScoreFn = Literal["softmax", "sigmoid", "sqrtsoftplus", "topk_softmax", "topk_sigmoid"]
GroupScore = Literal["top2_sum", "max"]

SCORE_FNS: tuple[str, ...] = ("softmax", "sigmoid", "sqrtsoftplus", "topk_softmax", "topk_sigmoid")
GROUP_SCORES: tuple[str, ...] = ("top2_sum", "max")
BOOL_FIELDS: tuple[str, ...] = ("renorm", "use_bias", "hash_routing", "router_prenorm", "expert_scale",
                                "weight_on_input")


@dataclass(frozen=True, kw_only=True)
class RouterSpec:
    """How one layer turns f32 router logits [T, E(+Z)] into (ids [T, K], weights [T, K]).

    score_fn:
        "softmax"      s = softmax(logits) over all E (+Z) columns; key = s (+ bias)
        "sigmoid"      s = sigmoid(logits); key = s + bias (DeepSeek-V3 / GLM / Kimi)
        "sqrtsoftplus" s = sqrt(softplus(logits)); key = s + bias (DeepSeek-V4)
        "topk_softmax" key = logit; weights = softmax over the K picked logits (gpt-oss)
        "topk_sigmoid" key = logit; weights = sigmoid(picked logit) (llama4; the weight
                       scales the expert input, see `weight_on_input`)
    num_experts:      E, routed experts with weights (zero experts not counted).
    top_k:            K.
    renorm:           divide the picked weights by their sum (+ renorm_eps).
    renorm_eps:       added to the sum before dividing (1e-20 for DeepSeek, 0 elsewhere);
                      a finite float >= 0.
    scaling_factor:   multiplies the final weights (routed_scaling_factor / route_scale);
                      a finite float > 0.
    n_group, topk_group, group_score: group-limited selection; n_group=1 disables it.
    use_bias:         the selection key adds a per-expert bias (e_score_correction_bias);
                      the weights never include it.
    num_zero_experts: Z LongCat zero experts: logits have E + Z columns; a pick >= E is
                      an identity expert.
    hash_routing:     ids come from `hash_table[input_ids]` (DeepSeek-V4 hash layers);
                      weights still come from the scores.
    router_prenorm:   the router's input is RMSNorm(x) * scale * H^-1/2 (gemma4), applied
                      by the layer before the logits, not by `route`.
    expert_scale:     weights are multiplied by a per-expert scale vector (gemma4).
    weight_on_input:  the weight multiplies the expert's input instead of its output (llama4).
    renorm_before_scale: order is fixed: renorm, then per-expert scale, then scaling_factor.

    Every field is checked at construction: a str "2", None, NaN or inf in a float
    field, or a non-bool flag, raises here rather than as NaN weights later. Int values
    of the float fields are stored as float.
    """

    score_fn: ScoreFn
    num_experts: int
    top_k: int
    renorm: bool = False
    renorm_eps: float = 0.0
    scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: GroupScore = "top2_sum"
    use_bias: bool = False
    num_zero_experts: int = 0
    hash_routing: bool = False
    router_prenorm: bool = False
    expert_scale: bool = False
    weight_on_input: bool = False

    def __post_init__(self) -> None:
        if self.score_fn not in SCORE_FNS:
            raise ValueError(f"RouterSpec.score_fn={self.score_fn!r}: expected one of {SCORE_FNS}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"RouterSpec.group_score={self.group_score!r}: expected one of {GROUP_SCORES}")
        for name in ("num_experts", "top_k", "n_group", "topk_group"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RouterSpec.{name}={v!r}: expected an int >= 1")
        for name in BOOL_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, bool):
                # A truthy str or None would silently pick a rule: only True/False name one.
                raise TypeError(f"RouterSpec.{name}={v!r}: expected a bool")
        self._check_float("renorm_eps", minimum=0.0, strict=False)
        self._check_float("scaling_factor", minimum=0.0, strict=True)
        if (not isinstance(self.num_zero_experts, int) or isinstance(self.num_zero_experts, bool)
                or self.num_zero_experts < 0):
            raise ValueError(f"RouterSpec.num_zero_experts={self.num_zero_experts!r}: expected an int >= 0")
        if self.top_k > self.num_slots:
            raise ValueError(
                f"RouterSpec.top_k={self.top_k} exceeds the {self.num_slots} experts "
                f"(num_experts={self.num_experts} + num_zero_experts={self.num_zero_experts})"
            )
        if self.n_group > 1:
            if self.num_slots % self.n_group:
                raise ValueError(
                    f"RouterSpec.n_group={self.n_group} does not divide the {self.num_slots} experts"
                )
            if self.topk_group > self.n_group:
                raise ValueError(
                    f"RouterSpec.topk_group={self.topk_group} exceeds n_group={self.n_group}"
                )
            per_group = self.num_slots // self.n_group
            if self.group_score == "top2_sum" and per_group < 2:
                raise ValueError(
                    f"RouterSpec.group_score='top2_sum' needs >= 2 experts per group, got {per_group} "
                    f"(E={self.num_slots}, n_group={self.n_group})"
                )
            if self.top_k > self.topk_group * per_group:
                raise ValueError(
                    f"RouterSpec.top_k={self.top_k} exceeds the {self.topk_group * per_group} experts "
                    f"in topk_group={self.topk_group} groups of {per_group}"
                )
        if self.score_fn in ("topk_softmax", "topk_sigmoid") and (self.use_bias or self.n_group > 1):
            raise ValueError(f"RouterSpec.score_fn={self.score_fn!r} selects on logits: no bias or groups")

    def _check_float(self, name: str, *, minimum: float, strict: bool) -> None:
        """A finite real > minimum (strict) or >= minimum; stored as float."""
        v = getattr(self, name)
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"RouterSpec.{name}={v!r}: expected a finite float {bound}, got {type(v).__name__}")
        if not math.isfinite(v) or (v <= minimum if strict else v < minimum):
            raise ValueError(f"RouterSpec.{name}={v!r}: expected a finite float {bound}")
        # frozen dataclass: the one sanctioned way to normalise a field in __post_init__
        object.__setattr__(self, name, float(v))

    @property
    def num_slots(self) -> int:
        """Columns of the logits: E routed + Z zero experts."""
        return self.num_experts + self.num_zero_experts

    def replace(self, **changes) -> RouterSpec:
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return RouterSpec(**values)
