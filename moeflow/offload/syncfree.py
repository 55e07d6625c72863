"""Sync-free offloaded decode (OffloadConfig.sync_free): no host sync per layer step, CUDA-graph capturable.

Legend: L offloaded layers, E routed experts of a layer (E_max the widest), K picks per
token, T tokens, N = T*K pairs of one layer step, Z cache slots (gpu_slots), Q staging
slots = min(E_max, NCAP), NCAP = sync_free_tokens * K_max pairs a sync-free step serves,
P = Z + Q pool rows, B bytes of one packed expert (moeflow.offload.store, packed layout).
A key is (layer, expert).

Device state (allocated once, so a captured graph reads fixed addresses):
    pool_PB   uint8 [P, B]   rows 0..Z-1: the cache slots (the SlotTable's); Z..P-1: staging.
                             `weights` is the ExpertWeights over all P rows (typed views).
    lut_LE    int32 [L, E_max]  (layer, expert) -> cache slot, -1 = not resident (on device).
    log_LR    int32 [L, 1 + 2*NCAP]  per layer: a step counter, the last step's ids and remap.

Two modes, by the eviction policy:

Policy "lru": device admission (`admit_torch` / the admit kernel). More state on the device:
    slot_key_Z int32 (layer * E_max + e, -1 empty), stamp_Z int64 (last step that used the
    slot), clock_1 int64. One layer step: clock += 1; the step's resident experts get
    stamp = clock; each missing expert (in order of its first pair) takes the slot of least
    stamp (ties: lowest slot), the evicted key leaves the lut, the new key enters it, and the
    copy kernel reads its packed row from pinned host memory straight into that slot; then the
    impl runs on the pool (no staging rows: P = Z). A miss crosses PCIe once; `refill` only
    reads the logs back for the counters (a copied expert is logged as -2 - slot). Needs
    Z >= min(E_max, NCAP). A synchronous step (prefill) reads the device state back, runs
    the host SlotTable on it (`SlotTable.adopt`) and writes the result back (stamps in LRU
    order).

Policy "random_oldest": staging + lagged refill, below. One layer step (`run_step`,
N <= NCAP), two kernels (moeflow.kernels.offload_gather; the CPU device runs `remap_torch` +
`stage_torch`, the same rule in torch), then the layer's own experts impl, unchanged, on the
pool:
    1. remap: each pair reads lut[e]; an expert with lut[e] = -1 gets staging slot Z + r, r its
       rank among the step's missing experts ordered by first pair (owner = the first pair
       using it); the step's ids and remap go to its log row.
    2. stage: the missing experts' packed rows are copied from the pinned host store (mapped
       into the device's address space: the kernel reads host memory over PCIe) into their
       staging slots. Q >= min(N, E): a step never runs out of staging slots.
    3. the impl runs on `weights` with the remapped ids: the same rows of the same bytes in
       the same order per expert as the resident model, and the resident model's tile
       configuration (a Triton impl's tiles are looked up for the resident E, not P: tuned
       tables are keyed by E), so the output is the resident model's, bit for bit.
Nothing in a step reads a device value on the host.

Refill (`refill`: eager steps call it at layer 0; between CUDA-graph replays the caller does),
lagging a step and never waiting. First the log is snapshot into a pinned buffer (non_blocking,
with an event) for this or a later refill, then:
    a. copies issued by an earlier refill whose ready event has completed (event.query())
       become resident: their lut entries are set (phase B);
    b. log snapshots whose D2H event has completed are fed, layer by layer, to the SlotTable
       and its eviction policy (moeflow.offload.slots / policy), as the synchronous path
       feeds them; each load evicts a slot: the evicted key's lut entry is cleared (phase A);
    c. the lut goes to the device on the current stream (one non_blocking copy from a pinned
       mirror), then an event marks the stream and the loads are copied on the copy stream
       after it: a slot is overwritten only after every kernel enqueued before (the last
       readers of its old expert) has run, and after the lut that no longer points at it.
       A loaded key stays -1 in the lut (served from staging) until (a) sees its copy done.
Call `refill` on the stream the steps (or replays) run on. Snapshot and mirror rings have
RING entries; when a snapshot is not taken because all are in flight, the steps it missed
are counted (`GraphStats.dropped`), never waited for.

Steps of more than NCAP pairs (a prefill) run the synchronous path (the runtime's read-back
and ExpertCache.ensure into the same Z slots); the lut is brought up to date after it.
Refused inside a CUDA-graph capture (ValueError naming sync_free_tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import torch

from .._triton import triton_available
from ..config import ExpertWeights
from ..experts.base import tiled_as
from ..experts.source import scaled_rows
from ..types import TokenBatch
from .cache import CudaCopyEngine, ExpertCache, HostCopyEngine
from .prefetch import read_back
from .slots import Key, SlotTable
from .store import packed_views

__all__ = ["GraphStats", "SyncFreeOffload", "remap_torch", "stage_torch"]

# Entries of the pinned lut-mirror and log-snapshot rings. Replays let the host run many steps
# ahead of the device; with 4 entries the refill dropped ~80% of the steps of a 24-step decode
# replayed from a CUDA graph on an H200 (GraphStats.dropped), so the policy saw a fifth of the
# routing. A snapshot is L*(1+2*NCAP) int32 and a mirror L*E_max int32: 32 of each cost kilobytes
# of pinned memory.
RING = 32


@dataclass
class GraphStats:
    """Counters of the sync-free path (device truth, read back lagged; `snapshot()` gives a dict).

    steps:          sync-free layer steps run (eager or captured: replays counted through `observed`).
    observed:       layer steps whose log the refill has read back.
    dropped:        layer steps whose log was overwritten before a snapshot read it.
    device_hits:    distinct experts of observed steps found resident (lut >= 0) on the device.
    staged:         distinct experts of observed steps copied into staging (read from host memory).
    bytes_staged:   staged * expert bytes (what crossed PCIe for the steps themselves).
    refill_copies:  cache loads the refill issued (copy stream); refill_bytes their bytes.
    sync_steps:     steps of more than NCAP pairs, run on the synchronous path.
    deferred:       refills put off because every lut mirror was still in flight.
    """

    steps: int = 0
    observed: int = 0
    dropped: int = 0
    device_hits: int = 0
    staged: int = 0
    bytes_staged: int = 0
    refill_copies: int = 0
    refill_bytes: int = 0
    sync_steps: int = 0
    deferred: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.device_hits + self.staged
        return self.device_hits / n if n else 0.0

    def snapshot(self) -> dict:
        d = asdict(self)
        d["hit_rate"] = self.hit_rate
        return d


# ---- the step in torch (CPU device; the kernels' specification) -------------------------------


def remap_torch(ids_N: torch.Tensor, lut_E: torch.Tensor, num_cache_slots: int, pool_rows: int, ncap: int,
                log_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(remap_N int32 [N], experts to stage int64 [r] in rank order); writes log_R. The remap kernel's rule.

    ids_N: int [N] (N <= ncap); lut_E: int32 [E]; log_R: int32 [1 + 2*ncap] (step counter, ids, remap).
    """
    ids = ids_N.reshape(-1).long()
    N, E = int(ids.shape[0]), int(lut_E.shape[0])
    in_range = (ids >= 0) & (ids < E)
    slot = torch.where(in_range, lut_E.long()[ids.clamp(0, E - 1)], torch.full_like(ids, -1))
    miss = in_range & (slot < 0)
    n = torch.arange(N, device=ids.device)
    owner = torch.where(ids[:, None] == ids[None, :], n[None, :], N).min(dim=1).values
    is_job = miss & (owner == n)
    before = torch.cumsum(is_job.long(), 0) - is_job.long()
    remap = torch.where(miss, num_cache_slots + before[owner], slot)
    remap = torch.where(in_range, remap, torch.full_like(remap, pool_rows)).to(torch.int32)
    log_R[0] += 1
    log_R[1:].fill_(-1)
    log_R[1 : 1 + N] = ids.to(torch.int32)
    log_R[1 + ncap : 1 + ncap + N] = remap
    return remap, ids[is_job]


def stage_torch(experts: torch.Tensor, host_EB: torch.Tensor, pool_PB: torch.Tensor, num_cache_slots: int,
                rows: torch.Tensor | None = None) -> None:
    """pool[Z + r] (or pool[rows[r]]) = host[experts[r]] (packed rows of bytes): the copy kernel's effect."""
    r = int(experts.numel())
    if not r:
        return
    src = host_EB.index_select(0, experts.to(host_EB.device)).to(pool_PB.device)
    if rows is None:
        pool_PB[num_cache_slots : num_cache_slots + r] = src
    else:
        pool_PB[rows.to(pool_PB.device).long()] = src


def admit_torch(ids_N: torch.Tensor, layer: int, lut_LE: torch.Tensor, slot_key_Z: torch.Tensor,
                stamp_Z: torch.Tensor, clock_1: torch.Tensor, num_experts: int, pool_rows: int, ncap: int,
                log_R: torch.Tensor, advance: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device admission of one layer step (policy "lru"): (remap_N int32, experts int64 [r], their slots [r]).

    The admit kernel's rule (moeflow.kernels.offload_gather.offload_admit_kernel), in torch:
    step = clock + advance; every resident expert of the step gets stamp = step; each missing
    expert, in order of its first pair, takes the slot of least stamp (ties: lowest slot), whose
    old key leaves the lut; lut, slot_key, stamp and clock are updated in place. The log row
    holds the ids and the remap, an admitted expert's slot written as -2 - slot.
    lut_LE int32 [L, E_max]; slot_key_Z int32 [Z] (layer * E_max + e, or -1); stamp_Z, clock_1 int64.
    """
    ids = ids_N.reshape(-1).long()
    N, E = int(ids.shape[0]), num_experts
    E_max = int(lut_LE.shape[1])
    flat = lut_LE.view(-1)
    base = layer * E_max
    in_range = (ids >= 0) & (ids < E)
    slot = torch.where(in_range, flat.long()[(base + ids).clamp(0, flat.numel() - 1)], torch.full_like(ids, -1))
    step = int(clock_1[0]) + advance
    hit = in_range & (slot >= 0)
    stamp_Z[slot[hit]] = step
    miss = in_range & (slot < 0)
    n = torch.arange(N, device=ids.device)
    owner = torch.where(ids[:, None] == ids[None, :], n[None, :], N).min(dim=1).values
    jobs = ids[miss & (owner == n)]  # in order of their first pair
    victims = []
    for e in jobs.tolist():
        v = int(torch.argmin(stamp_Z))  # torch.argmin: the first minimum, the lowest slot on ties
        old = int(slot_key_Z[v])
        if old >= 0:
            flat[old] = -1
        slot_key_Z[v] = base + e
        flat[base + e] = v
        stamp_Z[v] = step
        victims.append(v)
    clock_1[0] = step
    got = dict(zip(jobs.tolist(), victims))
    remap = torch.tensor([got[e] if m else (int(sl) if r else pool_rows)
                          for e, m, sl, r in zip(ids.tolist(), miss.tolist(), slot.tolist(), in_range.tolist())],
                         dtype=torch.int32)
    log_R[0] += 1
    log_R[1:].fill_(-1)
    log_R[1 : 1 + N] = ids.to(torch.int32)
    log_R[1 + ncap : 1 + ncap + N] = torch.where(miss, -2 - remap, remap).to(torch.int32)
    return remap, jobs, torch.tensor(victims, dtype=torch.int64)


# ---- the cache over the pool's first Z rows ------------------------------------------------


class _PoolCache(ExpertCache):
    """An ExpertCache whose Z slot buffers are the first Z rows of the sync-free pool.

    ExpertCache.__init__ allocates buffers of its own; the pool must hold the cache slots and
    the staging slots in one tensor (one ExpertWeights for the impl), so this sets the same
    attributes over views instead (an ExpertCache `buffers=` argument would retire it).
    """

    def __init__(self, store, buffers: dict[str, torch.Tensor], num_slots: int, policy, device: torch.device,
                 *, measure_wait: bool) -> None:
        self.store = store
        self.device = device
        self.num_slots = num_slots
        self.buffers = buffers
        self.weights = ExpertWeights(**buffers, layout=store.layout, interleaved=store.interleaved,
                                     quant=getattr(store, "quant", None))
        self.table = SlotTable(num_slots, policy, store.expert_bytes)
        if device.type == "cuda":
            self.engine: HostCopyEngine | CudaCopyEngine = CudaCopyEngine(
                device, num_slots, self.table.stats, measure_wait=measure_wait)
        else:
            self.engine = HostCopyEngine()


class _Done:
    """The CPU stand-in of a CUDA event: work on the CPU device is done when issued."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


# ---- the runtime part -----------------------------------------------------------------------


class SyncFreeOffload:
    """The sync-free state of one OffloadRuntime (module doc): pool, lut, log, lagged refill.

    runtime: the OffloadRuntime (its store must be packed: ExpertStore.from_weights(packed=True)).
    policy:  the eviction policy of the Z cache slots.

    Attributes: cache (the ExpertCache over the pool's first Z rows), weights (all P rows),
    lut, log, stats (GraphStats), ncap, num_staging (Q), use_triton (the kernels; the CPU
    device runs the torch version unless a test sets it under the Triton interpreter),
    journal (None, or a list the refill appends its ordered device operations to: tests).
    """

    def __init__(self, runtime, policy) -> None:
        store, config = runtime.store, runtime.config
        device = torch.device(config.resolved_device())
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.cuda = device.type == "cuda"
        if store.packed is None:
            raise ValueError(f"OffloadConfig.sync_free=True: the store (mode {store.mode!r}) has no packed host "
                             f"buffers; expected ExpertStore.from_weights(..., mode='pinned', packed=True)")
        if self.cuda and not store.pinned:
            raise ValueError("OffloadConfig.sync_free=True: the packed store is not pinned; the device kernel reads "
                             "host memory only when it is page-locked (mapped into the device's address space)")
        if self.cuda and not triton_available():
            raise ValueError(f"OffloadConfig.sync_free=True on {device}: needs the triton package (its gather "
                             f"kernel); expected device='cpu' or Triton installed")
        self.runtime = runtime
        self.store = store
        L = store.num_layers
        E_max = max(store.num_experts)
        K_max = max(layer.config.top_k for layer in runtime.layers)
        self.Z = config.gpu_slots
        self.ncap = config.sync_free_tokens * K_max
        # policy "lru": the admit kernel evicts and loads on the device (no staging rows, no refill
        # copies: a miss crosses PCIe once); else misses are staged and the host policy refills lagged
        self.device_lru = config.policy == "lru"
        # Z >= this under device admission is checked by attach's _check_sync_free, before any layer changes
        self.max_step_experts = min(E_max, self.ncap)
        self.num_staging = 0 if self.device_lru else self.max_step_experts
        self.P = self.Z + self.num_staging
        # 0xFF bytes: a row never loaded reads NaN (floats) / -1, loud if a bug ever read it
        self.pool = torch.full((self.P, store.packed_row_bytes), 255, dtype=torch.uint8, device=device)
        views = packed_views(self.pool, store.shapes, store.dtypes, store.packed_offsets)
        self.weights = ExpertWeights(**views, layout=store.layout, interleaved=store.interleaved,
                                     quant=getattr(store, "quant", None))
        self.cache = _PoolCache(store, {n: v[: self.Z] for n, v in views.items()}, self.Z, policy, device,
                                measure_wait=config.measure_wait)
        self.lut = torch.full((L, E_max), -1, dtype=torch.int32, device=device)
        self.want = torch.full((L, E_max), -1, dtype=torch.int32)  # host: what the lut is to hold
        if self.device_lru:  # the admit kernel's state (moeflow.kernels.offload_gather, admit_torch)
            self.slot_key = torch.full((self.Z,), -1, dtype=torch.int32, device=device)
            self.stamp = torch.zeros(self.Z, dtype=torch.int64, device=device)
            self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.log = torch.full((L, 1 + 2 * self.ncap), -1, dtype=torch.int32, device=device)
        self.log[:, 0] = 0
        self.last_seq = [0] * L
        self.inflight: dict[int, Key] = {}  # slot -> key copied by a refill, not yet in the lut
        pin = self.cuda
        self._mirrors = [torch.empty((L, E_max), dtype=torch.int32, pin_memory=pin) for _ in range(RING)]
        self._mirror_ev = [self._event() for _ in range(RING)]
        self._snaps = [torch.empty(tuple(self.log.shape), dtype=torch.int32, pin_memory=pin) for _ in range(RING)]
        self._snap_ev = [self._event() for _ in range(RING)]
        self._pending: deque[int] = deque()  # snapshot ring entries in flight, oldest first
        self._host32 = [p.view(torch.int32) for p in store.packed]
        self._pool32 = self.pool.view(torch.int32)
        self.use_triton = self.cuda
        if self.cuda:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            from ..kernels.offload_gather import COPY_PROGRAMS_PER_SM

            self.programs = sms * COPY_PROGRAMS_PER_SM
        else:
            self.programs = 2
        self.stats = GraphStats()
        self.journal: list | None = None

    # ---- helpers --------------------------------------------------------------------------
    def _event(self):
        return torch.cuda.Event() if self.cuda else _Done()

    def _stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def _note(self, *op) -> None:
        if self.journal is not None:
            self.journal.append(op)

    def _copy_done(self, slot: int) -> bool:
        """Whether the refill copy into `slot` has completed (an event query: never waits)."""
        return self.cache.engine.ready[slot].query() if self.cuda else True

    # ---- one layer step -------------------------------------------------------------------
    def run_step(self, pos: int, impl, batch, config) -> torch.Tensor:
        """The layer step of position `pos` (module doc); the runtime has checked x and the batch."""
        tokens = isinstance(batch, TokenBatch)
        ids = batch.ids_TK if tokens else batch.expert_N
        N = int(ids.numel())
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        if N > self.ncap:
            if capturing:
                raise ValueError(
                    f"OffloadConfig.sync_free_tokens={self.runtime.config.sync_free_tokens}: a captured layer step "
                    f"of {N} (token, pick) pairs exceeds the {self.ncap} a sync-free step serves; expected "
                    f"sync_free_tokens >= the captured batch's tokens")
            return self._sync_step(pos, impl, batch, config, ids)
        if pos == 0 and not capturing:
            self.refill()
        remap_N = self.gather(pos, ids)
        self.stats.steps += 1
        if tokens:
            T, K = int(ids.shape[0]), int(ids.shape[1])
            run = self._pool_impl(impl, pos, K, T, tokens=True)
            return run.forward_tokens(batch.x_TH, remap_N.view(T, K), batch.weights_TK, self.weights, config)
        run = self._pool_impl(impl, pos, config.top_k, max(1, N // config.top_k))
        return run.forward_pairs(scaled_rows(batch, config), remap_N, self.weights, config)

    def gather(self, pos: int, ids: torch.Tensor) -> torch.Tensor:
        """remap_N int32 [N] of layer `pos`'s step, its missing experts staged (module doc, steps 1-2)."""
        E = self.store.num_experts[pos]
        flat = ids.reshape(-1)
        if flat.dtype not in (torch.int32, torch.int64):
            flat = flat.to(torch.int32)
        flat = flat.contiguous()
        lut, log = self.lut[pos, :E], self.log[pos]
        if self.device_lru:
            return self._admit(pos, flat, log)
        if self.use_triton:
            from ..kernels.offload_gather import gather_launch

            remap = torch.empty(flat.shape[0], dtype=torch.int32, device=self.device)
            jobs = torch.empty(1 + 2 * self.num_staging, dtype=torch.int32, device=self.device)
            gather_launch(flat, lut, self._host32[pos], self._pool32, remap, jobs, log, num_cache_slots=self.Z,
                          ncap=self.ncap, programs=self.programs)
            return remap
        remap, experts = remap_torch(flat, lut, self.Z, self.P, self.ncap, log)
        stage_torch(experts, self.store.packed[pos], self.pool, self.Z)
        return remap

    def _admit(self, pos: int, flat: torch.Tensor, log: torch.Tensor) -> torch.Tensor:
        """remap_N int32 [N]: layer `pos`'s experts admitted into the cache on the device (LRU), misses copied."""
        E = self.store.num_experts[pos]
        if self.use_triton:
            from ..kernels.offload_gather import admit_launch

            remap = torch.empty(flat.shape[0], dtype=torch.int32, device=self.device)
            jobs = torch.empty(1 + 2 * self.max_step_experts, dtype=torch.int32, device=self.device)
            admit_launch(flat, self.lut, self.slot_key, self.stamp, self.clock, self._host32[pos], self._pool32,
                         remap, jobs, log, layer=pos, ncap=self.ncap, programs=self.programs)
            return remap
        remap, experts, rows = admit_torch(flat, pos, self.lut, self.slot_key, self.stamp, self.clock, E, self.P,
                                           self.ncap, log)
        stage_torch(experts, self.store.packed[pos], self.pool, self.Z, rows)
        return remap

    def _adopt_device_state(self) -> None:
        """Device LRU -> the host SlotTable, `want` and the clock mirror (a read-back: the synchronous path only)."""
        E_max = int(self.lut.shape[1])
        keys = self.slot_key.cpu().tolist()
        self.cache.table.adopt([None if k < 0 else (k // E_max, k % E_max) for k in keys], self.stamp.cpu().tolist())
        self.want.copy_(self.lut.cpu())
        self._clock_host = int(self.clock.cpu()[0])

    def _push_device_state(self) -> None:
        """The host SlotTable's slots and LRU order -> slot_key, stamps and clock (after a synchronous step)."""
        table = self.cache.table
        E_max = int(self.lut.shape[1])
        keys = [-1 if k is None else k[0] * E_max + k[1] for k in table.slot_key]
        stamps = [0] * self.Z
        for i, slot in enumerate(table.order):  # least recently used first: the lowest stamp
            stamps[slot] = self._clock_host + 1 + i
        self.slot_key.copy_(torch.tensor(keys, dtype=torch.int32))
        self.stamp.copy_(torch.tensor(stamps, dtype=torch.int64))
        self.clock.fill_(self._clock_host + len(table.order))

    def _pool_impl(self, impl, pos: int, top_k: int, num_tokens: int, *, tokens: bool = False):
        """The impl to run on the pool: a tiled impl picks tiles and path by E, and the pool's E
        is Z + staging, so it runs as for the resident layer's E (experts.base.tiled_as)."""
        return tiled_as(impl, self.store.num_experts[pos])

    # ---- the synchronous path for big steps -----------------------------------------------
    def _sync_step(self, pos: int, impl, batch, config, ids: torch.Tensor) -> torch.Tensor:
        ids_host, _ = read_back(ids, None)
        E = self.store.num_experts[pos]
        used = sorted({e for e in ids_host if 0 <= e < E})
        if self.device_lru:
            self._adopt_device_state()
        table = self.cache.table
        before = list(table.slot_key)
        y = self.runtime._run_cached(pos, impl, batch, config, ids, ids_host, used, [])
        changed = False
        for slot, (old, new) in enumerate(zip(before, table.slot_key)):
            if old == new:
                continue
            # the compute stream waited for these copies (ExpertCache.ensure): resident for every later kernel
            if old is not None and self.want[old] == slot:
                self.want[old] = -1
            if new is not None:
                self.want[new] = slot
            self.inflight.pop(slot, None)
            changed = True
        if changed:
            self._upload(self._free_mirror(wait=True))
        if self.device_lru:
            self._push_device_state()
        self.stats.sync_steps += 1
        return y

    # ---- lagged refill --------------------------------------------------------------------
    def _free_mirror(self, *, wait: bool = False) -> int | None:
        """A lut mirror whose last upload has completed (None when all are in flight and not `wait`)."""
        for i, ev in enumerate(self._mirror_ev):
            if ev.query():
                return i
        if not wait:
            return None
        self._mirror_ev[0].synchronize()  # the synchronous path only
        return 0

    def _upload(self, i: int) -> None:
        """The lut to the device on the current stream (stream-ordered before anything enqueued after)."""
        if self.cuda:
            self._mirrors[i].copy_(self.want)
            self.lut.copy_(self._mirrors[i], non_blocking=True)
            self._mirror_ev[i].record(self._stream())
        else:
            self.lut.copy_(self.want)
        self._note("upload", self.want.clone())

    def refill(self) -> None:
        """Feed the policy from completed read-backs, load its choices, publish finished loads (module doc).

        Never waits on the device. Call it between CUDA-graph replays, on their stream (eager
        steps call it at layer 0); refused inside a capture.
        """
        if self.cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("refill(): called inside a CUDA-graph capture; call it between replays")
        with self.runtime.lock:
            self._snapshot()  # first: on the CPU device it is complete at once and fed just below
            if self.device_lru:  # the device admitted and copied already: the read-backs are stats only
                while self._pending and self._snap_ev[self._pending[0]].query():
                    self._feed(self._snaps[self._pending.popleft()])
                return
            i = self._free_mirror()
            if i is None:
                self.stats.deferred += 1
                return
            changed = False
            stream = self._stream()
            for slot, key in list(self.inflight.items()):  # (a) finished loads become resident
                if self._copy_done(slot):
                    del self.inflight[slot]
                    if stream is not None:
                        stream.wait_event(self.cache.engine.ready[slot])  # complete already: orders, never stalls
                    self.want[key] = slot
                    changed = True
            loads: list[tuple[Key, int]] = []
            while self._pending and self._snap_ev[self._pending[0]].query():  # (b) the policy, a step late
                loads += self._feed(self._snaps[self._pending.popleft()])
            changed = changed or bool(loads)
            if changed:
                self._upload(i)  # (c) evicted keys leave the lut before their slots are overwritten
            if loads:
                self.cache.engine.mark()
                self._note("mark")
                for key, slot in loads:
                    self.cache.engine.copy(slot, [(self.pool[slot], self.store.packed[key[0]][key[1]])])
                    self.inflight[slot] = key
                    self._note("copy", slot, key)
                self.stats.refill_copies += len(loads)
                self.stats.refill_bytes += len(loads) * self.store.expert_bytes

    def _snapshot(self) -> None:
        busy = set(self._pending)
        free = [j for j in range(RING) if j not in busy]
        if not free:
            return  # every snapshot is in flight: the steps it would have seen count as dropped
        j = free[0]
        self._snaps[j].copy_(self.log, non_blocking=self.cuda)
        self._snap_ev[j].record(self._stream())
        self._pending.append(j)
        self._note("snapshot", j)

    def _feed(self, snap: torch.Tensor) -> list[tuple[Key, int]]:
        """Feed one completed log snapshot to the SlotTable; [(key, slot)] loads, their old keys cleared in want."""
        table = self.cache.table
        st = self.stats
        ncap = self.ncap
        loads: list[tuple[Key, int]] = []
        for pos, row in enumerate(snap.tolist()):
            seq = row[0]
            if seq == self.last_seq[pos]:
                continue
            st.dropped += max(0, seq - self.last_seq[pos] - 1)
            st.observed += 1
            self.last_seq[pos] = seq
            E = self.store.num_experts[pos]
            first: dict[int, int] = {}
            for e, r in zip(row[1 : 1 + ncap], row[1 + ncap :]):
                if 0 <= e < E and e not in first:
                    first[e] = r
            # device admission logs a copied expert as -2 - slot; staging as a row >= Z
            hits = sum(1 for r in first.values() if 0 <= r < self.Z)
            st.device_hits += hits
            st.staged += len(first) - hits
            st.bytes_staged += (len(first) - hits) * self.store.expert_bytes
            if self.device_lru:
                continue
            used = sorted(first)
            for g in range(0, len(used), self.Z):  # a step of more experts than slots: in groups, as the sync path
                before = list(table.slot_key)
                table.begin_step()
                _, got = table.acquire([(pos, e) for e in used[g : g + self.Z]])
                for key, slot in got:
                    old = before[slot]
                    if old is not None and self.want[old] == slot:
                        self.want[old] = -1
                    loads.append((key, slot))
        # a slot loaded twice in one feed keeps only its last key (the earlier one was evicted again)
        last: dict[int, Key] = {}
        for key, slot in loads:
            last[slot] = key
        return [(key, slot) for slot, key in last.items()]

    def reset_stats(self) -> None:
        self.stats = GraphStats()
