"""Read a transformers 5 quantized experts module's tensors into a quantized ExpertWeights.

Legend: E experts, H hidden, I intermediate per expert, bn x bk the FP8 block.

Classes read (transformers 5.17 - 5.24; attribute names checked against the installed code):

    transformers.integrations.finegrained_fp8.FP8Experts  (quant_method "fp8": DeepSeek-V3, Qwen3 FP8, ...)
        gate_up_proj            float8_e4m3fn [E, 2I, H]    (has_gate=True; F.linear form, gate/up halves)
        gate_up_proj_scale_inv  float32 | float8_e8m0fnu [E, max(ceil(2I/bn), 2), ceil(H/bk)]
        down_proj               float8_e4m3fn [E, H, I]
        down_proj_scale_inv     [E, ceil(H/bn), ceil(I/bk)]
        block_size (bn, bk), activation_scheme "dynamic" | "static", has_gate, has_bias (False)
      -> read in place (the ExpertWeights holds views of the module's parameters).

    transformers.integrations.mxfp4.Mxfp4GptOssExperts  (quant_method "mxfp4": gpt-oss)
        gate_up_proj / down_proj                  triton_kernels Tensors (packed E2M1 in a
                                                  hardware-swizzled layout, GPU only)
        gate_up_proj_precision_config.weight_scale / down_proj_precision_config.weight_scale
                                                  triton_kernels Tensors of the E8M0 scales
        gate_up_proj_bias f32 [E, 2I], down_proj_bias f32 [E, H]
      -> read through each tensor's `storage.layout.unswizzle_data(storage.data)`, as
         transformers' own Mxfp4ReverseDeserialize does: a COPY (a swizzled layout has no view
         in [E, N, K/2] form), in the checkpoint's [E, 2I, H/2] + [E, 2I, H/32] form. While the
         module still holds plain uint8 parameters (before its weights were swizzled) there are
         no scales to read, and this refuses.
"""

from __future__ import annotations

from typing import Any

import torch

from .spec import MXFP4, fp8_block_spec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unswizzle(t: Any, what: str) -> torch.Tensor:
    """A triton_kernels Tensor's data in its logical (unswizzled) layout, transposed back to [.., N, K]."""
    storage = getattr(t, "storage", None)
    layout = getattr(storage, "layout", None)
    if layout is None or not hasattr(layout, "unswizzle_data"):
        raise TypeError(f"{what}: a {type(t).__name__}, expected a triton_kernels Tensor (storage.layout."
                        "unswizzle_data), as Mxfp4GptOssExperts holds after loading")
    # Mxfp4ReverseDeserialize: unswizzle, then swap the last two dims back to the checkpoint's order.
    return layout.unswizzle_data(storage.data).transpose(-1, -2)


def _fp8_experts(module: Any):
    from ..config import ExpertWeights

    name = type(module).__name__
    if not getattr(module, "has_gate", True):
        raise ValueError(f"{name}.has_gate=False: an ungated up_proj expert has no moeflow layout; expected "
                         "fused gate_up_proj")
    if getattr(module, "has_bias", False):
        raise ValueError(f"{name}.has_bias=True: FP8 experts with biases are not read")
    block = getattr(module, "block_size", None)
    if block is None:
        raise ValueError(f"{name}.block_size=None: per-tensor FP8 is not read; expected a block size (bn, bk)")
    scheme = getattr(module, "activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{name}.activation_scheme={scheme!r}: static activation scales are not read; "
                         "expected 'dynamic'")
    gu, s_gu = module.gate_up_proj, module.gate_up_proj_scale_inv
    dn, s_dn = module.down_proj, module.down_proj_scale_inv
    if gu.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}.gate_up_proj: dtype {gu.dtype}, expected torch.float8_e4m3fn (expert_dtype "
                        "'fp4' experts are not read)")
    spec = fp8_block_spec(tuple(int(b) for b in block), ue8m0=s_gu.dtype != torch.float32)
    bn = spec.block[0]
    I = int(gu.shape[1]) // 2
    # moeflow's gate_up grid is gate's then up's (2 * ceil(I / bn) rows); FP8Experts allocates
    # max(ceil(2I / bn), 2), the same number whenever I % bn == 0 or I < bn.
    if int(s_gu.shape[1]) != 2 * _cdiv(I, bn):
        raise ValueError(
            f"{name}.gate_up_proj_scale_inv: shape {tuple(s_gu.shape)}, expected {2 * _cdiv(I, bn)} block rows "
            f"(gate's ceil(I/bn) then up's, I={I}, bn={bn}): a block straddles the gate/up boundary"
        )
    return ExpertWeights(gu.detach(), dn.detach(), layout="linear", interleaved=False, quant=spec,
                         gate_up_scale=s_gu.detach(), down_scale=s_dn.detach())


def _mxfp4_experts(module: Any):
    from ..config import ExpertWeights

    name = type(module).__name__
    E, I, H = int(module.num_experts), int(module.intermediate_size), int(module.hidden_size)
    out = {}
    for proj, (n, k) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
        pc = getattr(module, f"{proj}_precision_config", None)
        if pc is None:
            raise ValueError(f"{name}.{proj}_precision_config=None: the module holds no MXFP4 scales yet "
                             "(weights not loaded); expected a loaded Mxfp4GptOssExperts")
        blocks = _unswizzle(getattr(module, proj), f"{name}.{proj}")
        scales = _unswizzle(pc.weight_scale, f"{name}.{proj}_precision_config.weight_scale")
        out[proj] = (blocks.reshape(E, n, k // 2).contiguous().to(torch.uint8),
                     scales.reshape(E, n, k // 32).contiguous().to(torch.uint8))
    (gu, s_gu), (dn, s_dn) = out["gate_up_proj"], out["down_proj"]
    return ExpertWeights(gu, dn, module.gate_up_proj_bias.detach(), module.down_proj_bias.detach(),
                         layout="matmul", interleaved=True, quant=MXFP4, gate_up_scale=s_gu, down_scale=s_dn)


def experts_from_hf_module(module: Any):
    """A quantized moeflow ExpertWeights from a transformers quantized experts module.

    Reads `FP8Experts` (in place: views of its parameters) and `Mxfp4GptOssExperts`
    (unswizzled copies); see the module docstring for the attributes read. The result's
    `quant` is the module's QuantSpec; `dequantize(dtype)` gives the plain weights in the
    family's moeflow layout ("linear" for FP8Experts, "matmul" + interleaved for gpt-oss).

    Raises TypeError for another module class, ValueError (naming the attribute) for a
    configuration with no moeflow form (per-tensor FP8, static activation scales, no gate).
    """
    cls = type(module).__name__
    if cls == "FP8Experts" or (hasattr(module, "gate_up_proj_scale_inv") and hasattr(module, "down_proj_scale_inv")):
        return _fp8_experts(module)
    if cls == "Mxfp4GptOssExperts" or hasattr(module, "gate_up_proj_precision_config"):
        return _mxfp4_experts(module)
    raise TypeError(f"experts_from_hf_module: {cls} is not a transformers quantized experts module "
                    "(expected FP8Experts or Mxfp4GptOssExperts)")
