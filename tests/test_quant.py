"""moeflow.quant: QuantSpec, the exact dequantizers, our quantizers, quantized ExpertWeights, reference experts.

Hand-built blocks with known values (partial edge blocks, signed zeros, all 16 E2M1 codes,
E8M0 bytes 0 / 127 / 254 / 255, nibble order), round trips within stated bounds, equality
with transformers' own dequantizers where they run on CPU, and the reference experts on
quantized weights equal to the same experts on the dequantized f32 weights (torch.equal).

Legend: E experts, H hidden, I intermediate per expert, N output rows, K input columns,
T tokens.
"""

from __future__ import annotations

import math

import pytest
import torch

from moeflow.config import ExpertWeights, MoEConfig
from moeflow.experts.reference import ReferenceExperts
from moeflow.experts.select import select_experts_impl
from moeflow.quant import (
    FORMATS,
    MXFP4,
    NVFP4,
    QuantSpec,
    check_expert_scales,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    experts_from_hf_module,
    fp8_block_spec,
    quant_spec_from_hf,
    quantize_experts,
    quantize_fp8_activations,
    quantize_fp8_block,
    quantize_mxfp4,
    quantize_nvfp4,
)
from moeflow.quant.formats import E2M1_VALUES, check_scales, e8m0_to_f32, pack_fp4, quantize_e2m1, unpack_fp4
from moeflow.routing.spec import RouterSpec

pytestmark = pytest.mark.usefixtures("one_thread")

E8M0 = torch.float8_e8m0fnu
SPECS = {"fp8_block": fp8_block_spec((16, 16)), "fp8_ue8m0": fp8_block_spec((16, 16), ue8m0=True),
         "mxfp4": MXFP4, "nvfp4": NVFP4}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


# ------------------------------------------------------------------------------ spec


def test_quant_spec_validation_names_field():
    with pytest.raises(ValueError, match=r"QuantSpec\.format='int4': expected one of"):
        QuantSpec(format="int4", block=(1, 32), scale_dtype=torch.uint8, activation_scheme="none")
    with pytest.raises(ValueError, match=r"QuantSpec\.block=\(1, 16\): format 'mxfp4' expects \(1, 32\)"):
        QuantSpec(format="mxfp4", block=(1, 16), scale_dtype=torch.uint8, activation_scheme="none")
    with pytest.raises(ValueError, match=r"QuantSpec\.block=\(0, 128\): expected a tuple of two ints >= 1"):
        QuantSpec(format="fp8_block", block=(0, 128), scale_dtype=torch.float32, activation_scheme="dynamic")
    with pytest.raises(ValueError, match=r"QuantSpec\.scale_dtype=torch\.float16: format 'fp8_block' expects"):
        QuantSpec(format="fp8_block", block=(128, 128), scale_dtype=torch.float16, activation_scheme="dynamic")
    with pytest.raises(ValueError, match=r"QuantSpec\.activation_scheme='dynamic': format 'mxfp4' expects"):
        QuantSpec(format="mxfp4", block=(1, 32), scale_dtype=torch.uint8, activation_scheme="dynamic")
    with pytest.raises(TypeError):
        QuantSpec("mxfp4", (1, 32), torch.uint8, "none")  # kw-only
    s = fp8_block_spec((128, 128))
    assert s.scale_grid(300, 7168) == (3, 56) and s.weight_dtype == torch.float8_e4m3fn and s.pack == 1
    assert MXFP4.pack == NVFP4.pack == 2 and NVFP4.has_global_scale and not MXFP4.has_global_scale


def test_quant_spec_from_hf():
    ds = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert quant_spec_from_hf(ds) == fp8_block_spec((128, 128))
    assert quant_spec_from_hf({**ds, "scale_fmt": "ue8m0"}).scale_dtype == E8M0
    assert quant_spec_from_hf({"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}) is MXFP4
    assert quant_spec_from_hf({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}) is NVFP4
    nested = {"quant_method": "modelopt", "producer": {"name": "modelopt"},
              "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}
    assert quant_spec_from_hf(nested) is NVFP4
    assert quant_spec_from_hf(None) is None
    from transformers import FineGrainedFP8Config

    assert quant_spec_from_hf(FineGrainedFP8Config(weight_block_size=(64, 128))) == fp8_block_spec((64, 128))
    with pytest.raises(ValueError, match=r"quant_method='awq': unknown, expected one of 'fp8', 'mxfp4', 'modelopt'"):
        quant_spec_from_hf({"quant_method": "awq"})
    with pytest.raises(ValueError, match=r"quant_method='compressed-tensors'.*weight_global_scale"):
        quant_spec_from_hf({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"})
    with pytest.raises(ValueError, match=r"activation_scheme='static'"):
        quant_spec_from_hf({**ds, "activation_scheme": "static"})
    with pytest.raises(ValueError, match=r"weight_block_size=None"):
        quant_spec_from_hf({**ds, "weight_block_size": None})
    with pytest.raises(ValueError, match=r"quant_algo='FP8'"):
        quant_spec_from_hf({"quant_method": "modelopt", "quant_algo": "FP8"})
    with pytest.raises(ValueError, match=r"group_size=32"):
        quant_spec_from_hf({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32})


# ------------------------------------------------------------------------------ codes and scales


def test_every_e2m1_code_and_the_nibble_order():
    codes = torch.arange(16, dtype=torch.uint8)
    # Byte (hi << 4) | lo: lo is the even element, hi the odd one.
    packed = pack_fp4(torch.stack((codes, codes.flip(0)), dim=-1).flatten())
    assert torch.equal(packed, codes | (codes.flip(0) << 4))
    assert torch.equal(unpack_fp4(packed), torch.stack((codes, codes.flip(0)), dim=-1).flatten())
    all_bytes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(all_bytes)), all_bytes)
    # Every code through the MXFP4 dequantizer at scale 1 (byte 127): the E2M1 table, signed zero included.
    row = torch.cat((codes, codes)).reshape(1, 32)
    got = dequantize_mxfp4(pack_fp4(row), torch.full((1, 1), 127, dtype=torch.uint8))[0]
    want = torch.tensor(E2M1_VALUES * 2)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert torch.signbit(got[8]) and got[8] == 0  # code 8 is -0.0
    # One byte, by hand: 0x2B = hi 2 (1.0), lo 0xB (-1.5) -> [-1.5, 1.0].
    one = torch.zeros(1, 16, dtype=torch.uint8)
    one[0, 0] = 0x2B
    assert dequantize_mxfp4(one, torch.full((1, 1), 127, dtype=torch.uint8))[0, :2].tolist() == [-1.5, 1.0]


def test_e8m0_extreme_exponents():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = e8m0_to_f32(b)
    want = [math.ldexp(1.0, -127), math.ldexp(1.0, -126), 0.5, 1.0, 2.0, math.ldexp(1.0, 127)]
    assert got[:6].tolist() == want and math.isnan(got[6])
    assert torch.equal(e8m0_to_f32(b.view(E8M0))[:6], got[:6])  # float8_e8m0fnu scales read the same
    assert torch.equal(b.view(E8M0).float()[:6], got[:6])  # and equal torch's own conversion
    # MXFP4 blocks at the extremes: byte 0 with 0.5 -> 2^-128 (an f32 subnormal, exact); byte 254
    # with 1.5 -> 1.5 * 2^127 (finite), with 2.0 -> inf (f32 overflow); byte 255 -> NaN for the whole block.
    codes = torch.zeros(4, 32, dtype=torch.uint8)
    codes[0, 0], codes[1, 0], codes[2, 0], codes[3, 0], codes[3, 1] = 1, 3, 4, 2, 0
    scales = torch.tensor([[0], [254], [254], [255]], dtype=torch.uint8)
    w = dequantize_mxfp4(pack_fp4(codes), scales)
    assert w[0, 0].item() == math.ldexp(1.0, -128) and w[0, 1].item() == 0.0
    assert w[1, 0].item() == 1.5 * math.ldexp(1.0, 127)
    assert math.isinf(w[2, 0].item())
    assert torch.isnan(w[3]).all()  # 0 * NaN too: the NaN scale poisons its whole block
    with pytest.raises(ValueError, match=r"scales\[3\]: holds E8M0 byte 255 \(NaN\) at index \(3, 0\)"):
        check_scales("scales[3]", scales, "e8m0")


def test_fp8_block_partial_edges_by_hand():
    """W[i, j] = Wq[i, j] * s[i // bn, j // bk] element by element, with partial edge blocks on both axes."""
    g = torch.Generator().manual_seed(0)
    N, K, bn, bk = 5, 7, 2, 3  # grid 3 x 3; last row block 1 row, last column block 1 column
    wq = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn)
    s = torch.tensor([[0.5, 2.0, 0.25], [3.0, 1.0, 0.125], [7.0, 0.0625, 10.0]])
    w = dequantize_fp8_block(wq, s, (bn, bk))
    for i in range(N):
        for j in range(K):
            assert w[i, j].item() == wq[i, j].float().item() * s[i // bn, j // bk].item(), (i, j)
    with pytest.raises(ValueError, match=r"scale: shape \(3, 2\), expected \(3, 3\) for weight \(5, 7\)"):
        dequantize_fp8_block(wq, s[:, :2], (bn, bk))
    with pytest.raises(TypeError, match=r"w_NK: dtype torch\.float32, expected torch\.float8_e4m3fn"):
        dequantize_fp8_block(wq.float(), s, (bn, bk))
    # bf16 output: the f32 products rounded once.
    assert torch.equal(dequantize_fp8_block(wq, s, (bn, bk), torch.bfloat16), w.to(torch.bfloat16))
    # UE8M0 scales: exact powers of two.
    e = torch.tensor([[127, 128, 126], [120, 130, 127], [0, 254, 127]], dtype=torch.uint8)
    w8 = dequantize_fp8_block(wq, e.view(E8M0), (bn, bk))
    assert torch.equal(w8, wq.float() * e8m0_to_f32(e).repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K])


def test_signed_zeros_survive():
    wq = torch.tensor([[0.0, -0.0, 1.0, -1.0]]).to(torch.float8_e4m3fn)
    w = dequantize_fp8_block(wq, torch.tensor([[3.0]]), (128, 128))
    assert torch.signbit(w[0]).tolist() == [False, True, False, True]
    assert quantize_e2m1(torch.tensor([0.0, -0.0, -0.1, 0.1])).tolist() == [0, 8, 8, 0]
    q, s = quantize_fp8_block(torch.tensor([[0.0, -0.0, 2.0]]))
    assert torch.signbit(dequantize_fp8_block(q, s, (128, 128)))[0].tolist() == [False, True, False]


def test_e2m1_round_to_nearest_even_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9, -5.0, -0.3, 0.74, 4.9, 5.1])
    vals = torch.tensor(E2M1_VALUES)[quantize_e2m1(x).long()]
    assert vals.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -4.0, -0.5, 0.5, 4.0, 6.0]
    with pytest.raises(ValueError, match="NaN"):
        quantize_e2m1(torch.tensor([float("nan")]))


def test_nvfp4_by_hand():
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).reshape(1, 32)  # every code, twice
    scale = torch.tensor([[2.0, 0.375]]).to(torch.float8_e4m3fn)  # one per 16 values
    s2 = torch.tensor(1.0 / 3.0)
    w = dequantize_nvfp4(pack_fp4(codes), scale, s2)
    lut = torch.tensor(E2M1_VALUES)
    want = torch.cat((lut * 2.0, lut * 0.375)) * s2  # (e2m1 * s8) exact, then one rounding by s2
    assert torch.equal(w[0], want)
    with pytest.raises(ValueError, match=r"scale_2: shape \(2,\), expected \(\) \(one per tensor\)"):
        dequantize_nvfp4(pack_fp4(codes), scale, torch.ones(2))
    with pytest.raises(ValueError, match=r"scale: shape \(1, 1\), expected \(1, 2\) \(one per 16 values\)"):
        dequantize_nvfp4(pack_fp4(codes), scale[:, :1], s2)


# ------------------------------------------------------------------------------ quantizers


@pytest.mark.parametrize("name", list(SPECS))
def test_quantize_dequantize_round_trip_bounds(name):
    """|W - deq(q(W))| per element: fp8 <= 16 s (half an e4m3 ulp at the top of its range: 448 -> 16);
    mxfp4 <= 2^(b-127) (half the widest E2M1 gap, 4..6); nvfp4 <= s8 * s2 (the same, saturation included)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 40, 64, generator=g) * torch.logspace(-3, 1, 64)  # a spread of magnitudes
    w[0, :16, :32] = 0.0  # an all-zero block
    spec = SPECS[name]
    if spec.format == "fp8_block":
        q, s = quantize_fp8_block(w, spec.block, ue8m0=spec.scale_dtype == E8M0)
        d = dequantize_fp8_block(q, s, spec.block)
        sf = s.float() if s.dtype == torch.float32 else e8m0_to_f32(s)
        bound = 16 * sf.repeat_interleave(16, 1)[:, :40].repeat_interleave(16, 2)
        assert torch.equal(quantize_fp8_block(w, spec.block, ue8m0=spec.scale_dtype == E8M0)[0].view(torch.uint8),
                           q.view(torch.uint8))  # deterministic
    elif spec.format == "mxfp4":
        q, s = quantize_mxfp4(w)
        d = dequantize_mxfp4(q, s)
        bound = e8m0_to_f32(s).repeat_interleave(32, -1)
    else:
        q, s, s2 = quantize_nvfp4(w)
        d = dequantize_nvfp4(q, s, s2)
        bound = (s.float() * s2[:, None, None]).repeat_interleave(16, -1)
    assert ((d - w).abs() <= bound * (1 + 1e-6)).all(), float(((d - w).abs() / bound).max())
    assert (d[0, :16, :32] == 0).all()
    rel = float((d - w).norm() / w.norm())
    assert rel < {"fp8_block": 0.04, "mxfp4": 0.2, "nvfp4": 0.15}[spec.format], rel


def test_fp8_activation_quantization():
    x = torch.tensor([[1.0, -896.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.5]])
    xq, s = quantize_fp8_activations(x, block=3)  # groups [0:3], [3:5] (partial)
    f32 = (torch.tensor(0.5) / 448.0).item()  # the f32 quotient
    assert s.tolist() == [[2.0, 1.0], [1.0, f32]]  # all-zero group: s = 1
    back = dequantize_fp8_block(xq, s, (1, 3))
    assert back[0, 1].item() == -896.0 and back[1, 4].item() == 0.5 and (back[1, :4] == 0).all()


def test_quantizers_same_numbers_under_cuda_scalar_division():
    """The quantizers give the CPU's (IEEE) numbers under PyTorch-CUDA's `tensor / python_scalar`
    semantics (a * fl(1 / b), emulated on the CPU by moeflow.testing.cuda_scalar_division).

    Why: a W8A8 reference computing s = amax / 448 that way on CUDA is 1 ulp off the kernels' div_rn
    for ~55% of the groups, and bf16 activations land exactly on e4m3 midpoints often enough (~0.1%)
    that the ulp flips codes: rel-L2 1e-2 against the kernels on an H200.
    """
    from moeflow.testing import cuda_scalar_division

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g).to(torch.bfloat16).float()  # bf16 values: exact ties occur
    w = torch.randn(3, 96, 160, generator=g) * 0.05
    amax = x.view(512, 2, 128).abs().amax(dim=-1)  # per token per 128 channels, all > 0 here
    ieee = amax / 448.0  # CPU: IEEE f32 division
    with cuda_scalar_division():
        assert not torch.equal(amax / 448.0, ieee), "the emulation must change `tensor / 448.0` here"
        got_a = quantize_fp8_activations(x, 128)
        got_b = [quantize_fp8_block(w[0], (32, 32), ue8m0=u) for u in (False, True)]
        got_m, got_n = quantize_mxfp4(w[1]), quantize_nvfp4(w[2])
    want_a = quantize_fp8_activations(x, 128)
    assert torch.equal(want_a[1], ieee), "s = max|x| / 448 is the IEEE f32 quotient (the kernels' div_rn)"
    assert torch.equal(got_a[1], want_a[1]), "fp8 activation scales differ under CUDA division semantics"
    assert _equal_bits(got_a[0], want_a[0]), "fp8 activation codes differ under CUDA division semantics"
    for u, got in zip((False, True), got_b):
        assert all(_equal_bits(a, b) for a, b in zip(got, quantize_fp8_block(w[0], (32, 32), ue8m0=u)))
    assert all(_equal_bits(a, b) for a, b in zip(got_m, quantize_mxfp4(w[1])))
    assert all(_equal_bits(a, b) for a, b in zip(got_n, quantize_nvfp4(w[2])))


# ------------------------------------------------------------------------------ against transformers


def test_mxfp4_equals_transformers_dequantizer():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(2)
    E, N, K = 3, 8, 64
    blocks = torch.randint(0, 256, (E, N, K // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(110, 140, (E, N, K // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        hf = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N], gpt-oss' matmul layout
        ours = dequantize_mxfp4(blocks.reshape(E, N, K // 2), scales, dtype)
        assert torch.equal(ours.transpose(1, 2), hf), dtype


def test_fp8_equals_transformers_dequantizer():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(3)
    wq = (torch.randn(2, 64, 96, generator=g) * 100).to(torch.float8_e4m3fn)
    s = torch.rand(2, 4, 3, generator=g) + 0.01
    hf = Fp8Dequantize(None)._dequantize_one(wq, s, output_dtype=torch.float32)
    assert torch.equal(dequantize_fp8_block(wq, s, (16, 32)), hf)


# ------------------------------------------------------------------------------ ExpertWeights


def _plain(E=3, H=64, I=32, layout="linear", interleaved=False, bias=False, seed=0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * I, H, generator=g) / 4
    dn = torch.randn(E, H, I, generator=g) / 6
    if layout == "matmul":
        gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
    b = (torch.randn(E, 2 * I, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1) if bias else (None, None)
    return ExpertWeights(gu, dn, *b, layout=layout, interleaved=interleaved)


def test_quantized_expert_weights_shapes_and_accounting():
    w = _plain()
    q = quantize_experts(w, SPECS["fp8_block"])
    assert q.gate_up.dtype == torch.float8_e4m3fn and q.gate_up_scale.shape == (3, 4, 4)
    assert (q.num_experts, q.hidden_size, q.intermediate_size) == (3, 64, 32)
    assert q.nbytes == 3 * (64 * 64 + 64 * 32) + 4 * (3 * 4 * 4 + 3 * 4 * 2)
    assert q.expert_bytes == q.nbytes // 3 and w.expert_bytes == 4 * (64 * 64 + 64 * 32)
    n = quantize_experts(w, NVFP4)
    assert n.gate_up.shape == (3, 64, 32) and n.gate_up_scale_2.shape == (3, 2) and n.down_scale_2.shape == (3,)
    assert n.nbytes == 3 * (64 * 32 + 64 * 16) + 3 * (64 * 4 + 64 * 2) + 4 * 3 * 3
    kw = dict(layout="linear", quant=SPECS["fp8_block"], gate_up_scale=q.gate_up_scale, down_scale=q.down_scale)
    with pytest.raises(ValueError, match=r"ExpertWeights\.gate_up_scale: shape \(3, 3, 4\), expected \(3, 4, 4\)"):
        ExpertWeights(q.gate_up, q.down, **{**kw, "gate_up_scale": q.gate_up_scale[:, :3]})
    with pytest.raises(TypeError, match=r"ExpertWeights\.down_scale: dtype torch\.float16, expected torch\.float32"):
        ExpertWeights(q.gate_up, q.down, **{**kw, "down_scale": q.down_scale.half()})
    with pytest.raises(TypeError, match=r"ExpertWeights\.gate_up: dtype torch\.float32, expected torch\.float8_e4m3fn"):
        ExpertWeights(q.gate_up.float(), q.down, **kw)
    with pytest.raises(ValueError, match=r"ExpertWeights\.down_scale: missing"):
        ExpertWeights(q.gate_up, q.down, **{**kw, "down_scale": None})
    with pytest.raises(ValueError, match=r"ExpertWeights\.gate_up_scale: given without ExpertWeights\.quant"):
        ExpertWeights(w.gate_up, w.down, gate_up_scale=q.gate_up_scale)
    with pytest.raises(ValueError, match=r"ExpertWeights\.gate_up_scale_2: given, but quant format 'fp8_block'"):
        ExpertWeights(q.gate_up, q.down, **kw, gate_up_scale_2=torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"ExpertWeights\.interleaved=True: quant format 'fp8_block'"):
        ExpertWeights(q.gate_up, q.down, **kw | {"layout": "linear"}, interleaved=True)
    with pytest.raises(ValueError, match=r"ExpertWeights\.gate_up_scale_2: missing"):
        ExpertWeights(n.gate_up, n.down, quant=NVFP4, gate_up_scale=n.gate_up_scale, down_scale=n.down_scale,
                      down_scale_2=n.down_scale_2)
    with pytest.raises(ValueError, match=r"H=48 is not a multiple of 32, the mxfp4 block"):
        ExpertWeights(torch.zeros(3, 64, 24, dtype=torch.uint8), torch.zeros(3, 48, 16, dtype=torch.uint8),
                      quant=MXFP4, gate_up_scale=torch.zeros(3, 64, 1, dtype=torch.uint8),
                      down_scale=torch.zeros(3, 48, 1, dtype=torch.uint8))


@pytest.mark.parametrize("name", list(SPECS))
def test_subset_keeps_scales_aligned(name):
    spec = SPECS[name]
    w = _plain(layout="matmul", interleaved=True, bias=True) if spec.format == "mxfp4" else _plain()
    q = quantize_experts(w, spec)
    full = q.dequantize(torch.float32)
    for ids in ([2, 0], range(1, 3)):
        sub = q.subset(ids)
        assert sub.quant == spec and sub.num_experts == len(ids)
        d = sub.dequantize(torch.float32)
        assert torch.equal(d.gate_up, full.gate_up[list(ids)]) and torch.equal(d.down, full.down[list(ids)])
    view = q.subset(range(1, 3))
    assert view.gate_up_scale.data_ptr() == q.gate_up_scale[1].data_ptr()  # contiguous: views, no copy


def test_dequantize_layouts_and_dtypes():
    w = _plain(layout="matmul", interleaved=True, bias=True)
    q = quantize_experts(w, MXFP4)
    assert q.gate_up.shape == (3, 64, 32)  # stored [E, 2I, H/2] whatever the layout
    d32, d16 = q.dequantize(torch.float32), q.dequantize(torch.bfloat16)
    assert d32.layout == "matmul" and d32.interleaved and d32.gate_up.shape == (3, 64, 64)
    assert d32.gate_up.is_contiguous() and d16.gate_up_bias.dtype == torch.bfloat16
    assert torch.equal(d16.gate_up, d32.gate_up.to(torch.bfloat16))  # MXFP4 values are exact in bf16 too
    assert w.dequantize(torch.float32) is w
    assert w.dequantize(torch.bfloat16).gate_up.dtype == torch.bfloat16


def test_check_expert_scales_names_the_field():
    q = quantize_experts(_plain(), SPECS["fp8_block"])
    check_expert_scales(q)
    q.down_scale[1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"ExpertWeights\.down_scale: holds a NaN or infinite value at index \(1, 0, 0\)"):
        check_expert_scales(q)
    m = quantize_experts(_plain(), MXFP4)
    m.gate_up_scale[0, 3, 1] = 255
    with pytest.raises(ValueError, match=r"ExpertWeights\.gate_up_scale: holds E8M0 byte 255"):
        check_expert_scales(m)
    n = quantize_experts(_plain(), NVFP4)
    n.gate_up_scale_2[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"ExpertWeights\.gate_up_scale_2: holds a NaN"):
        check_expert_scales(n)


# ------------------------------------------------------------------------------ reference experts and selection


def _config(w: ExpertWeights, activation="silu") -> MoEConfig:
    spec = RouterSpec(score_fn="softmax", num_experts=w.num_experts, top_k=2, renorm=True)
    return MoEConfig(hidden_size=w.hidden_size, intermediate_size=w.intermediate_size, router=spec,
                     activation=activation, swiglu_limit=7.0 if activation == "gptoss" else None,
                     layout=w.layout, interleaved=w.interleaved, expert_bias=w.has_bias)


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_on_quantized_equals_reference_on_dequantized_f32(name):
    spec = SPECS[name]
    if spec.format == "mxfp4":
        w, act = _plain(layout="matmul", interleaved=True, bias=True), "gptoss"
    else:
        w, act = _plain(), "silu"
    q = quantize_experts(w, spec)
    cfg = _config(w, act)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(11, w.hidden_size, generator=g)
    ids = torch.tensor([0, 2, 2, 1, 0, 0, 1, 2, 2, 2, 0])
    ref = ReferenceExperts()
    want = ref.forward_pairs(x, ids, q.dequantize(torch.float32), cfg)
    got = ref.forward_pairs(x, ids, q, cfg)
    assert torch.equal(got, want)
    # bf16 rows: computed in f32, returned in bf16.
    got16 = ref.forward_pairs(x.bfloat16(), ids, q, cfg)
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16, ref.forward_pairs(x.bfloat16().float(), ids, q, cfg).bfloat16())
    # The quantization error against the unquantized weights, for scale (not a contract).
    err = float((got - ref.forward_pairs(x, ids, w, cfg)).norm() / want.norm())
    assert err < 0.25, err


def test_select_refuses_impls_without_quantized_support():
    w = _plain()
    cfg, spec = _config(w), SPECS["fp8_block"]
    assert select_experts_impl(cfg, "cpu", 4, quant=spec).name == "reference"
    assert select_experts_impl(cfg, "cpu", 4, "reference", quant=spec).name == "reference"
    assert select_experts_impl(cfg, "cpu", 4).name == "grouped"  # unquantized: unchanged
    with pytest.raises(ValueError, match=r"experts impl 'grouped' refuses these weights: it cannot run quantized "
                                         r"weights of format 'fp8_block'.*'reference' runs them"):
        select_experts_impl(cfg, "cpu", 4, "grouped", quant=spec)
    with pytest.raises(TypeError, match="quant: expected a QuantSpec or None"):
        select_experts_impl(cfg, "cpu", 4, quant="fp8")
    assert set(ReferenceExperts.quant_formats) == set(FORMATS)


# ------------------------------------------------------------------------------ transformers modules


def test_experts_from_hf_fp8_module_reads_in_place():
    from transformers import Qwen3MoeConfig
    from transformers.integrations.finegrained_fp8 import FP8Experts

    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=3, num_experts_per_tok=2)
    mod = FP8Experts(cfg, block_size=(16, 16))
    q = quantize_experts(_plain(), SPECS["fp8_block"])
    with torch.no_grad():
        for name, t in (("gate_up_proj", q.gate_up), ("gate_up_proj_scale_inv", q.gate_up_scale),
                        ("down_proj", q.down), ("down_proj_scale_inv", q.down_scale)):
            getattr(mod, name).copy_(t)
    got = experts_from_hf_module(mod)
    assert got.quant == SPECS["fp8_block"] and got.layout == "linear"
    assert got.gate_up.data_ptr() == mod.gate_up_proj.data_ptr()  # views of the parameters
    assert got.gate_up_scale.data_ptr() == mod.gate_up_proj_scale_inv.data_ptr()
    assert torch.equal(got.dequantize(torch.float32).gate_up, q.dequantize(torch.float32).gate_up)
    # Tiny I < bn: FP8Experts allocates 2 block rows (gate's and up's), moeflow's grid too.
    small = FP8Experts(cfg, block_size=(128, 128))
    assert experts_from_hf_module(small).gate_up_scale.shape == (3, 2, 1)
    with pytest.raises(TypeError, match="is not a transformers quantized experts module"):
        experts_from_hf_module(torch.nn.Linear(2, 2))


class _StridedStorage:
    """A stand-in for a triton_kernels Tensor with an identity ("strided") layout."""

    def __init__(self, data):
        class Layout:
            @staticmethod
            def unswizzle_data(d):
                return d

        self.storage = type("S", (), {"data": data, "layout": Layout()})()


def test_experts_from_hf_mxfp4_module_unswizzles():
    from types import SimpleNamespace

    w = _plain(layout="matmul", interleaved=True, bias=True)
    q = quantize_experts(w, MXFP4)
    E, H, I = 3, 64, 32
    # Mxfp4GptOssExperts holds the data transposed to [E, K/2, N] before swizzling.
    mod = SimpleNamespace(
        num_experts=E, intermediate_size=I, hidden_size=H,
        gate_up_proj=_StridedStorage(q.gate_up.transpose(1, 2)), down_proj=_StridedStorage(q.down.transpose(1, 2)),
        gate_up_proj_precision_config=SimpleNamespace(weight_scale=_StridedStorage(q.gate_up_scale.transpose(1, 2))),
        down_proj_precision_config=SimpleNamespace(weight_scale=_StridedStorage(q.down_scale.transpose(1, 2))),
        gate_up_proj_bias=w.gate_up_bias, down_proj_bias=w.down_bias)
    got = experts_from_hf_module(mod)
    assert got.quant is MXFP4 and got.layout == "matmul" and got.interleaved
    assert torch.equal(got.gate_up, q.gate_up) and torch.equal(got.down_scale, q.down_scale)
    mod.gate_up_proj_precision_config = None
    with pytest.raises(ValueError, match="gate_up_proj_precision_config=None"):
        experts_from_hf_module(mod)


# ------------------------------------------------------------------------------ scales no producer writes


def test_quantize_nvfp4_never_writes_a_zero_block_scale():
    """ModelOpt's rule: an all-zero block gets scale 1, and a tiny nonzero one at least the smallest e4m3
    subnormal (2^-9), where the quantizer wrote 0, which `check_scales` refuses."""
    w = torch.zeros(2, 48)
    w[0, :16] = 1000.0
    w[0, 16:32] = 1e-6  # amax16 / (6 * s2) ~ 4.5e-7: below every e4m3 value
    packed, scale, scale_2 = quantize_nvfp4(w)
    assert scale.float().tolist() == [[448.0, 2.0 ** -9, 1.0], [1.0, 1.0, 1.0]]
    check_scales("scale", scale, "float")
    assert torch.equal(dequantize_nvfp4(packed, scale, scale_2)[1], torch.zeros(48))


def test_check_scales_refuses_values_no_producer_writes():
    with pytest.raises(ValueError, match=r"s: holds a scale <= 0 at index \(1,\) \(-0\.0;"):
        check_scales("s", torch.tensor([1.0, -0.0]), "float")
    fp8 = torch.tensor([1.0, 3.4e38 / 448 * 1.01])
    check_scales("s", fp8, "float")  # finite on its own
    with pytest.raises(ValueError, match=r"s: holds a scale that overflows float32 times 448"):
        check_scales("s", fp8, "float", code_max=448.0)
    # UE8M0: 2^119 * 448 is finite, 2^120 * 448 is not.
    check_scales("s", torch.tensor([246], dtype=torch.uint8), "e8m0", code_max=448.0)
    with pytest.raises(ValueError, match=r"s: holds a scale that overflows float32 times 448.* \(247; 1 of 2\); expected scale \* 448 finite"):
        check_scales("s", torch.tensor([246, 247], dtype=torch.uint8), "e8m0", code_max=448.0)


@pytest.mark.parametrize("qc, error, field", [
    ({"quant_method": "fp8", "weight_block_size": [128.5, 128]}, ValueError, r"weight_block_size\[0\]=128\.5"),
    ({"quant_method": "fp8", "weight_block_size": [128, True]}, TypeError, r"weight_block_size\[1\]=True"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16.9}, ValueError, r"group_size=16\.9"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": "16"}, TypeError, r"group_size='16'"),
])
def test_quant_spec_from_hf_refuses_non_integer_sizes(qc, error, field):
    with pytest.raises(error, match=rf"quantization_config\.{field}: expected an int"):
        quant_spec_from_hf(qc)
    # An integral float is the same int, not a truncation.
    assert quant_spec_from_hf({"quant_method": "fp8", "weight_block_size": [128.0, 128]}) == fp8_block_spec((128, 128))


def test_check_expert_scales_refuses_a_finite_scale_that_dequantizes_to_inf():
    """An in-memory fp8 block scale of 1e38 is finite, but 448 x 1e38 overflows float32: refused by name, as at
    load (quant.formats.scale_code_max)."""
    q = quantize_experts(_plain(), SPECS["fp8_block"])
    q.gate_up_scale[0, 0, 0] = 1e38
    with pytest.raises(ValueError, match=r"ExpertWeights\.gate_up_scale"):
        check_expert_scales(q)
