"""The expert slot cache: S whole-expert slots on the device, (layer, expert) -> slot.

Legend: S slots, L layers, E routed experts per layer, H hidden, I intermediate
per expert, N (token, pick) pairs of one layer step. A key is (layer, expert).

Two parts:
    SlotTable   pure bookkeeping (no tensors): the key <-> slot maps, the LRU
                order, the pin epochs, the predictor's protected set and the stats
                (moeflow.offload.slots, re-exported here).
    ExpertCache a SlotTable plus the slot buffers (allocated once, in __init__) and a
                copy engine: CUDA (copies on a side stream, one event per slot, the
                compute stream waits only on the slots it reads) or host (the same
                calls, copies done at once: testable on CPU).

Pinning and the stats' identities: moeflow.offload.slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from .slots import CacheRates, CacheStats, EvictionPolicy, Key, SlotTable

__all__ = ["CacheRates", "CacheStats", "CudaCopyEngine", "EvictionPolicy", "ExpertCache", "HostCopyEngine", "Key",
           "SlotTable"]


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

    def prefetch(self, keys: Sequence[Key], *, gate=None) -> int:
        """Start copies of the keys not yet resident (never evicting pinned or protected keys);
        `gate` (a PrefetchGate, or None: every key) decides which copies pay."""
        loads = self.table.prefetch(keys, gate=gate)
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

    def refresh(self, layer: int) -> int:
        """Copy the resident experts of `layer` into their slots again (after the store's tensors changed).

        The same engine calls as a miss (the copies follow every kernel enqueued so far; the next
        step's compute waits on their slots). Returns how many slots were copied.
        """
        self.engine.mark()
        n = 0
        for slot, key in enumerate(self.table.slot_key):
            if key is not None and key[0] == layer:
                self.engine.copy(slot, self._pieces(key, slot))
                n += 1
        return n

    def warm(self, keys: Sequence[Key]) -> None:
        """Fill slots with `keys` in order (e.g. the most used experts) before serving."""
        keys = list(dict.fromkeys(keys))[: self.num_slots]
        self.table.begin_step()
        _, loads = self.table.acquire(keys)
        for key, slot in loads:
            self.engine.copy(slot, self._pieces(key, slot))
        self.engine.wait(self.table.key_to_slot[k] for k in keys)

