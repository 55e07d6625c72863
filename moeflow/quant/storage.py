"""Quantized `ExpertWeights` storage: the shape / dtype rules and the stored tensors in moeflow's layout.

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

This module sits below `moeflow.config` (it takes an ExpertWeights, never builds one):
`ExpertWeights.__post_init__` checks quantized storage with `check_quantized`, and
`ExpertWeights.dequantize` wraps `dequantized_tensors`. moeflow.quant.experts (the quantizer,
scale value checks) builds ExpertWeights on top of moeflow.config.
"""

from __future__ import annotations

from typing import Any

import torch

from ..weight_checks import check_expert_biases
from .formats import dequantize_fp8_block, dequantize_mxfp4, dequantize_nvfp4
from .spec import QuantSpec

__all__ = ["SCALE_FIELDS", "check_quantized", "dequantized_tensors", "expected_scale_shapes"]

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


def check_quantized(w: Any) -> tuple[int, int, int]:
    """Validate a quantized ExpertWeights' shapes, dtypes and devices; return (E, H, I).

    Raises TypeError / ValueError naming the field, what it is and what was expected.
    Reads no tensor data (scale values are checked by `check_expert_scales`).
    """
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


def dequantized_tensors(w: Any, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(gate_up, down, gate_up_bias, down_bias) of a quantized ExpertWeights `w`, plain `dtype` tensors in `w.layout`.

    Values computed in f32 from the scales (bit-exact contract per format: `moeflow.quant.formats`);
    biases cast to `dtype`. `ExpertWeights.dequantize` wraps them in an ExpertWeights.
    """
    spec = w.quant
    if spec is None:
        raise ValueError("dequantized_tensors: w.quant is None (the weights are not quantized)")
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

    return _to_layout(gate_up, w.layout), _to_layout(down, w.layout), cast(w.gate_up_bias), cast(w.down_bias)
