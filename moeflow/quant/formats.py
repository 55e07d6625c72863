"""Per-tensor codecs of the quantized formats: exact torch dequantizers and our round-to-nearest quantizers.

Legend: N output rows, K input columns of one weight (`...` leading dims, e.g. E experts),
Kp = K / 2 packed bytes (FP4), bn x bk the FP8 block, T tokens, H channels.

Every dequantizer computes in float32 and returns the requested dtype:
    fp8_block  W = f32(Wq) * s            Wq e4m3 (exact in f32); s float32 (one rounding) or
                                          UE8M0 2^(b - 127) (exact, a power of two)
    mxfp4      W = e2m1 * 2^(b - 127)     exact in f32 (both factors are short), except that
                                          |e2m1| >= 2 with b = 254 overflows to +-inf
    nvfp4      W = (e2m1 * s8) * s2       e2m1 * s8 is exact in f32 (2 x 4 significant bits);
                                          one rounding multiplying by the f32 s2
then one cast to the requested dtype (round to nearest even). E8M0 byte 255 is NaN
(OCP MX v1.0): a block with that scale dequantizes to NaN; `check_scales` refuses it.

Quantizers (what the tests use to build quantized checkpoints; deterministic, round to
nearest, ties to even):
    fp8_block  s = amax_block / 448 (UE8M0: the next power of two >= it); Wq = e4m3(W / s)
    mxfp4      b = 127 + ceil(log2(amax_block / 6)) (so |W| / 2^(b-127) <= 6); codes = e2m1(W / 2^(b-127))
    nvfp4      s2 = amax_tensor / (6 * 448); s8 = e4m3(amax_block / (6 * s2)); codes = e2m1(W / (s8 * s2))
An all-zero block gets scale 1 (fp8_block, nvfp4 s8 and s2) or byte 127 (mxfp4), and a nonzero nvfp4
block at least the smallest e4m3 subnormal 2^-9: no quantizer writes a scale <= 0. Scale quotients by
the constants are the IEEE f32 division on every device (`div_by_const`), so CPU and CUDA produce
the same bytes, and quantize_fp8_activations the same numbers as the FP8 kernels (div_rn).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E4M3_MIN_SUBNORMAL = 2.0 ** -9
# The 16 E2M1 codes: bit 3 is the sign, bits 0-2 index 0, .5, 1, 1.5, 2, 3, 4, 6.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
E8M0_NAN = 255


def div_by_const(v: torch.Tensor, c: float) -> torch.Tensor:
    """f32 v / c correctly rounded (IEEE division) on every device: the scale rule `amax / 448` etc.

    Not `v / c`: PyTorch on CUDA computes a tensor divided by a Python scalar as v * fl(1 / c),
    which differs from the IEEE quotient in the last bit for about 55% of values (c = 448; every
    f32 checked). For FP8 activations that one bit decides how exact ties of bf16 values round
    (x / s lands on an e4m3 midpoint), so the GPU reference disagreed with the kernels' div_rn
    (rel-L2 ~1e-2). Computed in float64 and rounded once to float32: equal to the IEEE f32
    quotient for every f32 input and c in (448, 6, 2688), whether the device divides or multiplies
    by the float64 reciprocal (checked over all significands).
    """
    return (v.to(torch.float64) / c).to(torch.float32)


def _check_tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], dim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype}, expected {' or '.join(str(d) for d in dtypes)}")
    if dim is not None and t.dim() < dim:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected at least {dim} dims")
    return t


def _check_float_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"dtype={dtype}: expected a floating dtype of 16 bits or more (float32, bfloat16, ...)")


# ------------------------------------------------------------------------------ scalars


def e2m1_lut(device: torch.device | str = "cpu") -> torch.Tensor:
    """f32 [16]: the value of each E2M1 code (signed zero at code 8)."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., Kp] -> uint8 codes [..., 2 * Kp]: the LOW nibble is the even element."""
    _check_tensor("packed", packed, (torch.uint8,), 1)
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (0..15, K even) -> uint8 [..., K / 2], even element in the low nibble."""
    _check_tensor("codes", codes, (torch.uint8,), 1)
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: shape {tuple(codes.shape)}, expected an even last dim (two codes a byte)")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes: max {int(codes.max())}, expected 4-bit codes 0..15")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., Kp] -> f32 [..., 2 * Kp], the E2M1 values of the packed codes."""
    return e2m1_lut(packed.device)[unpack_fp4(packed).long()]


def e8m0_to_f32(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8 bytes or float8_e8m0fnu) -> f32 2^(b - 127); byte 255 -> NaN.

    Built from the f32 bit pattern (b << 23), so every value is exact, 2^-127 (byte 0,
    an f32 subnormal) included, and the result does not depend on an exp2 implementation.
    """
    dtypes = (torch.uint8,) + ((_E8M0,) if _E8M0 is not None else ())
    _check_tensor("scale", scale, dtypes)
    b = scale.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)  # 2^-127 = 0x00400000
    out = bits.view(torch.float32)
    return torch.where(b == E8M0_NAN, torch.full_like(out, float("nan")), out)


def f32_to_e8m0_ceil(v: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 byte of the smallest power of two >= v (v > 0 f32), clamped to [0, 254]; v <= 0 -> 127."""
    m, e = torch.frexp(v)  # v = m * 2^e, m in [0.5, 1)
    # ceil(log2 v) = e - 1 when v is a power of two (m == 0.5), else e.
    ceil_log2 = torch.where(m == 0.5, e - 1, e).to(torch.int32)
    b = (ceil_log2 + 127).clamp(0, 254)
    return torch.where(v > 0, b, torch.full_like(b, 127)).to(torch.uint8)


def quantize_e2m1(x: torch.Tensor) -> torch.Tensor:
    """f32 values -> uint8 E2M1 codes, round to nearest, ties to the even mantissa, saturating at +-6.

    The sign is kept (-0.1 -> code 8, -0.0). NaN is refused.
    """
    _check_tensor("x", x, (torch.float32,))
    if torch.isnan(x).any():
        raise ValueError("x: holds NaN, which E2M1 cannot encode")
    a = x.abs()
    # Midpoints between neighbouring magnitudes; at a tie the code with an even mantissa
    # (0, 1, 2, 4 are even codes 0, 2, 4, 6) wins: strict > before an even code, >= before an odd one.
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75)
            + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    return code | (torch.signbit(x).to(torch.uint8) << 3)


# ------------------------------------------------------------------------------ fp8 block


def _expand_blocks(s: torch.Tensor, n: int, k: int, bn: int, bk: int) -> torch.Tensor:
    """[..., ceil(n/bn), ceil(k/bk)] -> [..., n, k]: each scale repeated over its (possibly partial) block."""
    return s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def fp8_scale_to_f32(scale: torch.Tensor) -> torch.Tensor:
    """A fp8_block scale (float32, or UE8M0 float8_e8m0fnu) as f32."""
    if _E8M0 is not None and scale.dtype == _E8M0:
        return e8m0_to_f32(scale)
    return scale.to(torch.float32)


def dequantize_fp8_block(w_NK: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K] dtype: W[i, j] = f32(Wq[i, j]) * s[i // bn, j // bk] (partial edge blocks allowed).

    Args:
        w_NK: float8_e4m3fn [..., N, K].
        scale: float32 or float8_e8m0fnu [..., ceil(N/bn), ceil(K/bk)] (the stored `weight_scale_inv`).
        block: (bn, bk).
        dtype: result dtype (computed in f32, cast once).
    """
    _check_tensor("w_NK", w_NK, (torch.float8_e4m3fn,), 2)
    sdt = (torch.float32,) + ((_E8M0,) if _E8M0 is not None else ())
    _check_tensor("scale", scale, sdt, 2)
    _check_float_dtype(dtype)
    bn, bk = block
    n, k = w_NK.shape[-2:]
    want = (*w_NK.shape[:-2], -(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale: shape {tuple(scale.shape)}, expected {want} for weight {tuple(w_NK.shape)} "
                         f"with block {tuple(block)}")
    s = _expand_blocks(fp8_scale_to_f32(scale), n, k, bn, bk)
    return (w_NK.to(torch.float32) * s).to(dtype)


def quantize_fp8_block(w_NK: torch.Tensor, block: tuple[int, int] = (128, 128), *,
                       ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(Wq float8_e4m3fn [..., N, K], scale [..., ceil(N/bn), ceil(K/bk)] float32 or float8_e8m0fnu).

    s = amax(|W| over the block) / 448 (ue8m0: the smallest power of two >= that), 1 for an
    all-zero block; Wq = e4m3(clamp(W / s, +-448)), round to nearest even.
    """
    _check_tensor("w_NK", w_NK, (torch.float32, torch.bfloat16, torch.float16), 2)
    if ue8m0 and _E8M0 is None:
        raise ValueError("quantize_fp8_block(ue8m0=True): this torch has no float8_e8m0fnu")
    bn, bk = block
    w = w_NK.to(torch.float32)
    n, k = w.shape[-2:]
    gn, gk = -(-n // bn), -(-k // bk)
    # Pad to whole blocks with zeros (they do not change a block's amax).
    pad = torch.zeros((*w.shape[:-2], gn * bn, gk * bk), dtype=torch.float32, device=w.device)
    pad[..., :n, :k] = w
    amax = pad.unflatten(-1, (gk, bk)).unflatten(-3, (gn, bn)).abs().amax(dim=(-3, -1))
    if ue8m0:
        byte = f32_to_e8m0_ceil(div_by_const(amax, FP8_E4M3_MAX))
        byte = torch.where(amax > 0, byte, torch.full_like(byte, 127))
        scale = byte.view(_E8M0)
        s = e8m0_to_f32(byte)
    else:
        s = torch.where(amax > 0, div_by_const(amax, FP8_E4M3_MAX), torch.ones_like(amax))
        scale = s
    q = (w / _expand_blocks(s, n, k, bn, bk)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_activations(x_TH: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization (the reference the FP8 kernels follow), per token per `block` channels.

    Returns (xq float8_e4m3fn [T, H], s f32 [T, ceil(H / block)]) with s = max|x| / 448 over
    the group (1 for an all-zero group) and xq = e4m3(clamp(x / s, +-448)); x ~ xq * s. Both
    divisions are IEEE f32 (s correctly rounded, as the kernels' div_rn) on CPU and CUDA alike.
    """
    _check_tensor("x_TH", x_TH, (torch.float32, torch.bfloat16, torch.float16), 2)
    q, s = quantize_fp8_block(x_TH, (1, block))
    return q, s


# ------------------------------------------------------------------------------ mxfp4


def dequantize_mxfp4(packed_NKp: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K] dtype: W = e2m1 * 2^(scale - 127), 32 values per scale along K.

    Args:
        packed_NKp: uint8 [..., N, K/2], two E2M1 codes a byte (low nibble = even element).
        scale: uint8 E8M0 [..., N, K/32] (byte 255 = NaN).
        dtype: result dtype (computed in f32, cast once).
    """
    _check_tensor("packed_NKp", packed_NKp, (torch.uint8,), 2)
    _check_tensor("scale", scale, (torch.uint8,) + ((_E8M0,) if _E8M0 is not None else ()), 2)
    _check_float_dtype(dtype)
    n, kp = packed_NKp.shape[-2:]
    if kp % 16 or tuple(scale.shape) != (*packed_NKp.shape[:-1], kp // 16):
        raise ValueError(f"scale: shape {tuple(scale.shape)}, expected {(*packed_NKp.shape[:-1], kp // 16)} "
                         f"(one per 32 values) for packed {tuple(packed_NKp.shape)} (K = {2 * kp}, a multiple of 32)")
    v = e2m1_values(packed_NKp).unflatten(-1, (kp // 16, 32))
    return (v * e8m0_to_f32(scale).unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_mxfp4(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., N, K/2], scale uint8 E8M0 [..., N, K/32]) of W [..., N, K] (K % 32 == 0).

    b = 127 + ceil(log2(amax / 6)) per 32 values (127 for an all-zero block), clamped to
    [0, 254]; codes = e2m1(W / 2^(b - 127)), round to nearest even, saturating at 6.
    """
    _check_tensor("w_NK", w_NK, (torch.float32, torch.bfloat16, torch.float16), 2)
    k = w_NK.shape[-1]
    if k % 32:
        raise ValueError(f"w_NK: shape {tuple(w_NK.shape)}, expected K (last dim) a multiple of 32 for MXFP4")
    w = w_NK.to(torch.float32).unflatten(-1, (k // 32, 32))
    amax = w.abs().amax(dim=-1)
    byte = f32_to_e8m0_ceil(div_by_const(amax, E2M1_MAX))
    codes = quantize_e2m1(w / e8m0_to_f32(byte).unsqueeze(-1))
    return pack_fp4(codes.flatten(-2)), byte


# ------------------------------------------------------------------------------ nvfp4


def dequantize_nvfp4(packed_NKp: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K] dtype: W = (e2m1 * f32(scale)) * scale_2, 16 values per scale along K.

    Args:
        packed_NKp: uint8 [..., N, K/2] (low nibble = even element).
        scale: float8_e4m3fn [..., N, K/16] (ModelOpt `weight_scale`, unswizzled).
        scale_2: float32 [...] (one per leading index: ModelOpt `weight_scale_2`, which multiplies).
        dtype: result dtype (computed in f32, cast once).
    """
    _check_tensor("packed_NKp", packed_NKp, (torch.uint8,), 2)
    _check_tensor("scale", scale, (torch.float8_e4m3fn,), 2)
    _check_tensor("scale_2", scale_2, (torch.float32,))
    _check_float_dtype(dtype)
    kp = packed_NKp.shape[-1]
    lead = tuple(packed_NKp.shape[:-2])
    if kp % 8 or tuple(scale.shape) != (*packed_NKp.shape[:-1], kp // 8):
        raise ValueError(f"scale: shape {tuple(scale.shape)}, expected {(*packed_NKp.shape[:-1], kp // 8)} "
                         f"(one per 16 values) for packed {tuple(packed_NKp.shape)} (K = {2 * kp}, a multiple of 16)")
    if tuple(scale_2.shape) != lead:
        raise ValueError(f"scale_2: shape {tuple(scale_2.shape)}, expected {lead} (one per tensor)")
    v = e2m1_values(packed_NKp).unflatten(-1, (kp // 8, 16))
    w = (v * scale.to(torch.float32).unsqueeze(-1)).flatten(-2)
    return (w * scale_2[..., None, None]).to(dtype)


def quantize_nvfp4(w_NK: torch.Tensor, scale_2: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [..., N, K/2], scale float8_e4m3fn [..., N, K/16], scale_2 f32 [...]) of W [..., N, K].

    scale_2 = amax over each [N, K] tensor / (6 * 448) unless given (1 for an all-zero tensor);
    scale = e4m3(clamp(amax16 / (6 * scale_2), 2^-9, 448)) (1 for an all-zero block);
    codes = e2m1(W / (f32(scale) * scale_2)) (0 where that divisor is 0), round to nearest even,
    saturating at 6.
    """
    _check_tensor("w_NK", w_NK, (torch.float32, torch.bfloat16, torch.float16), 2)
    k = w_NK.shape[-1]
    if k % 16:
        raise ValueError(f"w_NK: shape {tuple(w_NK.shape)}, expected K (last dim) a multiple of 16 for NVFP4")
    w = w_NK.to(torch.float32)
    if scale_2 is None:
        amax_t = w.abs().amax(dim=(-2, -1))
        scale_2 = torch.where(amax_t > 0, div_by_const(amax_t, E2M1_MAX * FP8_E4M3_MAX), torch.ones_like(amax_t))
    _check_tensor("scale_2", scale_2, (torch.float32,))
    g = w.unflatten(-1, (k // 16, 16))
    s2 = scale_2[..., None, None]
    amax = g.abs().amax(dim=-1)
    # ModelOpt's rule: an all-zero block gets scale 1; a nonzero one at least the smallest
    # float8_e4m3fn subnormal (2^-9), never a 0 that `check_scales` refuses.
    raw = (amax / (E2M1_MAX * s2)).clamp(min=_E4M3_MIN_SUBNORMAL, max=FP8_E4M3_MAX)
    scale = torch.where(amax > 0, raw, torch.ones_like(raw)).to(torch.float8_e4m3fn)
    div = (scale.to(torch.float32) * s2).unsqueeze(-1)
    safe = torch.where(div > 0, div, torch.ones_like(div))
    codes = quantize_e2m1(torch.where(div > 0, g / safe, torch.zeros_like(g)))
    return pack_fp4(codes.flatten(-2)), scale, scale_2


# ------------------------------------------------------------------------------ validation


def scale_code_max(fmt: str, field: str) -> float | None:
    """The largest |value| a scale of `field` multiplies under format `fmt`, None when it scales no weight.

    fmt: a QuantSpec.format; field: "gate_up_scale" / "down_scale" (block scales), "scale_2"
    (nvfp4 per-tensor), "input_scale" (nvfp4 activations). A scale times this must stay finite
    in float32, or a block of largest codes dequantizes to inf (`check_scales`).
    """
    if field in ("gate_up_scale", "down_scale"):
        return {"fp8_block": FP8_E4M3_MAX, "mxfp4": E2M1_MAX, "nvfp4": E2M1_MAX}[fmt]
    if field == "scale_2":
        return E2M1_MAX * FP8_E4M3_MAX  # e2m1 * (a float8_e4m3fn block scale <= 448) * scale_2
    return None


def check_scales(name: str, scale: torch.Tensor, kind: str, *, code_max: float | None = None) -> None:
    """Raise ValueError naming `name` when a scale tensor holds a value no producer writes.

    kind: "float" (float32 / float8_e4m3fn scales: NaN, +-inf, 0 and negative values refused;
    every producer writes amax-based scales > 0, ModelOpt and the quantizers here 1 for an
    all-zero block) or "e8m0" (uint8 / float8_e8m0fnu exponent bytes: 255, the E8M0 NaN,
    refused; every other byte is a power of two > 0).
    code_max: the largest |value| the scale multiplies (`scale_code_max`): a scale whose
    product with it overflows float32 is refused too, since a block holding that code would
    dequantize to inf (a float32 FP8 scale above 3.4e38 / 448; UE8M0 bytes >= 247 for FP8,
    254 for MXFP4). Reads the tensor (a device sync on CUDA): for loading, not the hot path.
    """
    if kind == "e8m0":
        b = scale.view(torch.uint8)
        checks = [(b == E8M0_NAN, "E8M0 byte 255 (NaN)", "bytes 0..254")]
        values = e8m0_to_f32(b)
    elif kind == "float":
        values = scale.to(torch.float32)
        finite = torch.isfinite(values)
        checks = [(~finite, "a NaN or infinite value", "finite scales > 0"),
                  (finite & (values <= 0), "a scale <= 0", "finite scales > 0")]
    else:
        raise ValueError(f"check_scales: kind={kind!r}, expected 'float' or 'e8m0'")
    if code_max is not None:
        checks.append((torch.isfinite(values) & torch.isinf(values * code_max),
                       f"a scale that overflows float32 times {code_max:g}, the largest value it multiplies",
                       f"scale * {code_max:g} finite"))
    for bad, what, expected in checks:
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            v = values[idx].item() if kind == "float" else int(scale.view(torch.uint8)[idx])
            raise ValueError(f"{name}: holds {what} at index {idx} ({v!r}; {int(bad.sum())} of {bad.numel()}); "
                             f"expected {expected}")
