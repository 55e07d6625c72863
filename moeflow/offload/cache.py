"""The expert slot cache: S whole-expert slots on the device, (layer, expert) -> slot.

Legend: S slots, L layers, E routed experts per layer, H hidden, I intermediate
per expert, N (token, pick) pairs of one layer step. A key is (layer, expert).

Two parts:
    SlotTable   pure bookkeeping (no tensors): the key <-> slot maps, the LRU
                order, the pin epochs, the predictor's protected set and the stats.
                Trace replay runs exactly this object, so a simulated hit rate is the
                live cache's hit rate.
    ExpertCache a SlotTable plus the slot buffers (allocated once, in __init__) and a
                copy engine: CUDA (copies on a side stream, one event per slot, the
                compute stream waits only on the slots it reads) or host (the same
                calls, copies done at once: testable on CPU).

Pinning: `begin_step()` advances an epoch; `acquire` stamps the slots of the
step's experts with it; a slot whose stamp equals the current epoch is never a
candidate for eviction. One step = one layer of one token batch (or one chunk
of it), so an expert a kernel is about to read can never be evicted under it.

Stats add up: hits + misses = demand keys; bytes_copied = (misses +
prefetch_issued) * expert_bytes; prefetch_issued = prefetch_used +
prefetch_wasted + pending prefetches (loaded, neither used nor evicted yet).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from .policy import EvictionPolicy, Key


class CacheRates:
    """Rates derived from hit / miss / prefetch counts (shared by live stats and replays)."""

    hits: int
    misses: int
    prefetch_used: int
    prefetch_wasted: int

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    @property
    def prefetch_precision(self) -> float:
        """Prefetched experts used before eviction / prefetches decided (used + wasted; pending excluded)."""
        done = self.prefetch_used + self.prefetch_wasted
        return self.prefetch_used / done if done else 0.0

    @property
    def prefetch_recall(self) -> float:
        """Of the experts that had to come from the host, the share a prefetch brought in time."""
        d = self.prefetch_used + self.misses
        return self.prefetch_used / d if d else 0.0


@dataclass
class CacheStats(CacheRates):
    """Counters of one cache (mutable; `snapshot()` gives a dict).

    hits / misses:     demand keys found resident / copied on demand.
    bytes_copied:      all host->device bytes (demand + prefetch).
    prefetch_issued:   keys copied ahead of use; _used: hit before eviction;
                       _wasted: evicted unused. Pending = issued - used - wasted.
    evictions:         occupied slots overwritten.
    steps:             begin_step calls (layer steps).
    wait_s:            seconds the compute stream stalled on copies (CUDA events; 0 on CPU).
    wait_unmeasured:   waits whose timing events were recycled before they completed.
    """

    hits: int = 0
    misses: int = 0
    bytes_copied: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    evictions: int = 0
    steps: int = 0
    wait_s: float = 0.0
    wait_unmeasured: int = 0

    def snapshot(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        d["prefetch_precision"] = self.prefetch_precision
        return d


class SlotTable:
    """Key <-> slot bookkeeping with pin epochs, an LRU order and stats; no tensors.

    num_slots:   S.
    policy:      chooses victims among unpinned slots (moeflow/offload/policy.py).
    expert_bytes: bytes one expert's copy moves (for bytes_copied).
    """

    def __init__(self, num_slots: int, policy: EvictionPolicy, expert_bytes: int) -> None:
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r}: expected an int >= 1")
        self.num_slots = num_slots
        self.policy = policy
        self.expert_bytes = int(expert_bytes)
        self.key_to_slot: dict[Key, int] = {}
        self.slot_key: list[Key | None] = [None] * num_slots
        self.pin_epoch: list[int] = [-1] * num_slots
        self.epoch = 0
        # occupied slots, least recently used first (a use = demand hit or load)
        self.order: OrderedDict[int, None] = OrderedDict()
        self.free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self.prefetched: set[int] = set()  # slots loaded by prefetch, not yet used
        self._protected: frozenset[Key] = frozenset()  # what the predictor wants next
        self.predicted: tuple[Key, ...] = ()  # the same keys, best prediction first
        self.stats = CacheStats()
        # Optional policy hooks (duck-typed so LRU & co. stay as they were):
        #   observe(table, keys)          every acquire, before its hits and misses are served;
        #   admit_prefetch(table, key)    False skips a guess before any slot is chosen.
        self.set_policy(policy)

    def set_policy(self, policy: EvictionPolicy) -> None:
        """Swap the eviction policy (its hooks included); the slots and stats stay as they are."""
        self.policy = policy
        self._observe = getattr(policy, "observe", None)
        self._admit = getattr(policy, "admit_prefetch", None)

    @property
    def protected(self) -> frozenset[Key]:
        """The keys the predictor wants next (prefetch never evicts them; 'predictive' spares them)."""
        return self._protected

    @protected.setter
    def protected(self, keys: Iterable[Key]) -> None:
        # An ordered iterable (a list best-first, as the Prefetcher gives) keeps its rank order in
        # `predicted` for policies that weigh a prediction by its rank; a set gives an arbitrary order.
        ranked = tuple(dict.fromkeys(keys))
        self.predicted = ranked
        self._protected = frozenset(ranked)

    def adopt(self, slot_keys: list[Key | None], recency: list[int]) -> None:
        """Take over slots assigned elsewhere (the sync-free path's device LRU admission).

        slot_keys[s]: the key slot s holds (None: empty); recency[s]: when it was last used
        (larger is more recent; ties by slot). Stats and pins stay as they are.
        """
        if len(slot_keys) != self.num_slots or len(recency) != self.num_slots:
            raise ValueError(f"adopt: {len(slot_keys)} keys / {len(recency)} stamps for {self.num_slots} slots")
        self.slot_key = list(slot_keys)
        self.key_to_slot = {k: s for s, k in enumerate(slot_keys) if k is not None}
        if len(self.key_to_slot) != sum(k is not None for k in slot_keys):
            raise ValueError("adopt: a key is held by two slots")
        held = sorted((s for s, k in enumerate(slot_keys) if k is not None), key=lambda s: (recency[s], s))
        self.order = OrderedDict((s, None) for s in held)
        self.free = [s for s in range(self.num_slots - 1, -1, -1) if slot_keys[s] is None]
        self.prefetched.clear()

    # ---- queries -------------------------------------------------------------------------
    def is_pinned(self, slot: int) -> bool:
        return self.pin_epoch[slot] == self.epoch

    def candidates(self, limit: int | None, *, skip_protected: bool) -> list[int]:
        """Up to `limit` (None: all) occupied, unpinned slots, least recently used first.

        skip_protected: leave out the keys the predictor wants (table.protected).
        """
        out: list[int] = []
        for slot in self.order:
            if self.pin_epoch[slot] == self.epoch:
                continue
            if skip_protected and self.slot_key[slot] in self.protected:
                continue
            out.append(slot)
            if limit is not None and len(out) >= limit:
                break
        return out

    def resident(self) -> set[Key]:
        return set(self.key_to_slot)

    # ---- mutation ------------------------------------------------------------------------
    def begin_step(self) -> int:
        """A new epoch: the previous step's pins lapse. Returns the epoch."""
        self.epoch += 1
        self.stats.steps += 1
        return self.epoch

    def _touch(self, slot: int) -> None:
        self.order[slot] = None
        self.order.move_to_end(slot)

    def _place(self, key: Key, slot: int, *, guess: bool = False) -> None:
        old = self.slot_key[slot]
        if old is not None:
            del self.key_to_slot[old]
            self.stats.evictions += 1
            if slot in self.prefetched:
                self.prefetched.discard(slot)
                self.stats.prefetch_wasted += 1
        self.slot_key[slot] = key
        self.key_to_slot[key] = slot
        self._touch(slot)
        if guess:
            # A guess enters at the least-recently-used end and moves up only when used:
            # a wrong prediction is the next thing evicted and displaces nothing else
            # (on the tiny model's trace this cut LRU+prefetch misses by a further 10-30%).
            self.order.move_to_end(slot, last=False)

    def acquire(self, keys: Iterable[Key]) -> tuple[dict[Key, int], list[tuple[Key, int]]]:
        """Pin `keys` (distinct) for the current epoch, making room for the missing ones.

        Returns (key -> slot for every key, [(key, slot)] to copy now: the misses).
        Hits are pinned before any eviction, so a miss never evicts a key of the
        same step. ValueError when the step holds more distinct keys than slots.
        """
        want = list(dict.fromkeys(keys))
        if len(want) > self.num_slots:
            raise ValueError(
                f"a step needs {len(want)} distinct experts but the cache has gpu_slots={self.num_slots}"
            )
        if self._observe is not None:
            self._observe(self, want)
        slots: dict[Key, int] = {}
        missing: list[Key] = []
        for key in want:
            slot = self.key_to_slot.get(key)
            if slot is None:
                missing.append(key)
                continue
            self.pin_epoch[slot] = self.epoch
            self._touch(slot)
            self.stats.hits += 1
            if slot in self.prefetched:
                self.prefetched.discard(slot)
                self.stats.prefetch_used += 1
            slots[key] = slot
        loads: list[tuple[Key, int]] = []
        for key in missing:
            slot = self.free.pop() if self.free else self.policy.victim(self, for_prefetch=False)
            if slot is None or self.pin_epoch[slot] == self.epoch:
                raise RuntimeError(f"policy {self.policy.name!r} offered no unpinned slot for {key}")
            self._place(key, slot)
            self.pin_epoch[slot] = self.epoch
            self.stats.misses += 1
            self.stats.bytes_copied += self.expert_bytes
            slots[key] = slot
            loads.append((key, slot))
        return slots, loads

    def prefetch(self, keys: Iterable[Key]) -> list[tuple[Key, int]]:
        """Plan copies of the not-yet-resident `keys` into free or evictable slots.

        Never evicts a pinned slot or a protected key (what the predictor wants); a key
        is skipped when no such slot exists or the policy declines (`admit_prefetch` False,
        or victim None). Returns [(key, slot)].
        """
        loads: list[tuple[Key, int]] = []
        batch = list(dict.fromkeys(keys))
        saved = self._protected
        # the batch's own keys are wanted too: a later guess never displaces an earlier one
        # (set on the field, not the property: `predicted`, the rank order, stays as it was)
        self._protected = saved | frozenset(batch)
        try:
            for key in batch:
                if key in self.key_to_slot:
                    continue
                if self._admit is not None and not self._admit(self, key):
                    continue
                slot = self.free.pop() if self.free else self.policy.victim(self, for_prefetch=True)
                if slot is None:
                    continue
                if self.pin_epoch[slot] == self.epoch or self.slot_key[slot] in self.protected:
                    raise RuntimeError(f"policy {self.policy.name!r} offered a pinned or protected slot {slot}")
                self._place(key, slot, guess=True)
                self.prefetched.add(slot)
                self.stats.prefetch_issued += 1
                self.stats.bytes_copied += self.expert_bytes
                loads.append((key, slot))
        finally:
            self._protected = saved
        return loads

    def check_invariants(self) -> None:
        """AssertionError when the maps disagree (tests call this after every operation)."""
        assert len(self.key_to_slot) <= self.num_slots, "more keys than slots"
        seen: set[Key] = set()
        for slot, key in enumerate(self.slot_key):
            if key is None:
                assert slot in self.free and slot not in self.order, f"empty slot {slot} not free"
                continue
            assert key not in seen, f"key {key} held twice"
            seen.add(key)
            assert self.key_to_slot[key] == slot, f"maps disagree on {key}"
            assert slot in self.order and slot not in self.free, f"slot {slot} order/free mismatch"
        assert seen == set(self.key_to_slot), "key_to_slot has keys no slot holds"
        assert len(self.order) + len(self.free) == self.num_slots
        s = self.stats
        pending = len(self.prefetched)
        assert s.prefetch_issued == s.prefetch_used + s.prefetch_wasted + pending, "prefetch counts"
        assert s.bytes_copied == (s.misses + s.prefetch_issued) * self.expert_bytes, "bytes"


# ---- copy engines -----------------------------------------------------------------------


class HostCopyEngine:
    """CPU stand-in for the CUDA engine: the same calls, copies done at once."""

    def mark(self) -> None:
        pass

    def copy(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in pieces:
            dst.copy_(src)

    def wait(self, slots: Iterable[int]) -> None:
        pass

    def harvest(self, stats: CacheStats) -> None:
        pass


class CudaCopyEngine:
    """Copies on a side stream; the compute stream waits on per-slot events, never the host.

    Order guarantees:
    - `mark()` records an event on the compute stream before a batch of copies, and
      the copy stream waits on it: a slot is overwritten only after every kernel
      enqueued so far (the last readers of its old expert) has run.
    - each copy records the slot's ready event on the copy stream; `wait(slots)`
      makes the compute stream wait on the events of the slots it will read.
    All events are created here, once; nothing in copy/wait allocates device memory.
    """

    def __init__(self, device: torch.device, num_slots: int, stats: CacheStats, *, measure_wait: bool,
                 ring: int = 1024) -> None:
        self.device = device
        self.stats = stats
        self.copy_stream = torch.cuda.Stream(device=device)
        self.ready = [torch.cuda.Event() for _ in range(num_slots)]
        self.pending = [False] * num_slots
        self.mark_event = torch.cuda.Event()
        self.measure_wait = measure_wait
        self.ring = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(ring if measure_wait else 0)]
        self.ring_used = [False] * len(self.ring)
        self.ring_pos = 0
        self._marked = False

    def mark(self) -> None:
        self.mark_event.record(torch.cuda.current_stream(self.device))
        self._marked = True

    def copy(self, slot: int, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        stream = self.copy_stream
        if not self._marked:
            self.mark()
        with torch.cuda.stream(stream):
            stream.wait_event(self.mark_event)
            for dst, src in pieces:
                dst.copy_(src, non_blocking=True)
            self.ready[slot].record(stream)
        self.pending[slot] = True

    def wait(self, slots: Iterable[int]) -> None:
        todo = [s for s in slots if self.pending[s]]
        if not todo:
            return
        compute = torch.cuda.current_stream(self.device)
        pair = None
        if self.ring:
            pair = self._ring_next()
            pair[0].record(compute)
        for s in todo:
            compute.wait_event(self.ready[s])
            self.pending[s] = False
        if pair is not None:
            pair[1].record(compute)
        self._marked = False

    def _ring_next(self):
        i = self.ring_pos
        self.ring_pos = (i + 1) % len(self.ring)
        if self.ring_used[i]:
            a, b = self.ring[i]
            # query() is cudaEventQuery: no host sync; an unfinished pair is counted, not waited on
            if a.query() and b.query():
                self.stats.wait_s += a.elapsed_time(b) / 1e3
            else:
                self.stats.wait_unmeasured += 1
        self.ring_used[i] = True
        return self.ring[i]

    def harvest(self, stats: CacheStats) -> None:
        """Fold every completed timing pair into stats.wait_s (event queries, no sync)."""
        for i, used in enumerate(self.ring_used):
            if used:
                a, b = self.ring[i]
                if a.query() and b.query():
                    stats.wait_s += a.elapsed_time(b) / 1e3
                    self.ring_used[i] = False


# ---- the cache --------------------------------------------------------------------------


class ExpertCache:
    """S device slots holding whole experts, fed from an ExpertStore.

    store:       moeflow.offload.store.ExpertStore (the host copies and their layout).
    num_slots:   S (OffloadConfig.gpu_slots).
    policy:      an EvictionPolicy.
    device:      where the slots live ("cuda..." or "cpu").
    measure_wait: time the compute stream's waits (CUDA only).

    Attributes:
        buffers:  name -> tensor [S, *store.shapes[name]] on `device`, allocated here once.
        weights:  ExpertWeights over all S slots (slot ids play the role of expert ids).
        table:    the SlotTable; stats in `table.stats` / `stats()`.
    """

    def __init__(self, store, num_slots: int, policy: EvictionPolicy, device: str | torch.device,
                 *, measure_wait: bool = True) -> None:
        from ..config import ExpertWeights

        self.store = store
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_slots = num_slots
        dtypes = getattr(store, "dtypes", None) or {}
        self.buffers: dict[str, torch.Tensor] = {
            name: torch.empty((num_slots, *shape), dtype=dtypes.get(name, store.dtype), device=self.device)
            for name, shape in store.shapes.items()
        }
        if self.device.type == "cpu":
            # deterministic contents for never-loaded slots (a kernel must never read them)
            for b in self.buffers.values():
                b.fill_(float("nan") if b.dtype.is_floating_point and b.element_size() > 1 else 0)
        self.weights = ExpertWeights(**self.buffers, layout=store.layout, interleaved=store.interleaved,
                                     quant=getattr(store, "quant", None))
        self.table = SlotTable(num_slots, policy, store.expert_bytes)
        if self.device.type == "cuda":
            self.engine: HostCopyEngine | CudaCopyEngine = CudaCopyEngine(
                self.device, num_slots, self.table.stats, measure_wait=measure_wait)
        else:
            self.engine = HostCopyEngine()

    def _pieces(self, key: Key, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for name, rows, src in self.store.pieces(*key):
            dst = self.buffers[name][slot]
            if rows is not None:
                dst = dst[rows[0] : rows[1]]
            out.append((dst, src))
        return out

    def ensure(self, keys: Sequence[Key]) -> dict[Key, int]:
        """One step: pin `keys` (distinct), copy the missing ones, make compute wait for them.

        Returns key -> slot. After this call, kernels enqueued on the current
        stream may read those slots; the slots stay pinned until the next step.
        """
        self.table.begin_step()
        self.engine.mark()
        slots, loads = self.table.acquire(keys)
        for key, slot in loads:
            self.engine.copy(slot, self._pieces(key, slot))
        self.engine.wait(slots.values())
        return slots

    def prefetch(self, keys: Sequence[Key]) -> int:
        """Start copies of the keys not yet resident (never evicting pinned or protected keys)."""
        loads = self.table.prefetch(keys)
        for key, slot in loads:
            self.engine.copy(slot, self._pieces(key, slot))
        return len(loads)

    def protect(self, keys: Iterable[Key]) -> None:
        """The predictor's wanted keys, best first: prefetch never evicts them; 'predictive' spares them
        too; 'adaptive' weighs each by its rank's measured precision (so the order is kept)."""
        self.table.protected = list(keys)

    def stats(self) -> CacheStats:
        self.engine.harvest(self.table.stats)
        return self.table.stats

    def reset_stats(self) -> None:
        """Zero the counters (e.g. after warm-up); resident prefetches stop counting as pending."""
        self.engine.harvest(self.table.stats)
        self.table.stats.__init__()
        self.table.prefetched.clear()

    def warm(self, keys: Sequence[Key]) -> None:
        """Fill slots with `keys` in order (e.g. the most used experts) before serving."""
        keys = list(dict.fromkeys(keys))[: self.num_slots]
        self.table.begin_step()
        _, loads = self.table.acquire(keys)
        for key, slot in loads:
            self.engine.copy(slot, self._pieces(key, slot))
        self.engine.wait(self.table.key_to_slot[k] for k in keys)

