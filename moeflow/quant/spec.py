"""QuantSpec: how a set of expert weights is quantized (one spec, never a set of flags).

Legend: N output rows of one projection (2I for gate_up, H for down), K its input
(reduction) axis (H for gate_up, I for down), E experts.

Formats (the published layouts, `docs/experts.md` "Quantized experts"):

    "fp8_block"  DeepSeek-V3 style: float8_e4m3fn weights [N, K], one scale per block of
                 block = (bn, bk) = weight_block_size (128 x 128), stored as
                 `weight_scale_inv` float32 (or UE8M0 float8_e8m0fnu) [ceil(N/bn), ceil(K/bk)];
                 the stored "inv" value MULTIPLIES: W[i, j] = Wq[i, j] * s[i // bn, j // bk].
    "mxfp4"      OCP MX (gpt-oss): E2M1 pairs packed in uint8 (the LOW nibble is the even
                 element), one E8M0 exponent byte per 32 values along K (block = (1, 32)):
                 W = e2m1 * 2^(byte - 127).
    "nvfp4"      NVIDIA ModelOpt: E2M1 pairs packed in uint8 (low nibble even), one
                 float8_e4m3fn scale per 16 values along K (block = (1, 16)) and one float32
                 `weight_scale_2` per tensor that MULTIPLIES: W = e2m1 * weight_scale * weight_scale_2.

`quant_spec_from_hf(quantization_config)` reads a config.json `quantization_config`
(a dict or a transformers QuantizationConfigMixin) and refuses, naming the field, any
method or producer whose scale convention it cannot identify.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

FORMATS: tuple[str, ...] = ("fp8_block", "mxfp4", "nvfp4")
ACTIVATION_SCHEMES: tuple[str, ...] = ("dynamic", "static", "none")

# The UE8M0 dtype exists on torch >= 2.7 (both the CPU 2.13 and the GPU 2.11 machines).
_E8M0 = getattr(torch, "float8_e8m0fnu", None)

# Per format: allowed block shapes (None: any positive pair), scale dtypes, weight storage
# dtype, values packed per stored element, activation schemes.
_RULES: dict[str, dict[str, Any]] = {
    "fp8_block": dict(block=None, scale_dtypes=(torch.float32,) + ((_E8M0,) if _E8M0 is not None else ()),
                      weight_dtype=torch.float8_e4m3fn, pack=1, schemes=("dynamic",)),
    "mxfp4": dict(block=(1, 32), scale_dtypes=(torch.uint8,), weight_dtype=torch.uint8, pack=2,
                  schemes=("none",)),
    "nvfp4": dict(block=(1, 16), scale_dtypes=(torch.float8_e4m3fn,), weight_dtype=torch.uint8, pack=2,
                  schemes=("static", "none")),
}


@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How the routed experts' weights are quantized.

    format:            "fp8_block" | "mxfp4" | "nvfp4".
    block:             (bn, bk): output rows x input columns covered by one scale.
                       fp8_block: weight_block_size (e.g. (128, 128)); mxfp4: (1, 32); nvfp4: (1, 16).
    scale_dtype:       dtype of the block scales as stored. fp8_block: torch.float32 or
                       torch.float8_e8m0fnu (UE8M0, 2^(byte - 127)); mxfp4: torch.uint8 (E8M0
                       bytes); nvfp4: torch.float8_e4m3fn.
    activation_scheme: how a kernel quantizes the activations: "dynamic" (fp8_block: per token
                       per bk channels, s = max|x| / 448, computed at run time; FP8 static
                       activation scales are not read), "static" (nvfp4: a stored per-tensor
                       `input_scale`), or "none" (weight-only: mxfp4 in gpt-oss, nvfp4 without
                       input scales). The reference experts ignore it (they run the dequantized
                       weights on unquantized activations).
    """

    format: str
    block: tuple[int, int]
    scale_dtype: torch.dtype
    activation_scheme: str

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"QuantSpec.format={self.format!r}: expected one of {FORMATS}")
        rules = _RULES[self.format]
        b = self.block
        if (not isinstance(b, tuple) or len(b) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in b)):
            raise ValueError(f"QuantSpec.block={b!r}: expected a tuple of two ints >= 1")
        if rules["block"] is not None and b != rules["block"]:
            raise ValueError(f"QuantSpec.block={b!r}: format {self.format!r} expects {rules['block']}")
        if self.scale_dtype not in rules["scale_dtypes"]:
            raise ValueError(
                f"QuantSpec.scale_dtype={self.scale_dtype}: format {self.format!r} expects one of "
                f"{tuple(str(d) for d in rules['scale_dtypes'])}"
            )
        if self.activation_scheme not in rules["schemes"]:
            raise ValueError(
                f"QuantSpec.activation_scheme={self.activation_scheme!r}: format {self.format!r} expects "
                f"one of {rules['schemes']}"
            )

    @property
    def weight_dtype(self) -> torch.dtype:
        """Storage dtype of the quantized weight tensor (float8_e4m3fn, or uint8 for packed FP4)."""
        return _RULES[self.format]["weight_dtype"]

    @property
    def pack(self) -> int:
        """Values per stored element along K (2 for the FP4 formats, 1 for FP8)."""
        return _RULES[self.format]["pack"]

    @property
    def has_global_scale(self) -> bool:
        """The format carries a per-tensor second-level scale (nvfp4 `weight_scale_2`)."""
        return self.format == "nvfp4"

    def scale_grid(self, n: int, k: int) -> tuple[int, int]:
        """Shape of the block-scale grid of one [n, k] weight: (ceil(n / bn), ceil(k / bk))."""
        bn, bk = self.block
        return (-(-n // bn), -(-k // bk))


def fp8_block_spec(block: tuple[int, int] = (128, 128), *, ue8m0: bool = False,
                   activation_scheme: str = "dynamic") -> QuantSpec:
    """The DeepSeek-style FP8 block spec (float32 scales, or UE8M0 with ue8m0=True)."""
    if ue8m0 and _E8M0 is None:
        raise ValueError("fp8_block_spec(ue8m0=True): this torch has no float8_e8m0fnu")
    return QuantSpec(format="fp8_block", block=tuple(block), scale_dtype=_E8M0 if ue8m0 else torch.float32,
                     activation_scheme=activation_scheme)


MXFP4 = QuantSpec(format="mxfp4", block=(1, 32), scale_dtype=torch.uint8, activation_scheme="none")
NVFP4 = QuantSpec(format="nvfp4", block=(1, 16), scale_dtype=torch.float8_e4m3fn, activation_scheme="static")


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _int_field(name: str, value: Any) -> int:
    """An integer config value (an int, or a float with an integral value), never truncated."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"quantization_config.{name}={value!r}: expected an int, got {type(value).__name__}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"quantization_config.{name}={value!r}: expected an int (not truncated)")
    return int(value)


def quant_spec_from_hf(quantization_config: Any) -> QuantSpec | None:
    """The QuantSpec of a Hugging Face `quantization_config` (config.json dict or QuantizationConfigMixin).

    None gives None (an unquantized checkpoint). Recognised:
        quant_method "fp8"       FineGrainedFP8Config: fmt "e4m3", weight_block_size [bn, bk] (a per-tensor
                                 block None is refused), scale_fmt "float" | "ue8m0",
                                 activation_scheme "dynamic" ("static" is refused).
        quant_method "mxfp4"     gpt-oss MXFP4 (weight-only).
        quant_method "modelopt"  NVIDIA ModelOpt with quant_algo "NVFP4" (flat, or nested under
                                 "quantization" as in hf_quant_config.json), group_size 16.

    Raises ValueError naming the field, the value and what was expected, for an unknown
    quant_method and for producers whose scale convention differs from the published
    layouts above (compressed-tensors NVFP4 stores `weight_global_scale`, the DIVISOR;
    transformers' own "nvfp4" method is not serializable).
    """
    if quantization_config is None:
        return None
    if hasattr(quantization_config, "to_dict") and not isinstance(quantization_config, Mapping):
        quantization_config = quantization_config.to_dict()
    if not isinstance(quantization_config, Mapping):
        raise TypeError(
            f"quantization_config: expected a dict or a transformers QuantizationConfigMixin, got "
            f"{type(quantization_config).__name__}"
        )
    method = _get(quantization_config, "quant_method")
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method == "fp8":
        fmt = _get(quantization_config, "fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"quantization_config.fmt={fmt!r}: expected 'e4m3' (float8_e4m3fn weights)")
        block = _get(quantization_config, "weight_block_size")
        if block is None:
            raise ValueError("quantization_config.weight_block_size=None: per-tensor FP8 is not read; "
                             "expected a block size [bn, bk] such as [128, 128]")
        if not isinstance(block, (list, tuple)) or len(block) != 2:
            raise ValueError(f"quantization_config.weight_block_size={block!r}: expected [bn, bk]")
        scale_fmt = _get(quantization_config, "scale_fmt", "float") or "float"
        if scale_fmt not in ("float", "ue8m0"):
            raise ValueError(f"quantization_config.scale_fmt={scale_fmt!r}: expected 'float' or 'ue8m0'")
        expert_dtype = _get(quantization_config, "expert_dtype", "fp8") or "fp8"
        if expert_dtype != "fp8":
            raise ValueError(f"quantization_config.expert_dtype={expert_dtype!r}: expected 'fp8' "
                             "(DeepSeek-V4 FP4-packed experts are not read)")
        scheme = str(_get(quantization_config, "activation_scheme", "dynamic")).lower()
        block = tuple(_int_field(f"weight_block_size[{i}]", v) for i, v in enumerate(block))
        return fp8_block_spec(block, ue8m0=scale_fmt == "ue8m0", activation_scheme=scheme)
    if method == "mxfp4":
        return MXFP4
    if method == "modelopt":
        nested = _get(quantization_config, "quantization")
        src = nested if isinstance(nested, Mapping) else quantization_config
        algo = _get(src, "quant_algo")
        if algo != "NVFP4":
            raise ValueError(f"quantization_config.quant_algo={algo!r}: expected 'NVFP4' (ModelOpt FP8 and "
                             "NVFP4_AWQ, which adds pre_quant_scale, are not read)")
        group = _get(src, "group_size", 16)
        if group is not None and _int_field("group_size", group) != 16:
            raise ValueError(f"quantization_config.group_size={group!r}: expected 16 for NVFP4")
        return NVFP4
    if method == "compressed-tensors":
        raise ValueError(
            "quantization_config.quant_method='compressed-tensors': not read (its NVFP4 stores "
            "weight_packed and weight_global_scale, the divisor of the ModelOpt weight_scale_2); "
            "expected 'fp8', 'mxfp4' or 'modelopt'"
        )
    if method == "nvfp4":
        raise ValueError(
            "quantization_config.quant_method='nvfp4': transformers' on-the-fly NVFP4 is not serializable "
            "(swizzled weight_sf buffers); expected 'fp8', 'mxfp4' or 'modelopt' (ModelOpt NVFP4 checkpoints)"
        )
    raise ValueError(
        f"quantization_config.quant_method={method!r}: unknown, expected one of 'fp8', 'mxfp4', 'modelopt'"
    )
