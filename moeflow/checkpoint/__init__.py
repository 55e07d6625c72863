"""Hugging Face safetensors checkpoints: lazy index, per-family key adapters, one-layer loads.

    from moeflow.checkpoint import CheckpointIndex, load_moe_layer
    idx = CheckpointIndex(path)                         # headers only, shards memory-mapped
    lw = load_moe_layer(idx, config, 3, experts=[0, 1])  # -> LayerWeights
"""

from __future__ import annotations

from .families import CHECKPOINT_FAMILIES, KeyAdapter, adapter_for
from .index import CheckpointError, CheckpointIndex, TensorInfo
from .loader import (
    LayerPlan,
    LayerWeights,
    SharedExpertWeights,
    load_moe_layer,
    moe_layer_indices,
    plan_layer,
)

__all__ = [
    "CHECKPOINT_FAMILIES",
    "CheckpointError",
    "CheckpointIndex",
    "KeyAdapter",
    "LayerPlan",
    "LayerWeights",
    "SharedExpertWeights",
    "TensorInfo",
    "adapter_for",
    "load_moe_layer",
    "moe_layer_indices",
    "plan_layer",
]
