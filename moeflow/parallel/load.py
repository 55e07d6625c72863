"""Measured expert load: per layer, per logical expert, the routed pairs counted on the device.

Legend: L MoE layers (model order), E routed experts, Z zero experts, T tokens of a step,
K picks per token, W ranks of the expert-parallel group.

    track_load(model)                     # start counting (shard_layer does it for every EP layer)
    load_LE = expert_load(model)          # int64 [L, E] pairs routed to each expert since the last reset
    load_LE = expert_load(model, reduce=True, reset=True)   # the group's load (one collective), then zero

Each layer's counter is a forward hook that adds the step's routing (`layer.last_routing.ids_TK`)
into an int64 [E + Z] device buffer with one scatter-add: no host read per step, and a CUDA
graph replay of the step (moeflow.layer_graphs) hands the hook the graph's routing buffers,
so replays count too. Zero experts are counted but not returned.

Under expert parallelism a rank counts the tokens it routes. `reduce=True` sums the [L, E]
table over the layers' group in one all_reduce; layers in all_reduce mode route the same
tokens on every rank, so only rank 0 contributes their rows (the sum is then the group's
load, not W times it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .dist_utils import collective, group_device, group_rank

__all__ = ["LoadCounter", "track_load", "expert_load", "load_layers"]

_ATTR = "_moeflow_load"


class LoadCounter:
    """One layer's routed-pair counts.

    counts: int64 [E + Z] on the routing's device (moved there at the first step that routes
    elsewhere). handle: the forward hook's handle (`stop()` removes it).
    """

    def __init__(self, layer) -> None:
        spec = layer.config.router
        self.num_experts = int(spec.num_experts)
        dev = layer.router_weights.weight_EH.device
        self.counts = torch.zeros(self.num_experts + int(spec.num_zero_experts), dtype=torch.int64,
                                  device="cpu" if dev.type == "meta" else dev)
        self.handle = layer.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        routing = module.last_routing
        if routing is None:
            return
        self.add(routing.ids_TK)

    def add(self, ids_TK: torch.Tensor) -> None:
        """Count the picks of ids_TK (int [T, K], ids in [0, E + Z)); device-side, no host read."""
        flat = ids_TK.reshape(-1).to(torch.int64)
        if self.counts.device != flat.device:
            self.counts = self.counts.to(flat.device)
        self.counts.scatter_add_(0, flat, torch.ones_like(flat))

    def reset(self) -> None:
        self.counts.zero_()

    def stop(self) -> None:
        self.handle.remove()


def load_layers(model_or_layers) -> list:
    """The MoELayers of a model (module order) or of a list of layers, as given."""
    if isinstance(model_or_layers, (list, tuple)):
        layers = list(model_or_layers)
    else:
        from ..offload.trace import find_moe_layers

        layers = find_moe_layers(model_or_layers)
    if not layers:
        raise ValueError("model: no MoELayer found; patch it first (moeflow.patch_model) or pass the layers")
    for i, layer in enumerate(layers):
        if not hasattr(layer, "last_routing") or not hasattr(layer, "register_forward_hook"):
            raise TypeError(f"layers[{i}]: expected a moeflow.MoELayer, got {type(layer).__name__}")
    return layers


def track_load(model_or_layers) -> list[LoadCounter]:
    """Start counting each layer's routed pairs (idempotent: a counting layer keeps its counter)."""
    out = []
    for layer in load_layers(model_or_layers):
        c = layer.__dict__.get(_ATTR)
        if c is None:
            c = layer.__dict__[_ATTR] = LoadCounter(layer)
        out.append(c)
    return out


def expert_load(model_or_layers, *, reset: bool = False, reduce: bool = False,
                timeout_s: float | None = None) -> torch.Tensor:
    """int64 [L, E]: pairs routed to each logical expert of each layer (model order) since the
    counting began or was last reset.

    reset:  zero the counters after reading (this rank's; with reduce, after the collective).
    reduce: sum over the layers' expert-parallel group (one all_reduce; collective: every rank
            calls it at the same point, between steps). The layers must share one group.
    timeout_s: the all_reduce's limit (None: the first layer's dispatcher's).
    Returned on the counters' device (no host read unless reduce runs on another device).
    Raises ValueError naming the layer that does not count (call `track_load` first), or
    whose E differs from the first layer's, or (reduce) that is not expert-parallel.
    """
    for name, v in (("reset", reset), ("reduce", reduce)):
        if not isinstance(v, bool):
            raise TypeError(f"{name}={v!r}: expected True or False")
    layers = load_layers(model_or_layers)
    counters = []
    for i, layer in enumerate(layers):
        c = layer.__dict__.get(_ATTR)
        if c is None:
            raise ValueError(f"layers[{i}] (layer_idx={getattr(layer, 'layer_idx', '?')}): its load is not counted; "
                             f"call moeflow.parallel.track_load(model) first (shard_layer and patch_model(ep_group=...) "
                             f"count by themselves)")
        if c.num_experts != counters[0].num_experts if counters else False:
            raise ValueError(f"layers[{i}]: E={c.num_experts}, but layers[0] has E={counters[0].num_experts}; "
                             f"expert_load returns one [L, E] table")
        counters.append(c)
    device = counters[0].counts.device
    load_LE = torch.stack([c.counts[: c.num_experts].to(device) for c in counters])
    if reduce:
        load_LE = _reduce(layers, load_LE, timeout_s)
    if reset:
        for c in counters:
            c.reset()
    return load_LE


def _reduce(layers: Sequence, load_LE: torch.Tensor, timeout_s: float | None) -> torch.Tensor:
    groups = []
    for i, layer in enumerate(layers):
        g = getattr(layer.dispatcher, "group", None)
        if g is None:
            raise ValueError(f"layers[{i}] (layer_idx={layer.layer_idx}): not expert-parallel; reduce=True sums over "
                             f"an expert-parallel group (pass reduce=False)")
        groups.append(g)
    group = groups[0]
    if any(g is not group for g in groups):
        raise ValueError("reduce=True: the layers are sharded over different process groups; expected one")
    d0 = layers[0].dispatcher
    wire = load_LE.to(group_device(group)).clone()
    if group_rank(group) != 0:
        replicated = torch.tensor([layer.dispatcher.name == "all_reduce" for layer in layers], device=wire.device)
        wire[replicated] = 0
    collective("all_reduce(expert load)", dist.all_reduce, wire, group=group,
               timeout_s=d0.timeout_s if timeout_s is None else timeout_s)
    return wire.to(load_LE.device)
