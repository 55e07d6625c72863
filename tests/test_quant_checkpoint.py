"""Quantized checkpoints through moeflow.checkpoint.load_moe_layer: FP8 block, MXFP4, NVFP4.

Each test writes its own tiny quantized checkpoint in the format's exact tensor names: a
tiny HF model's expert tensors quantized with moeflow's quantizer, saved with
safetensors.torch.save_file next to a config.json carrying `quantization_config`. Then:
the quantized tensors load bit for bit (dtype=None), the dequantized load equals the
independently dequantized reference exactly (torch.equal), the reference experts give the
same bits on both, and a bad checkpoint raises CheckpointError naming the key.

Legend: E experts, H hidden, I intermediate per expert, Is shared-expert width.
"""

from __future__ import annotations

import os

import pytest
import torch
from hf_configs import tiny_model

from moeflow.checkpoint import CheckpointError, CheckpointIndex, load_moe_layer
from moeflow.checkpoint.write import write_model_checkpoint
from moeflow.config import ExpertWeights, MoEConfig
from moeflow.experts.reference import ReferenceExperts
from moeflow.quant import MXFP4, NVFP4, fp8_block_spec
from moeflow.quant.formats import dequantize_fp8_block
from moeflow.routing.spec import RouterSpec

pytestmark = pytest.mark.usefixtures("one_thread", "hf_quiet")

FP8_CFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
MXFP4_CFG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"]}
NVFP4_CFG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "producer": {"name": "modelopt"}}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _layer_weights(model, i: int, family: str) -> ExpertWeights:
    ex = model.model.layers[i].mlp.experts
    if family == "gpt_oss":
        return ExpertWeights(ex.gate_up_proj.detach(), ex.down_proj.detach(), ex.gate_up_proj_bias.detach(),
                             ex.down_proj_bias.detach(), layout="matmul", interleaved=True)
    return ExpertWeights(ex.gate_up_proj.detach(), ex.down_proj.detach())


def write_quantized(directory, family: str, spec, qcfg: dict, *, fmt: str, layers=(1,), shards: int = 1,
                    edit=None, **overrides) -> tuple[str, dict[int, ExpertWeights], dict]:
    """Quantize `family`'s MoE experts of `layers` into `directory` (fmt "per_expert" | "fused").

    Returns (directory, {layer: quantized ExpertWeights written}, {shared key: (q, scale[, s2])}).
    """
    return write_model_checkpoint(directory, tiny_model(family, **overrides), family, spec=spec,
                                  quantization_config=qcfg, fmt=fmt, layers=layers, shards=shards, edit=edit)


def _check_loaded(path: str, family: str, layer: int, q: ExpertWeights, *, ids=None) -> None:
    """dtype=None: the stored bits, aligned scales; f32 / bf16: equal to the reference dequantization."""
    ids = list(range(q.num_experts)) if ids is None else list(ids)
    want_q = q.subset(ids)
    lw = load_moe_layer(path, family, layer, experts=ids)
    got = lw.experts
    assert got.quant == q.quant and lw.expert_ids == tuple(ids)
    for name in ExpertWeights.TENSOR_FIELDS:
        assert _same(getattr(got, name), getattr(want_q, name)), name
    scale_keys = [k for k in lw.keys if "scale" in k]
    assert scale_keys, "scale keys are accounted in LayerWeights.keys"
    for dtype in (torch.float32, torch.bfloat16):
        lw_d = load_moe_layer(path, family, layer, experts=ids, dtype=dtype)
        want = want_q.dequantize(dtype)
        assert lw_d.experts.quant is None and lw_d.experts.dtype == dtype
        for name in ("gate_up", "down", "gate_up_bias", "down_bias"):
            assert _same(getattr(lw_d.experts, name), getattr(want, name)), (name, dtype)


def _reference_same_bits(q: ExpertWeights, activation: str = "silu") -> None:
    spec = RouterSpec(score_fn="softmax", num_experts=q.num_experts, top_k=2, renorm=True)
    cfg = MoEConfig(hidden_size=q.hidden_size, intermediate_size=q.intermediate_size, router=spec,
                    activation=activation, swiglu_limit=7.0 if activation == "gptoss" else None, layout=q.layout,
                    interleaved=q.interleaved, expert_bias=q.has_bias)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, q.hidden_size, generator=g)
    ids = torch.randint(0, q.num_experts, (9,), generator=g)
    ref = ReferenceExperts()
    assert torch.equal(ref.forward_pairs(x, ids, q, cfg), ref.forward_pairs(x, ids, q.dequantize(torch.float32), cfg))


# ------------------------------------------------------------------------------ each format


def test_deepseek_v3_fp8_per_expert_with_quantized_shared_expert(tmp_path):
    spec = fp8_block_spec((16, 16))  # H=32, I=24: grids 2 x 2 with partial edge blocks
    path, written, shared = write_quantized(tmp_path, "deepseek_v3", spec, FP8_CFG, fmt="per_expert")
    q = written[1]
    assert q.gate_up_scale.shape == (8, 4, 2)  # gate's 2 block rows, then up's
    idx = CheckpointIndex(path)
    assert idx.info("model.layers.1.mlp.experts.5.up_proj.weight_scale_inv").shape == (2, 2)
    _check_loaded(path, "deepseek_v3", 1, q)
    _check_loaded(path, "deepseek_v3", 1, q, ids=[5, 2, 7])
    lw = load_moe_layer(idx, "deepseek_v3", 1)
    assert lw.source_format == "per_expert"
    # The shared expert comes back dequantized (the config's dtype: float32 here).
    wq, s = shared["model.layers.1.mlp.shared_experts.gate_proj.weight"]
    assert torch.equal(lw.shared.gate_IH, dequantize_fp8_block(wq, s, (16, 16)))
    lw16 = load_moe_layer(idx, "deepseek_v3", 1, dtype=torch.bfloat16)
    assert torch.equal(lw16.shared.gate_IH, dequantize_fp8_block(wq, s, (16, 16), torch.bfloat16))
    _reference_same_bits(lw.experts)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["f32_scales", "ue8m0_scales"])
def test_qwen3_moe_fp8_fused_sharded(tmp_path, ue8m0):
    """transformers 5's fused names, the default 128 x 128 block (one partial block per axis), 3 shards."""
    spec = fp8_block_spec((128, 128), ue8m0=ue8m0)
    qcfg = {**FP8_CFG, "weight_block_size": [128, 128], **({"scale_fmt": "ue8m0"} if ue8m0 else {})}
    path, written, _ = write_quantized(tmp_path, "qwen3_moe", spec, qcfg, fmt="fused", layers=(0, 1), shards=3)
    idx = CheckpointIndex(path)
    want_dt = torch.float8_e8m0fnu if ue8m0 else torch.float32
    assert idx.info("model.layers.1.mlp.experts.gate_up_proj_scale_inv").dtype == want_dt
    for layer in (0, 1):
        assert written[layer].gate_up_scale.shape == (6, 2, 1)
        _check_loaded(path, "qwen3_moe", layer, written[layer])
        _check_loaded(path, "qwen3_moe", layer, written[layer], ids=[4, 1])
    assert load_moe_layer(idx, "qwen3_moe", 1).source_format == "fused"
    _reference_same_bits(load_moe_layer(idx, "qwen3_moe", 0).experts)


def test_ue8m0_scale_inv_loads_kept_and_dequantized_by_hand(tmp_path):
    """A real safetensors file (dtype F8_E8M0) with transformers 5's fused FP8 names: the kept
    bits (dtype=None) and the f32 load equal a hand dequantization Wq * 2^(byte - 127), exactly.

    The scale bytes are set by hand and include the extremes that stay finite: byte 1 (2^-126;
    the smallest product 2^-9 * 2^-126 is an exact f32 subnormal) and 245 (448 * 2^118 < f32 max).
    f32(e4m3) * 2^k is then exact, so the reference is exact arithmetic (ldexp), not a second
    implementation of the dequantizer.
    """
    from safetensors import safe_open

    spec = fp8_block_spec((128, 128), ue8m0=True)
    qcfg = {**FP8_CFG, "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    p = "model.layers.1.mlp.experts."
    cycle = torch.tensor([1, 127, 245, 100, 140, 126, 133], dtype=torch.uint8)
    hand: dict[str, torch.Tensor] = {}

    def edit(t):
        for name in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):
            s = t[p + name]
            assert s.dtype == torch.float8_e8m0fnu, (name, s.dtype)
            b = cycle[torch.arange(s.numel()) % len(cycle)].view(s.shape)
            hand[name] = b
            t[p + name] = b.view(torch.float8_e8m0fnu)

    path, written, _ = write_quantized(tmp_path, "qwen3_moe", spec, qcfg, fmt="fused", layers=(1,), edit=edit)
    q = written[1]
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as fh:  # what the file header says
        assert fh.get_slice(p + "gate_up_proj_scale_inv").get_dtype() == "F8_E8M0"
    assert CheckpointIndex(path).info(p + "gate_up_proj_scale_inv").dtype == torch.float8_e8m0fnu

    kept = load_moe_layer(path, "qwen3_moe", 1).experts
    assert kept.quant == spec
    assert kept.gate_up_scale.dtype == torch.float8_e8m0fnu and kept.down_scale.dtype == torch.float8_e8m0fnu
    assert torch.equal(kept.gate_up_scale.view(torch.uint8), hand["gate_up_proj_scale_inv"])
    assert torch.equal(kept.down_scale.view(torch.uint8), hand["down_proj_scale_inv"])
    assert _same(kept.gate_up, q.gate_up) and _same(kept.down, q.down)

    deq = load_moe_layer(path, "qwen3_moe", 1, dtype=torch.float32).experts
    assert deq.quant is None and deq.dtype == torch.float32

    def by_hand(wq: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """[E, out, in] f32: e4m3 value times 2^(byte - 127) of its 128 x 128 block (partial blocks cut)."""
        n, k = wq.shape[-2:]
        ex = b.to(torch.int32) - 127
        ex = ex.repeat_interleave(128, dim=1)[:, :n].repeat_interleave(128, dim=2)[:, :, :k]
        return torch.ldexp(wq.to(torch.float32), ex.to(torch.float32))

    I, gi = q.intermediate_size, -(-q.intermediate_size // 128)  # gate's block rows come first, then up's
    b_gu = hand["gate_up_proj_scale_inv"]
    want = {"gate_up": torch.cat([by_hand(q.gate_up[:, :I], b_gu[:, :gi]), by_hand(q.gate_up[:, I:], b_gu[:, gi:])], 1),
            "down": by_hand(q.down, hand["down_proj_scale_inv"])}
    extremes = torch.cat([want["gate_up"].flatten(), want["down"].flatten()]).abs()
    assert torch.isfinite(extremes).all() and extremes.max() > 1e30 and extremes[extremes > 0].min() < 1e-30
    for name in ("gate_up", "down"):
        got = getattr(deq, name)
        assert torch.equal(got, want[name]), f"{name}: max |diff| {float((got - want[name]).abs().max()):.3e}"


def test_gpt_oss_mxfp4_fused_equals_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, written, _ = write_quantized(tmp_path, "gpt_oss", MXFP4, MXFP4_CFG, fmt="fused", layers=(0, 1),
                                       intermediate_size=32)
    for layer in (0, 1):
        _check_loaded(path, "gpt_oss", layer, written[layer])
    _check_loaded(path, "gpt_oss", 1, written[1], ids=[3, 0])
    idx = CheckpointIndex(path)
    p = "model.layers.1.mlp.experts."
    for dtype in (torch.float32, torch.bfloat16):
        lw = load_moe_layer(idx, "gpt_oss", 1, dtype=dtype)
        hf_gu = convert_moe_packed_tensors(idx.get(p + "gate_up_proj_blocks"), idx.get(p + "gate_up_proj_scales"),
                                           dtype=dtype)
        hf_dn = convert_moe_packed_tensors(idx.get(p + "down_proj_blocks"), idx.get(p + "down_proj_scales"),
                                           dtype=dtype)
        assert torch.equal(lw.experts.gate_up, hf_gu) and torch.equal(lw.experts.down, hf_dn)
        assert lw.experts.gate_up.shape == (4, 32, 64) and lw.experts.gate_up_bias.dtype == dtype
    lw = load_moe_layer(idx, "gpt_oss", 1)
    assert lw.router_bias_E is not None and lw.experts.gate_up_bias.dtype == torch.float32
    _reference_same_bits(lw.experts, "gptoss")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_nvfp4_per_expert(tmp_path, family):
    path, written, shared = write_quantized(tmp_path, family, NVFP4, NVFP4_CFG, fmt="per_expert",
                                            moe_intermediate_size=32)
    q = written[1]
    idx = CheckpointIndex(path)
    lw = load_moe_layer(idx, family, 1)
    assert lw.source_format == "per_expert"
    assert lw.experts.gate_up_input_scale.shape == (q.num_experts, 2)
    inp = idx.get("model.layers.1.mlp.experts.3.up_proj.input_scale")
    assert torch.equal(lw.experts.gate_up_input_scale[3, 1], inp)
    # The written ExpertWeights has no input scales; compare everything else.
    q_in = ExpertWeights(q.gate_up, q.down, quant=NVFP4, gate_up_scale=q.gate_up_scale, down_scale=q.down_scale,
                         gate_up_scale_2=q.gate_up_scale_2, down_scale_2=q.down_scale_2,
                         gate_up_input_scale=lw.experts.gate_up_input_scale,
                         down_input_scale=lw.experts.down_input_scale)
    _check_loaded(path, family, 1, q_in)
    _check_loaded(path, family, 1, q_in, ids=[2, 5])
    if shared:
        from moeflow.quant import dequantize_nvfp4

        wq, s, s2 = shared["model.layers.1.mlp.shared_experts.down_proj.weight"]
        assert torch.equal(lw.shared.down_HI, dequantize_nvfp4(wq, s, s2))
    _reference_same_bits(lw.experts)


# ------------------------------------------------------------------------------ errors name the key


P1 = "model.layers.1.mlp."


def _fp8(tmp_path, edit, qcfg=FP8_CFG, name="ck") -> str:
    return write_quantized(tmp_path / name, "qwen3_moe", fp8_block_spec((16, 16)), qcfg, fmt="per_expert",
                           layers=(0, 1), edit=edit)[0]


def test_missing_scale_is_named(tmp_path):
    key = P1 + "experts.3.down_proj.weight_scale_inv"
    path = _fp8(tmp_path, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=rf"missing key {key.replace('.', '[.]')}") as exc:
        load_moe_layer(path, "qwen3_moe", 1)
    assert exc.value.key == key
    load_moe_layer(path, "qwen3_moe", 0)  # the other layer is fine


def test_scale_grid_that_does_not_match_the_weight_is_named(tmp_path):
    key = P1 + "experts.0.gate_proj.weight_scale_inv"
    path = _fp8(tmp_path, lambda t: t.update({key: torch.ones(1, 2)}))
    with pytest.raises(CheckpointError, match=rf"{key.replace('.', '[.]')}: shape \[1, 2\], expected \[2, 2\]"):
        load_moe_layer(path, "qwen3_moe", 1)
    # Fused: a single ceil(2I/bn) grid where gate's and up's are expected.
    fused = write_quantized(tmp_path / "fused", "qwen3_moe", fp8_block_spec((128, 128)),
                            {**FP8_CFG, "weight_block_size": [128, 128]}, fmt="fused",
                            edit=lambda t: t.update({P1 + "experts.gate_up_proj_scale_inv": torch.ones(6, 1, 1)}))[0]
    with pytest.raises(CheckpointError, match=r"experts\.gate_up_proj_scale_inv: shape \[6, 1, 1\], expected \[6, 2, 1\]"):
        load_moe_layer(fused, "qwen3_moe", 1)


def test_wrong_dtypes_are_named(tmp_path):
    key = P1 + "experts.1.up_proj.weight_scale_inv"
    path = _fp8(tmp_path, lambda t: t.update({key: t[key].half()}), name="a")
    with pytest.raises(CheckpointError, match=rf"{key.replace('.', '[.]')}: dtype torch\.float16, expected torch\.float32"):
        load_moe_layer(path, "qwen3_moe", 1)
    wkey = P1 + "experts.1.up_proj.weight"
    path = _fp8(tmp_path, lambda t: t.update({wkey: t[wkey].float()}), name="b")
    with pytest.raises(CheckpointError, match=rf"{wkey.replace('.', '[.]')}: dtype torch\.float32, expected "
                                              r"torch\.float8_e4m3fn"):
        load_moe_layer(path, "qwen3_moe", 1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_scales_are_named(tmp_path, bad):
    key = P1 + "experts.2.gate_proj.weight_scale_inv"

    def edit(t):
        t[key] = t[key].clone()
        t[key][1, 0] = bad

    path = _fp8(tmp_path, edit)
    with pytest.raises(CheckpointError, match=rf"{key.replace('.', '[.]')}: holds a NaN or infinite value") as exc:
        load_moe_layer(path, "qwen3_moe", 1, dtype=torch.float32)
    assert exc.value.key == key
    load_moe_layer(path, "qwen3_moe", 1, experts=[0, 1])  # only the experts asked for are read


def test_e8m0_nan_byte_and_nvfp4_scale_2_are_named(tmp_path):
    key = P1 + "experts.down_proj_scales"

    def edit(t):
        t[key] = t[key].clone()
        t[key][1, 2, 0] = 255

    path = write_quantized(tmp_path / "m", "gpt_oss", MXFP4, MXFP4_CFG, fmt="fused", edit=edit,
                           intermediate_size=32)[0]
    with pytest.raises(CheckpointError, match=rf"{key.replace('.', '[.]')}: holds E8M0 byte 255 \(NaN\)"):
        load_moe_layer(path, "gpt_oss", 1)
    k2 = P1 + "experts.4.down_proj.weight_scale_2"
    path = write_quantized(tmp_path / "n", "qwen3_moe", NVFP4, NVFP4_CFG, fmt="per_expert", moe_intermediate_size=32,
                           edit=lambda t: t.update({k2: torch.tensor(float("nan"))}))[0]
    with pytest.raises(CheckpointError, match=rf"{k2.replace('.', '[.]')}: holds a NaN"):
        load_moe_layer(path, "qwen3_moe", 1)
    k3 = P1 + "experts.4.down_proj.input_scale"
    path = write_quantized(tmp_path / "o", "qwen3_moe", NVFP4, NVFP4_CFG, fmt="per_expert", moe_intermediate_size=32,
                           edit=lambda t: t.pop(k3))[0]
    with pytest.raises(CheckpointError, match=rf"missing key {k3.replace('.', '[.]')}"):
        load_moe_layer(path, "qwen3_moe", 1)


def test_unknown_quant_method_is_named(tmp_path):
    path = _fp8(tmp_path, None, qcfg={"quant_method": "bitnet"})
    with pytest.raises(CheckpointError, match=r"quantization_config\.quant_method='bitnet': unknown") as exc:
        load_moe_layer(path, "qwen3_moe", 1)
    assert exc.value.key == "quantization_config.quant_method"


def test_unpublished_layouts_are_refused(tmp_path):
    # An MXFP4 quantization_config over per-expert names: no published per-expert MXFP4 layout.
    path = _fp8(tmp_path, None, qcfg=MXFP4_CFG)
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_proj\.weight: MXFP4 is published for fused experts"):
        load_moe_layer(path, "qwen3_moe", 1)


# ------------------------------------------------------------------------------ scales no producer writes


@pytest.mark.parametrize("bad", [0.0, -0.0, -0.5], ids=["zero", "negative_zero", "negative"])
def test_zero_and_negative_fp8_scales_are_named(tmp_path, bad):
    """A 0 scale zeroes its block, a negative one flips it: both loaded silently before."""
    key = P1 + "experts.2.gate_proj.weight_scale_inv"

    def edit(t):
        t[key] = t[key].clone()
        t[key][1, 0] = bad

    path = _fp8(tmp_path, edit)
    with pytest.raises(CheckpointError, match=rf"{key.replace('.', '[.]')}: holds a scale <= 0 at index \(1, 0\)") \
            as exc:
        load_moe_layer(path, "qwen3_moe", 1)
    assert exc.value.key == key


def test_finite_fp8_scale_that_dequantizes_to_inf_is_named(tmp_path):
    """1e38 is a finite float32, but 448 * 1e38 is not: a block holding e4m3 448 became inf."""
    key = P1 + "experts.0.down_proj.weight_scale_inv"

    def edit(t):
        t[key] = t[key].clone()
        t[key][0, 1] = 1e38

    path = _fp8(tmp_path, edit)
    with pytest.raises(CheckpointError, match=rf"{key.replace('.', '[.]')}: holds a scale that overflows float32 "
                                              r"times 448, the largest value it multiplies at index \(0, 1\)"):
        load_moe_layer(path, "qwen3_moe", 1)


@pytest.mark.parametrize("part, value, what", [
    ("weight_scale_2", 0.0, "a scale <= 0"),
    ("input_scale", -1.0, "a scale <= 0"),
    ("weight_scale_2", 3e35, "a scale that overflows float32 times 2688"),
])
def test_bad_nvfp4_per_tensor_scales_are_named(tmp_path, part, value, what):
    key = P1 + f"experts.4.down_proj.{part}"
    path = write_quantized(tmp_path / "n", "qwen3_moe", NVFP4, NVFP4_CFG, fmt="per_expert", moe_intermediate_size=32,
                           edit=lambda t: t.update({key: torch.tensor(value)}))[0]
    with pytest.raises(CheckpointError, match=rf"{key.replace('.', '[.]')}: holds {what}"):
        load_moe_layer(path, "qwen3_moe", 1)


def test_zero_nvfp4_block_scale_is_named(tmp_path):
    key = P1 + "experts.1.up_proj.weight_scale"

    def edit(t):
        t[key] = t[key].clone()
        t[key][3, 1] = 0.0

    path = write_quantized(tmp_path / "n", "qwen3_moe", NVFP4, NVFP4_CFG, fmt="per_expert", moe_intermediate_size=32,
                           edit=edit)[0]
    with pytest.raises(CheckpointError, match=rf"{key.replace('.', '[.]')}: holds a scale <= 0 at index \(3, 1\)"):
        load_moe_layer(path, "qwen3_moe", 1)


@pytest.mark.parametrize("qcfg, field", [
    ({**FP8_CFG, "weight_block_size": [16.5, 16]}, r"quantization_config\.weight_block_size\[0\]=16\.5"),
    ({**FP8_CFG, "weight_block_size": [16, "16"]}, r"quantization_config\.weight_block_size\[1\]='16'"),
    ({**NVFP4_CFG, "group_size": 16.9}, r"quantization_config\.group_size=16\.9"),
], ids=["block_16.5", "block_str", "group_16.9"])
def test_non_integer_block_and_group_sizes_are_named(tmp_path, qcfg, field):
    """int(16.5) and int(16.9) were 16: the block size was read as something the config never said."""
    path = _fp8(tmp_path, None, qcfg=qcfg)
    with pytest.raises(CheckpointError, match=rf"{field}: expected an int"):
        load_moe_layer(path, "qwen3_moe", 1)
