"""moeflow.from_pretrained on tiny checkpoints written in each stored format's exact tensor names.

Each case quantizes a tiny HF model's experts (and, where the format's releases do, its dense
linear weights) with moeflow's quantizer (moeflow.checkpoint.write), loads the directory with
moeflow.from_pretrained and checks: every MoE layer's experts are held in the stored dtype
(never dequantized), the logits match the oracle within TOL, greedy tokens are equal.

The oracle: transformers' own model where it loads the checkpoint here (bf16 mixtral:
`AutoModelForCausalLM.from_pretrained`; gpt-oss MXFP4: transformers' own MXFP4 dequantizer
`convert_moe_packed_tensors` on the written blocks); elsewhere (FP8 and NVFP4: transformers'
quantizers need accelerate, which CI does not install) the same tiny HF model with every
quantized tensor replaced by moeflow's float32 dequantization, run unpatched.

Legend: E experts, H hidden, I intermediate per expert.
"""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch
from hf_configs import tiny_model

import moeflow
from moeflow.checkpoint import CheckpointError
from moeflow.checkpoint.write import write_model_checkpoint
from moeflow.hf import moe_layers
from moeflow.quant import MXFP4, NVFP4, fp8_block_spec
from moeflow.quant.formats import dequantize_fp8_block, dequantize_nvfp4
from moeflow.testing import assert_close

pytestmark = pytest.mark.usefixtures("one_thread", "hf_quiet")

# f32 everywhere: moeflow's reference experts vs HF's expert loop differ in summation order only
# (max-abs seen ~1e-7 on these logits); bf16 mixtral: one bf16 rounding of the output (~4e-3).
TOL = dict(rtol=1e-4, atol=1e-4)
TOL_BF16 = dict(rtol=2e-2, atol=2e-2)
IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])

# name -> (family, spec, fmt, dense quantized, model overrides, dtype written)
CASES = {
    "gpt_oss-mxfp4": ("gpt_oss", MXFP4, "fused", False, dict(intermediate_size=32), torch.float32),
    "deepseek_v3-fp8-per_expert": ("deepseek_v3", fp8_block_spec((16, 16)), "per_expert", True, {}, torch.float32),
    "qwen3_moe-fp8-fused": ("qwen3_moe", fp8_block_spec((16, 16)), "fused", True, {}, torch.float32),
    "qwen3_moe-nvfp4-modelopt": ("qwen3_moe", NVFP4, "per_expert", True, dict(moe_intermediate_size=32),
                                 torch.float32),
    "mixtral-bf16": ("mixtral", None, "per_expert", False, {}, torch.bfloat16),
}
STORED = {None: None, "fp8_block": torch.float8_e4m3fn, "mxfp4": torch.uint8, "nvfp4": torch.uint8}


def _write(tmp_path, case: str):
    family, spec, fmt, dense, overrides, dtype = CASES[case]
    model = tiny_model(family, **overrides).to(dtype)
    model.config.dtype = dtype
    d, written, quantized = write_model_checkpoint(tmp_path / case, model, family, spec=spec, fmt=fmt, dense=dense)
    return d, model, written, quantized


def _oracle(case: str, d: str, model, written, quantized):
    """The model the loaded one must match (see the module docstring), unpatched."""
    family, spec, *_ = CASES[case]
    if spec is None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(d).eval()
    ref = copy.deepcopy(model).eval()
    sd = dict(ref.named_parameters())
    with torch.no_grad():
        for i, q in written.items():
            ex = ref.model.layers[i].mlp.experts
            if spec.format == "mxfp4":
                from transformers.integrations.mxfp4 import convert_moe_packed_tensors

                E, H = q.num_experts, q.hidden_size
                gu = convert_moe_packed_tensors(q.gate_up.reshape(E, 2 * q.intermediate_size, -1, 16),
                                                q.gate_up_scale, dtype=torch.float32)
                dn = convert_moe_packed_tensors(q.down.reshape(E, H, -1, 16), q.down_scale, dtype=torch.float32)
                ex.gate_up_proj.copy_(gu)
                ex.down_proj.copy_(dn)
            else:
                deq = q.dequantize(torch.float32)
                ex.gate_up_proj.copy_(deq.gate_up)
                ex.down_proj.copy_(deq.down)
        for key, parts in quantized.items():
            if spec.format == "fp8_block":
                sd[key].copy_(dequantize_fp8_block(parts[0], parts[1], spec.block, torch.float32))
            else:
                sd[key].copy_(dequantize_nvfp4(*parts, torch.float32))
    return ref


def _greedy(model, n: int = 6) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(IDS, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0)


def _check_stored(model, case: str) -> None:
    family, spec, *_, dtype = CASES[case]
    want = STORED[spec.format if spec is not None else None] or dtype
    layers = moe_layers(model)
    assert layers, "no moeflow layer"
    for layer in layers:
        w = layer.expert_weights
        assert w.gate_up.dtype == want and w.down.dtype == want, (case, w.gate_up.dtype, want)
        assert w.quant == spec, (case, w.quant)


@pytest.mark.parametrize("case", list(CASES))
def test_loads_stored_format_and_matches_oracle(tmp_path, case):
    d, model, written, quantized = _write(tmp_path, case)
    got = moeflow.from_pretrained(d, device="cpu", progress=False)
    _check_stored(got, case)
    rep = got.moeflow_load
    assert rep.patch is not None and len(rep.patch) == len(written)
    # + the NVFP4 per-projection f32 input scales, which the written ExpertWeights does not hold
    extra = sum(3 * 4 * w.num_experts for w in written.values()) if CASES[case][1] is NVFP4 else 0
    assert rep.expert_bytes == sum(w.nbytes for w in written.values()) + extra
    ref = _oracle(case, d, model, written, quantized)
    with torch.no_grad():
        a, b = got(IDS).logits, ref(IDS).logits
    tol = TOL_BF16 if CASES[case][5] == torch.bfloat16 else TOL
    assert a.dtype == b.dtype
    assert_close(a.float(), b.float(), **tol, what=f"{case} logits")
    assert torch.equal(_greedy(got), _greedy(ref)), case


@pytest.mark.parametrize("case", ["gpt_oss-mxfp4", "deepseek_v3-fp8-per_expert", "mixtral-bf16"])
def test_offload_keeps_stored_format_and_logits(tmp_path, case):
    d, *_ = _write(tmp_path, case)
    resident = moeflow.from_pretrained(d, device="cpu", progress=False)
    K = resident.config.num_experts_per_tok
    off = moeflow.from_pretrained(d, device="cpu", progress=False,
                                  offload=moeflow.OffloadConfig(gpu_slots=K + 1, device="cpu"))
    rep = off.moeflow_load
    assert rep.offloaded_bytes == rep.expert_bytes > 0 and rep.patch.offload
    runtime = moe_layers(off)[0].offload
    spec = CASES[case][1]
    assert runtime.store.quant == spec
    with torch.no_grad():
        a, b = off(IDS).logits, resident(IDS).logits
    assert_close(a.float(), b.float(), rtol=0, atol=0, what=f"{case} offloaded logits")
    assert torch.equal(_greedy(off), _greedy(resident))


def test_dtype_other_than_stored_casts_unquantized_experts(tmp_path):
    """dtype=float32 on a bf16 checkpoint (as transformers' from_pretrained casts): plain experts are
    cast to the activations' dtype, and the logits are the bf16 model's to bf16 rounding."""
    d, *_ = _write(tmp_path, "mixtral-bf16")
    stored = moeflow.from_pretrained(d, device="cpu", progress=False)
    wide = moeflow.from_pretrained(d, device="cpu", dtype=torch.float32, progress=False)
    for layer in moe_layers(wide):
        assert layer.expert_weights.gate_up.dtype == torch.float32
    with torch.no_grad():
        a, b = wide(IDS).logits, stored(IDS).logits
    assert a.dtype == torch.float32
    assert_close(a, b.float(), **TOL_BF16, what="f32 load vs bf16 load logits")


# ------------------------------------------------------------------------------ bad input is named


def _qwen_fp8(tmp_path, **kw):
    d, *_ = write_model_checkpoint(tmp_path / "ck", tiny_model("qwen3_moe"), "qwen3_moe",
                                   spec=fp8_block_spec((16, 16)), fmt="fused", dense=True, shards=3, **kw)
    return d


def test_missing_shard_is_named(tmp_path):
    d = _qwen_fp8(tmp_path)
    shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(shards) >= 3, shards
    os.remove(os.path.join(d, shards[1]))
    with pytest.raises(CheckpointError, match=shards[1]):
        moeflow.from_pretrained(d, device="cpu", progress=False)


def test_scale_grid_that_does_not_match_is_named(tmp_path):
    key = "model.layers.0.self_attn.q_proj.weight_scale_inv"

    def edit(t):
        t[key] = t[key][:1].contiguous()

    d = _qwen_fp8(tmp_path, edit=edit)
    with pytest.raises(CheckpointError, match=key):
        moeflow.from_pretrained(d, device="cpu", progress=False)

    def drop(t):
        del t[key]

    d = _qwen_fp8(tmp_path / "dropped", edit=drop)
    with pytest.raises(CheckpointError, match=f"q_proj.weight: stored as torch.float8_e4m3fn.*{key} is missing"):
        moeflow.from_pretrained(d, device="cpu", progress=False)

    ekey = "model.layers.1.mlp.experts.down_proj_scale_inv"

    def edit_expert(t):
        t[ekey] = t[ekey][:, :1].contiguous()

    d = write_model_checkpoint(tmp_path / "ck2", tiny_model("qwen3_moe"), "qwen3_moe",
                               spec=fp8_block_spec((16, 16)), fmt="fused", edit=edit_expert)[0]
    with pytest.raises(CheckpointError, match=ekey):
        moeflow.from_pretrained(d, device="cpu", progress=False)


def test_unknown_format_and_stray_key_are_named(tmp_path):
    d = _qwen_fp8(tmp_path)
    with open(os.path.join(d, "config.json")) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with open(os.path.join(d, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    with pytest.raises(CheckpointError, match="awq"):
        moeflow.from_pretrained(d, device="cpu", progress=False)

    def stray(t):
        t["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)

    d = write_model_checkpoint(tmp_path / "ck3", tiny_model("qwen3_moe"), "qwen3_moe", edit=stray)[0]
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.extra.weight"):
        moeflow.from_pretrained(d, device="cpu", progress=False)


def test_bad_arguments_are_named(tmp_path):
    d = write_model_checkpoint(tmp_path / "ck", tiny_model("qwen3_moe"), "qwen3_moe")[0]
    with pytest.raises(TypeError, match="dtype"):
        moeflow.from_pretrained(d, dtype=torch.int8, device="cpu")
    with pytest.raises(TypeError, match="offload"):
        moeflow.from_pretrained(d, device="cpu", offload={"gpu_slots": 4})
    with pytest.raises(ValueError, match="ep_mode"):
        moeflow.from_pretrained(d, device="cpu", ep_mode="ring")
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="warmup_tokens"):
            moeflow.from_pretrained(d, device="cpu", warmup_tokens=bad)
    with pytest.raises(CheckpointError, match="not a directory"):
        moeflow.from_pretrained(os.path.join(d, "nope"), device="cpu")


def test_progress_line_without_a_bar(tmp_path, capsys):
    d = write_model_checkpoint(tmp_path / "ck", tiny_model("qwen3_moe"), "qwen3_moe")[0]
    from moeflow.pretrained import _Progress

    p = _Progress(2 ** 30, True)
    p.bar = None  # as without tqdm
    p.update(2 ** 29, "layer 0")
    assert "layer 0: 0.50 / 1.00 GiB" in capsys.readouterr().err
    assert moeflow.from_pretrained(d, device="cpu", progress=False).moeflow_load.seconds > 0


# ------------------------------------------------------------------------------ expert parallelism


def _ep_worker(rank: int, W: int, port: int, dirs: dict[str, str], out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W)
    try:
        res = {}
        for case, d in dirs.items():
            m = moeflow.from_pretrained(d, device="cpu", progress=False, ep_group=dist.group.WORLD)
            layers = moe_layers(m)
            with torch.no_grad():
                logits = m(IDS).logits
            res[case] = (logits, [layer.expert_weights.num_experts for layer in layers],
                         [layer.expert_weights.gate_up.dtype for layer in layers], m.moeflow_load.expert_bytes)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_expert_parallel_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp
    from ep_spawn import free_port

    cases = ["gpt_oss-mxfp4", "deepseek_v3-fp8-per_expert"]
    dirs, want = {}, {}
    for case in cases:
        d, *_ = _write(tmp_path, case)
        dirs[case] = d
        full = moeflow.from_pretrained(d, device="cpu", progress=False)
        with torch.no_grad():
            want[case] = (full(IDS).logits, full.moeflow_load.expert_bytes)
    ctx = mp.get_context("spawn")
    port, out_dir = free_port(), str(tmp_path)
    procs = [ctx.Process(target=_ep_worker, args=(r, 2, port, dirs, out_dir), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    for r in range(2):
        path = os.path.join(out_dir, f"rank{r}.pt")
        assert os.path.exists(path), f"rank {r} wrote no result (exit code {procs[r].exitcode})"
        res = torch.load(path)
        for case in cases:
            logits, counts, dtypes, nbytes = res[case]
            E = {"gpt_oss-mxfp4": 4, "deepseek_v3-fp8-per_expert": 8}[case]
            assert set(counts) == {E // 2}, (case, counts)  # each rank read its half only
            assert nbytes * 2 == want[case][1]
            assert set(dtypes) == {STORED[CASES[case][1].format]}
            assert_close(logits, want[case][0], **TOL, what=f"{case} rank {r} logits")


# ------------------------------------------------------------------------------ on the GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["gpt_oss-mxfp4", "qwen3_moe-fp8-fused", "deepseek_v3-fp8-per_expert",
                                  "qwen3_moe-nvfp4-modelopt", "mixtral-bf16"])
def test_cuda_load_keeps_stored_bytes_and_matches_cpu(tmp_path, case):
    """On CUDA (bf16 activations): experts stored as written, on the device; logits within bf16 error of the
    CPU f32 load; peak device memory while loading within what the model keeps plus one layer's experts
    (per-expert checkpoints are stacked into the fused layout on the device) plus 8 MiB."""
    d, *_ = _write(tmp_path, case)
    cpu = moeflow.from_pretrained(d, device="cpu", dtype=torch.float32, progress=False)
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    # warmup_tokens=0: the load's own peak (the warm-up's transient activations up to T = 8192 are
    # workspace of forwards, not of loading; tests/test_warming.py runs it)
    got = moeflow.from_pretrained(d, device=dev, dtype=torch.bfloat16, progress=False, warmup_tokens=0)
    peak = torch.cuda.max_memory_allocated(dev) - base
    kept = torch.cuda.memory_allocated(dev) - base
    rep = got.moeflow_load
    layer = max(w.expert_weights.nbytes for w in moe_layers(got))
    assert kept <= rep.expert_bytes + rep.dense_bytes + (8 << 20), (kept, rep)
    assert peak <= rep.expert_bytes + rep.dense_bytes + layer + (8 << 20), (peak, rep)
    _check_stored(got, case)
    assert all(layer.expert_weights.gate_up.device.type == "cuda" for layer in moe_layers(got))
    with torch.no_grad():
        a = got(IDS.to(dev)).logits.float().cpu()
        b = cpu(IDS).logits
    assert_close(a, b, rtol=5e-2, atol=5e-2, what=f"{case} cuda bf16 logits vs cpu f32")
