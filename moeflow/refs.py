"""Tensors held by reference on a module: the model's own Parameters, never copies.

An `nn.Parameter` is registered as that same Parameter object (so it is shared with the
model it came from, and `.to()` converts it in place for both); a view along dim 0 of a
Parameter (e.g. LongCat's `gate_up_proj[:E]`, whose Parameter also holds rows for the
zero experts) is stored as the whole Parameter plus the row range and re-sliced at each
use, so it too survives `.to()`; any other tensor is registered as a buffer. A narrowed
Parameter is registered under `<name>_full`.

`TensorRefs` is the one place that knows this storage; the layer, the resident expert
source and the HF adapter only call `set_ref` / `ref`.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["TensorRefs", "param_rows"]


def param_rows(t: torch.Tensor) -> tuple[nn.Parameter, int, int] | None:
    """(base, start, length) when t is base.narrow(0, start, length) of an nn.Parameter base."""
    base = t._base
    if not isinstance(base, nn.Parameter) or isinstance(t, nn.Parameter):
        return None
    if t.dim() != base.dim() or t.dim() == 0 or tuple(t.shape[1:]) != tuple(base.shape[1:]):
        return None
    if t.stride() != base.stride() or base.stride(0) == 0:
        return None
    delta = t.storage_offset() - base.storage_offset()
    if delta < 0 or delta % base.stride(0):
        return None
    start = delta // base.stride(0)
    if start + t.shape[0] > base.shape[0]:
        return None
    return base, start, int(t.shape[0])


class TensorRefs(nn.Module):
    """An nn.Module whose named tensors are registered by reference (see the module docstring).

    `persistent`: buffers go into state_dict (a standalone layer saves its tensors);
    False for holders of views another module already saves.
    """

    def __init__(self, *, persistent: bool = True) -> None:
        super().__init__()
        self._ref_rows: dict[str, tuple[int, int]] = {}
        self._ref_persistent = persistent

    def set_ref(self, name: str, t: torch.Tensor | None) -> None:
        """Register `t` under `name` by reference (None clears it)."""
        for n in (name, f"{name}_full"):
            self._parameters.pop(n, None)
            self._buffers.pop(n, None)
            self.__dict__.pop(n, None)
        self._ref_rows.pop(name, None)
        if t is None:
            setattr(self, name, None)
            return
        if isinstance(t, nn.Parameter):
            self.register_parameter(name, t)
            return
        rows = param_rows(t)
        if rows is not None:
            base, start, length = rows
            self.register_parameter(f"{name}_full", base)
            self._ref_rows[name] = (start, length)
            return
        self.register_buffer(name, t, persistent=self._ref_persistent)

    def ref(self, name: str) -> torch.Tensor | None:
        """The tensor registered as `name` now (a narrowed Parameter is re-sliced)."""
        rows = self._ref_rows.get(name)
        if rows is not None:
            return getattr(self, f"{name}_full").narrow(0, rows[0], rows[1])
        return getattr(self, name)

    def release_ref(self, name: str) -> None:
        """Give the registered tensor (the whole Parameter of a narrowed view) empty storage.

        Frees host/device memory shared with the model the tensor came from (offload
        keeps its own copy); the Parameter object and its dtype stay.
        """
        full = f"{name}_full" if name in self._ref_rows else name
        t = getattr(self, full, None)
        if t is None:
            return
        with torch.no_grad():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
