"""Quantized experts: FP8 block-scaled, MXFP4 and NVFP4 weights, carried by one QuantSpec.

    spec.py        QuantSpec, quant_spec_from_hf (config.json `quantization_config` -> spec)
    formats.py     per-tensor codecs: exact torch dequantizers, our round-to-nearest quantizers,
                   the FP8 dynamic activation quantizer the kernels follow, scale checks
    storage.py     the storage rules of a quantized ExpertWeights (shapes, dtypes) and its
                   stored tensors dequantized to moeflow's layout; below moeflow.config
    experts.py     quantized ExpertWeights: dequantize / quantize, scale value checks
    checkpoint.py  scale-key rules and reads for moeflow.checkpoint.loader
    hf.py          experts_from_hf_module: a transformers FP8 / MXFP4 experts module's tensors

Names resolve lazily (moeflow.config imports the spec and the storage rules; nothing heavier is loaded).
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "QuantSpec": "moeflow.quant.spec",
    "FORMATS": "moeflow.quant.spec",
    "MXFP4": "moeflow.quant.spec",
    "NVFP4": "moeflow.quant.spec",
    "fp8_block_spec": "moeflow.quant.spec",
    "quant_spec_from_hf": "moeflow.quant.spec",
    "dequantize_fp8_block": "moeflow.quant.formats",
    "dequantize_mxfp4": "moeflow.quant.formats",
    "dequantize_nvfp4": "moeflow.quant.formats",
    "quantize_fp8_block": "moeflow.quant.formats",
    "quantize_mxfp4": "moeflow.quant.formats",
    "quantize_nvfp4": "moeflow.quant.formats",
    "quantize_fp8_activations": "moeflow.quant.formats",
    "dequantize_experts": "moeflow.quant.experts",
    "quantize_experts": "moeflow.quant.experts",
    "check_expert_scales": "moeflow.quant.experts",
    "experts_from_hf_module": "moeflow.quant.hf",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports("moeflow.quant", globals(), _EXPORTS)
