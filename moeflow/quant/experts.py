"""Quantized `ExpertWeights`: shape rules, dequantization to moeflow's layout, our quantizer, scale checks.

Legend: E experts, H hidden, I intermediate per expert, N output rows, K input columns,
P values packed per stored element (2 for the FP4 formats, 1 for FP8), bn x bk the FP8 block.

A quantized ExpertWeights (`w.quant` set) stores each projection as its checkpoints do,
[E, N, K / P] with the scales blocking the K (input) axis, whatever `w.layout` says;
`layout` names the form `dequantize` returns (and the MoEConfig expects):

    tensor               fp8_block                      mxfp4               nvfp4
    gate_up [E, 2I, H/P] float8_e4m3fn                  uint8 (2 codes/B)   uint8 (2 codes/B)
    down    [E, H, I/P]  float8_e4m3fn                  uint8               uint8
    gate_up_scale        [E, 2*ceil(I/bn), ceil(H/bk)]  [E, 2I, H/32] u8    [E, 2I, H/16] e4m3
    down_scale           [E, ceil(H/bn), ceil(I/bk)]    [E, H, I/32] u8     [E, H, I/16] e4m3
    gate_up_scale_2      -                              -                   [E, 2] f32 (gate, up)
    down_scale_2         -                              -                   [E] f32
    gate_up_input_scale  -                              -                   [E, 2] f32 or None
    down_input_scale     -                              -                   [E] f32 or None

The fp8_block gate_up grid holds gate's grid (ceil(I/bn) rows) then up's: what
concatenating the per-expert `gate_proj` / `up_proj` scales gives and what transformers'
FP8Experts allocates; it equals the single grid ceil(2I/bn) of the fused tensor when
I % bn == 0 (every released checkpoint). nvfp4 likewise scales gate and up with their
own `weight_scale_2` (and input_scale). Interleaved gate/up (gpt-oss) is MXFP4-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .formats import (
    check_scales,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
)
from .spec import QuantSpec

if TYPE_CHECKING:
    from ..config import ExpertWeights

# Every quantization tensor field of ExpertWeights, in one place.
SCALE_FIELDS: tuple[str, ...] = ("gate_up_scale", "down_scale", "gate_up_scale_2", "down_scale_2",
                                 "gate_up_input_scale", "down_input_scale")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expected_scale_shapes(spec: QuantSpec, E: int, H: int, I: int) -> dict[str, tuple[int, ...] | None]:
    """Shape of each scale field for E experts of sizes H, I under `spec` (None: must be absent)."""
    bn, bk = spec.block
    if spec.format == "fp8_block":
        return {"gate_up_scale": (E, 2 * _cdiv(I, bn), _cdiv(H, bk)), "down_scale": (E, _cdiv(H, bn), _cdiv(I, bk)),
                "gate_up_scale_2": None, "down_scale_2": None, "gate_up_input_scale": None,
                "down_input_scale": None}
    if spec.format == "mxfp4":
        return {"gate_up_scale": (E, 2 * I, H // 32), "down_scale": (E, H, I // 32), "gate_up_scale_2": None,
                "down_scale_2": None, "gate_up_input_scale": None, "down_input_scale": None}
    return {"gate_up_scale": (E, 2 * I, H // 16), "down_scale": (E, H, I // 16), "gate_up_scale_2": (E, 2),
            "down_scale_2": (E,), "gate_up_input_scale": (E, 2), "down_input_scale": (E,)}


def check_quantized(w: ExpertWeights) -> tuple[int, int, int]:
    """Validate a quantized ExpertWeights' shapes, dtypes and devices; return (E, H, I).

    Raises TypeError / ValueError naming the field, what it is and what was expected.
    Reads no tensor data (scale values are checked by `check_expert_scales`).
    """
    from ..config import check_expert_biases

    spec = w.quant
    if spec is None:
        given = [n for n in SCALE_FIELDS if getattr(w, n) is not None]
        raise ValueError(f"ExpertWeights.{given[0]}: given without ExpertWeights.quant (a QuantSpec)")
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"ExpertWeights.quant: expected a QuantSpec or None, got {type(spec).__name__}")
    for name in ("gate_up", "down"):
        t = getattr(w, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ExpertWeights.{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"ExpertWeights.{name}: shape {tuple(t.shape)}, expected a 3-D tensor [E, N, K/P] "
                             f"({spec.format} stores [E, out, in])")
        if t.dtype != spec.weight_dtype:
            raise TypeError(f"ExpertWeights.{name}: dtype {t.dtype}, expected {spec.weight_dtype} for "
                            f"quant format {spec.format!r}")
    if w.interleaved and spec.format != "mxfp4":
        raise ValueError(f"ExpertWeights.interleaved=True: quant format {spec.format!r} has no published "
                         "interleaved gate/up layout (only 'mxfp4', gpt-oss)")
    gu, dn, P = w.gate_up, w.down, spec.pack
    E, two_i, H = int(gu.shape[0]), int(gu.shape[1]), int(gu.shape[2]) * P
    if two_i % 2 or two_i == 0:
        raise ValueError(f"ExpertWeights.gate_up: shape {tuple(gu.shape)} has an odd or empty 2I axis ({two_i}); "
                         f"{spec.format} stores gate_up [E, 2I, H/{P}]")
    I = two_i // 2
    if I % P:
        raise ValueError(f"ExpertWeights.gate_up: I={I} is odd; {spec.format} packs {P} values a byte along I in down")
    want_down = (E, H, I // P)
    if tuple(dn.shape) != want_down:
        raise ValueError(f"ExpertWeights.down: shape {tuple(dn.shape)}, expected {want_down} to match gate_up "
                         f"{tuple(gu.shape)} ({spec.format} stores gate_up [E, 2I, H/{P}], down [E, H, I/{P}])")
    for axis, size in (("H", H), ("I", I)):
        group = {"mxfp4": 32, "nvfp4": 16}.get(spec.format)
        if group is not None and size % group:
            raise ValueError(f"ExpertWeights: {axis}={size} is not a multiple of {group}, the {spec.format} block")
    for name, want in expected_scale_shapes(spec, E, H, I).items():
        t = getattr(w, name)
        optional = name.endswith("input_scale")
        if want is None or (optional and t is None):
            if t is not None:
                raise ValueError(f"ExpertWeights.{name}: given, but quant format {spec.format!r} has no such tensor")
            continue
        if t is None:
            raise ValueError(f"ExpertWeights.{name}: missing, quant format {spec.format!r} needs {want}")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ExpertWeights.{name}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != want:
            raise ValueError(f"ExpertWeights.{name}: shape {tuple(t.shape)}, expected {want} for {spec.format} "
                             f"block {spec.block} (E={E}, H={H}, I={I})")
        want_dtype = spec.scale_dtype if name in ("gate_up_scale", "down_scale") else torch.float32
        if t.dtype != want_dtype:
            raise TypeError(f"ExpertWeights.{name}: dtype {t.dtype}, expected {want_dtype}")
    if (w.gate_up_input_scale is None) != (w.down_input_scale is None):
        raise ValueError("ExpertWeights.gate_up_input_scale/down_input_scale: give both or neither")
    check_expert_biases(w, E, H, I)
    if (w.gate_up_bias is None) != (w.down_bias is None):
        raise ValueError("ExpertWeights.gate_up_bias/down_bias: give both or neither")
    if w.gate_up_bias is not None and w.gate_up_bias.dtype != w.down_bias.dtype:
        raise TypeError(f"ExpertWeights.down_bias: dtype {w.down_bias.dtype}, expected gate_up_bias's "
                        f"{w.gate_up_bias.dtype}")
    for name in ("down", "gate_up_bias", "down_bias", *SCALE_FIELDS):
        t = getattr(w, name)
        if t is not None and t.device != gu.device:
            raise ValueError(f"ExpertWeights.{name}: on {t.device}, expected gate_up's device {gu.device}")
    return E, H, I


def _to_layout(t_ENK: torch.Tensor, layout: str) -> torch.Tensor:
    # Quantized tensors are [E, out, in]; layout "matmul" keeps [E, in, out] (a contiguous copy,
    # so that the result is laid out like the model's own parameters).
    return t_ENK.transpose(1, 2).contiguous() if layout == "matmul" else t_ENK


def dequantize_experts(w: ExpertWeights, dtype: torch.dtype) -> ExpertWeights:
    """A plain ExpertWeights of `dtype` in moeflow's layout (`w.layout`), values computed in f32.

    Biases are cast to `dtype`. Bit-exact contract per format: `moeflow.quant.formats`.
    """
    from ..config import ExpertWeights

    spec = w.quant
    if spec is None:
        raise ValueError("dequantize_experts: w.quant is None (the weights are not quantized)")
    I = w.intermediate_size
    gu, dn = w.gate_up, w.down
    if spec.format == "fp8_block":
        g_rows = _cdiv(I, spec.block[0])
        s = w.gate_up_scale
        gate_up = torch.cat((dequantize_fp8_block(gu[:, :I], s[:, :g_rows], spec.block, dtype),
                             dequantize_fp8_block(gu[:, I:], s[:, g_rows:], spec.block, dtype)), dim=1)
        down = dequantize_fp8_block(dn, w.down_scale, spec.block, dtype)
    elif spec.format == "mxfp4":
        gate_up = dequantize_mxfp4(gu, w.gate_up_scale, dtype)
        down = dequantize_mxfp4(dn, w.down_scale, dtype)
    else:
        s, s2 = w.gate_up_scale, w.gate_up_scale_2
        gate_up = torch.cat((dequantize_nvfp4(gu[:, :I], s[:, :I], s2[:, 0].contiguous(), dtype),
                             dequantize_nvfp4(gu[:, I:], s[:, I:], s2[:, 1].contiguous(), dtype)), dim=1)
        down = dequantize_nvfp4(dn, w.down_scale, w.down_scale_2, dtype)

    def cast(b: torch.Tensor | None) -> torch.Tensor | None:
        return None if b is None else b.to(dtype)

    return ExpertWeights(_to_layout(gate_up, w.layout), _to_layout(down, w.layout), cast(w.gate_up_bias),
                         cast(w.down_bias), layout=w.layout, interleaved=w.interleaved)


def quantize_experts(w: ExpertWeights, spec: QuantSpec) -> ExpertWeights:
    """Our quantizer over a plain ExpertWeights (tests, tiny checkpoints): a quantized ExpertWeights.

    Round to nearest, deterministic (rules in `moeflow.quant.formats`); gate and up are
    quantized as two tensors (their own block grids / weight_scale_2), as per-expert
    checkpoints store them. Biases are kept as they are. No input scales are made.
    """
    from ..config import ExpertWeights

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
            check_scales(f"ExpertWeights.{name}", t, scale_kind(w.quant, name))
