"""Dispatch / combine: local (one device), all_to_all and all_reduce expert parallelism.

Names resolve lazily so `import moeflow.parallel` does not pull in torch.distributed
machinery until it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "ep_plan": "moeflow.parallel.plan",
    "EPPlan": "moeflow.parallel.plan",
    "Placement": "moeflow.parallel.plan",
    "contiguous_ranges": "moeflow.parallel.plan",
    "shard_layer": "moeflow.parallel.ep",
    "EPMoELayer": "moeflow.parallel.ep",
    "load_ep_layer": "moeflow.parallel.ep",
    "AllToAllDispatcher": "moeflow.parallel.all_to_all",
    "AllReduceEP": "moeflow.parallel.all_reduce",
    "EPCollectiveError": "moeflow.parallel.dist_utils",
    "EPConfigMismatch": "moeflow.parallel.dist_utils",
    "local_dispatch": "moeflow.parallel.local",
    "combine_TH": "moeflow.parallel.local",
    "LocalDispatch": "moeflow.parallel.local",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moeflow.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
