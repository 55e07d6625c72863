"""Quantized `ExpertWeights`: dequantization, our quantizer, scale value checks.

Legend: E experts, H hidden, I intermediate per expert.

The storage rules (which tensor of which shape and dtype per format, `check_quantized`) are
moeflow.quant.storage, below moeflow.config; they are re-exported here. This module builds
ExpertWeights, so it sits above moeflow.config.
"""

from __future__ import annotations

import torch

from ..config import ExpertWeights
from .formats import check_scales, quantize_fp8_block, quantize_mxfp4, quantize_nvfp4, scale_code_max
from .spec import QuantSpec
from .storage import SCALE_FIELDS, check_quantized, expected_scale_shapes

__all__ = ["SCALE_FIELDS", "check_expert_scales", "check_quantized", "dequantize_experts", "expected_scale_shapes",
           "quantize_experts", "scale_kind"]

def dequantize_experts(w: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    """A plain ExpertWeights of `dtype` in moeflow's layout (`w.layout`), values computed in f32.

    Biases are cast to `dtype`. Bit-exact contract per format: `moeflow.quant.formats`.
    """
    if w.quant is None:
        raise ValueError("dequantize_experts: w.quant is None (the weights are not quantized)")
    return w.dequantize(dtype)


def quantize_experts(w: ExpertWeights, spec: QuantSpec) -> ExpertWeights:
    """Our quantizer over a plain ExpertWeights (tests, tiny checkpoints): a quantized ExpertWeights.

    Round to nearest, deterministic (rules in `moeflow.quant.formats`); gate and up are
    quantized as two tensors (their own block grids / weight_scale_2), as per-expert
    checkpoints store them. Biases are kept as they are. No input scales are made.
    """
    if w.quant is not None:
        raise ValueError(f"quantize_experts: w is already quantized ({w.quant.format})")
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec: expected a QuantSpec, got {type(spec).__name__}")
    # [E, out, in] forms of both projections.
    gu = w.gate_up.transpose(1, 2) if w.layout == "matmul" else w.gate_up
    dn = w.down.transpose(1, 2) if w.layout == "matmul" else w.down
    I = w.intermediate_size
    kw: dict = {}
    if spec.format == "fp8_block":
        ue8m0 = spec.scale_dtype != torch.float32
        (gq, gs), (uq, us) = (quantize_fp8_block(h, spec.block, ue8m0=ue8m0) for h in (gu[:, :I], gu[:, I:]))
        dq, ds = quantize_fp8_block(dn, spec.block, ue8m0=ue8m0)
        kw = dict(gate_up_scale=torch.cat((gs, us), dim=1), down_scale=ds)
        gate_up = torch.cat((gq, uq), dim=1)
    elif spec.format == "mxfp4":
        gate_up, gus = quantize_mxfp4(gu)
        dq, ds = quantize_mxfp4(dn)
        kw = dict(gate_up_scale=gus, down_scale=ds)
    else:
        (gq, gs, g2), (uq, us, u2) = (quantize_nvfp4(h) for h in (gu[:, :I], gu[:, I:]))
        dq, ds, d2 = quantize_nvfp4(dn)
        kw = dict(gate_up_scale=torch.cat((gs, us), dim=1), down_scale=ds,
                  gate_up_scale_2=torch.stack((g2, u2), dim=1), down_scale_2=d2)
        gate_up = torch.cat((gq, uq), dim=1)
    return ExpertWeights(gate_up, dq, w.gate_up_bias, w.down_bias, layout=w.layout, interleaved=w.interleaved,
                         quant=spec, **kw)


def scale_kind(spec: QuantSpec, field: str) -> str:
    """"e8m0" or "float": how `check_scales` reads the scale field `field` under `spec`."""
    if field in ("gate_up_scale", "down_scale") and spec.scale_dtype != torch.float32 \
            and spec.scale_dtype != torch.float8_e4m3fn:
        return "e8m0"
    return "float"


def check_expert_scales(w: ExpertWeights) -> None:
    """Raise ValueError naming the field when a scale holds NaN / inf (or the E8M0 NaN byte 255).

    Reads every scale tensor (a device sync on CUDA): call it when loading, not per forward.
    """
    if w.quant is None:
        return
    for name in SCALE_FIELDS:
        t = getattr(w, name)
        if t is not None:
            field = "scale_2" if name.endswith("_scale_2") else name
            check_scales(f"ExpertWeights.{name}", t, scale_kind(w.quant, name),
                         code_max=scale_code_max(w.quant.format, field))
