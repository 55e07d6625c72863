"""Whole models from checkpoints in their stored format: moeflow.from_pretrained at real shapes.

Each row writes random weights in the row's stored format at the real model's shapes (as many
decoder layers as --layers asks; the JSON names the depth), loads the directory with
`moeflow.from_pretrained` and measures, in one process:

    write_s, checkpoint_bytes   writing the checkpoint (random bytes in the format; the weights
                                are random, the layout, names and scale grids are the release's)
    load_s, peak_gpu_bytes      from_pretrained wall time (warmup_s of it: moeflow.warmup, the kernels'
                                compile); torch.cuda.max_memory_allocated after load
    peak_host_rss_bytes_load    the process's peak RSS during the load (Linux VmHWM, reset before it)
    prefill_tok_s               one forward of batch 1, T = --prefill-T (2048), use_cache=False
    decode_tok_s[eager, B]      model.generate (greedy, --new-tokens) at B = 1, 16, 64
    decode_tok_s[graph, B]      moeflow.hf.StaticDecoder (every decode step one CUDA graph replay);
                                graph_b1_gpu_us_per_token: its kernels' GPU time per token at batch 1
                                (torch profiler), the MoE step's and the rest's, and the five longest
    roof_step_s                 bytes read per decode step at batch 1 / HBM read roof (measured here),
                                offloaded rows: + host->device bytes per step (measured from the cache
                                stats) / PCIe roof (measured here); roof_frac = roof_step_s / step time
    hf_*                        transformers' own model on the same shapes (bf16 experts, random init,
                                its best experts implementation) where its bf16 model fits the device;
                                where it does not, the row says what transformers would allocate
    accelerate_offload_*        mixtral offload row: transformers + accelerate device_map offload at the
                                same GPU budget (when accelerate is installed)

Rows (--rows; real shapes from the released configs):
    gpt-oss-120b        MXFP4 experts (fused _blocks/_scales), 36 layers, H 2880, I 2880, E 128, K 4
    gpt-oss-20b         MXFP4, 24 layers, E 32, K 4
    qwen3-30b-a3b       bf16, 48 layers, H 2048, I 768, E 128, K 8 (fused keys)
    qwen3-30b-a3b-fp8   FP8 block 128x128 (experts and dense linears, fused expert keys)
    mixtral-8x7b        bf16, 32 layers, H 4096, I 14336, E 8, K 2, experts offloaded (--offload-frac of
                        the experts in GPU slots)
    deepseek-v3         FP8 block, per-expert keys, 61 layers (3 dense), H 7168, I 2048, E 256 + 1 shared,
                        K 8, experts offloaded in FP8
gpt-oss rows use full attention in every layer (at the lengths decoded here, < 128 tokens, the window
cuts nothing) and transformers' eager attention (it has no sdpa path for gpt-oss's sinks), so
their one-graph decode is not run (StaticDecoder captures sdpa models only): the row says so.

    python benchmarks/bench_models.py --smoke --out /tmp/models.json          # tiny shapes, CPU, seconds
    python benchmarks/bench_models.py --rows gpt-oss-120b:12,qwen3-30b-a3b:16 --out $OUT/models.json

The JSON is rewritten after every row (a run cut short keeps the rows it finished); each row's
checkpoint is deleted after it (--keep keeps them), so the disk holds one row at a time.

Legend: B decode batch, T prefill tokens, E experts, K experts per token, H hidden, I intermediate.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import env_info  # noqa: E402

GIB = 1 << 30

# name -> family, stored format, expert key format, real depth, offloaded
ROWS: dict[str, dict] = {
    "gpt-oss-120b": dict(family="gpt_oss", fmt="mxfp4", keys="fused", depth=36, offload=False),
    "gpt-oss-20b": dict(family="gpt_oss", fmt="mxfp4", keys="fused", depth=24, offload=False),
    "qwen3-30b-a3b": dict(family="qwen3_moe", fmt="bf16", keys="fused", depth=48, offload=False),
    "qwen3-30b-a3b-fp8": dict(family="qwen3_moe", fmt="fp8_block", keys="fused", depth=48, offload=False),
    "mixtral-8x7b": dict(family="mixtral", fmt="bf16", keys="fused", depth=32, offload=True),
    "deepseek-v3": dict(family="deepseek_v3", fmt="fp8_block", keys="per_expert", depth=61, offload=True),
}


def make_config(row: str, layers: int, *, smoke: bool):
    """The transformers config of a row at `layers` decoder layers (smoke: tiny sizes, same structure)."""
    import transformers

    common = dict(num_hidden_layers=layers, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, dtype="bfloat16")
    if smoke:
        common.update(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096)
    if row.startswith("gpt-oss"):
        E = {"gpt-oss-120b": 128, "gpt-oss-20b": 32}[row]
        # its YaRN rope expects 32 x 4096 positions
        real = dict(vocab_size=201088, hidden_size=2880, num_attention_heads=64, num_key_value_heads=8)
        kw = dict(real, **common) if not smoke else common
        kw["max_position_embeddings"] = 131072
        return transformers.GptOssConfig(**kw, head_dim=16 if smoke else 64, intermediate_size=32 if smoke else 2880,
                                         num_local_experts=4 if smoke else E, num_experts_per_tok=2 if smoke else 4,
                                         sliding_window=128,
                                         layer_types=["full_attention"] * layers)
    if row.startswith("qwen3"):
        real = dict(vocab_size=151936, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                    max_position_embeddings=40960)
        kw = dict(real, **common) if not smoke else common
        return transformers.Qwen3MoeConfig(**kw, head_dim=16 if smoke else 128, intermediate_size=96 if smoke else 6144,
                                           moe_intermediate_size=32 if smoke else 768, num_experts=4 if smoke else 128,
                                           num_experts_per_tok=2 if smoke else 8, norm_topk_prob=True,
                                           decoder_sparse_step=1, mlp_only_layers=[])
    if row == "mixtral-8x7b":
        real = dict(vocab_size=32000, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=32768)
        kw = dict(real, **common) if not smoke else common
        return transformers.MixtralConfig(**kw, head_dim=16 if smoke else 128, intermediate_size=32 if smoke else 14336,
                                          num_local_experts=4 if smoke else 8, num_experts_per_tok=2)
    if row == "deepseek-v3":
        real = dict(vocab_size=129280, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                    max_position_embeddings=163840)
        kw = dict(real, **common) if not smoke else common
        mla = (dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
               if smoke else dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                  v_head_dim=128))
        return transformers.DeepseekV3Config(
            **kw, **mla, intermediate_size=64 if smoke else 18432, moe_intermediate_size=32 if smoke else 2048,
            n_routed_experts=4 if smoke else 256, n_shared_experts=1, num_experts_per_tok=2 if smoke else 8,
            n_group=2 if smoke else 8, topk_group=1 if smoke else 4, first_k_dense_replace=min(3, layers - 1),
            norm_topk_prob=True, routed_scaling_factor=2.5)
    raise ValueError(f"row={row!r}: expected one of {sorted(ROWS)}")


def _spec(fmt: str, smoke: bool):
    from moeflow.quant import MXFP4, fp8_block_spec

    if fmt == "mxfp4":
        return MXFP4
    if fmt == "fp8_block":
        return fp8_block_spec((16, 16) if smoke else (128, 128))
    return None


def _random_experts(E: int, H: int, I: int, spec, *, layout: str, interleaved: bool, bias: bool, gen_device):
    """Random ExpertWeights in the stored format; values ~0.02 like an initialised model's."""
    from moeflow.config import ExpertWeights

    g = torch.Generator(device=gen_device).manual_seed(E * 7 + H)
    bias_t = (torch.randn(E, 2 * I, generator=g, device=gen_device).mul_(0.02).bfloat16(),
              torch.randn(E, H, generator=g, device=gen_device).mul_(0.02).bfloat16()) if bias else (None, None)
    if spec is None:
        gu_shape = (E, 2 * I, H) if layout == "linear" else (E, H, 2 * I)
        dn_shape = (E, H, I) if layout == "linear" else (E, I, H)
        gu = torch.randn(gu_shape, generator=g, device=gen_device, dtype=torch.bfloat16).mul_(0.02)
        dn = torch.randn(dn_shape, generator=g, device=gen_device, dtype=torch.bfloat16).mul_(0.02)
        return ExpertWeights(gu, dn, *bias_t, layout=layout, interleaved=interleaved)
    if spec.format == "mxfp4":
        # random E2M1 nibbles, block exponents 2^-8: |w| <= 6 / 256
        gu = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, device=gen_device, dtype=torch.uint8)
        dn = torch.randint(0, 256, (E, H, I // 2), generator=g, device=gen_device, dtype=torch.uint8)
        gs = torch.full((E, 2 * I, H // 32), 119, dtype=torch.uint8, device=gen_device)
        ds = torch.full((E, H, I // 32), 119, dtype=torch.uint8, device=gen_device)
        return ExpertWeights(gu, dn, *bias_t, layout=layout, interleaved=interleaved, quant=spec,
                             gate_up_scale=gs, down_scale=ds)
    bn, bk = spec.block
    # bf16 draws (half the transient memory of f32: DeepSeek-V3's gate_up is 256 x 4096 x 7168)
    gu = torch.randn(E, 2 * I, H, generator=g, device=gen_device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    dn = torch.randn(E, H, I, generator=g, device=gen_device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    cd = lambda a, b: -(-a // b)  # noqa: E731
    gs = torch.full((E, 2 * cd(I, bn), cd(H, bk)), 0.02, device=gen_device)
    ds = torch.full((E, cd(H, bn), cd(I, bk)), 0.02, device=gen_device)
    return ExpertWeights(gu, dn, *bias_t, layout=layout, interleaved=interleaved, quant=spec,
                         gate_up_scale=gs, down_scale=ds)


def write_random_checkpoint(directory: str, config, row: str, *, smoke: bool, shard_gib: float = 4.0) -> dict:
    """Random weights of `config` in the row's stored format, written shard by shard; returns sizes and seconds."""
    from transformers import AutoModelForCausalLM

    from moeflow.checkpoint.write import (
        QUANTIZATION_CONFIGS,
        ShardWriter,
        dense_tensors,
        expert_tensors,
        write_config,
    )
    from moeflow.families import family_for

    t0 = time.perf_counter()
    r = ROWS[row]
    fam = family_for(r["family"])
    adapter = fam.checkpoint
    spec = _spec(r["fmt"], smoke)
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        skel = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    writer = ShardWriter(directory, shard_bytes=max(1 << 20, int(shard_gib * GIB)))
    g = torch.Generator(device=gen_device).manual_seed(0)
    moe = [i for i in range(config.num_hidden_layers) if adapter.is_moe_layer(config, i)]
    d = adapter.dims(config)
    expert_bytes = 0
    for name, t in skel.state_dict().items():
        if ".mlp.experts." in name:
            continue
        if "norm" in name or name.endswith("e_score_correction_bias") or name.endswith("sinks"):
            v = torch.ones(t.shape, dtype=t.dtype) if "norm" in name else torch.zeros(t.shape, dtype=t.dtype)
        else:
            v = torch.randn(t.shape, generator=g, device=gen_device, dtype=torch.float32).mul_(0.02).to(t.dtype)
        quantize = (spec is not None and spec.format == "fp8_block" and v.dim() == 2 and ".layers." in name
                    and name.endswith("proj.weight") and ".gate." not in name)
        writer.add_all(dense_tensors(name, v, spec if quantize else None))
        if ".layers." in name and name.endswith("input_layernorm.weight"):
            i = int(name.split(".layers.")[1].split(".")[0])
            if i in moe:
                w = _random_experts(d.E, d.H, d.I, spec, layout=fam.layout, interleaved=fam.interleaved,
                                    bias=fam.expert_bias, gen_device=gen_device)
                expert_bytes += w.nbytes
                writer.add_all(expert_tensors(adapter, i, w, fmt=r["keys"]))
                del w
    writer.close()
    qc = None
    if spec is not None:
        qc = dict(QUANTIZATION_CONFIGS[spec.format])
        if spec.format == "fp8_block":
            qc["weight_block_size"] = list(spec.block)
    write_config(directory, config, quantization_config=qc)
    return dict(write_s=time.perf_counter() - t0, checkpoint_bytes=writer.total_bytes, expert_bytes=expert_bytes)


class Row:
    """One row's measurements as JSON-ready dicts."""

    def __init__(self, name: str, args) -> None:
        self.name, self.args, self.out = name, args, {"row": name}

    def err(self, what: str, exc: BaseException) -> None:
        self.out.setdefault("errors", {})[what] = f"{type(exc).__name__}: {str(exc)[:400]}"
        print(f"  {self.name} {what}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def _reset_peak_rss() -> None:
    """Linux: restart the process's peak-RSS count (VmHWM), so the load's peak excludes the writing."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _peak_rss(field: str = "VmHWM") -> int | None:
    """Peak resident bytes since the last reset (VmHWM; "VmRSS": now), None where /proc is not there."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, reps: int = 1) -> float:
    best = math.inf
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _ids(B: int, T: int, V: int, device, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (B, T), generator=g).to(device)


@torch.no_grad()
def measure_model(model, row: Row, device, *, prefix: str = "", graph: bool = True) -> None:
    """prefill tok/s at T, eager decode tok/s at each B, graph decode tok/s (StaticDecoder)."""
    args, V = row.args, model.config.vocab_size
    T, N, P = args.prefill_T, args.new_tokens, 16
    try:
        ids = _ids(1, T, V, device)
        for _ in range(2):  # steady state of a repeated length: first sighting, then a layer-graph capture
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
        t = _timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1), device, reps=args.repeats)
        row.out[prefix + "prefill_tok_s"] = T / t
    except Exception as exc:  # noqa: BLE001 - a row records what failed and goes on
        row.err(prefix + "prefill", exc)
    for B in args.batches:
        try:
            ids = _ids(B, P, V, device, seed=B)
            kw = dict(do_sample=False, pad_token_id=0)
            # One untimed generate of the timed length: every KV length the timed call meets is then
            # seen (sdpa's cuDNN attention builds a plan per new length: a first 32-token generate
            # of the 8-layer qwen3 row took 2.96 s against 0.29 s once warm, H100), and so is the
            # step's T (its layer graph is captured at the second step).
            model.generate(ids, max_new_tokens=N, min_new_tokens=N, **kw)
            t = _timed(lambda ids=ids, kw=kw: model.generate(ids, max_new_tokens=N, min_new_tokens=N, **kw), device)
            row.out[f"{prefix}decode_tok_s_eager_B{B}"] = B * N / t
        except Exception as exc:  # noqa: BLE001
            row.err(f"{prefix}decode eager B={B}", exc)
        if not graph or device.type != "cuda":
            continue
        try:
            from moeflow.hf import StaticDecoder

            dec = StaticDecoder(model, batch_size=B, max_len=P + N + 1)
            dec.generate(ids, N)  # captures
            t = _timed(lambda dec=dec, ids=ids: dec.generate(ids, N), device)
            row.out[f"{prefix}decode_tok_s_graph_B{B}"] = B * N / t
            if B == 1:
                row.out[f"{prefix}graph_b1_gpu_us_per_token"] = _kernel_split(lambda dec=dec, ids=ids: dec.generate(ids, N), N)
            dec = None  # its static cache and graph go before the next batch size
        except Exception as exc:  # noqa: BLE001
            row.err(f"{prefix}decode graph B={B}", exc)


# Kernel names of the MoE step (router, align, expert GEMMs, combine): the rest of a decode step is
# transformers' attention, norms, embeddings and LM head.
_MOE_KERNELS = ("moe_", "_route_kernel", "router_", "_gemv", "align")


def _kernel_split(fn, tokens: int) -> dict:
    """GPU kernel time per token of fn() (torch profiler): the MoE kernels', everything else's, and the
    five longest kernels by name (us per token)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_name: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        if us is None:
            us = getattr(e, "cuda_time_total", 0.0)
        if us and not e.key.startswith(("cuda", "Memcpy", "Memset", "ProfilerStep")):
            by_name[e.key] = by_name.get(e.key, 0.0) + us / tokens
    if not by_name:
        return {"note": "the profiler saw no kernel inside the replays"}
    moe = sum(v for k, v in by_name.items() if any(m in k for m in _MOE_KERNELS))
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    return {"moe": round(moe, 2), "other": round(sum(by_name.values()) - moe, 2),
            "top": {k[:60]: round(v, 2) for k, v in top}}


def decode_bytes_b1(model, K: int) -> int:
    """Bytes one decode step at batch 1 reads: every resident parameter except the embedding table (one
    row) and the routed experts, plus K routed experts per MoE layer at their stored size."""
    from moeflow.hf import moe_layers

    layers = moe_layers(model)
    skip = {id(p) for p in model.get_input_embeddings().parameters()}
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip
                and p.device.type != "meta")
    per_expert = 0
    for layer in layers:
        w = layer.expert_weights if getattr(layer, "offload", None) is None else None
        if w is not None:
            dense -= sum(t.numel() * t.element_size() for t in _expert_tensors(w) if _is_param(model, t))
            per_expert += K * w.expert_bytes
    return dense + per_expert


def _expert_tensors(w):
    from moeflow.config import ExpertWeights

    return [t for n in ExpertWeights.TENSOR_FIELDS if (t := getattr(w, n)) is not None]


def _is_param(model, t) -> bool:
    return any(p is t for p in model.parameters())


def _roofs(device) -> dict:
    if device.type != "cuda":
        return {}
    from benchmarks.common import hbm_read_roof_bytes_per_s, pcie_roof_bytes_per_s

    return dict(hbm_Bps=hbm_read_roof_bytes_per_s(), pcie_Bps=pcie_roof_bytes_per_s())


def _offload_config(config, row: str, frac: float, smoke: bool):
    import moeflow
    from moeflow.checkpoint.families import adapter_for

    adapter = adapter_for(ROWS[row]["family"])
    d = adapter.dims(config)
    n_moe = sum(adapter.is_moe_layer(config, i) for i in range(config.num_hidden_layers))
    slots = max(d.K + 1, int(frac * d.E * n_moe))
    return moeflow.OffloadConfig(gpu_slots=slots, device=None if not smoke else "cpu")


def run_row(name: str, layers: int | None, args, device, roofs: dict) -> dict:
    import moeflow

    r = ROWS[name]
    layers = layers or (2 if args.smoke else r["depth"])
    config = make_config(name, layers, smoke=args.smoke)
    row = Row(name, args)
    row.out.update(layers=layers, real_depth=r["depth"], format=r["fmt"], keys=r["keys"])
    directory = os.path.join(args.workdir, name)
    shutil.rmtree(directory, ignore_errors=True)
    print(f"[{name}] writing {layers} layers to {directory}", flush=True)
    row.out.update(write_random_checkpoint(directory, config, name, smoke=args.smoke))
    print(f"[{name}] wrote {row.out['checkpoint_bytes'] / GIB:.2f} GiB in {row.out['write_s']:.1f} s", flush=True)
    offload = _offload_config(config, name, args.offload_frac, args.smoke) if r["offload"] else None
    if offload is not None:
        row.out["offload_gpu_slots"] = offload.gpu_slots
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    _reset_peak_rss()
    row.out["host_rss_bytes_before_load"] = _peak_rss("VmRSS")
    try:
        t0 = time.perf_counter()
        model = moeflow.from_pretrained(directory, device=device, dtype=torch.bfloat16, offload=offload,
                                        progress=not args.smoke, attn_implementation=_attn(name))
        row.out["load_s"] = time.perf_counter() - t0
        warm = model.moeflow_load.warmup
        row.out["warmup_s"] = warm.seconds if warm is not None else None  # (inside load_s)
    except Exception as exc:  # noqa: BLE001
        row.err("load", exc)
        return row.out
    row.out["peak_host_rss_bytes_load"] = _peak_rss()
    rep = model.moeflow_load
    row.out.update(expert_bytes_loaded=rep.expert_bytes, dense_bytes_loaded=rep.dense_bytes,
                   offloaded_bytes=rep.offloaded_bytes)
    if device.type == "cuda":
        row.out["peak_gpu_bytes_after_load"] = torch.cuda.max_memory_allocated(device)
    measure_model(model, row, device, graph=_attn(name) == "sdpa")
    if _attn(name) != "sdpa":
        row.out["graph_status"] = ("not run: transformers' gpt-oss attention is eager only (no sdpa: its sinks), "
                                   "and StaticDecoder's capture needs sdpa masks built on the device")
    if device.type == "cuda":
        row.out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
    K = config.num_experts_per_tok
    step_bytes = decode_bytes_b1(model, K)
    row.out["decode_bytes_b1_resident"] = step_bytes
    if roofs:
        roof = step_bytes / roofs["hbm_Bps"]
        if offload is not None:
            from moeflow.hf import moe_layers

            rt = moe_layers(model)[0].offload
            ids = _ids(1, 16, config.vocab_size, device, seed=5)
            rt.reset_stats()
            model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                           pad_token_id=0)
            copied = rt.stats().bytes_copied / args.new_tokens
            row.out["offload_bytes_copied_per_token_b1"] = copied
            roof += copied / roofs["pcie_Bps"]
        row.out["roof_step_s_b1"] = roof
        for kind in ("graph", "eager"):
            got = row.out.get(f"decode_tok_s_{kind}_B1")
            if got:
                row.out[f"roof_frac_{kind}_b1"] = roof * got
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    run_peers(name, config, row, device, directory, offload)
    if not args.keep:
        shutil.rmtree(directory, ignore_errors=True)
    return row.out


def _attn(row: str) -> str:
    """The attention implementation a row runs: sdpa, except gpt-oss (transformers has eager only)."""
    return "eager" if row.startswith("gpt-oss") else "sdpa"


def _hf_bf16_bytes(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in m.parameters())


def run_peers(name: str, config, row: Row, device, directory: str, offload) -> None:
    """transformers' bf16 model where it fits (random init, same shapes); accelerate offload for offload rows."""
    from transformers import AutoModelForCausalLM

    need = _hf_bf16_bytes(config)
    row.out["hf_bf16_bytes"] = need
    if name != "deepseek-v3":  # (its first 3 layers are dense: two small configs do not give its per-layer size)
        smoke = config.vocab_size == 256
        one, two = (_hf_bf16_bytes(make_config(name, n, smoke=smoke)) for n in (1, 2))
        depth = ROWS[name]["depth"]
        row.out["hf_bf16_bytes_full_depth"] = one + (depth - 1) * (two - one)  # what transformers allocates
    cap = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    if offload is None:
        if cap is not None and need > 0.85 * cap:
            row.out["hf_status"] = (f"not run: transformers' bf16 model is {need / GIB:.1f} GiB (its MXFP4 path "
                                    "without the hub kernels package dequantizes to bf16) > 0.85 x "
                                    f"{cap / GIB:.1f} GiB device memory")
            return
        try:
            torch.manual_seed(0)
            with torch.device(device):
                hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=_attn(name))
            hf.eval()
            impl = "default"
            for cand in ("grouped_mm", "batched_mm"):
                try:
                    hf.set_experts_implementation(cand)
                    impl = cand
                    break
                except Exception:  # noqa: BLE001 - not offered by this transformers
                    continue
            row.out["hf_experts_implementation"] = impl
            measure_model(hf, row, device, prefix="hf_", graph=_attn(name) == "sdpa")
            for k in [k for k in row.out if k.startswith("decode_tok_s_")]:
                if row.out.get("hf_" + k):
                    row.out["vs_hf_" + k[len("decode_tok_s_"):]] = row.out[k] / row.out["hf_" + k]
            if row.out.get("hf_prefill_tok_s") and row.out.get("prefill_tok_s"):
                row.out["vs_hf_prefill"] = row.out["prefill_tok_s"] / row.out["hf_prefill_tok_s"]
            del hf
        except Exception as exc:  # noqa: BLE001
            row.err("hf", exc)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return
    if device.type != "cuda":
        row.out["accelerate_status"] = "not run: CPU"
        return
    try:
        import accelerate  # noqa: F401
    except ImportError:
        row.out["accelerate_status"] = "not run: accelerate is not installed"
        return
    try:
        budget = row.out.get("peak_gpu_bytes", 0)
        hf = AutoModelForCausalLM.from_pretrained(directory, device_map="auto", dtype=torch.bfloat16,
                                                  max_memory={0: int(budget), "cpu": int(200 * GIB)})
        hf.eval()
        row.out["accelerate_gpu_budget_bytes"] = int(budget)
        ids = _ids(1, 16, config.vocab_size, device)
        n = 4
        with torch.no_grad():
            t = _timed(lambda hf=hf: hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                 pad_token_id=0), device)
        row.out["accelerate_offload_decode_tok_s_B1"] = n / t
        if row.out.get("decode_tok_s_eager_B1"):
            row.out["vs_accelerate_eager_B1"] = row.out["decode_tok_s_eager_B1"] / row.out[
                "accelerate_offload_decode_tok_s_B1"]
        del hf
    except Exception as exc:  # noqa: BLE001
        row.err("accelerate offload", exc)
    gc.collect()
    torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS),
                    help=f"comma list of NAME or NAME:LAYERS, NAME one of {', '.join(ROWS)}")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of rows named without :LAYERS (default: the real depth)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a check that the script runs)")
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--prefill-T", type=int, default=None, help="prefill tokens (default 2048; smoke 32)")
    ap.add_argument("--new-tokens", type=int, default=None, help="decode tokens per generate (default 32; smoke 4)")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,16,64; smoke 1,2)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--offload-frac", type=float, default=0.5,
                    help="offload rows: share of all experts held in GPU slots")
    ap.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    args = ap.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        ap.error(f"--layers={args.layers}: expected >= 1")
    rows: list[tuple[str, int | None]] = []
    for item in (r.strip() for r in args.rows.split(",") if r.strip()):
        name, _, n = item.partition(":")
        if name not in ROWS:
            ap.error(f"--rows: unknown row {name!r}; expected some of {list(ROWS)}")
        if n and (not n.isdigit() or int(n) < 1):
            ap.error(f"--rows: {item!r}: LAYERS must be an int >= 1")
        rows.append((name, int(n) if n else args.layers))
    args.prefill_T = args.prefill_T or (32 if args.smoke else 2048)
    args.new_tokens = args.new_tokens or (4 if args.smoke else 32)
    args.batches = [int(b) for b in (args.batches or ("1,2" if args.smoke else "1,16,64")).split(",")]
    if args.workdir is None:
        import tempfile

        args.workdir = tempfile.mkdtemp(prefix="moeflow_bench_models_")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    roofs = _roofs(device)
    meta = dict(env_info(), command=" ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
                roofs=roofs, device_type=device.type)
    out = []
    for name, layers in rows:
        try:
            out.append(run_row(name, layers, args, device, roofs))
        except Exception as exc:  # noqa: BLE001 - the other rows still run
            out.append({"row": name, "errors": {"row": f"{type(exc).__name__}: {str(exc)[:400]}"}})
            print(f"[{name}] failed: {type(exc).__name__}: {exc}", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": out}, indent=1, default=str))
        print(json.dumps(out[-1], default=str), flush=True)
    if not args.keep and args.workdir.startswith(os.path.join(os.path.sep, "tmp")):
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
