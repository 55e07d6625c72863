"""attach_offload: run a list of MoELayers from an ExpertStore through one device slot cache.

Legend: T tokens, H hidden, E routed experts, Z zero experts, K picks per token,
S slots, L offloaded layers, N (token, pick) pairs, W prediction width.

How it hooks into MoELayer (moeflow/layer.py), without editing it: MoELayer.forward
is route -> `self.experts_forward(x_TH, routing)` -> + shared expert. attach_offload
sets an instance attribute `experts_forward` on each layer (it shadows the method)
that, per call:

    1. runs the next layer's router on x_TH (Prefetcher.predict_ids, device),
    2. reads this layer's ids and the prediction back in ONE device->host copy
       (the read-back routing-driven offload needs anyway; seed 004 does the same),
    3. protects the predicted keys, pins this step's experts and copies the missing
       ones (ExpertCache.ensure: side stream + per-slot events; compute waits only on
       the slots it reads),
    4. issues the prefetch of the predicted missing experts (side stream, overlapping
       this layer's compute),
    5. remaps expert ids to slot ids with a small device lookup table and calls the
       layer's own `run_experts` on ExpertWeights views of the slot buffers, so the
       dispatch, kernels and combine are exactly the resident model's (same rows in
       the same order per expert -> the same bits).

When one step touches more distinct experts than there are slots (a long prefill),
the experts run in groups of <= S: the pairs path (dispatch, forward_pairs per group
on contiguous row ranges, unpermute, combine), still every expert seeing all its rows
in order.

The layer's own expert Parameters are released (their storage replaced by an empty
tensor of the same dtype) once the store holds a copy, so `model.to("cuda")` afterwards
moves only the rest of the model. Pass release=False to keep them (tests compare).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..experts.select import select_experts_impl
from ..layer import MoELayer, run_experts
from ..parallel.local import combine_TH, dispatch_rows, local_dispatch, unpermute_TKH
from ..types import RoutingResult
from .cache import CacheStats, ExpertCache
from .config import OffloadConfig
from .policy import Key, make_policy
from .prefetch import Prefetcher
from .store import ExpertStore, available_host_bytes

_EXPERT_PARAMS = ("gate_up", "down", "gate_up_bias", "down_bias")
# "auto" pins a host copy only when it leaves this much of the available memory free
_HOST_MARGIN = 0.8


class OffloadRuntime:
    """The live offload state of a model: store, cache, prefetcher, and the per-layer hooks.

    Attributes:
        layers, store, cache, prefetcher, config.
        copies_per_step: demand + prefetch copies of the latest step (diagnostics).
    """

    def __init__(self, layers: Sequence[MoELayer], store: ExpertStore, config: OffloadConfig) -> None:
        self.layers = list(layers)
        self.store = store
        self.config = config
        device = torch.device(config.resolved_device())
        policy = make_policy(config.policy, config.gpu_slots, fraction=config.oldest_fraction, seed=config.seed)
        self.cache = ExpertCache(store, config.gpu_slots, policy, device, measure_wait=config.measure_wait)
        self.device = self.cache.device
        width = config.prediction_width(max(layer.config.top_k for layer in self.layers))
        self.prefetcher = Prefetcher(self.layers, self.cache, width=width, prefetch=config.prefetch_width > 0)
        e_max = max(layer.config.router.num_slots for layer in self.layers)
        ids_dtype = torch.int32
        pin = self.device.type == "cuda"
        # the expert id -> slot id table: host staging (pinned) + device copy, allocated once
        self._lut_host = torch.zeros(e_max, dtype=ids_dtype, pin_memory=pin)
        self._lut_dev = self._lut_host if self.device.type == "cpu" else torch.zeros(
            e_max, dtype=ids_dtype, device=self.device)
        self._installed: list[MoELayer] = []

    # ---- hooks ----------------------------------------------------------------------------
    def install(self) -> None:
        for pos, layer in enumerate(self.layers):
            layer.experts_forward = self._make_hook(pos, layer)  # instance attribute shadows the method
            layer.offload = self
            self._installed.append(layer)

    def detach(self) -> None:
        """Remove the hooks (the layers then need their expert tensors back to run)."""
        for layer in self._installed:
            layer.__dict__.pop("experts_forward", None)
            layer.__dict__.pop("offload", None)
        self._installed.clear()

    def _make_hook(self, pos: int, layer: MoELayer):
        def experts_forward(x_TH: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
            return self.forward_layer(pos, layer, x_TH, routing)

        return experts_forward

    # ---- one layer step -------------------------------------------------------------------
    def forward_layer(self, pos: int, layer: MoELayer, x_TH: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
        cfg = layer.config
        if x_TH.device != self.device:
            raise ValueError(f"x_TH: on {x_TH.device}, expected the offload cache's device {self.device} "
                             f"(move the model's non-expert parts there: model.to({str(self.device)!r}))")
        if x_TH.dtype != self.store.dtype:
            raise TypeError(f"x_TH: dtype {x_TH.dtype}, expected the offloaded experts' dtype {self.store.dtype}")
        T = int(routing.ids_TK.shape[0])
        impl = select_experts_impl(cfg, x_TH.device, T, layer.experts_impl)
        layer.impl_name = impl.name
        if T == 0:
            return x_TH.new_zeros(0, x_TH.shape[1])
        E = cfg.num_experts
        pred_TW = self.prefetcher.predict_ids(pos, x_TH)
        ids_host, pred_host = _read_back(routing.ids_TK, pred_TW)  # the step's one device->host read
        used = sorted({e for row in ids_host for e in row if e < E})
        pred_keys = Prefetcher.keys(pos, pred_host)
        self.prefetcher.protect(pred_keys)
        S = self.cache.num_slots
        if len(used) <= S:
            slots = self.cache.ensure([(pos, e) for e in used])
            self.prefetcher.issue(pred_keys)
            slot_routing = RoutingResult(self._remap(routing.ids_TK, pos, used, slots, E, cfg), routing.weights_TK)
            return run_experts(x_TH, slot_routing, self.cache.weights, cfg, impl)
        return self._forward_chunked(pos, layer, x_TH, routing, ids_host, used, impl, pred_keys)

    def _remap(self, ids_TK: torch.Tensor, pos: int, used: list[int], slots: dict[Key, int], E: int,
               cfg) -> torch.Tensor:
        """ids_TK with routed ids replaced by slot ids and zero experts by S + z (device)."""
        lut = self._lut_host
        for e in used:
            lut[e] = slots[(pos, e)]
        S = self.cache.num_slots
        for z in range(cfg.router.num_zero_experts):
            lut[E + z] = S + z
        if self._lut_dev is not lut:
            # stream-ordered, from pinned memory; the next write to the staging table happens
            # after the next read-back, which the compute stream has passed by then
            self._lut_dev.copy_(lut, non_blocking=True)
        flat = ids_TK.reshape(-1)
        return torch.index_select(self._lut_dev, 0, flat).view(ids_TK.shape)

    def _forward_chunked(self, pos, layer, x_TH, routing, ids_host, used, impl, pred_keys):
        """More distinct experts than slots: run them in groups of <= S on contiguous row ranges."""
        cfg = layer.config
        spec = cfg.router
        E, S = cfg.num_experts, self.cache.num_slots
        d = local_dispatch(routing.ids_TK, E, num_zero_experts=spec.num_zero_experts)
        x_NH = dispatch_rows(x_TH, d)
        if spec.weight_on_input:
            w_N1 = routing.weights_TK.reshape(-1).index_select(0, d.order_N).to(x_TH.dtype).unsqueeze(1)
            x_NH = x_NH * w_N1
        counts = [0] * E
        for row in ids_host:
            for e in row:
                if e < E:
                    counts[e] += 1
        starts, acc = [0] * (E + 1), 0
        for e in range(E):
            starts[e] = acc
            acc += counts[e]
        starts[E] = acc
        y_NH = torch.empty_like(x_NH)
        for g in range(0, len(used), S):
            group = used[g : g + S]
            slots = self.cache.ensure([(pos, e) for e in group])
            if g + S >= len(used):
                self.prefetcher.issue(pred_keys)
            a, b = starts[group[0]], starts[group[-1] + 1]  # rows are sorted by expert
            lut = self._lut_host
            for e in group:
                lut[e] = slots[(pos, e)]
            if self._lut_dev is not lut:
                self._lut_dev.copy_(lut, non_blocking=True)
            slot_N = torch.index_select(self._lut_dev, 0, d.expert_N[a:b].to(self._lut_dev.dtype))
            y_NH[a:b] = impl.forward_pairs(x_NH[a:b], slot_N, self.cache.weights, cfg)
        y_TKH = unpermute_TKH(y_NH, d)
        return combine_TH(y_TKH, routing.weights_TK, x_TH=x_TH, zero_TK=d.zero_TK,
                          weight_on_input=spec.weight_on_input, out_dtype=x_TH.dtype)

    # ---- reporting ------------------------------------------------------------------------
    def stats(self) -> CacheStats:
        return self.cache.stats()

    def reset_stats(self) -> None:
        self.cache.reset_stats()


def _read_back(ids_TK: torch.Tensor, pred_TW: torch.Tensor | None) -> tuple[list[list[int]], list[list[int]] | None]:
    """Host lists of the routing ids [T][K] and predicted ids [T][W], in one device->host copy."""
    T, K = int(ids_TK.shape[0]), int(ids_TK.shape[1])
    if pred_TW is None:
        flat = ids_TK.reshape(-1).tolist()
        return [flat[t * K : (t + 1) * K] for t in range(T)], None
    W = int(pred_TW.shape[1])
    both = torch.cat([ids_TK.reshape(-1).to(torch.int32), pred_TW.reshape(-1).to(torch.int32)]).tolist()
    ids = [both[t * K : (t + 1) * K] for t in range(T)]
    off = T * K
    pred = [both[off + t * W : off + (t + 1) * W] for t in range(T)]
    return ids, pred


def _choose_store(layers: Sequence[MoELayer], config: OffloadConfig) -> str:
    if config.store != "auto":
        return config.store
    weights = [layer.expert_weights for layer in layers]
    need = sum(w.gate_up.numel() + w.down.numel() for w in weights) * weights[0].gate_up.element_size()
    avail = available_host_bytes()
    if avail is None or need <= _HOST_MARGIN * avail:
        return "pinned"
    return "mmap" if config.checkpoint is not None else "model"


def attach_offload(layers: Sequence[MoELayer], config: OffloadConfig, *, release: bool = True,
                   progress: bool = True, layer_ids: Sequence[int] | None = None,
                   store: ExpertStore | None = None) -> OffloadRuntime:
    """Serve `layers` (model order) from host memory through one cache of config.gpu_slots experts.

    Args:
        layers: the model's MoELayers, in the order a token visits them (position i is
            layer i of the cache keys and traces).
        config: OffloadConfig.
        release: after the store holds the experts, replace the layers' expert Parameters'
            storage by empty tensors (frees host/device memory; the model's non-expert
            parts can then be moved with model.to(device)). Not done in store mode "model".
        progress: tqdm bar over the initial load.
        layer_ids: checkpoint layer numbers for store "mmap" (default: each layer's layer_idx).
        store: an ExpertStore already built for these layers (e.g. shared by several
            runtimes in a benchmark); config.store is then ignored and nothing is released.
    Returns:
        the OffloadRuntime (stats(), cache, store, detach()); also set as `layer.offload`.
    Raises:
        ValueError naming the OffloadConfig field (too few slots for K, prefetch wider
        than E) or the layer (shapes differ, expert parallel subsets).
    """
    if not isinstance(config, OffloadConfig):
        raise TypeError(f"config: expected an OffloadConfig, got {type(config).__name__}")
    layers = list(layers)
    for i, layer in enumerate(layers):
        if not isinstance(layer, MoELayer):
            raise TypeError(f"layers[{i}]: expected a MoELayer, got {type(layer).__name__}")
        if getattr(layer, "offload", None) is not None:
            raise ValueError(f"layers[{i}] (layer_idx={layer.layer_idx}): already offloaded")
    config.check_layers([layer.config.top_k for layer in layers], [layer.config.num_experts for layer in layers])
    if store is not None:
        if store.num_experts != [layer.config.num_experts for layer in layers]:
            raise ValueError(f"store: {store.num_experts} experts per layer, the layers have "
                             f"{[layer.config.num_experts for layer in layers]}")
        runtime = OffloadRuntime(layers, store, config)
        runtime.install()
        return runtime
    mode = _choose_store(layers, config)
    if mode == "mmap":
        ids = list(layer_ids) if layer_ids is not None else [layer.layer_idx for layer in layers]
        w0 = layers[0].expert_weights
        store = ExpertStore.from_checkpoint(config.checkpoint, ids, layout=w0.layout, interleaved=w0.interleaved,
                                            dtype=w0.dtype, progress=progress)
        for i, layer in enumerate(layers):
            if store.num_experts[i] != layer.config.num_experts:
                raise ValueError(f"layers[{i}]: {layer.config.num_experts} experts, but checkpoint layer {ids[i]} "
                                 f"has {store.num_experts[i]}")
    else:
        store = ExpertStore.from_weights([layer.expert_weights for layer in layers], mode=mode, progress=progress)
    runtime = OffloadRuntime(layers, store, config)
    if release and mode != "model":
        for layer in layers:
            _release_experts(layer)
    runtime.install()
    return runtime


def _release_experts(layer: MoELayer) -> None:
    """Free the layer's expert tensors (shared with the model) by giving them empty storage."""
    for name in _EXPERT_PARAMS:
        full = f"{name}_full" if name in layer._rows else name
        t = getattr(layer, full, None)
        if t is None:
            continue
        with torch.no_grad():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
