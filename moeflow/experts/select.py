"""Choosing an experts implementation: a pure function of (config, device, T, requested).

Legend: T tokens in the call, K picks per token, H hidden, I intermediate size.

Registered names:
    "reference"  ReferenceExperts: loop over experts (the oracle).
    "grouped"    GroupedExperts: grouped GEMM over rows sorted by expert; for small T
                 (T * K <= BMM_MAX_PAIRS and the gathered weights small) the per-row
                 bmm path.
    "triton"     `moeflow.experts.triton` when it imports (Triton installed): the
                 module's `TritonExperts` class (or an `IMPL` instance). Imported lazily;
                 an ImportError leaves it unregistered.
    "triton_quant", "triton_quant_bi"
                 `moeflow.experts.triton_quant.TritonQuantExperts` (quantized weights:
                 fp8_block, mxfp4, nvfp4; "_bi" its batch-invariant mode), registered the same way.

"auto": "triton" on CUDA when it is available and its `supports(config)` accepts,
else "grouped". A requested name that is unknown, refused by `supports(config)`, or
not built for the device raises ValueError carrying the reason.

Quantized weights (`quant=` a moeflow.quant.QuantSpec): only an impl whose
`quant_formats` attribute names the format runs them ("reference" runs every format);
"auto" takes the first of triton_quant (CUDA), triton (CUDA), reference that does.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..config import MoEConfig
from .grouped import GroupedExperts
from .reference import ReferenceExperts

# The per-row bmm path copies one expert's weights per row, so it is only worth it
# for a few rows (decode); a starting point, to be replaced by measured tuning data.
BMM_MAX_PAIRS = 16
# Upper bound on the bytes of weights the bmm path gathers (counted at 4 bytes an
# element: select has no dtype): beyond it the grouped GEMM runs whatever T is.
BMM_MAX_GATHER_BYTES = 64 << 20

_REFERENCE = ReferenceExperts()
_GROUPED = GroupedExperts(path="grouped_mm")
_GROUPED_BMM = GroupedExperts(path="bmm")


@functools.lru_cache(maxsize=16)
def _triton_impl(options=None):
    """The Triton experts impl (with these KernelOptions; None: the defaults), or None when
    moeflow.experts.triton (or Triton) does not import."""
    try:
        mod = importlib.import_module("moeflow.experts.triton")
    except ImportError:
        return None
    return mod.IMPL if options is None else mod.TritonExperts(options=options)


@functools.lru_cache(maxsize=16)
def _triton_bi_impl(options=None):
    """The Triton impl in batch-invariant mode (one fixed reduction order for every T), or None."""
    if _triton_impl() is None:
        return None
    from .triton import TritonExperts

    return TritonExperts(batch_invariant=True, options=options)


@functools.lru_cache(maxsize=16)
def _triton_quant_impl(batch_invariant: bool = False, options=None):
    """The quantized-weights Triton impl (batch-invariant mode or not), or None when it does not import."""
    try:
        mod = importlib.import_module("moeflow.experts.triton_quant")
    except ImportError:
        return None
    return mod.TritonQuantExperts(batch_invariant=batch_invariant, options=options)


def available_impls() -> tuple[str, ...]:
    """Names get_impl accepts in this environment."""
    names = ("reference", "grouped")
    names += ("triton", "triton_bi") if _triton_impl() is not None else ()
    return names + (("triton_quant", "triton_quant_bi") if _triton_quant_impl() is not None else ())


def get_impl(name: str, options=None):
    """The implementation registered under `name` ("reference", "grouped", "triton", "triton_bi").

    options: a moeflow.experts.options.KernelOptions for the Triton impls (None: the defaults).

    "triton_bi" is the Triton impl in batch-invariant mode: a token's output bits do
    not depend on the batch it runs in.

    "grouped" is its grouped-GEMM path; `select_experts_impl` also picks its bmm path.
    """
    if name == "reference":
        return _REFERENCE
    if name == "grouped":
        return _GROUPED
    if name in ("triton", "triton_bi"):
        impl = _triton_impl(options) if name == "triton" else _triton_bi_impl(options)
        if impl is None:
            raise ValueError(
                f"experts impl {name!r}: unavailable (moeflow.experts.triton or the triton package does not import)"
            )
        return impl
    if name in ("triton_quant", "triton_quant_bi"):
        impl = _triton_quant_impl(name == "triton_quant_bi", options)
        if impl is None:
            raise ValueError(f"experts impl {name!r}: unavailable (moeflow.experts.triton_quant does not import)")
        return impl
    raise ValueError(f"experts impl {name!r}: unknown, expected one of {available_impls()} or 'auto'")


def _device_ok(impl, device: torch.device) -> tuple[bool, str]:
    # A Triton impl that does not declare its device types is taken to be CUDA-only.
    default = ("cuda",) if str(getattr(impl, "name", "")).startswith("triton") else None
    types = getattr(impl, "device_types", default)
    if types is None or device.type in types:
        return True, ""
    return False, f"runs on device types {tuple(types)}, not {device.type!r}"


def _grouped_for(config: MoEConfig, T: int) -> GroupedExperts:
    pairs = T * config.top_k
    gather_bytes = pairs * 3 * config.intermediate_size * config.hidden_size * 4
    if pairs <= BMM_MAX_PAIRS and gather_bytes <= BMM_MAX_GATHER_BYTES:
        return _GROUPED_BMM
    return _GROUPED


def _quant_ok(impl, quant) -> tuple[bool, str]:
    formats = tuple(getattr(impl, "quant_formats", ()))
    if quant is None:
        return True, ""
    if quant.format in formats:
        # an impl may refuse a spec of a format it runs (e.g. an fp8 block size it has no tile for)
        check = getattr(impl, "supports_quant", None)
        ok, why = check(quant) if check is not None else (True, "")
        return (True, "") if ok else (False, why)
    return False, (f"it cannot run quantized weights of format {quant.format!r} (its quant_formats: {formats}); "
                   f"'reference' runs them on the dequantized weights")


def select_experts_impl(config: MoEConfig, device: torch.device | str, T: int, requested: str = "auto", *,
                        quant=None, options=None):
    """The experts implementation to run `config` on `device` for a call of T tokens.

    Pure: the same arguments give the same object (no state is read or written
    besides the one-time lazy import of the Triton module).

    Args:
        config: the layer's MoEConfig.
        device: where the experts' tensors live.
        T: tokens in the call (>= 0); picks the grouped impl's bmm path for small T.
        requested: "auto" or a registered name.
        quant: the weights' moeflow.quant.QuantSpec (ExpertWeights.quant), None for plain weights.
        options: a moeflow.experts.options.KernelOptions for the Triton impls (None: the defaults).

    Raises:
        ValueError: unknown name, or the named impl refuses the config or device
            (the message carries its reason).
    """
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected MoEConfig, got {type(config).__name__}")
    if isinstance(T, bool) or not isinstance(T, int) or T < 0:
        raise ValueError(f"T={T!r}: expected an int >= 0")
    if not isinstance(requested, str):
        raise TypeError(f"requested: expected a str, got {type(requested).__name__}")
    device = torch.device(device)
    if quant is not None:
        from ..quant.spec import QuantSpec

        if not isinstance(quant, QuantSpec):
            raise TypeError(f"quant: expected a QuantSpec or None, got {type(quant).__name__}")
        if requested == "auto":
            triton = _triton_impl(options) if device.type == "cuda" else None
            triton_quant = _triton_quant_impl(False, options) if device.type == "cuda" else None
            for impl in (triton_quant, triton, _REFERENCE):
                if (impl is not None and _quant_ok(impl, quant)[0] and impl.supports(config)[0]
                        and _device_ok(impl, device)[0]):
                    return impl
    if requested == "auto":
        if device.type == "cuda":
            impl = _triton_impl(options)
            if impl is not None and impl.supports(config)[0] and _device_ok(impl, device)[0]:
                return impl
        return _grouped_for(config, T)
    impl = get_impl(requested, options)
    ok, reason = impl.supports(config)
    if not ok:
        raise ValueError(f"experts impl {requested!r} refuses this config: {reason}")
    ok, reason = _device_ok(impl, device)
    if not ok:
        raise ValueError(f"experts impl {requested!r} refuses device {device}: {reason}")
    ok, reason = _quant_ok(impl, quant)
    if not ok:
        raise ValueError(f"experts impl {requested!r} refuses these weights: {reason}")
    if requested == "grouped":
        return _grouped_for(config, T)
    return impl
