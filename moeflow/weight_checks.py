"""The rule for the experts' optional biases, shared by plain and quantized `ExpertWeights`.

Legend: E experts held, H hidden, I intermediate per expert.

It sits below both `moeflow.config` (plain weights) and `moeflow.quant.storage` (quantized
storage), which each check their own tensors and then the biases with this one function.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_expert_biases"]


def check_expert_biases(w: Any, E: int, H: int, I: int) -> None:
    """TypeError/ValueError naming the bias of `w` (an ExpertWeights) that is not a floating
    gate_up_bias [E, 2I] / down_bias [E, H] tensor (or None)."""
    for name, want in (("gate_up_bias", (E, 2 * I)), ("down_bias", (E, H))):
        b = getattr(w, name)
        if b is None:
            continue
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"ExpertWeights.{name}: expected a torch.Tensor or None, got {type(b).__name__}")
        if tuple(b.shape) != want:
            raise ValueError(f"ExpertWeights.{name}: shape {tuple(b.shape)}, expected {want}")
        if not b.dtype.is_floating_point:
            raise TypeError(f"ExpertWeights.{name}: dtype {b.dtype}, expected a floating dtype")
