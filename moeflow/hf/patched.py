"""What a patched model holds: its patched blocks, their MoELayers, its deferred routing check.

Read-only queries on a model `patch_model` (moeflow.hf.patch) changed. They sit below both
moeflow.hf.patch (which re-exports them) and moeflow.hf.graphs (whose StaticDecoder and layer
graphs find the layers and run the routing check after replays), so neither imports the other's
caller.
"""

from __future__ import annotations

from torch import nn

from ..layer import MoELayer
from .blocks import MoEBlock

__all__ = ["check_routing", "moe_layers", "patched_modules"]


def patched_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module of `model` that patch_model turned into a MoEBlock, in model order."""
    return [(p, m) for p, m in model.named_modules() if isinstance(m, MoEBlock)]


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoELayers of a patched model, one per replaced block, in model order."""
    seen: dict[int, MoELayer] = {}
    for _, m in patched_modules(model):
        layer = m.moe_layer
        seen.setdefault(id(layer), layer)
    return list(seen.values())


def check_routing(model: nn.Module, *, wait: bool = True) -> None:
    """Raise the named ValueError (layer, row) if any routing of a patched model failed so far.

    A patched model checks its GPU routing status once per forward without a host sync
    (moeflow.routing.monitor); this forces the check now (wait=True: one sync), e.g. after
    the last step of a generation or after CUDA-graph replays.
    """
    monitor = model.__dict__.get("_moeflow_routing")
    if monitor is None:
        raise ValueError(f"check_routing: {type(model).__name__} is not patched by moeflow.patch_model")
    monitor.check(wait=wait)
