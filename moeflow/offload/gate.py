"""PrefetchGate: copy a predicted expert ahead only when its expected saving pays its bytes.

Legend: B bytes of one expert, L offloaded layers, W prediction width, a key is (layer, expert).

A demand miss is copied on the critical path: its layer's compute waits for all of its B
bytes. A prefetch is copied on the side stream behind compute, but the host link is one
queue: whatever part of its copy does not fit in the time the link would otherwise sit idle
during the layer step (`overlap`, in expert copies per layer step) delays the next demand
copies by as much. And it may evict a resident expert that would have hit. So, in bytes on
the critical path, a guess of key k is worth copying when

    p_k * B  >  (1 - h) * B  +  (1 - p_k) * q * B      (q only when the copy evicts; 0 into a free slot)

    p_k: the probability that k is used at its layer's next step: the measured precision of
         past predictions of the same layer at the same rank (only predictions of experts not
         resident at the time: the population the gate decides on), Beta(1, 1) prior;
    h:   the share of k's copy hidden behind this step's compute: the step's `overlap` budget
         is spent by the guesses admitted before k, in rank order (h = min(1, budget left));
    q:   the measured share of prefetch victims demanded again within L steps (one token: the
         time a victim would still have stayed resident), prior 1/4 (weight 2). It weighs only
         the wasted case (1 - p_k): when the guess is used, its demand miss would have evicted
         a resident expert all the same.

With overlap 0 (every copy fully exposed, a PCIe-bound decode) no guess pays (p <= 1):
the rule copies nothing, as the GPU rows measured ask: there plain LRU decodes faster than LRU
with prefetch (benchmarks/RESULTS.md, Offload). The overlap of a run is measurable:
pinned H2D bandwidth x (resident decode time per layer step) / B (bench_offload.py prints it).

Deterministic (counts only, no clock, no RNG) and O(W) per step; the trace replay runs this
object, so a replay's copies are the live prefetcher's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .slots import Key

PREFETCH_RULES: tuple[str, ...] = ("cost", "always")


class PrefetchGate:
    """The cost rule of the module doc, with its online estimates.

    overlap: expert copies per layer step the host link completes behind compute (>= 0).
    width:   W, the prediction width: ranks >= W (a prefill step's many tokens) share one bucket.
    """

    def __init__(self, *, overlap: float, width: int) -> None:
        if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not overlap >= 0.0:
            raise ValueError(f"overlap={overlap!r}: expected a float >= 0 (expert copies per layer step)")
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ValueError(f"width={width!r}: expected an int >= 1")
        self.overlap = float(overlap)
        self.width = width
        self._used: dict[tuple[int, int], float] = {}  # (layer, rank) -> predictions used (+ prior)
        self._seen: dict[tuple[int, int], float] = {}  # (layer, rank) -> predictions scored (+ prior)
        self._pending: dict[int, list[tuple[int, int]]] = {}  # layer -> [(expert, rank)] to score
        self._rank: dict[Key, int] = {}  # the current prediction's ranks
        self._victims: dict[Key, int] = {}  # key evicted by a prefetch -> the step it was evicted at
        self.regret_used = 0.5  # victims demanded within L steps (+ prior)
        self.regret_seen = 2.0
        self.layers = 1  # L: 1 + the largest layer seen
        self.step = 0
        self._left = self.overlap  # hidden budget left in this step
        self.admitted = 0
        self.declined = 0

    # ---- estimates ---------------------------------------------------------------------------
    def precision(self, layer: int, rank: int) -> float:
        """p of a prediction of `layer` at `rank` (rank capped at W)."""
        k = (layer, min(rank, self.width))
        return (self._used.get(k, 0.0) + 1.0) / (self._seen.get(k, 0.0) + 2.0)

    @property
    def regret(self) -> float:
        """q: the share of prefetch victims demanded again within L steps."""
        return self.regret_used / self.regret_seen

    # ---- the step protocol -------------------------------------------------------------------
    def observe(self, keys: Iterable[Key]) -> None:
        """A layer step's demand keys (before they are served): score the predictions made for
        their layer and the victims, and open the step's hidden budget."""
        self.step += 1
        self._left = self.overlap
        by_layer: dict[int, set[int]] = {}
        for j, e in keys:
            by_layer.setdefault(j, set()).add(e)
            if (j, e) in self._victims:
                del self._victims[(j, e)]
                self.regret_used += 1.0
                self.regret_seen += 1.0
        for j, used in by_layer.items():
            self.layers = max(self.layers, j + 1)
            for e, r in self._pending.pop(j, ()):
                k = (j, r)
                self._seen[k] = self._seen.get(k, 0.0) + 1.0
                self._used[k] = self._used.get(k, 0.0) + (e in used)
        old = [k for k, s in self._victims.items() if self.step - s > self.layers]
        for k in old:  # not demanded within one token: it would have been evicted anyway
            del self._victims[k]
            self.regret_seen += 1.0

    def predicted(self, keys: Sequence[Key]) -> None:
        """The prediction about to be offered (best first: position = rank at decode)."""
        self._rank = {k: i for i, k in enumerate(keys)}

    def admit(self, key: Key, *, evicts: bool) -> bool:
        """Whether to copy `key` (not resident) now; `evicts`: the copy would evict a resident key."""
        j, e = key
        r = min(self._rank.get(key, self.width), self.width)
        self._pending.setdefault(j, []).append((e, r))
        hidden = min(1.0, self._left)
        p = self.precision(j, r)
        if p > (1.0 - hidden) + (1.0 - p) * (self.regret if evicts else 0.0):
            self._left -= hidden
            self.admitted += 1
            return True
        self.declined += 1
        return False

    def evicted(self, key: Key) -> None:
        """A prefetch evicted `key` (its regret is scored by `observe`)."""
        self._victims[key] = self.step
