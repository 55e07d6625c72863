"""attach_offload: serve a list of MoELayers' experts from host memory through one device slot cache.

Legend: T tokens, H hidden, E routed experts (a rank's local count under expert
parallelism), Z zero experts, K picks per token, S slots, L offloaded layers, N (token,
pick) rows, W prediction width.

Offload is an expert-source choice (moeflow.types.ExpertSource): `attach_offload` gives
each layer an `OffloadedExperts` source (`layer.set_source`), so the layer's one forward,
its dispatcher (local, all_to_all, all_reduce) and its experts impl stay as they are.
Per layer step, `OffloadedExperts.run`:

    1. runs the next layer's router on the step input (Prefetcher.predict_ids, device),
    2. reads the batch's expert ids and the prediction back in ONE device->host copy
       (the read-back routing-driven offload needs anyway),
    3. protects the predicted keys, pins this step's experts and copies the missing
       ones (ExpertCache.ensure: side stream + per-slot events; compute waits only on
       the slots it reads),
    4. issues the prefetch of the predicted missing experts the prefetch rule admits (side
       stream, overlapping this layer's compute; OffloadConfig.prefetch_rule),
    5. maps expert ids to slot ids with a small device lookup table and runs the impl on
       ExpertWeights views of the slot buffers: the same rows in the same order per
       expert as the resident source, so the same bits.

Every impl call has the step's N rows, as the resident layer's one call has (an impl may
block its arithmetic by the call's shape, so a call on part of the rows could give other
bits). When one step touches more distinct experts than there are slots (a long prefill),
the experts run in groups of <= S - 1, one call of all N rows each: the other rows go to a
spare slot and are dropped, every expert still seeing all its rows in order (`_cache_rows`).

CPU execution of missed experts (OffloadConfig.cpu_experts "auto" / "always",
moeflow.offload.cpu_experts): after the read-back, the step's experts that are not resident
are split into those copied (as above) and those run on the CPU from the store's host
tensors (never copied, never placed in a slot). The CPU experts' rows go to the host first
(their copy ordered before the GPU experts' kernels, so waiting for it never waits for
them), then the GPU experts are launched (asynchronous on CUDA), then the CPU rows are
computed, copied back and written into their rows of y: combine then sums every row in
slot order, as it does for the resident model. With the cache on the CPU both parts run in
calls of all N rows (the resident call's shape: its bits). A fused TokenBatch is run as pairs in such
a step (the local dispatch, then combine_TH). Counters: `cpu_stats()`.

Sync-free decode (OffloadConfig.sync_free, moeflow.offload.syncfree): the step reads nothing
back: a device (layer, expert) -> slot table, a kernel that stages the misses from pinned host
memory into spare slots of the same pool and remaps the ids, and a cache refill that lags a
step (`refill()`: eager steps call it; call it between CUDA-graph replays). Counters:
`graph_stats()`. Steps of more than sync_free_tokens tokens run the path above.

Under expert parallelism each rank's cache holds only its local experts (keys (layer,
local expert)); the prediction ranks the next layer's experts for this rank's tokens and
keeps the ones this rank owns.

Concurrency: one runtime's state (slot table, staging table, pins) is shared by every
layer; a lock serialises layer steps, so forwards from several threads give the resident
model's answers (one at a time), never a step that sees another's slots.

The layer's own expert Parameters are released (their storage replaced by an empty
tensor of the same dtype) once the store holds a copy, so `model.to("cuda")` afterwards
moves only the rest of the model. Pass release=False to keep them (tests compare).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import torch

from ..config import ExpertWeights, MoEConfig
from ..experts.base import tiled_as
from ..experts.source import scaled_rows
from ..parallel.local import combine_TH, dispatch_rows, local_dispatch, unpermute_TKH
from ..types import ExpertBatch, PairBatch, TokenBatch
from .cache import CacheStats, ExpertCache
from .config import OffloadConfig
from .cpu_experts import (
    CpuExpertStats,
    ReuseEstimate,
    choose_cpu_experts,
    host_expert_weights,
    measure_bandwidths,
)
from .policy import make_policy
from .prefetch import Prefetcher, read_back
from .slots import Key
from .store import ExpertStore, available_host_bytes, check_matches
from .syncfree import SyncFreeOffload

# "auto" pins a host copy only when it leaves this much of the available memory free
_HOST_MARGIN = 0.8

__all__ = ["OffloadRuntime", "OffloadedExperts", "OffloadedExpertsError", "attach_offload", "check_offload"]


class OffloadedExpertsError(ValueError):
    """An offloaded layer's experts cannot be written this way (`load_state_dict`, `OffloadRuntime.load_experts`).

    Attributes: layer (the layer's position in the runtime), tensor (the expert tensor, or None).
    """

    def __init__(self, message: str, *, layer: int, tensor: str | None = None) -> None:
        super().__init__(message)
        self.layer, self.tensor = layer, tensor


class OffloadedExperts:
    """The ExpertSource of one offloaded layer: its experts come from the runtime's slot cache.

    runtime: the shared OffloadRuntime; pos: the layer's position in it (cache key layer).
    num_experts: experts served (ids the batches use; a rank's local count under EP).
    """

    def __init__(self, runtime: OffloadRuntime, pos: int) -> None:
        self.runtime = runtime
        self.pos = pos
        self.num_experts = runtime.store.num_experts[pos]

    @property
    def dtype(self) -> torch.dtype | None:
        """The activations' dtype (None for quantized experts, whose storage dtype is not it)."""
        store = self.runtime.store
        return None if getattr(store, "quant", None) is not None else store.dtype

    @property
    def quant(self):
        """The slots' QuantSpec: the store keeps the checkpoint's quantized bytes."""
        return getattr(self.runtime.store, "quant", None)

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    def run(self, impl, batch: ExpertBatch, config: MoEConfig, *, step_input: torch.Tensor | None = None
            ) -> torch.Tensor:
        return self.runtime.run_step(self.pos, impl, batch, config, step_input)

    def __repr__(self) -> str:
        return f"OffloadedExperts(layer={self.pos}, experts={self.num_experts}, slots={self.runtime.cache.num_slots})"


class OffloadRuntime:
    """The live offload state of a model: store, cache, prefetcher, and the per-layer sources.

    Attributes:
        layers, store, cache, prefetcher, config, device.
        sources: the OffloadedExperts of each layer (position order).
        cpu_impl: the experts impl the CPU experts run with (config.cpu_experts != "off");
            None: the step's own impl when the cache is on the CPU (bit-identical rows),
            "reference" otherwise (F.linear straight on the host tensors, no weight copy).
        bandwidths: (B_cpu, B_pcie) bytes/s of the cost model ("auto"), measured at the first
            "auto" step unless `set_bandwidths` gave them; None until then.
    """

    def __init__(self, layers: Sequence, store: ExpertStore, config: OffloadConfig) -> None:
        _check_cpu_experts(config, store)  # before the cache is built from the store
        self.layers = list(layers)
        self.store = store
        self.config = config
        device = torch.device(config.resolved_device())
        policy = make_policy(config.policy, config.gpu_slots, fraction=config.oldest_fraction, seed=config.seed)
        self.lock = threading.RLock()
        self.graph = None
        if config.sync_free:
            self.graph = SyncFreeOffload(self, policy)  # its cache's slots are the first rows of its pool
            self.cache = self.graph.cache
        else:
            self.cache = ExpertCache(store, config.gpu_slots, policy, device, measure_wait=config.measure_wait)
        self.device = self.cache.device
        width = config.prediction_width(max(layer.config.top_k for layer in self.layers))
        self.prefetcher = Prefetcher(self.layers, self.cache, width=width, prefetch=config.prefetch_width > 0,
                                     rule=config.prefetch_rule, overlap=config.prefetch_overlap)
        e_max = max(store.num_experts) + max(layer.config.router.num_zero_experts for layer in self.layers)
        pin = self.device.type == "cuda"
        # the expert id -> slot id table: host staging (pinned) + device copy, allocated once
        self._lut_host = torch.zeros(e_max, dtype=torch.int32, pin_memory=pin)
        self._lut_dev = self._lut_host if self.device.type == "cpu" else torch.zeros(
            e_max, dtype=torch.int32, device=self.device)
        self.sources = [OffloadedExperts(self, pos) for pos in range(len(self.layers))]
        self._resident: list = []
        self.cpu_impl = None
        self.bandwidths: tuple[float, float] | None = None
        self._cpu_stats = CpuExpertStats()
        # hits per copy of the last ~8 tokens of layer steps (the cost model's reuse r)
        self.reuse = ReuseEstimate(alpha=1.0 / (8 * len(self.layers)))

    # ---- sources ---------------------------------------------------------------------------
    def install(self) -> None:
        """Give every layer its OffloadedExperts source (the resident ones are kept for detach)."""
        self._resident = [layer.source for layer in self.layers]
        # per layer: expert tensor name -> (the model's Parameter holding it, its row range or None,
        # the Parameter's shape before any release): what a state_dict names (state_dict_hook)
        self._params = [_expert_params(src, self.store.shapes) for src in self._resident]
        for layer, src in zip(self.layers, self.sources):
            layer.set_source(src)
            layer.offload = self

    def detach(self) -> None:
        """Give the layers their resident sources back (they need their expert tensors then)."""
        for layer, src in zip(self.layers, self._resident):
            layer.set_source(src)
            layer.__dict__.pop("offload", None)
        self._resident = []

    # ---- one layer step -------------------------------------------------------------------
    def run_step(self, pos: int, impl, batch: ExpertBatch, config: MoEConfig, step_input: torch.Tensor | None
                 ) -> torch.Tensor:
        with self.lock:
            return self._run_step(pos, impl, batch, config, step_input)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.device != self.device:
            raise ValueError(f"x_TH: on {x.device}, expected the offload cache's device {self.device} "
                             f"(move the model's non-expert parts there: model.to({str(self.device)!r}))")
        if getattr(self.store, "quant", None) is None and x.dtype != self.store.dtype:
            raise TypeError(f"x_TH: dtype {x.dtype}, expected the offloaded experts' dtype {self.store.dtype}")

    def _run_step(self, pos, impl, batch: ExpertBatch, config: MoEConfig, step_input) -> torch.Tensor:
        tokens = isinstance(batch, TokenBatch)
        x = batch.x_TH if tokens else batch.x_NH
        self._check_input(x)
        H = config.hidden_size
        if tokens:
            ids = batch.ids_TK
        else:
            if batch.valid_N is not None:
                raise ValueError("offload: fixed-shape (static) expert-parallel batches are not served from the "
                                 "slot cache; shard with static_tokens=None")
            ids = batch.expert_N
        if ids.numel() == 0:
            return x.new_zeros(int(x.shape[0]), H)
        if self.graph is not None:
            return self.graph.run_step(pos, impl, batch, config)
        E = self.store.num_experts[pos]
        # the slot pool has S experts, not E: pick tiles as the resident layer does (bit identity)
        impl = tiled_as(impl, E)
        pred_TW = self.prefetcher.predict_ids(pos, step_input) if step_input is not None else None
        ids_host, pred_host = read_back(ids, pred_TW)  # the step's one device->host read
        used = sorted({e for e in ids_host if e < E})
        pred_keys = self.prefetcher.local_keys(pos, pred_host)
        self.prefetcher.protect(pred_keys)
        self.prefetcher.observe([(pos, e) for e in used])
        self._cpu_stats.demand_keys += len(used)
        if self.config.cpu_experts != "off":
            cpu_set = self._choose_cpu(pos, impl, config, ids_host, used)
            if cpu_set:
                return self._run_with_cpu(pos, impl, batch, config, ids_host, used, cpu_set, pred_keys)
            before = self._load_counts()
            y = self._run_cached(pos, impl, batch, config, ids, ids_host, used, pred_keys)
            self._observe_reuse(before)
            return y
        return self._run_cached(pos, impl, batch, config, ids, ids_host, used, pred_keys)

    def _run_cached(self, pos, impl, batch: ExpertBatch, config: MoEConfig, ids, ids_host, used, pred_keys
                    ) -> torch.Tensor:
        """Every expert of the step from the slot cache (the path of cpu_experts="off")."""
        tokens = isinstance(batch, TokenBatch)
        E = self.store.num_experts[pos]
        S = self.cache.num_slots
        w = self.cache.weights
        if len(used) <= S:
            slots = self.cache.ensure([(pos, e) for e in used])
            self.prefetcher.issue(pred_keys)
            lut = self._fill_lut(pos, used, slots, E, config.router.num_zero_experts)
            if tokens:
                slot_TK = torch.index_select(lut, 0, ids.reshape(-1).to(torch.int32)).view(ids.shape)
                return impl.forward_tokens(batch.x_TH, slot_TK, batch.weights_TK, w, config)
            slot_N = torch.index_select(lut, 0, ids.to(torch.int32))
            return impl.forward_pairs(scaled_rows(batch, config), slot_N, w, config)
        if tokens:
            return self._tokens_chunked(pos, impl, batch, config, used, pred_keys)
        return self._cache_rows(pos, impl, scaled_rows(batch, config), batch.expert_N, ids_host, config, used,
                                pred_keys)

    def _fill_lut(self, pos: int, used: list[int], slots: dict[Key, int], E: int, Z: int) -> torch.Tensor:
        """The device expert id -> slot id table for this step (zero experts -> S + z)."""
        lut = self._lut_host
        for e in used:
            lut[e] = slots[(pos, e)]
        S = self.cache.num_slots
        for z in range(Z):
            lut[E + z] = S + z
        if self._lut_dev is not lut:
            # stream-ordered, from pinned memory; the next write to the staging table happens
            # after the next read-back, which the compute stream has passed by then
            self._lut_dev.copy_(lut, non_blocking=True)
        return self._lut_dev

    def _cache_rows(self, pos, impl, x_NH, expert_N, ids_host, config, serve, pred_keys) -> torch.Tensor:
        """y_NH [N, H] whose rows of the experts `serve` (sorted ids) come from the slot cache; other rows unset.

        Every impl call has all N rows of the step, as the resident layer's one call has: an impl
        may block its arithmetic by the call's shape (a BLAS for a batch of GEMMs, a kernel's tiles
        chosen by N), so a call on part of the rows could give other bits. The experts run in groups
        of at most S (more distinct experts than slots: a long prefill), each on all its rows in
        order; rows of experts outside the group go to a spare slot that holds none of the group's
        experts and their results are dropped. A group then holds at most S - 1 experts; with one
        slot, the spare is a zero expert appended to a copy of the pool for the call.
        """
        S = self.cache.num_slots
        dev = x_NH.device
        serve_set = set(serve)
        outside = len(serve) > S or any(e not in serve_set for e in ids_host)
        size = max(1, S - 1) if outside else S
        e_max = int(self._lut_host.shape[0])
        ids_t = torch.tensor(ids_host, dtype=torch.int64)
        ids_32 = expert_N.to(torch.int32)
        y_NH = torch.empty_like(x_NH)
        for g in range(0, len(serve), size):
            group = serve[g : g + size]
            slots = self.cache.ensure([(pos, e) for e in group])
            if g + size >= len(serve):
                self.prefetcher.issue(pred_keys)
            w = self.cache.weights
            taken = set(slots.values())
            spare = next((s for s in range(S) if s not in taken), None)
            if spare is None and outside:
                w, spare = _with_zero_expert(w), S
            # a fresh table per group (pinned, non-blocking on CUDA): the previous group's upload
            # may still be reading its own when this one is filled
            lut = torch.full((e_max,), 0 if spare is None else spare, dtype=torch.int32)
            for e in group:
                lut[e] = slots[(pos, e)]
            if dev.type == "cuda":
                lut = lut.pin_memory().to(dev, non_blocking=True)
            elif lut.device != dev:
                lut = lut.to(dev)
            y = impl.forward_pairs(x_NH, torch.index_select(lut, 0, ids_32), w, config)
            if not outside:
                return y
            member = torch.zeros(e_max, dtype=torch.bool)
            member[group] = True
            rows = member[ids_t].nonzero().squeeze(1).to(dev)
            y_NH.index_copy_(0, rows, y.index_select(0, rows))
        return y_NH

    def _tokens_chunked(self, pos, impl, batch: TokenBatch, config, used, pred_keys) -> torch.Tensor:
        """A fused batch with more distinct experts than slots: as pairs grouped by expert, then combined."""
        E = self.store.num_experts[pos]
        d = local_dispatch(batch.ids_TK, E)
        on_input = config.router.weight_on_input
        w_N = batch.weights_TK.reshape(-1).index_select(0, d.order_N).to(torch.float32) if on_input else None
        x_NH = scaled_rows(PairBatch(dispatch_rows(batch.x_TH, d), d.expert_N, None, w_N), config)
        y_NH = self._cache_rows(pos, impl, x_NH, d.expert_N, d.expert_N.tolist(), config, used, pred_keys)
        return combine_TH(unpermute_TKH(y_NH, d), batch.weights_TK, weight_on_input=on_input,
                          out_dtype=batch.x_TH.dtype)

    # ---- CPU execution of missed experts ---------------------------------------------------
    def set_bandwidths(self, cpu_Bps: float, pcie_Bps: float) -> None:
        """Give the cost model its bandwidths (bytes/s) instead of measuring them at the first "auto" step."""
        for name, v in (("cpu_Bps", cpu_Bps), ("pcie_Bps", pcie_Bps)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"set_bandwidths: {name}={v!r}, expected a number of bytes/s > 0")
        self.bandwidths = (float(cpu_Bps), float(pcie_Bps))

    def measure_bandwidths(self, impl=None) -> tuple[float, float]:
        """Measure (B_cpu, B_pcie) in bytes/s now (moeflow.offload.cpu_experts.measure_bandwidths)
        and keep them for the cost model. Without this call (or set_bandwidths) "auto" measures
        them at its first step that has a choice to make: a one-off pause of a few milliseconds
        per expert size, which a caller timing its steps wants out of the timed region."""
        if self.config.cpu_experts == "off":
            raise ValueError("measure_bandwidths: OffloadConfig.cpu_experts='off' has no cost model; "
                             "expected 'auto' or 'always'")
        if impl is None:
            from ..experts.select import get_impl

            impl = get_impl("reference")  # what a CUDA runtime's CPU experts run (_cpu_impl_for)
        self.bandwidths = measure_bandwidths(self.store, self._cpu_impl_for(impl), self.layers[0].config,
                                             self.device)
        return self.bandwidths

    def _cpu_impl_for(self, impl):
        if self.cpu_impl is not None:
            return self.cpu_impl
        if self.device.type == "cpu":
            return impl  # the step's own impl: each CPU expert's rows get the resident bits
        from ..experts.select import get_impl

        return get_impl("reference")

    def _load_counts(self) -> tuple[int, int]:
        s = self.cache.table.stats
        return s.hits, s.misses + s.prefetch_issued

    def _observe_reuse(self, before: tuple[int, int]) -> None:
        hits, loads = self._load_counts()
        self.reuse.update(hits - before[0], loads - before[1])

    def _choose_cpu(self, pos: int, impl, config: MoEConfig, ids_host: list[int], used: list[int]) -> set[int]:
        """The step's experts to run on the CPU: the misses ("always"), or the cost model's pick ("auto")."""
        resident = self.cache.table.key_to_slot
        missing = [e for e in used if (pos, e) not in resident]
        if not missing:
            return set()
        if self.config.cpu_experts == "always":
            return set(missing)
        if self.cache.table.free:
            return set()  # the cache is still warming up: a copy into a free slot evicts nothing
        if self.bandwidths is None:
            self.bandwidths = measure_bandwidths(self.store, self._cpu_impl_for(impl), config, self.device)
        rows: dict[int, int] = dict.fromkeys(missing, 0)
        for e in ids_host:
            if e in rows:
                rows[e] += 1
        cpu_Bps, pcie_Bps = self.bandwidths
        return choose_cpu_experts(rows, cpu_Bps=cpu_Bps, pcie_Bps=pcie_Bps, reuse=self.reuse.reuse)

    def _run_with_cpu(self, pos, impl, batch: ExpertBatch, config: MoEConfig, ids_host, used, cpu_set, pred_keys
                      ) -> torch.Tensor:
        """A step whose experts `cpu_set` run on the CPU: a fused batch as pairs, then the pair path."""
        E = self.store.num_experts[pos]
        if not isinstance(batch, TokenBatch):
            return self._pairs_with_cpu(pos, impl, scaled_rows(batch, config), batch.expert_N, ids_host, config,
                                        used, cpu_set, pred_keys)
        d = local_dispatch(batch.ids_TK, E)
        on_input = config.router.weight_on_input
        w_N = batch.weights_TK.reshape(-1).index_select(0, d.order_N).to(torch.float32) if on_input else None
        x_NH = scaled_rows(PairBatch(dispatch_rows(batch.x_TH, d), d.expert_N, None, w_N), config)
        # the pairs' experts in dispatch order from the host ids (a stable sort, as local_dispatch's):
        # no second device read
        order = sorted(range(len(ids_host)), key=ids_host.__getitem__)
        y_NH = self._pairs_with_cpu(pos, impl, x_NH, d.expert_N, [ids_host[p] for p in order], config, used,
                                    cpu_set, pred_keys)
        return combine_TH(unpermute_TKH(y_NH, d), batch.weights_TK, weight_on_input=on_input,
                          out_dtype=batch.x_TH.dtype)

    def _pairs_with_cpu(self, pos, impl, x_NH, expert_N, ex_host, config, used, cpu_set, pred_keys
                        ) -> torch.Tensor:
        """y_NH [N, H]: the rows of `cpu_set`'s experts computed on the CPU, the others from the cache.

        x_NH: [N, H] the rows as the experts see them (llama4: already w * x); expert_N: int [N]
        (device); ex_host: the same ids as a host list. With the cache on the CPU both parts run
        in calls of all N rows (`_cache_rows`, `_host_rows`): the resident call's shape, so its bits.
        """
        dev = x_NH.device
        cuda = dev.type == "cuda"
        cpu_rows = [n for n, e in enumerate(ex_host) if e in cpu_set]
        gpu_used = [e for e in used if e not in cpu_set]

        def to_dev(rows: list[int]) -> torch.Tensor:
            t = torch.tensor(rows, dtype=torch.int64)
            # pinned + non_blocking: a pageable upload would wait for the GPU experts' kernels
            return t.pin_memory().to(dev, non_blocking=True) if cuda else t

        cpu_idx = to_dev(cpu_rows)
        # 1. (CUDA) the CPU rows to the host, ordered before the GPU experts: waiting for them never
        # waits for those
        ready = x_cpu = None
        if cuda:
            x_cpu = torch.empty((len(cpu_rows), x_NH.shape[1]), dtype=x_NH.dtype, pin_memory=True)
            x_cpu.copy_(x_NH.index_select(0, cpu_idx), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))
        # 2. the experts from the cache (asynchronous on CUDA)
        before = self._load_counts()
        if gpu_used:
            y_NH = self._cache_rows(pos, impl, x_NH, expert_N, ex_host, config, gpu_used, pred_keys)
        else:
            y_NH = torch.empty_like(x_NH)
            self.cache.ensure([])  # a step all the same: last step's pins lapse
            self.prefetcher.issue(pred_keys)
        self._observe_reuse(before)
        # 3. the CPU experts, each on its rows in their order, from the store's host tensors
        t0 = time.perf_counter()
        cpu_impl = self._cpu_impl_for(impl)
        experts = sorted({ex_host[n] for n in cpu_rows})
        if cuda:
            ready.synchronize()
            y_cpu = torch.empty_like(x_cpu)
            local: dict[int, list[int]] = {}
            for i, n in enumerate(cpu_rows):
                local.setdefault(ex_host[n], []).append(i)
            for e in experts:
                li = torch.tensor(local[e], dtype=torch.int64)
                w_e = host_expert_weights(self.store, pos, e)
                y_cpu.index_copy_(0, li, cpu_impl.forward_pairs(x_cpu.index_select(0, li),
                                                                 torch.zeros(len(li), dtype=torch.int64), w_e, config))
        else:
            y_cpu = self._host_rows(pos, cpu_impl, x_NH, expert_N, config, experts).index_select(0, cpu_idx)
        st = self._cpu_stats
        st.cpu_s += time.perf_counter() - t0
        st.cpu_steps += 1
        st.cpu_experts += len(experts)
        st.cpu_rows += len(cpu_rows)
        st.bytes_not_copied += len(experts) * self.store.expert_bytes
        # 4. the CPU results into their rows (combine sums all rows in slot order afterwards)
        if cuda:
            y_cpu = y_cpu.pin_memory().to(dev, non_blocking=True)
        y_NH.index_copy_(0, cpu_idx, y_cpu)
        return y_NH

    def _host_rows(self, pos, impl, x_NH, expert_N, config, experts: list[int]) -> torch.Tensor:
        """y_NH [N, H] (host) of one call of all N rows on the store's host tensors; the rows of `experts` valid.

        The resident layer's call shape (see `_cache_rows`). Stores that hold each layer's experts
        as [E, ...] tensors (pinned, model) give the layer's own ids; the mmap store's experts are
        assembled, `experts` in order and a zero expert last for the other rows.
        """
        tensors = None if self.store.layer_tensors is None else self.store.layer_tensors[pos]
        ids = expert_N.to("cpu")
        if tensors is not None:
            w = ExpertWeights(**tensors, layout=self.store.layout, interleaved=self.store.interleaved)
        else:
            parts = [host_expert_weights(self.store, pos, e) for e in experts]
            w = _with_zero_expert(ExpertWeights(
                **{n: torch.cat([getattr(p, n) for p in parts]) for n in self.store.shapes},
                layout=self.store.layout, interleaved=self.store.interleaved))
            remap = torch.full((self.store.num_experts[pos],), len(experts), dtype=torch.int64)
            remap[experts] = torch.arange(len(experts))
            ids = remap[ids.long()]
        return impl.forward_pairs(x_NH.to("cpu"), ids, w, config)

    # ---- writing the experts ---------------------------------------------------------------
    def load_experts(self, pos: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write layer `pos`'s experts into the host store and copy its cached experts again.

        tensors: name (gate_up, down, the biases; quantized: the stored data and scales) -> the
        layer's E served experts [E, *per-expert shape], as the store holds them; a subset of the
        names is fine. Floating tensors are converted to the store's dtype (as load_state_dict's
        copy converts), others must have it. What `load_state_dict` on a patched model does for
        offloaded experts (`state_dict_hook`). OffloadedExpertsError, before anything is written,
        for a store that cannot take the write (mmap: the checkpoint file is the store; the
        sync-free path's device tables) or a tensor of another name, shape or dtype.
        """
        self._check_load(pos, tensors)
        self._write(pos, tensors)

    def _check_load(self, pos: int, tensors: dict[str, torch.Tensor]) -> None:
        store = self.store
        if isinstance(pos, bool) or not isinstance(pos, int) or not 0 <= pos < store.num_layers:
            raise ValueError(f"load_experts: pos={pos!r}, expected a layer position in [0, {store.num_layers})")
        what = ("drop the offloaded layers' expert tensors from the state_dict, or load the model with these "
                "weights before patch_model(..., offload=...)")
        if store.layer_tensors is None:
            raise OffloadedExpertsError(
                f"layer {pos}: offloaded experts cannot be written to store mode {store.mode!r} (the experts are "
                f"read from OffloadConfig.checkpoint on each miss); {what}, or offload with store='pinned'",
                layer=pos)
        if self.graph is not None:
            raise OffloadedExpertsError(
                f"layer {pos}: offloaded experts cannot be written with OffloadConfig.sync_free=True (its device "
                f"tables and staged copies are not refreshed); {what}", layer=pos)
        E = store.num_experts[pos]
        for name, t in tensors.items():
            if name not in store.shapes:
                raise OffloadedExpertsError(f"layer {pos}: {name!r} is not an expert tensor of this store, expected "
                                            f"one of {sorted(store.shapes)}", layer=pos, tensor=name)
            want = (E, *store.shapes[name])
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                raise OffloadedExpertsError(f"layer {pos}: {name} shape {tuple(getattr(t, 'shape', ()))}, expected "
                                            f"{want} (the layer's {E} experts)", layer=pos, tensor=name)
            dst = store.layer_tensors[pos][name]
            if t.dtype != dst.dtype and not (t.dtype.is_floating_point and dst.dtype.is_floating_point
                                             and dst.element_size() > 1):
                raise OffloadedExpertsError(f"layer {pos}: {name} dtype {t.dtype}, expected {dst.dtype} (stored "
                                            f"bytes are not converted)", layer=pos, tensor=name)

    def _write(self, pos: int, tensors: dict[str, torch.Tensor]) -> None:
        with self.lock:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # no copy still reads the host rows written below
            with torch.no_grad():
                for name, t in tensors.items():
                    self.store.layer_tensors[pos][name].copy_(t)
            self.cache.refresh(pos)

    def state_dict_hook(self, blocks: Sequence[tuple[object, torch.nn.Module, str]]):
        """A load_state_dict pre-hook for the model's root module that writes the offloaded experts to the host store.

        blocks: (layer, module, path): each offloaded MoELayer, the model's module whose
        Parameters its experts were (a patched HF block) and that module's path from the root.
        When a state_dict names those Parameters, the hook checks every named expert tensor of
        every layer (shape as the model held it; what `load_experts` refuses, e.g. an mmap store)
        before writing any, so a refusal (OffloadedExpertsError naming the key) comes before torch
        loads anything; then writes them (`load_experts`) and hands torch an empty tensor for each
        released Parameter, so its size check passes and nothing more is written there. Register
        it on the root: `model.register_load_state_dict_pre_hook(hook)`. None when no block
        holds such a Parameter.
        """
        keymap: dict[str, tuple[int, str, torch.nn.Parameter, tuple[int, int] | None, tuple[int, ...]]] = {}
        for layer, module, path in blocks:
            pos = self.layers.index(layer)
            names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
            for name, (base, rows, shape) in self._params[pos].items():
                if id(base) in names:
                    keymap[(f"{path}." if path else "") + names[id(base)]] = (pos, name, base, rows, shape)
        if not keymap:
            return None

        def hook(mod, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
            found = {prefix + k: v for k, v in keymap.items() if prefix + k in state_dict}
            per_layer: dict[int, dict[str, torch.Tensor]] = {}
            keys: dict[tuple[int, str], str] = {}
            for key, (pos, name, _, rows, shape) in found.items():
                t = state_dict[key]
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                    raise OffloadedExpertsError(
                        f"load_state_dict: {key}: shape {tuple(getattr(t, 'shape', ()))}, expected {shape} (layer "
                        f"{pos}'s offloaded experts as the model held them)", layer=pos, tensor=name)
                per_layer.setdefault(pos, {})[name] = t if rows is None else t.narrow(0, rows[0], rows[1])
                keys[(pos, name)] = key
            for pos, tensors in per_layer.items():  # every check before the first write
                try:
                    self._check_load(pos, tensors)
                except OffloadedExpertsError as exc:
                    key = keys.get((pos, exc.tensor)) or ", ".join(keys[(pos, n)] for n in tensors)
                    raise OffloadedExpertsError(f"load_state_dict: {key}: {exc}", layer=pos, tensor=exc.tensor) \
                        from None
            for pos, tensors in per_layer.items():
                self._write(pos, tensors)
            for key, (_, _, base, _, _) in found.items():
                if base.numel() == 0:  # released: the store holds the values now
                    state_dict[key] = base.detach()

        return hook

    # ---- reporting ------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        return self.cache.stats()

    def cpu_stats(self) -> CpuExpertStats:
        """Counters of CPU execution of missed experts (config.cpu_experts; they add up with stats())."""
        return self._cpu_stats

    def graph_stats(self):
        """GraphStats of the sync-free path (device hits / staged experts, read back lagged); None when off."""
        return None if self.graph is None else self.graph.stats

    def refill(self) -> None:
        """Sync-free path: feed the policy from finished read-backs and start the refill copies, never waiting.

        Eager steps call it themselves; between CUDA-graph replays of a decode step, call it
        (on the replays' stream) so the cache fills. ValueError when sync_free is off.
        """
        if self.graph is None:
            raise ValueError("refill(): OffloadConfig.sync_free=False, expected a runtime attached with sync_free=True")
        self.graph.refill()

    def reset_stats(self) -> None:
        self.cache.reset_stats()
        self._cpu_stats.__init__()
        if self.graph is not None:
            self.graph.reset_stats()


def _expert_params(src, names) -> dict[str, tuple[torch.nn.Parameter, tuple[int, int] | None, tuple[int, ...]]]:
    """name -> (the Parameter a resident source's expert tensor is, or is rows of; the row range; its shape).

    Tensors that are no model Parameter (a rank's local copies) are left out: no state_dict names them.
    """
    from ..refs import param_rows

    out = {}
    ref = getattr(src, "ref", None)
    for name in names:
        t = ref(name) if ref is not None else None
        if isinstance(t, torch.nn.Parameter):
            out[name] = (t, None, tuple(t.shape))
        elif isinstance(t, torch.Tensor) and (rows := param_rows(t)) is not None:
            base, start, length = rows
            out[name] = (base, (start, length), tuple(base.shape))
    return out


def _with_zero_expert(w: ExpertWeights) -> ExpertWeights:
    """A copy of `w` with one more expert, all zeros, after its own (a spare for rows whose results are dropped)."""
    tensors = {n: torch.cat([t, torch.zeros_like(t[:1])]) for n in ExpertWeights.TENSOR_FIELDS
               if (t := getattr(w, n)) is not None}
    return ExpertWeights(**tensors, layout=w.layout, interleaved=w.interleaved, quant=w.quant)


def _check_cpu_experts(config: OffloadConfig, store_or_weights) -> None:
    """ValueError naming OffloadConfig.cpu_experts when the experts cannot run on the CPU (quantized)."""
    quant = getattr(store_or_weights, "quant", None)
    if config.cpu_experts != "off" and quant is not None:
        raise ValueError(f"OffloadConfig.cpu_experts={config.cpu_experts!r}: quantized experts (format "
                         f"{getattr(quant, 'format', quant)!r}) are not run on the CPU; expected cpu_experts='off'")


def _check_sync_free(layers: list, config: OffloadConfig) -> None:
    """ValueError naming OffloadConfig.sync_free and the layer when the sync-free path cannot serve it."""
    for i, layer in enumerate(layers):
        z = layer.config.router.num_zero_experts
        if z:
            # zero experts are dispatched with a host read-back (moeflow.parallel.local)
            raise ValueError(f"OffloadConfig.sync_free=True: layers[{i}] (layer_idx={layer.layer_idx}) has {z} zero "
                             f"experts, whose dispatch reads back; expected layers without zero experts")
        if _local_ids(layer) is not None or not getattr(layer.dispatcher, "fuses", True):
            raise ValueError(f"OffloadConfig.sync_free=True: layers[{i}] (layer_idx={layer.layer_idx}) is expert-"
                             f"parallel ({type(layer.dispatcher).__name__}); expected single-device layers")
    if config.policy == "lru":
        # device admission takes one step's distinct experts into the cache at once (moeflow.offload.syncfree)
        need = max(min(layer.config.num_experts, config.sync_free_tokens * layer.config.top_k) for layer in layers)
        if config.gpu_slots < need:
            raise ValueError(
                f"OffloadConfig.gpu_slots={config.gpu_slots}: sync_free=True with policy 'lru' admits a step's experts "
                f"into the cache on the device, up to min(E, sync_free_tokens*K) = {need} at once; expected gpu_slots "
                f">= {need} (or policy='random_oldest')")
    dev = torch.device(config.resolved_device())
    if dev.type == "cuda":
        from .._triton import triton_available

        if not triton_available():
            raise ValueError(f"OffloadConfig.sync_free=True on {dev}: needs the triton package (its gather kernel); "
                             f"expected device='cpu' or Triton installed")


def _resident_weights(layer, i: int) -> ExpertWeights:
    """The layer's resident experts (ValueError naming it when they are not there to offload)."""
    src = layer.source
    if isinstance(src, OffloadedExperts) or getattr(layer, "offload", None) is not None:
        raise ValueError(f"layers[{i}] (layer_idx={layer.layer_idx}): already offloaded")
    if getattr(src, "spare_expert", None) is not None:
        raise ValueError(f"layers[{i}] (layer_idx={layer.layer_idx}): a fixed-shape (static_tokens) expert-parallel "
                         f"layer cannot be offloaded; shard it with static_tokens=None")
    w = getattr(src, "weights", None)
    if not isinstance(w, ExpertWeights):
        raise ValueError(f"layers[{i}] (layer_idx={layer.layer_idx}): its source {type(src).__name__} holds no "
                         f"resident experts to offload")
    return w


def _choose_store(weights: Sequence[ExpertWeights], config: OffloadConfig) -> str:
    if config.store != "auto":
        return config.store
    need = sum(w.nbytes for w in weights)
    avail = available_host_bytes()
    if avail is None or need <= _HOST_MARGIN * avail:
        return "pinned"
    return "mmap" if config.checkpoint is not None else "model"


def check_offload(layers: Sequence, config: OffloadConfig) -> list[ExpertWeights]:
    """Validate offloading `layers` with `config` without changing anything; the resident weights.

    Raises TypeError/ValueError naming the OffloadConfig field (too few slots for K, a
    prediction wider than E, a missing checkpoint path, a device that is not there) or the
    layer (already offloaded, no resident experts, static expert-parallel buffers).
    """
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config: expected an OffloadConfig, got {type(config).__name__}")
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not hasattr(layer, "set_source") or not hasattr(layer, "source"):
            raise TypeError(f"layers[{i}]: expected a MoELayer, got {type(layer).__name__}")
    config.check_layers([layer.config.top_k for layer in layers], [layer.config.num_experts for layer in layers])
    weights = [_resident_weights(layer, i) for i, layer in enumerate(layers)]
    _check_cpu_experts(config, weights[0])
    if config.sync_free:
        _check_sync_free(layers, config)
    if config.store == "mmap" or (config.store == "auto" and config.checkpoint is not None):
        if config.checkpoint is not None and not os.path.exists(os.fspath(config.checkpoint)):
            raise ValueError(f"OffloadConfig.checkpoint={os.fspath(config.checkpoint)!r}: no such file or directory")
    return weights


def attach_offload(layers: Sequence, config: OffloadConfig, *, release: bool = True,
                   progress: bool = True, layer_ids: Sequence[int] | None = None,
                   store: ExpertStore | None = None) -> OffloadRuntime:
    """Serve `layers` (model order) from host memory through one cache of config.gpu_slots experts.

    Args:
        layers: the model's MoELayers, in the order a token visits them (position i is
            layer i of the cache keys and traces). Expert-parallel layers (all_to_all or
            all_reduce, dynamic) offload their local experts only.
        config: OffloadConfig.
        release: after the store holds the experts, give the layers' expert Parameters
            empty storage (frees host/device memory; the model's non-expert parts can then
            be moved with model.to(device)). Not done in store mode "model".
        progress: tqdm bar over the initial load.
        layer_ids: checkpoint layer numbers for store "mmap" (default: each layer's layer_idx).
        store: an ExpertStore already built for these layers (e.g. shared by several
            runtimes in a benchmark); config.store is then ignored and nothing is released.
    Returns:
        the OffloadRuntime (stats(), cache, store, detach()); also set as `layer.offload`.
    Raises:
        ValueError naming the OffloadConfig field or the layer (see `check_offload`); every
        check runs before anything is changed, so a refused call leaves the layers as they were.
    """
    weights = check_offload(layers, config)
    layers = list(layers)
    locals_ = [_local_ids(layer) for layer in layers]
    if store is not None:
        if store.num_experts != [w.num_experts for w in weights]:
            raise ValueError(f"store: {store.num_experts} experts per layer, the layers have "
                             f"{[w.num_experts for w in weights]}")
        runtime = OffloadRuntime(layers, store, config)
        runtime.install()
        return runtime
    mode = _choose_store(weights, config)
    if config.sync_free and mode != "pinned":
        raise ValueError(f"OffloadConfig.sync_free=True: store={config.store!r} resolved to {mode!r} (the packed "
                         f"pinned copy does not fit in available host memory); expected room for a pinned copy")
    if mode == "mmap" and weights[0].quant is not None:
        raise ValueError("OffloadConfig.store='mmap': quantized experts are served from a pinned host copy "
                         "(store='pinned' or 'auto'); reading them lazily from the checkpoint is not built")
    if mode == "mmap":
        ids = list(layer_ids) if layer_ids is not None else [layer.layer_idx for layer in layers]
        w0 = weights[0]
        expert_ids = None if all(loc is None for loc in locals_) else [
            list(loc) if loc is not None else list(range(w.num_experts)) for loc, w in zip(locals_, weights)]
        store = ExpertStore.from_checkpoint(os.fspath(config.checkpoint), ids, layout=w0.layout,
                                            interleaved=w0.interleaved, dtype=w0.dtype, progress=progress,
                                            expert_ids=expert_ids)
        for i, w in enumerate(weights):
            if store.num_experts[i] != w.num_experts:
                raise ValueError(f"layers[{i}]: {w.num_experts} experts, but checkpoint layer {ids[i]} "
                                 f"has {store.num_experts[i]}")
        # the file must hold the model's experts: sampled rows against the resident tensors
        check_matches(store, weights, layer_ids=ids, expert_ids=expert_ids,
                      source=f"OffloadConfig.checkpoint={os.fspath(config.checkpoint)!r}")
    else:
        store = ExpertStore.from_weights(weights, mode=mode, progress=progress, packed=config.sync_free)
    runtime = OffloadRuntime(layers, store, config)
    resident = [layer.source for layer in layers]
    runtime.install()
    if release and mode != "model":
        for src in resident:
            src.release()
    return runtime


def _local_ids(layer) -> tuple[int, ...] | None:
    """The global ids of the experts a layer's source serves (None: all, in order)."""
    ids = getattr(layer.dispatcher, "local_ids", None)
    return tuple(ids) if ids is not None else None
