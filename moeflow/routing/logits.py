"""Batch-invariant router logits: f32 [T, E] = x_TH @ weight_EH.T with a fixed reduction order.

Legend: T tokens, H hidden size, E router outputs (routed + zero experts).

Why not F.linear: BLAS picks kernels by shape (a GEMV at T = 1, blocked GEMMs
above), so a row's bits change with the batch it sits in. Here each logit is
the sum over k of the exact products x[t, k] * w[e, k] (bf16/fp16 products are
exact in f32), reduced by torch's row reduction over the contiguous H axis,
whose order depends only on H. Rows are processed in chunks to bound memory;
chunking never changes a row's reduction.

Memory layout: torch's elementwise product keeps the strides of its inputs, and
its reduction walks memory in stride order, so a column-major (or otherwise
strided) x or weight would sum the same products in another order. Both are
therefore made row-major f32 before the product: the bits depend on values,
never on strides.
"""

from __future__ import annotations

import torch

from .._triton import triton_available

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Elements of the [chunk, E, H] product tensor materialised at once (64 MiB of f32).
_CHUNK_ELEMS = 1 << 24


def _check(x_TH: torch.Tensor, weight_EH: torch.Tensor, name: str = "weight_EH") -> None:
    for n, t in (("x_TH", x_TH), (name, weight_EH)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{n}: dtype {t.dtype}, expected one of bf16/fp16/fp32")
        if t.dim() != 2:
            raise ValueError(f"{n}: shape {tuple(t.shape)}, expected 2-D")
    if x_TH.shape[1] != weight_EH.shape[1]:
        raise ValueError(
            f"{name}: shape {tuple(weight_EH.shape)} does not match x_TH hidden size {x_TH.shape[1]} (expected (E, {x_TH.shape[1]}))"
        )
    if x_TH.device != weight_EH.device:
        raise ValueError(f"{name}: on {weight_EH.device}, x_TH on {x_TH.device}: expected one device")


def _unit_stride_h(t: torch.Tensor) -> torch.Tensor:
    """`t` [N, H] itself when its H axis has unit stride, else a row-major copy."""
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def router_logits_reference(x_TH: torch.Tensor, weight_EH: torch.Tensor) -> torch.Tensor:
    """The torch twin of the kernels: f32 [T, E], row t depends only on x_TH[t] (any device)."""
    T, H = x_TH.shape
    E = weight_EH.shape[0]
    # Row-major f32 operands: the product [C, E, H] is then row-major and its sum over H
    # runs in the one order fixed by H (see the module doc on memory layout).
    w_EH = weight_EH.to(torch.float32).contiguous()
    rows = max(1, _CHUNK_ELEMS // max(1, E * H))
    # [C, 1, H] * [1, E, H] -> [C, E, H]: exact products, then a per-row sum over H.
    # (No `out=`: it would refuse inputs that require grad.)
    chunks = [
        (x_TH[start : start + rows].to(torch.float32).contiguous().unsqueeze(1) * w_EH.unsqueeze(0)).sum(dim=-1)
        for start in range(0, T, rows)
    ]
    if not chunks:
        return torch.empty(0, E, dtype=torch.float32, device=x_TH.device)
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=0)


def router_logits(x_TH: torch.Tensor, weight_EH: torch.Tensor) -> torch.Tensor:
    """Router logits in f32, bit-identical per row whatever T is and wherever the row sits.

    Args:
        x_TH: bf16/fp16/fp32 [T, H] router input, any strides (a transposed or sliced
            view gives the same bits as its contiguous copy).
        weight_EH: bf16/fp16/fp32 [E, H] router weight, any strides (no bias: add a
            router-linear bias, as gpt-oss has, to the result).
    Returns:
        float32 [T, E]. On CUDA with Triton installed, a Triton kernel with a
        T-independent reduction order (`moeflow.routing.gpu`); CPU and GPU agree
        with themselves across batch sizes, not bitwise with each other.
    """
    _check(x_TH, weight_EH)
    if x_TH.is_cuda and triton_available():
        from . import gpu

        # The kernel reads rows at any row stride but needs unit stride along H; a copy of
        # a strided operand keeps the values, hence the bits.
        return gpu.router_logits_cuda(_unit_stride_h(x_TH), _unit_stride_h(weight_EH))
    return router_logits_reference(x_TH, weight_EH)
