"""Prefetcher: the next layer's router on this layer's input -> protected keys and early copies.

Legend: T tokens, H hidden, E routed experts of the next layer, W prediction
width (experts per token; may exceed K), L offloaded layers.

After layer l routes, run layer l+1's router weight on layer l's input (one
extra GEMV, `predict_next_ids`), rank by l+1's selection key, and take the best
W per token as (l+1, expert) cache keys. The device ids are read back together
with layer l's own routing ids (one read-back per layer, the one routing already
needs), then:
    - the cache protects them: a prefetch never evicts a wanted key, and the
      "predictive" policy spares them on demand misses too;
    - when prefetch is on, the missing ones are copied on the side stream while
      layer l computes; layer l+1 waits only on the events of the slots it reads.
The last layer predicts nothing (the next token's first layer input is unknown).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..routing.predict import predict_next_ids
from ..routing.router import router_input
from .gate import PREFETCH_RULES, PrefetchGate
from .slots import Key


class Prefetcher:
    """Next-layer prediction for a list of MoELayers sharing one ExpertCache.

    layers:   the offloaded MoELayers in model order (position = cache layer index).
    cache:    the ExpertCache (or None: prediction only, e.g. trace recording).
    width:    W experts per token to predict (0: predict nothing).
    prefetch: issue copies of the predicted missing experts (else only protect them).
    rule:     "cost" (copy a guess only when its expected saving pays its bytes:
              moeflow.offload.gate.PrefetchGate) or "always" (every predicted missing key).
    overlap:  the cost rule's expert copies per layer step hidden behind compute.
    """

    def __init__(self, layers: Sequence, cache, *, width: int, prefetch: bool, rule: str = "cost",
                 overlap: float = 0.0) -> None:
        if rule not in PREFETCH_RULES:
            raise ValueError(f"rule={rule!r}: expected one of {PREFETCH_RULES}")
        self.layers = list(layers)
        self.cache = cache
        self.width = int(width)
        self.prefetch_enabled = bool(prefetch) and self.width > 0
        self.gate = PrefetchGate(overlap=overlap, width=self.width) if self.prefetch_enabled and rule == "cost" else None
        self.issued_last = 0
        # Expert parallelism: layer -> {global expert id: local id} of the experts this rank
        # serves (None: every expert, ids unchanged). A prediction keeps only owned experts.
        self._to_local: list[dict[int, int] | None] = []
        for layer in self.layers:
            ids = getattr(getattr(layer, "dispatcher", None), "local_ids", None)
            self._to_local.append(None if ids is None else {int(g): j for j, g in enumerate(ids)})

    def predict_ids(self, pos: int, x_TH: torch.Tensor) -> torch.Tensor | None:
        """int32 [T, W] device ids (global) of layer pos+1 predicted from layer pos's input (None: nothing)."""
        if self.width <= 0 or pos + 1 >= len(self.layers):
            return None
        nxt = self.layers[pos + 1]
        rw = nxt.router_weights
        w = min(self.width, nxt.config.num_experts)
        return predict_next_ids(
            router_input(rw, x_TH),
            rw.weight_EH,
            nxt.config.router,
            bias=rw.selection_bias_E,
            width=w,
            router_bias_E=rw.router_bias_E,
        )

    def local_keys(self, pos: int, pred_rows: Sequence[Sequence[int]] | None) -> list[Key]:
        """`keys` in the cache's id space: under expert parallelism only the next layer's experts
        this rank serves, as local ids."""
        keys = self.keys(pos, pred_rows)
        if not keys or pos + 1 >= len(self._to_local) or self._to_local[pos + 1] is None:
            return keys
        m = self._to_local[pos + 1]
        return [(layer, m[e]) for layer, e in keys if e in m]

    @staticmethod
    def keys(pos: int, pred_rows: Sequence[Sequence[int]] | None) -> list[Key]:
        """Distinct (pos+1, expert) keys of the predicted rows, best ranks first across tokens."""
        if not pred_rows:
            return []
        out: dict[Key, None] = {}
        width = max(len(r) for r in pred_rows)
        for rank in range(width):  # interleave by rank so a truncated prefetch keeps every token's best
            for row in pred_rows:
                if rank < len(row):
                    out[(pos + 1, int(row[rank]))] = None
        return list(out)

    def protect(self, keys: Sequence[Key]) -> None:
        if self.cache is not None:
            self.cache.protect(keys)

    def observe(self, keys: Sequence[Key]) -> None:
        """A layer step's demand keys, before they are served (the cost rule's estimates learn from them)."""
        if self.gate is not None:
            self.gate.observe(keys)

    def issue(self, keys: Sequence[Key]) -> int:
        """Start the copies of the predicted keys not yet resident (those the rule admits); returns how many."""
        if not self.prefetch_enabled or self.cache is None or not keys:
            self.issued_last = 0
            return 0
        if self.gate is not None:
            self.gate.predicted(keys)
        self.issued_last = self.cache.prefetch(keys, gate=self.gate)
        return self.issued_last


def read_back(ids: torch.Tensor, pred_TW: torch.Tensor | None) -> tuple[list[int], list[list[int]] | None]:
    """Host lists of the step's expert ids (flat, from ids [T, K] or [N]) and predicted ids [T][W]
    (pred_TW [T, W] or None), in one device->host copy: the read-back a step with host-side
    bookkeeping needs anyway carries the prediction along."""
    flat = ids.reshape(-1).to(torch.int32)
    if pred_TW is None:
        return flat.tolist(), None
    W = int(pred_TW.shape[1])
    n = int(flat.shape[0])
    both = torch.cat([flat, pred_TW.reshape(-1).to(torch.int32)]).tolist()
    T = int(pred_TW.shape[0])
    pred = [both[n + t * W : n + (t + 1) * W] for t in range(T)]
    return both[:n], pred
