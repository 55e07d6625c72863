"""Dispatch / combine: local (one device), all_to_all and all_reduce expert parallelism; expert load
balance (redundant copies, measured load, placement, rebalancing).

Names resolve lazily so `import moeflow.parallel` does not pull in torch.distributed
machinery until it is used.
"""

from __future__ import annotations

from moeflow._lazy import lazy_exports

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
    "EPGroupBroken": "moeflow.parallel.dist_utils",
    "EPInputMismatch": "moeflow.parallel.dist_utils",
    "EPStepAborted": "moeflow.parallel.dist_utils",
    "EPStepMismatch": "moeflow.parallel.dist_utils",
    "check_steps": "moeflow.parallel.dist_utils",
    "local_dispatch": "moeflow.parallel.local",
    "EPPlacementError": "moeflow.parallel.plan",
    "physical_ids": "moeflow.parallel.plan",
    "track_load": "moeflow.parallel.load",
    "expert_load": "moeflow.parallel.load",
    "plan_placement": "moeflow.parallel.eplb",
    "ModelPlacement": "moeflow.parallel.eplb",
    "rebalance": "moeflow.parallel.rebalancing",
    "RebalanceReport": "moeflow.parallel.rebalancing",
    "EPRebalanceAborted": "moeflow.parallel.rebalancing",
    "combine_TH": "moeflow.parallel.local",
    "LocalDispatch": "moeflow.parallel.local",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("moeflow.parallel", globals(), _EXPORTS)
