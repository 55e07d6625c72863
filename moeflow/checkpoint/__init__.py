"""Hugging Face safetensors checkpoints: lazy index, per-family key adapters, one-layer loads.

    from moeflow.checkpoint import CheckpointIndex, load_moe_layer
    idx = CheckpointIndex(path)                         # headers only, shards memory-mapped
    lw = load_moe_layer(idx, config, 3, experts=[0, 1])  # -> LayerWeights

Names resolve lazily: the family table (`moeflow.families`) imports the key types of
`moeflow.checkpoint.keys` without loading the loader.
"""

from __future__ import annotations

from moeflow._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CHECKPOINT_FAMILIES": "moeflow.checkpoint.families",
    "KeyAdapter": "moeflow.checkpoint.keys",
    "adapter_for": "moeflow.checkpoint.families",
    "CheckpointError": "moeflow.checkpoint.index",
    "ConfigError": "moeflow.checkpoint.files",
    "CheckpointIndex": "moeflow.checkpoint.index",
    "TensorInfo": "moeflow.checkpoint.index",
    "LayerPlan": "moeflow.checkpoint.loader",
    "LayerWeights": "moeflow.checkpoint.loader",
    "SharedExpertWeights": "moeflow.checkpoint.loader",
    "load_moe_layer": "moeflow.checkpoint.loader",
    "moe_layer_indices": "moeflow.checkpoint.loader",
    "plan_layer": "moeflow.checkpoint.loader",
    "build_moe_layer": "moeflow.checkpoint.build",
    "load_ep_layer": "moeflow.checkpoint.build",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("moeflow.checkpoint", globals(), _EXPORTS)
