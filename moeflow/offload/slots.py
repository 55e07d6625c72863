"""The slot table: which (layer, expert) key each of S cache slots holds, pins, LRU order, stats.

Legend: S slots, L layers, E routed experts per layer. A key is (layer, expert).

    SlotTable   pure bookkeeping (no tensors): the key <-> slot maps, the LRU order, the pin
                epochs, the predictor's protected set and the stats. Trace replay runs exactly
                this object, so a simulated hit rate is the live cache's hit rate.
    EvictionPolicy  the interface the table calls to choose a victim (the policies are
                moeflow.offload.policy, which builds tables of its own: Adaptive's ghost caches).
    CacheStats / CacheRates  the counters and the rates derived from them.

Pinning: `begin_step()` advances an epoch; `acquire` stamps the slots of the step's experts
with it; a slot whose stamp equals the current epoch is never a candidate for eviction. One
step = one layer of one token batch (or one chunk of it), so an expert a kernel is about to
read can never be evicted under it.

Stats add up: hits + misses = demand keys; bytes_copied = (misses + prefetch_issued) *
expert_bytes; prefetch_issued = prefetch_used + prefetch_wasted + pending prefetches (loaded,
neither used nor evicted yet).

This module sits below both moeflow.offload.cache (the device slots) and
moeflow.offload.policy (the policies, whose ghost caches are SlotTables).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Protocol

__all__ = ["CacheRates", "CacheStats", "EvictionPolicy", "Key", "SlotTable"]

Key = tuple[int, int]


class EvictionPolicy(Protocol):
    """Chooses the slot to evict; state lives in the SlotTable."""

    name: str

    def victim(self, table: SlotTable, *, for_prefetch: bool) -> int | None:
        """A slot among `table.candidates(...)`, or None (no candidate / skip a prefetch)."""
        ...


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

    def prefetch(self, keys: Iterable[Key], *, gate=None) -> list[tuple[Key, int]]:
        """Plan copies of the not-yet-resident `keys` into free or evictable slots.

        Never evicts a pinned slot or a protected key (what the predictor wants); a key
        is skipped when no such slot exists or the policy declines (`admit_prefetch` False,
        or victim None), or when `gate` (moeflow.offload.gate.PrefetchGate: `admit(key,
        evicts=...)`, `evicted(key)`) says the copy does not pay. Returns [(key, slot)].
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
                if gate is not None and not gate.admit(key, evicts=not self.free):
                    continue
                slot = self.free.pop() if self.free else self.policy.victim(self, for_prefetch=True)
                if slot is None:
                    continue
                if self.pin_epoch[slot] == self.epoch or self.slot_key[slot] in self.protected:
                    raise RuntimeError(f"policy {self.policy.name!r} offered a pinned or protected slot {slot}")
                if gate is not None and self.slot_key[slot] is not None:
                    gate.evicted(self.slot_key[slot])
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
