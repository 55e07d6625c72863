"""End to end: a transformers MoE model, unpatched vs `moeflow.patch_model`, through HF's own APIs.

One model per standard shape (shared/spec/benchmarks.md), random weights (torch.manual_seed, HF's own
init, built on the GPU in bf16), L decoder layers, every layer MoE, vocab 4096 (so the LM head and
embedding stay small next to L MoE layers). Attention is at the real model's sizes except for
deepseek-v3, whose MLA keeps its ranks and head dims but has 32 heads instead of 128 (so an sdpa
math fallback at T = 8192 fits beside the experts; attention is "rest" here):

    qwen3-30b-a3b  Qwen3MoeConfig    H 2048, I 768,   E 128, K 8, 32 heads / 4 kv, head_dim 128
    mixtral-8x7b   MixtralConfig     H 4096, I 14336, E 8,   K 2, 32 heads / 8 kv, head_dim 128
    deepseek-v3    DeepseekV3Config  H 7168, I 2048,  E 256 + 1 shared, K 8, n_group 8, topk_group 4,
                                     first_k_dense_replace 0, q_lora 1536, kv_lora 512, 32 heads
    gpt-oss-120b   GptOssConfig      H 2880, I 2880,  E 128, K 4, 64 heads / 8 kv, head_dim 64

L is --layers (8), lowered per shape until the model fits the device twice over (bf16 while timing,
then the same instance converted in place to fp32 for the reference; deepseek-v3 gets 2 layers on
an H200): the chosen L and the bytes are printed and stored in the JSON meta.

Variants (--variants, default hf,auto,triton_bi), all on the *same model instance*: "hf" is the model
as built (its default experts implementation, recorded as `hf_experts_implementation`); "no_moe"
(prefill and decode points only) puts a module that returns its input in place of every MoE block, so its row
is the rest of the model's wall time, a floor no MoE implementation beats in eager mode; any other
name X is `moeflow.patch_model(model, experts=X)` before the point and `moeflow.unpatch_model(model)`
after it (the weights are shared, never copied). patch_model replays every MoE step from a CUDA graph
cached per token count (`layer_graphs=True`, its default: the timed repeats replay); "X+eager" patches
with `layer_graphs=False` (every step eager); "X+graphs" is X with its graphs named explicitly.

Metrics (one JSON row per shape x variant x metric x parameter; `status` says ok / error / n/a):
    prefill_tok_s, prefill_ms     one forward of batch 1, seq T, use_cache=False, logits_to_keep=1
                                  (what a server computes at prefill); median of --repeats, CUDA events.
    decode_tok_s, decode_ms_per_step
                                  model.generate, greedy, prompt of --prompt-len random tokens, batch B,
                                  min_new_tokens = max_new_tokens = N: decode = (t(N) - t(1)) / (N - 1),
                                  so the prompt's prefill is taken out; generate_tok_s = B*N / t(N).
    decode_tokens_equal_hf        fraction of the batch-1 greedy tokens equal to the hf variant's.
    layer_ms (part=router|experts|shared|moe_glue|rest), head_ms, forward_gpu_busy_ms/_span_ms
                                  from a torch.profiler trace of one prefill forward at T (2048):
                                  forward hooks open record_function ranges around the router module
                                  (gate / router), the experts module, the shared expert module, the
                                  whole MoE block and the LM head; on a patched model around
                                  MoELayer.route and MoELayer.experts_forward (instance wrappers, removed
                                  after). Each CUDA kernel / memcpy / memset is attributed through its
                                  launch's correlation id to the innermost range open at launch time;
                                  moe_glue = inside the block but outside the three parts; rest =
                                  attention, norms, embedding (per layer = total / L). A part whose range
                                  never opened, or a trace where > 2% of kernel time has no launch,
                                  is "n/a" (a kernel without a launch event is attributed by name only
                                  if it is one of moeflow's: _router_logits / _reduce_splits / _route ->
                                  router, moe_align / moe_gate_up / moe_down / moe_combine -> experts).
                                  On CPU the parts are the ranges' inclusive CPU wall times.
    syncs_per_prefill, syncs_per_decode_token
                                  host-blocking CUDA runtime calls in the profiler's CPU events inside
                                  the measured call: cuda/cuStream|Device|Ctx|EventSynchronize plus
                                  blocking cudaMemcpy device-to-host (a cudaMemcpyAsync D2H is followed by
                                  its own cudaStreamSynchronize, counted once). Per decode token =
                                  (count(generate N) - count(generate 1)) / (N - 1).
    logits_rel_l2, top1_agree     all logits of one forward (batch 1, --accuracy-T tokens) against the
                                  same model converted in place to fp32 (HF "eager" experts), at the end
                                  of the shape.
    graph_decode_tok_s, static_eager_decode_tok_s, graph_tokens_equal_eager, graph_capture_s
                                  (--graphs only) greedy decode through moeflow.hf.StaticDecoder:
                                  static cache, each step replayed from one CUDA graph, against the
                                  same recipe run eagerly (its tokens must be equal); per step =
                                  (t(N) - t(1)) / (N - 1). A refused model (eager attention,
                                  sliding-window cache layers) is recorded as the row's status.

    compiled_decode_tok_s, compiled_tokens_equal_eager, compiled_compile_s
                                  (--compiled only) transformers' compiled decode path: generate with
                                  cache_implementation="static" and compile_config=CompileConfig(fullgraph=True,
                                  mode=--compile-mode, default "reduce-overhead"): transformers compiles the
                                  decode step (its prefill stays eager). hf runs it once per experts
                                  implementation of --compiled-hf-experts (row field `experts`; the best of
                                  them is the row to beat); a patched variant runs its moeflow ops inside the
                                  compiled graph (moeflow.hf.op). Per step = (t(N) - t(1)) / (N - 1) after two
                                  warm-up generates (compile, CUDA-graph recording); tokens are compared with
                                  the same variant's eager greedy tokens (the decode point's, same prompt;
                                  that point runs first here when --points left it out).
                                  Compare with decode_tok_s (eager) and graph_decode_tok_s (StaticDecoder).
    fresh_prefill_tok_s           (--fresh-prefill only) prefill as users send it: --fresh-count prompts of
                                  batch 1, each a length T in --fresh-T (512..8192) seen once (seeded,
                                  distinct, none equal to a warm-up length nor to another variant's: the
                                  attention's per-length plans stay cold for each), one forward each (use_cache=False,
                                  logits_to_keep=1); value = sum T / sum of the forwards' times (each timed
                                  alone, CUDA-synchronised); detail lists the per-length ms. A moeflow
                                  variant first runs moeflow.warmup up to the largest length (what
                                  from_pretrained does at load; detail.warmup_s), then every variant runs two
                                  forwards at lengths outside the list. Layer graphs capture a T only at its
                                  second sighting, so none replays here.

Order and budget: per shape, tier 1 first (prefill at T = 2048, decode b1 and b16, accuracy logits,
the profiler split, decode syncs), then tier 2 (the other T and batches), then tier 3 (--graphs).
A tier-2/3 point starts only if its estimated cost plus a reserve for the tier-1 points of the
shapes still to come fits in --time-budget-s; every point starts only if it fits. Skipped points
and the reason are in meta["skipped"] / meta["stopped"]. A failing point (OOM, an exception in a
variant) is recorded with its error text and the run goes on. Benchmarks measure; nothing here
asserts a time.

    python3 benchmarks/bench_e2e.py --shapes all --quick                 # first GPU pass (~6 min)
    python3 benchmarks/bench_e2e.py --shapes qwen3-30b-a3b --layers 8 --graphs
    python3 benchmarks/bench_e2e.py --shapes all --layers 2 --points decode,graphs,compiled,fresh_prefill \
        --decode-batches 1,16 --variants hf,auto --no-accuracy                # compiled decode, fresh prefill
    python3 benchmarks/bench_e2e.py --tiny                               # GPU smoke run, tiny shapes
    python3 benchmarks/bench_e2e.py --cpu --tiny --out /tmp/e2e.json     # CPU check of the script
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import STANDARD_SHAPES, env_info, format_table, time_cpu, time_cuda, write_json  # noqa: E402

SHAPE_ORDER = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-120b")
VOCAB = 4096
TINY_VOCAB = 256
GIB = 1 << 30

# Range names (record_function) and the part each one stands for.
R_FORWARD, R_BLOCK, R_ROUTER, R_EXPERTS, R_SHARED, R_HEAD = (
    "e2e::forward", "e2e::moe_block", "e2e::router", "e2e::experts", "e2e::shared", "e2e::head")
RANGE_PART = {R_ROUTER: "router", R_EXPERTS: "experts", R_SHARED: "shared", R_BLOCK: "moe_glue",
              R_HEAD: "head", R_FORWARD: "rest"}
PARTS = ("router", "experts", "shared", "moe_glue", "rest")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuEventSynchronize")
BLOCKING_D2H = ("cudaMemcpy", "cuMemcpyDtoH", "cuMemcpyDtoH_v2", "cuMemcpy")
# Fallback for kernels whose launch event is missing (e.g. a driver-API launch the profiler did not record):
# moeflow's own Triton kernels by name (moeflow/kernels/*.py).
NAME_PARTS = (("router", re.compile(r"_router_logits_kernel|_reduce_splits_kernel|_route_kernel")),
              ("experts", re.compile(r"moe_align|moe_gate_up_kernel|moe_down_kernel|moe_combine_kernel")))
UNMATCHED_MAX = 0.02  # fraction of kernel time without a launch event beyond which a split is n/a

# Rough costs (s) of one point over all variants before any has been measured; replaced by measurements.
DEFAULT_COST = {"build": 20.0, "prefill": 10.0, "decode": 12.0, "accuracy": 5.0, "profile": 15.0,
                "decode_syncs": 10.0, "graphs": 120.0, "reference": 10.0, "compiled": 60.0, "fresh_prefill": 20.0}
DEFAULT_TIER1_PER_SHAPE = 75.0


# --------------------------------------------------------------------------- configs
def shape_config(name: str, layers: int, *, tiny: bool):
    """The transformers config of a standard shape (tiny: hidden 64, 4 experts, 2 heads of 16)."""
    import transformers

    s = STANDARD_SHAPES[name]
    H, I, E, K = s["H"], s["I"], s["E"], s["K"]
    heads = {"qwen3-30b-a3b": (32, 4, 128), "mixtral-8x7b": (32, 8, 128), "deepseek-v3": (32, 32, 64),
             "gpt-oss-120b": (64, 8, 64)}[name]
    if tiny:
        H, I, E, K, heads = 64, 32, 4, 2, (4, 2, 16)
    common = dict(vocab_size=TINY_VOCAB if tiny else VOCAB, hidden_size=H, num_hidden_layers=layers,
                  num_attention_heads=heads[0], num_key_value_heads=heads[1], tie_word_embeddings=False,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=16384)
    if name == "qwen3-30b-a3b":
        cfg = transformers.Qwen3MoeConfig(**common, head_dim=heads[2], intermediate_size=3 * I,
                                          moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    elif name == "mixtral-8x7b":
        cfg = transformers.MixtralConfig(**common, head_dim=heads[2], intermediate_size=I, num_local_experts=E,
                                         num_experts_per_tok=K)
    elif name == "deepseek-v3":
        mla = (dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16)
               if tiny else dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128))
        groups = (2, 1) if tiny else (8, 4)
        cfg = transformers.DeepseekV3Config(**common, **mla, intermediate_size=3 * I, moe_intermediate_size=I,
                                            n_routed_experts=E, n_shared_experts=s["shared"], num_experts_per_tok=K,
                                            n_group=groups[0], topk_group=groups[1], first_k_dense_replace=0,
                                            norm_topk_prob=True, routed_scaling_factor=2.5)
    elif name == "gpt-oss-120b":
        common["max_position_embeddings"] = 131072  # its YaRN rope expects 32 x 4096
        cfg = transformers.GptOssConfig(**common, head_dim=heads[2], intermediate_size=I, num_local_experts=E,
                                        num_experts_per_tok=K, sliding_window=8 if tiny else 128,
                                        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                                     for i in range(layers)])
    else:
        raise ValueError(f"shape {name!r}: expected one of {SHAPE_ORDER}")
    return cfg


def _from_config(cfg, dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except TypeError:  # an older transformers spelling
        return AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)


def model_bytes(cfg) -> int:
    with torch.device("meta"):
        m = _from_config(cfg, torch.bfloat16)
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


def fit_layers(name: str, want: int, *, tiny: bool, device: torch.device, accuracy: bool, max_T: int) -> dict:
    """Layers that fit: bf16 weights + activations while timing, 2x (fp32 reference) at the end."""
    b1 = model_bytes(shape_config(name, 1, tiny=tiny))
    b2 = model_bytes(shape_config(name, 2, tiny=tiny))
    per_layer, rest = b2 - b1, 2 * b1 - b2
    info = {"requested_layers": want, "bytes_per_layer_bf16": per_layer, "bytes_outside_layers_bf16": rest}
    if device.type != "cuda":
        info.update(layers=want, device_bytes=None)
        return info
    total = torch.cuda.get_device_properties(device).total_memory
    cap = 0.92 * total - 6 * GIB  # the allocator, cuBLAS / Triton workspaces, CUDA context
    cfg = shape_config(name, 1, tiny=tiny)
    # eager attention (gpt-oss) or a possible sdpa math fallback (MLA: q/k and v head dims differ)
    # materialises heads x T x T scores, in bf16 and f32, a few times
    attn = 0
    if name in ("gpt-oss-120b", "deepseek-v3"):
        attn = cfg.num_attention_heads * max_T * max_T * 10
    act = 10 * GIB + attn
    fit_bf16 = (cap - act - rest) // per_layer
    fit = fit_bf16
    if accuracy:
        fit = min(fit, (cap - 4 * GIB - 2 * rest) // (2 * per_layer))
    info.update(layers=int(max(1, min(want, fit))), device_bytes=total, activation_reserve=act,
                fits_bf16=int(fit_bf16), fits_with_fp32_reference=int(fit))
    return info


def build_model(cfg, device: torch.device, dtype: torch.dtype, seed: int):
    torch.manual_seed(seed)
    with torch.device(device):
        model = _from_config(cfg, dtype)
    return model.eval()


# --------------------------------------------------------------------------- variants
# "no_moe" (prefill and decode points): every MoE block replaced by a module that hands its input
# back, so the row is the wall time of everything else in the model (attention, norms, embedding, LM
# head, transformers' own host work, generate's loop): a floor no MoE implementation can beat in eager
# mode. (Its decoded tokens are meaningless and are not compared.)
NO_MOE = "no_moe"
NO_MOE_KINDS = ("prefill", "decode")
# Point kinds that --rounds repeats (wall-clock timings); the others run once.
ROUND_KINDS = ("prefill", "decode")


class _NoMoE(torch.nn.Module):
    """Stands in for an MoE block: returns x, in the block's output structure (a tensor, or a tuple
    whose first item is the hidden states, e.g. gpt-oss's (out, router_scores); the rest None)."""

    def __init__(self, block: torch.nn.Module, tuple_len: int):
        super().__init__()
        self.block = [block]  # kept out of the module tree, put back by remove_variant
        self.tuple_len = tuple_len

    def forward(self, x, *args, **kwargs):
        return x if not self.tuple_len else (x,) + (None,) * (self.tuple_len - 1)


def _install_no_moe(model) -> None:
    for block, *_ in _blocks(model):
        path = next(n for n, m in model.named_modules() if m is block)
        parent, _, attr = path.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        p = next(block.parameters())
        out = block(torch.zeros(1, 1, model.config.hidden_size, dtype=p.dtype, device=p.device))
        setattr(owner, attr, _NoMoE(block, len(out) if isinstance(out, tuple) else 0))


def _remove_no_moe(model) -> None:
    for name, m in list(model.named_modules()):
        if isinstance(m, _NoMoE):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, m.block[0])


# Variant suffixes: EAGER patches with layer_graphs=False (every MoE step eager); GRAPHS names
# patch_model's default (each MoE step replayed from a CUDA graph cached per T) explicitly.
GRAPHS, EAGER = "+graphs", "+eager"


def apply_variant(model, variant: str) -> None:
    if variant == NO_MOE:
        _install_no_moe(model)
    elif variant != "hf":
        import moeflow

        experts, graphs = variant, True
        for suffix in (GRAPHS, EAGER):
            if variant.endswith(suffix):
                experts, graphs = variant[: -len(suffix)], suffix == GRAPHS
        moeflow.patch_model(model, experts=experts, layer_graphs=graphs)


def remove_variant(model) -> None:
    from moeflow.hf import MoEBlock, unpatch_model

    _remove_no_moe(model)
    if any(isinstance(m, MoEBlock) for m in model.modules()):
        unpatch_model(model)


def variant_impl(model, variant: str) -> str:
    if variant == NO_MOE:
        return "none (MoE blocks return their input)"
    if variant == "hf":
        return "hf:" + str(getattr(model.config, "_experts_implementation", None))
    from moeflow.hf import moe_layers

    return ",".join(sorted({str(layer.impl_name) for layer in moe_layers(model)}))


# --------------------------------------------------------------------------- profiler ranges
def _blocks(model):
    """(block, router module | None, experts module, shared module | None) for every MoE block."""
    from moeflow.layer import MoELayer

    out = []
    for _, m in model.named_modules():
        if isinstance(m, MoELayer):
            continue
        children = dict(m.named_children())
        experts = children.get("experts")
        router = children.get("gate", children.get("router"))
        if experts is None or router is None:
            continue
        out.append((m, router, experts, children.get("shared_experts", children.get("shared_expert"))))
    return out


@contextmanager
def instrument(model):
    """record_function ranges around router / experts / shared / block / LM head for one profile.

    A patched model's layer graphs are off inside (a replay runs no Python, so no range would
    open): the split is of eager steps, which launch the same kernels a replay runs.
    """
    from torch.autograd.profiler import record_function

    from moeflow.hf import MoEBlock

    handles, undo, stack, graphs = [], [], [], []

    def hook(mod, name):
        def pre(_m, _args):
            rf = record_function(name)
            rf.__enter__()
            stack.append(rf)

        def post(_m, _args, _out):
            stack.pop().__exit__(None, None, None)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))

    def wrap(obj, attr, name):
        orig = getattr(obj, attr)

        def wrapped(*a, **k):
            with record_function(name):
                return orig(*a, **k)

        obj.__dict__[attr] = wrapped
        undo.append((obj, attr))

    for block, router, experts, shared in _blocks(model):
        hook(block, R_BLOCK)
        if shared is not None:
            hook(shared, R_SHARED)
        if isinstance(block, MoEBlock):
            layer = block.moe_layer
            if not any(o is layer for o, _ in undo):
                graphs.append((layer, layer.graphs))
                layer.graphs = None
                wrap(layer, "route", R_ROUTER)
                wrap(layer, "experts_forward", R_EXPERTS)
        else:
            hook(router, R_ROUTER)
            hook(experts, R_EXPERTS)
            if callable(getattr(block, "route_tokens_to_experts", None)):  # selection on the block (older HF)
                wrap(block, "route_tokens_to_experts", R_ROUTER)
    head = model.get_output_embeddings()
    if head is not None:
        hook(head, R_HEAD)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for obj, attr in undo:
            obj.__dict__.pop(attr, None)
        for layer, g in graphs:
            layer.graphs = g
        while stack:
            stack.pop().__exit__(None, None, None)


def profile_events(fn, device: torch.device, range_name: str) -> list[dict]:
    """The chrome-trace events of one fn() under torch.profiler, fn inside a range_name range."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        with record_function(range_name):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json", prefix="bench_e2e_trace_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.unlink(path)


def _cat(e: dict) -> str:
    return str(e.get("cat", "")).lower()


def _complete(events: list[dict], cats: tuple[str, ...]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and _cat(e) in cats and "ts" in e]


def _innermost(ranges: list[dict], ts: float) -> dict | None:
    best = None
    for r in ranges:
        if r["ts"] <= ts <= r["ts"] + r.get("dur", 0) and (best is None or r["ts"] >= best["ts"]):
            best = r
    return best


def _window(events: list[dict], range_name: str) -> tuple[float, float] | None:
    rs = [e for e in _complete(events, ("user_annotation",)) if e.get("name") == range_name]
    if not rs:
        return None
    return min(r["ts"] for r in rs), max(r["ts"] + r.get("dur", 0) for r in rs)


def count_syncs(events: list[dict], range_name: str) -> dict:
    """Host-blocking CUDA runtime calls made inside the range_name range (see the module docstring)."""
    win = _window(events, range_name)
    memcpy = {e["args"]["correlation"]: str(e.get("name", "")) for e in _complete(events, ("gpu_memcpy",))
              if "correlation" in e.get("args", {})}
    by_name: Counter = Counter()
    sync_calls = d2h = blocking = 0
    for e in _complete(events, ("cuda_runtime", "cuda_driver")):
        if win is not None and not (win[0] <= e["ts"] <= win[1]):
            continue
        name = str(e.get("name", ""))
        corr = e.get("args", {}).get("correlation")
        if name in SYNC_CALLS:
            sync_calls += 1
            by_name[name] += 1
        elif "memcpy" in name.lower() and "DtoH" in memcpy.get(corr, ""):
            d2h += 1
            by_name[f"{name} DtoH"] += 1
            if name in BLOCKING_D2H:
                blocking += 1
    return {"syncs": sync_calls + blocking, "sync_calls": sync_calls, "d2h_copies": d2h, "blocking_d2h": blocking,
            "by_name": dict(by_name), "window_found": win is not None}


def split_from_trace(events: list[dict], n_layers: int, *, cuda: bool) -> dict:
    """Per-part time of one profiled forward: ms totals, per-layer ms and reasons for n/a parts."""
    ranges = [e for e in _complete(events, ("user_annotation",)) if str(e.get("name", "")).startswith("e2e::")]
    opened = Counter(r["name"] for r in ranges)
    totals = dict.fromkeys((*PARTS, "head"), 0.0)
    top: dict[str, Counter] = {p: Counter() for p in totals}
    out: dict = {"basis": "cuda kernels by launch range" if cuda else "cpu wall time of the ranges",
                 "ranges_opened": dict(opened)}
    if cuda:
        launches = {e["args"]["correlation"]: e for e in _complete(events, ("cuda_runtime", "cuda_driver"))
                    if "correlation" in e.get("args", {})}
        kernels = _complete(events, ("kernel", "gpu_memcpy", "gpu_memset"))
        unmatched = by_name = busy = 0.0
        for k in kernels:
            dur = k.get("dur", 0) / 1e3
            busy += dur
            name = str(k.get("name", ""))
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is not None:
                r = _innermost(ranges, launch["ts"])
                part = RANGE_PART.get(r["name"], "rest") if r is not None else "rest"
            else:
                part = next((p for p, pat in NAME_PARTS if pat.search(name)), None)
                if part is None:
                    unmatched += dur
                    continue
                by_name += dur
            totals[part] += dur
            top[part][name[:90]] += dur
        span = ((max(k["ts"] + k.get("dur", 0) for k in kernels) - min(k["ts"] for k in kernels)) / 1e3
                if kernels else 0.0)
        out.update(busy_ms=busy, span_ms=span, unmatched_ms=unmatched, attributed_by_name_ms=by_name,
                   kernels=len(kernels))
        if not kernels or unmatched > UNMATCHED_MAX * busy:
            out["na"] = (f"{unmatched:.3f} of {busy:.3f} ms of kernel time has no launch event"
                         if kernels else "no kernels in the trace")
    else:
        dur = Counter()
        for r in ranges:
            dur[r["name"]] += r.get("dur", 0) / 1e3
        inner = dur[R_ROUTER] + dur[R_EXPERTS] + dur[R_SHARED]
        totals.update(router=dur[R_ROUTER], experts=dur[R_EXPERTS], shared=dur[R_SHARED],
                      moe_glue=max(0.0, dur[R_BLOCK] - inner), head=dur[R_HEAD],
                      rest=max(0.0, dur[R_FORWARD] - dur[R_BLOCK] - dur[R_HEAD]))
        out["forward_ms"] = dur[R_FORWARD]
    out["total_ms"] = totals
    out["per_layer_ms"] = {p: totals[p] / max(1, n_layers) for p in PARTS}
    need = {"router": R_ROUTER, "experts": R_EXPERTS, "shared": R_SHARED, "moe_glue": R_BLOCK}
    out["na_parts"] = {p: f"no {r} range opened (no such module in this model)" for p, r in need.items()
                       if opened.get(r, 0) == 0}
    out["top_kernels"] = {p: [[n, round(t, 4)] for n, t in c.most_common(4)] for p, c in top.items() if c}
    return out


# --------------------------------------------------------------------------- the run
class Run:
    """State of one invocation: rows, meta, budget, per-kind cost estimates."""

    def __init__(self, args, device, dtype):
        self.args, self.device, self.dtype = args, device, dtype
        self.t0 = time.time()
        self.rows: list[dict] = []
        self.cost: dict[str, float] = {}
        self.tier1_costs: list[float] = []
        self.meta = dict(env_info(), command=" ".join([Path(sys.executable).name, *sys.argv]),
                         args=vars(args), shapes={}, skipped=[], stopped=None,
                         tf32_matmul=bool(torch.backends.cuda.matmul.allow_tf32),
                         float32_matmul_precision=torch.get_float32_matmul_precision())

    def elapsed(self) -> float:
        return time.time() - self.t0

    def timer(self, fn, warmup: int) -> float:
        if self.device.type == "cuda":
            return time_cuda(fn, reps=self.args.repeats, warmup=warmup, flush=False)
        return time_cpu(fn, reps=self.args.repeats, warmup=warmup)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def fits(self, kind: str, tier: int, shapes_after: int, tier1_now: float | None = None) -> str | None:
        """None if the point may start, else why not (tier1_now: this shape's tier-1 cost so far)."""
        est = self.cost.get(kind, DEFAULT_COST[kind] * (0.05 if self.args.tiny else 1.0))
        left = self.args.time_budget_s - self.elapsed()
        if est > left:
            return f"estimated {est:.0f}s > {left:.0f}s left of the {self.args.time_budget_s:.0f}s budget"
        if tier > 1 and shapes_after:
            seen = self.tier1_costs + ([tier1_now] if tier1_now else [])
            per = (sum(seen) / len(seen)) if seen else DEFAULT_TIER1_PER_SHAPE * (0.05 if self.args.tiny else 1.0)
            reserve = per * shapes_after
            if est + reserve > left:
                return (f"estimated {est:.0f}s + {reserve:.0f}s reserved for tier 1 of {shapes_after} more "
                        f"shape(s) > {left:.0f}s left")
        return None

    def add(self, **row) -> None:
        row.setdefault("status", "ok")
        v = row.get("value")
        if isinstance(v, float) and not math.isfinite(v):
            row["status"] = f"n/a: non-finite value {v}"
            row["value"] = None
        self.rows.append(row)

    def save(self) -> None:
        """JSON and markdown, rewritten after every point (a killed run keeps what it measured)."""
        self.meta["elapsed_s"] = round(self.elapsed(), 1)
        write_json(self.args.out, self.rows, self.meta)
        Path(self.args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(self.args.md).write_text(markdown(self))


def _err(e: BaseException) -> str:
    return f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Shape:
    """One model and what its points share (inputs, eager tokens, accuracy logits)."""

    def __init__(self, run: Run, name: str, model, layers: int, vocab: int):
        self.run, self.name, self.model, self.layers, self.vocab = run, name, model, layers, vocab
        self.tokens: dict[tuple[str, int], torch.Tensor] = {}
        self.logits: dict[str, torch.Tensor] = {}
        self.impl: dict[str, str] = {}

    def ids(self, B: int, S: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(3, self.vocab, (B, S), generator=g).to(self.run.device)

    def base(self, variant: str, metric: str, **kw) -> dict:
        return dict(shape=self.name, variant=variant, metric=metric, layers=self.layers, **kw)

    # -- points (each runs for one variant, already applied) ---------------------------------
    def prefill(self, variant: str, T: int) -> None:
        ids = self.ids(1, T, seed=T)
        model = self.model

        def fn():
            return model(input_ids=ids, use_cache=False, logits_to_keep=1)

        t = self.run.timer(fn, warmup=2)
        self.run.add(**self.base(variant, "prefill_tok_s", T=T, value=T / t, unit="tok/s"))
        self.run.add(**self.base(variant, "prefill_ms", T=T, value=t * 1e3, unit="ms"))

    def _gen_config(self, n: int):
        """One GenerationConfig per n, reused."""
        cache = self.__dict__.setdefault("_gen_configs", {})
        if n not in cache:
            cache[n] = self._new_gen_config(n)
        return cache[n]

    @staticmethod
    def _new_gen_config(n: int):
        from transformers import GenerationConfig

        kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
        kw["disable_compile"] = True
        try:
            return GenerationConfig(**kw)
        except TypeError:
            kw.pop("disable_compile", None)
            return GenerationConfig(**kw)

    def _generator(self, B: int):
        P = self.run.args.prompt_len
        prompt = self.ids(B, P, seed=1000 + B)
        mask = torch.ones_like(prompt)
        model = self.model

        def gen(n: int):
            return model.generate(input_ids=prompt, attention_mask=mask, generation_config=self._gen_config(n))

        return gen, P

    def decode(self, variant: str, B: int) -> None:
        N = self.run.args.new_tokens
        gen, P = self._generator(B)
        out = gen(N)  # warm-up; also the tokens
        self.run.sync()
        new = out[:, P:].detach().cpu()
        if new.shape[1] != N:
            raise RuntimeError(f"generate produced {new.shape[1]} new tokens, expected {N}")
        self.tokens[(variant, B)] = new
        ref = self.tokens.get(("hf", B))
        if variant not in ("hf", NO_MOE) and ref is not None:
            self.run.add(**self.base(variant, "decode_tokens_equal_hf", batch=B,
                                     value=float((ref == new).float().mean()), unit="fraction"))
        tN = self.run.timer(lambda: gen(N), warmup=0)
        t1 = self.run.timer(lambda: gen(1), warmup=1)
        kw = dict(batch=B, new_tokens=N, prompt_len=P)
        self.run.add(**self.base(variant, "generate_tok_s", value=B * N / tN, unit="tok/s",
                                 note="includes the prompt's prefill", **kw))
        if tN > t1 and N > 1:
            step = (tN - t1) / (N - 1)
            self.run.add(**self.base(variant, "decode_tok_s", value=B / step, unit="tok/s", **kw))
            self.run.add(**self.base(variant, "decode_ms_per_step", value=step * 1e3, unit="ms", **kw))
        else:
            self.run.add(**self.base(variant, "decode_tok_s", value=None, status=(
                f"n/a: t(generate {N}) = {tN * 1e3:.2f} ms <= t(generate 1) = {t1 * 1e3:.2f} ms"), **kw))

    def graphs(self, variant: str, B: int) -> None:
        """Decode replayed from one CUDA graph (moeflow.hf.StaticDecoder) against the same recipe run eagerly."""
        from moeflow.hf.graphs import StaticDecoder

        N, P = self.run.args.new_tokens, self.run.args.prompt_len
        prompt = self.ids(B, P, seed=1000 + B)
        kw = dict(batch=B, new_tokens=N, prompt_len=P)
        decs = {}

        def time_steps(prefix, dec):
            tN = self.run.timer(lambda: dec.generate(prompt, N), warmup=1)
            t1 = self.run.timer(lambda: dec.generate(prompt, 1), warmup=1)  # the prefill alone
            if tN > t1:
                self.run.add(**self.base(variant, prefix + "decode_tok_s", value=B * (N - 1) / (tN - t1),
                                         unit="tok/s", **kw))
            else:
                self.run.add(**self.base(variant, prefix + "decode_tok_s", value=None,
                                         status=f"n/a: t(N) {tN * 1e3:.2f} ms <= t(1) {t1 * 1e3:.2f} ms", **kw))

        try:
            decs["static_eager_"] = StaticDecoder(self.model, batch_size=B, max_len=P + N, graph=False)
            want = decs["static_eager_"].generate(prompt, N)
            time_steps("static_eager_", decs["static_eager_"])
            t0 = time.time()
            decs["graph_"] = StaticDecoder(self.model, batch_size=B, max_len=P + N)
            got = decs["graph_"].generate(prompt, N)  # captures at its first decode step
            self.run.sync()
            self.run.add(**self.base(variant, "graph_capture_s", value=time.time() - t0, unit="s",
                                     note="first generate: prefill + warm-up + capture + replays", **kw))
            self.run.add(**self.base(variant, "graph_tokens_equal_eager", value=float((got == want).float().mean()),
                                     unit="fraction", note="vs the same static-cache recipe run eagerly", **kw))
            time_steps("graph_", decs["graph_"])
        finally:
            decs.clear()
            _free(self.run.device)

    def compiled(self, variant: str, B: int) -> None:
        """transformers' compiled decode path (static cache, compile_config): module docstring."""
        from transformers import CompileConfig, GenerationConfig

        args = self.run.args
        N, P = args.new_tokens, args.prompt_len
        prompt = self.ids(B, P, seed=1000 + B)
        mask = torch.ones_like(prompt)
        model = self.model
        cc = CompileConfig(fullgraph=True, mode=args.compile_mode)
        cfgs = {n: GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=2, cache_implementation="static", compile_config=cc) for n in (N, 1)}

        def gen(n: int):
            return model.generate(input_ids=prompt, attention_mask=mask, generation_config=cfgs[n])

        if (variant, B) not in self.tokens:  # the decode point did not run: its eager rows and tokens now
            self.decode(variant, B)
        impls = args.compiled_hf_experts_list if variant == "hf" else [None]
        before = getattr(model.config, "_experts_implementation", None)
        kw = dict(batch=B, new_tokens=N, prompt_len=P, mode=args.compile_mode)
        if self.run.device.type != "cuda":  # transformers compiles generate's decode step on accelerators only
            kw["note"] = "CPU: transformers does not compile here; the rows time the eager static-cache path"
        for impl in impls:
            row = dict(kw, experts=impl or "moeflow")
            try:
                if impl is not None:
                    model.set_experts_implementation(impl)
                torch._dynamo.reset()
                t0 = time.time()
                out = gen(N)  # compiles the decode step
                gen(N)  # with reduce-overhead: the CUDA-graph recording
                self.run.sync()
                self.run.add(**self.base(variant, "compiled_compile_s", value=time.time() - t0, unit="s",
                                         **{"note": "two generates: compile + recording", **row}))
                eager = self.tokens.get((variant, B))
                if eager is not None:
                    same = float((out[:, P:].detach().cpu() == eager).float().mean())
                    self.run.add(**self.base(variant, "compiled_tokens_equal_eager", value=same, unit="fraction",
                                             **{"note": "vs the decode point's eager greedy tokens", **row}))
                tN = self.run.timer(lambda: gen(N), warmup=0)
                t1 = self.run.timer(lambda: gen(1), warmup=1)
                if tN > t1:
                    step = (tN - t1) / (N - 1)
                    self.run.add(**self.base(variant, "compiled_decode_tok_s", value=B / step, unit="tok/s", **row))
                else:
                    self.run.add(**self.base(variant, "compiled_decode_tok_s", value=None, **row, status=(
                        f"n/a: t(N) {tN * 1e3:.2f} ms <= t(1) {t1 * 1e3:.2f} ms")))
            except Exception as e:
                self.run.add(**self.base(variant, "compiled_decode_tok_s", value=None, status=_err(e),
                                         traceback=traceback.format_exc()[-1500:], **row))
            finally:
                torch._dynamo.reset()
                if impl is not None and before is not None:
                    model.set_experts_implementation(before)
                _free(self.run.device)

    def fresh_prefill(self, variant: str) -> None:
        """Every prompt a new length, one forward each (module docstring)."""
        args = self.run.args
        lo, hi = args.fresh_T_range
        warm = (lo - 1, hi + 1) if lo > 1 else (hi + 1, hi + 2)
        # Lengths no variant has met: the model's attention is not ours, and sdpa's cuDNN kernels build
        # a plan per new length (about 55-60 ms a prompt at 2 layers, H200), which a variant timed on
        # lengths an earlier variant met would skip. Every variant draws from one seeded list of
        # distinct lengths, sorted and dealt round-robin, so each gets its own of similar sizes.
        n = len(args.variants_list)
        g = torch.Generator().manual_seed(args.seed + 4242)
        pool: list[int] = []
        while len(pool) < args.fresh_count * n:
            T = int(torch.randint(lo, hi + 1, (1,), generator=g))
            if T not in pool and T not in warm:
                pool.append(T)
        Ts = sorted(pool)[args.variants_list.index(variant)::n]
        model = self.model
        warm_s = None
        if variant not in ("hf", NO_MOE) and self.run.device.type == "cuda":
            # What from_pretrained does at load: compile the kernels of every token-count bucket
            # up to the largest length (moeflow.warmup), so that no fresh length waits for Triton.
            import moeflow

            warm_s = round(moeflow.warmup(model, max_tokens=hi + 2, progress=False).seconds, 2)
        for T in warm:
            model(input_ids=self.ids(1, T, seed=T), use_cache=False, logits_to_keep=1)
        self.run.sync()
        ms = []
        for T in Ts:
            ids = self.ids(1, T, seed=T)
            self.run.sync()
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
            self.run.sync()
            ms.append((time.perf_counter() - t0) * 1e3)
        self.run.add(**self.base(variant, "fresh_prefill_tok_s", value=sum(Ts) / (sum(ms) / 1e3), unit="tok/s",
                                 T_range=[lo, hi], count=len(Ts), detail={"T": Ts, "ms": [round(m, 3) for m in ms],
                                                                          "warmup_s": warm_s},
                                 note="each length once, one forward each; moeflow after moeflow.warmup"))

    def accuracy(self, variant: str) -> None:
        ids = self.ids(1, self.run.args.accuracy_T, seed=7)
        logits = self.model(input_ids=ids, use_cache=False).logits
        self.logits[variant] = logits.float().cpu()

    def profile(self, variant: str, T: int) -> None:
        ids = self.ids(1, T, seed=T)
        model = self.model

        def fn():
            return model(input_ids=ids, use_cache=False, logits_to_keep=1)

        with instrument(model):
            fn()
            self.run.sync()
            events = profile_events(fn, self.run.device, R_FORWARD)
        cuda = self.run.device.type == "cuda"
        split = split_from_trace(events, self.layers, cuda=cuda)
        detail = {k: split[k] for k in ("basis", "ranges_opened", "top_kernels", "total_ms", "unmatched_ms",
                                        "attributed_by_name_ms", "kernels") if k in split}
        for part in PARTS:
            why = split.get("na") or split["na_parts"].get(part)
            self.run.add(**self.base(variant, "layer_ms", T=T, part=part, unit="ms/layer",
                                     value=None if why else split["per_layer_ms"][part],
                                     status=f"n/a: {why}" if why else "ok"))
        why = split.get("na")
        self.run.add(**self.base(variant, "head_ms", T=T, unit="ms", value=None if why else split["total_ms"]["head"],
                                 status=f"n/a: {why}" if why else "ok", detail=detail))
        if cuda:
            for key in ("busy_ms", "span_ms"):
                self.run.add(**self.base(variant, f"forward_gpu_{key}", T=T, value=split[key], unit="ms",
                                         note="profiled forward (with ranges), kernels only"))
        syncs = count_syncs(events, R_FORWARD)
        self.run.add(**self.base(variant, "syncs_per_prefill", T=T, value=float(syncs["syncs"]), unit="syncs",
                                 detail=syncs, note="" if cuda else "CPU run: no CUDA runtime calls exist"))

    def decode_syncs(self, variant: str, B: int) -> None:
        N = self.run.args.new_tokens
        gen, _ = self._generator(B)
        gen(N)
        gen(N)  # the second sighting of each token count is captured (layer graphs): not counted
        self.run.sync()
        counts = {n: count_syncs(profile_events(lambda n=n: gen(n), self.run.device, "e2e::generate"),
                                 "e2e::generate") for n in (N, 1)}
        per_token = (counts[N]["syncs"] - counts[1]["syncs"]) / max(1, N - 1)
        self.run.add(**self.base(variant, "syncs_per_decode_token", batch=B, new_tokens=N, value=float(per_token),
                                 unit="syncs/token", detail={"generate_N": counts[N], "generate_1": counts[1]},
                                 note="" if self.run.device.type == "cuda" else "CPU run: no CUDA runtime calls exist"))

    def reference(self) -> None:
        """fp32 copy (this instance, converted in place) with HF eager experts; errors of every variant."""
        remove_variant(self.model)
        if not self.logits:
            return
        model = self.model.float()
        impl = "eager"
        try:
            model.set_experts_implementation("eager")
        except Exception:  # an older transformers: the experts read the config at each call
            try:
                model.config._experts_implementation = "eager"
            except Exception:
                impl = str(getattr(model.config, "_experts_implementation", None))
        self.run.meta["shapes"][self.name]["reference"] = f"fp32, same weights, hf experts {impl!r}"
        ids = self.ids(1, self.run.args.accuracy_T, seed=7)
        ref = model(input_ids=ids, use_cache=False).logits.float().cpu().double()
        top_ref = ref.argmax(-1)
        for variant, logits in self.logits.items():
            lg = logits.double()
            rel = float((lg - ref).norm() / ref.norm().clamp_min(1e-30))
            top1 = float((lg.argmax(-1) == top_ref).double().mean())
            kw = dict(T=self.run.args.accuracy_T)
            self.run.add(**self.base(variant, "logits_rel_l2", value=rel, unit="rel-L2 vs fp32", **kw))
            self.run.add(**self.base(variant, "top1_agree", value=top1, unit="fraction vs fp32", **kw))


def _profile_T(args) -> int:
    """The T of tier 1's prefill and profile points."""
    Ts = args.prefill_T_list
    return 2048 if 2048 in Ts else ([t for t in Ts if t <= 2048] or Ts)[-1]


def plan_points(args) -> list[tuple[int, str, dict]]:
    """(tier, kind, params) in the order they run for one shape."""
    Ts, Bs = args.prefill_T_list, args.decode_batches_list
    t1 = _profile_T(args)
    b1 = [b for b in Bs if b in (1, 16)] or Bs[:2]
    pts = [(1, "prefill", {"T": t1})] + [(1, "decode", {"B": b}) for b in b1]
    if not args.no_accuracy:
        pts.append((1, "accuracy", {}))
    pts.append((1, "profile", {"T": t1}))
    pts.append((1, "decode_syncs", {"B": min(Bs)}))
    pts += [(2, "prefill", {"T": t}) for t in Ts if t != t1]
    pts += [(2, "decode", {"B": b}) for b in Bs if b not in b1]
    if args.compiled:
        pts += [(3, "compiled", {"B": b}) for b in (b1 + [b for b in Bs if b not in b1])]
    if args.fresh_prefill:
        pts.append((3, "fresh_prefill", {}))
    if args.graphs:
        pts += [(3, "graphs", {"B": b}) for b in (b1 + [b for b in Bs if b not in b1])]
    if args.points:
        pts = [p for p in pts if p[1] in args.points_list]
    return pts


def run_shape(run: Run, name: str, shapes_after: int) -> None:
    args, device, dtype = run.args, run.device, run.dtype
    t_start = time.time()
    smeta = run.meta["shapes"].setdefault(name, {})
    why = run.fits("build", 1, 0)
    if why:
        run.meta["skipped"].append({"shape": name, "point": "build", "reason": why})
        return
    shape = None
    try:
        fit = fit_layers(name, args.layers, tiny=args.tiny, device=device, accuracy=not args.no_accuracy,
                         max_T=max(args.prefill_T_list + [args.accuracy_T]))
        L = fit["layers"]
        cfg = shape_config(name, L, tiny=args.tiny)
        t0 = time.time()
        model = build_model(cfg, device, dtype, seed=args.seed)
        run.sync()
        smeta.update(fit, config_class=type(cfg).__name__, model_class=type(model).__name__,
                     build_s=round(time.time() - t0, 2), vocab=cfg.vocab_size,
                     hf_experts_implementation=str(getattr(model.config, "_experts_implementation", None)),
                     hf_attn_implementation=str(getattr(model.config, "_attn_implementation", None)),
                     config=cfg.to_diff_dict() if hasattr(cfg, "to_diff_dict") else {})
        print(f"[{run.elapsed():6.1f}s] {name}: {L} layer(s) (asked {args.layers}; "
              f"{fit['bytes_per_layer_bf16'] / GIB:.2f} GiB/layer bf16), built in {smeta['build_s']}s, "
              f"hf experts={smeta['hf_experts_implementation']}, attn={smeta['hf_attn_implementation']}", flush=True)
        shape = Shape(run, name, model, L, cfg.vocab_size)
    except Exception as e:
        run.add(shape=name, variant="-", metric="build", value=None, status=_err(e))
        smeta["build_error"] = traceback.format_exc()[-2000:]
        print(f"[{run.elapsed():6.1f}s] {name}: build failed: {_err(e)}", flush=True)
        _free(device)
        run.save()
        return
    run.cost["build"] = time.time() - t_start
    tier1 = run.cost["build"]
    for tier, kind, params in plan_points(args):
        why = run.fits(kind, tier, shapes_after, tier1_now=tier1)
        if why:
            run.meta["skipped"].append({"shape": name, "point": kind, **_named(params), "tier": tier, "reason": why})
            if run.meta["stopped"] is None:
                run.meta["stopped"] = f"{name} {kind} {params}: {why}"
            print(f"[{run.elapsed():6.1f}s] {name} {kind} {params}: skipped ({why})", flush=True)
            continue
        t_point = time.time()
        # Timed points run the variants round-robin --rounds times (the host's speed drifts over a
        # run; every variant samples the same stretch of it); a metric's value is the median.
        rounds = args.rounds if kind in ROUND_KINDS else 1
        for rnd, variant in [(r, v) for r in range(rounds) for v in args.variants_list]:
            if variant == NO_MOE and kind not in NO_MOE_KINDS:
                continue  # a model without its MoE blocks has no decode, accuracy or profile worth a row
            n_rows = len(run.rows)
            try:
                apply_variant(shape.model, variant)
                getattr(shape, kind)(variant, **params)
                if variant not in shape.impl:
                    shape.impl[variant] = variant_impl(shape.model, variant)
            except Exception as e:
                metric = {"prefill": "prefill_tok_s", "decode": "decode_tok_s", "graphs": "graph_decode_tok_s",
                          "accuracy": "logits_rel_l2", "profile": "layer_ms",
                          "decode_syncs": "syncs_per_decode_token", "compiled": "compiled_decode_tok_s",
                          "fresh_prefill": "fresh_prefill_tok_s"}[kind]
                run.add(**shape.base(variant, metric, **_named(params), value=None, status=_err(e),
                                     traceback=traceback.format_exc()[-1500:]))
                if kind == "accuracy":
                    shape.logits.pop(variant, None)
            finally:
                try:
                    remove_variant(shape.model)
                except Exception as e:  # a model left patched would poison every later point
                    run.add(**shape.base(variant, "unpatch", value=None, status=_err(e)))
                try:
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.empty_cache()
                except Exception as e:  # e.g. a kernel fault: the context is gone, later points will say so
                    run.add(**shape.base(variant, "cuda_sync_after_point", value=None, status=_err(e)))
            new = run.rows[n_rows:]
            for r in new:
                r["round"] = rnd
            print(f"[{run.elapsed():6.1f}s] {name} {kind} {params} {variant}"
                  + (f" (round {rnd + 1}/{rounds})" if rounds > 1 else "") + ": "
                  + ("; ".join(_short(r) for r in new) if new else "done (rows come later)"), flush=True)
        dt = time.time() - t_point
        run.cost[kind] = dt
        if tier == 1:
            tier1 += dt
        run.save()
    run.tier1_costs.append(tier1)
    smeta["variant_impl"] = dict(shape.impl)
    if shape.logits:
        why = run.fits("reference", 1, 0)
        try:
            if why and run.elapsed() > args.time_budget_s:
                raise RuntimeError(f"skipped: {why}")
            t_ref = time.time()
            shape.reference()
            run.cost["reference"] = time.time() - t_ref
        except Exception as e:
            for variant in shape.logits:
                run.add(**shape.base(variant, "logits_rel_l2", value=None, status=f"reference {_err(e)}"))
        print(f"[{run.elapsed():6.1f}s] {name} accuracy: "
              + "; ".join(_short(r) for r in run.rows if r["shape"] == name and r["metric"] in
                          ("logits_rel_l2", "top1_agree")), flush=True)
    shape.model = None
    del model, shape
    try:
        if device.type == "cuda":
            smeta["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
            torch.cuda.reset_peak_memory_stats()
        _free(device)
    except Exception as e:
        smeta["cleanup_error"] = _err(e)
    run.save()


def _named(params: dict) -> dict:
    """Point parameters under their row names (B -> batch)."""
    return {("batch" if k == "B" else k): v for k, v in params.items()}


def _short(r: dict, *, shape: bool = False) -> str:
    key = "".join(f" {k}={r[k]}" for k in ("T", "batch", "part") if k in r)
    v = r.get("value")
    val = f"{v:.4g}" if isinstance(v, float) else str(v)
    return (f"{r['shape']} " if shape else "") + f"{r['variant']} {r['metric']}{key} = {val}" + ("" if r["status"] == "ok" else f" [{r['status'][:120]}]")


# --------------------------------------------------------------------------- reports
def _index(rows: list[dict]) -> dict:
    """(shape, variant, metric, T, batch, part) -> value; the median over rounds (--rounds)."""
    vals: dict = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("value") is not None:
            vals.setdefault((r["shape"], r["variant"], r["metric"], r.get("T"), r.get("batch"), r.get("part")),
                            []).append(r["value"])
    return {k: statistics.median(v) for k, v in vals.items()}


def summary_rows(run: Run) -> tuple[list[dict], list[str]]:
    idx = _index(run.rows)
    a = run.args
    cols = ["shape", "variant", "L", "impl"]
    cols += [f"dec_b{b}" for b in a.decode_batches_list] + [f"pf_{t}" for t in a.prefill_T_list]
    cols += ["rel_l2", "top1", "sync/tok", "sync/pf", "router", "experts", "shared", "glue", "rest"]
    out = []
    for name in a.shapes_list:
        sm = run.meta["shapes"].get(name, {})
        for v in a.variants_list:
            s = {"shape": name, "variant": v, "L": sm.get("layers", ""), "impl": sm.get("variant_impl", {}).get(v, "")}
            for b in a.decode_batches_list:
                s[f"dec_b{b}"] = idx.get((name, v, "decode_tok_s", None, b, None), "")
            for t in a.prefill_T_list:
                s[f"pf_{t}"] = idx.get((name, v, "prefill_tok_s", t, None, None), "")
            s["rel_l2"] = idx.get((name, v, "logits_rel_l2", a.accuracy_T, None, None), "")
            s["top1"] = idx.get((name, v, "top1_agree", a.accuracy_T, None, None), "")
            s["sync/tok"] = next((val for k, val in idx.items() if k[:3] == (name, v, "syncs_per_decode_token")), "")
            s["sync/pf"] = next((val for k, val in idx.items() if k[:3] == (name, v, "syncs_per_prefill")), "")
            for part, col in zip(PARTS, ("router", "experts", "shared", "glue", "rest")):
                s[col] = next((val for k, val in idx.items() if k[:3] == (name, v, "layer_ms") and k[5] == part), "")
            out.append(s)
    return out, cols


def markdown(run: Run) -> str:
    a, m = run.args, run.meta
    idx = _index(run.rows)
    dev = m["device"]
    lines = [f"## End to end (transformers model, unpatched vs patch_model) — {m['date'][:10]}, {dev}", "",
             f"- torch {m['torch']}, triton {m['triton']}, transformers {m['transformers']}; "
             f"command: `{m['command']}`.",
             f"- Random weights (seed {a.seed}), {'fp32' if run.dtype == torch.float32 else 'bf16'}, vocab "
             f"{VOCAB if not a.tiny else TINY_VOCAB}, every layer MoE; layers per shape: "
             + ", ".join(f"{n} {s.get('layers', '?')}" for n, s in m["shapes"].items())
             + f". One model instance per shape, patched and unpatched in turn. Medians of {a.repeats}"
             + (f"; prefill / decode run round-robin {a.rounds} times, median of the rounds." if a.rounds > 1 else "."),
             f"- decode = `generate` greedy, prompt {a.prompt_len}, {a.new_tokens} new tokens, "
             "(t(N) − t(1)) / (N − 1); prefill = one forward, batch 1, use_cache=False, logits_to_keep=1.",
             "- Cells: hf rows are tok/s; other rows are variant tok/s ÷ hf tok/s (> 1 is faster).", ""]
    if m.get("stopped"):
        lines += [f"- Budget: stopped adding points ({m['stopped']}); {len(m['skipped'])} point(s) skipped.", ""]
    cols = [f"decode b{b}" for b in a.decode_batches_list] + [f"prefill T={t}" for t in a.prefill_T_list]
    lines += ["| shape | L | variant | experts | " + " | ".join(cols) + " |", "|" + "---|" * (4 + len(cols))]
    for name, sm in m["shapes"].items():
        for v in a.variants_list:
            cells = []
            for metric, key in ([("decode_tok_s", (None, b)) for b in a.decode_batches_list]
                                + [("prefill_tok_s", (t, None)) for t in a.prefill_T_list]):
                mine = idx.get((name, v, metric, *key, None))
                hf = idx.get((name, "hf", metric, *key, None))
                if mine is None:
                    cells.append("")
                elif v == "hf":
                    cells.append(f"{mine:.4g}")
                else:
                    cells.append(f"{mine / hf:.2f}×" if hf else f"{mine:.4g} tok/s")
            lines.append(f"| {name} | {sm.get('layers', '')} | {v} | {sm.get('variant_impl', {}).get(v, '')} | "
                         + " | ".join(cells) + " |")
    if any(r["metric"] == "graph_decode_tok_s" for r in run.rows):
        lines += ["", "Decode replayed from a CUDA graph (`moeflow.hf.StaticDecoder`, static cache), tok/s: graph, the "
                  "same recipe eager, and `generate` eager; ratios against the unpatched (hf) model:", "",
                  "| shape | variant | batch | graph tok/s | static eager tok/s | generate tok/s | graph ÷ hf graph | "
                  "graph ÷ hf generate | graph tokens = eager |", "|" + "---|" * 9]
        for name in m["shapes"]:
            for b in a.decode_batches_list:
                for v in a.variants_list:
                    def g(metric, variant=v, b=b, name=name):
                        return idx.get((name, variant, metric, None, b, None))

                    gr, se, ge = g("graph_decode_tok_s"), g("static_eager_decode_tok_s"), g("decode_tok_s")
                    if gr is None and se is None:
                        continue
                    hg, hge = g("graph_decode_tok_s", "hf"), g("decode_tok_s", "hf")
                    eq = g("graph_tokens_equal_eager")

                    def fmt(x):
                        return "" if x is None else f"{x:.4g}"

                    lines.append(f"| {name} | {v} | {b} | {fmt(gr)} | {fmt(se)} | {fmt(ge)} | "
                                 f"{'' if gr is None or not hg else f'{gr / hg:.2f}×'} | "
                                 f"{'' if gr is None or not hge else f'{gr / hge:.2f}×'} | {fmt(eq)} |")
    lines += ["", f"Accuracy against the fp32 copy (batch 1, T = {a.accuracy_T}, all logits), host syncs, and the "
              f"per-layer split of one prefill forward at T = {_profile_T(a)} (ms/layer, "
              + ("CUDA kernel time by launch range" if run.device.type == "cuda" else "CPU wall time of the ranges")
              + "; empty where n/a):", "",
              "| shape | variant | logits rel-L2 | top-1 agree | syncs / decode token | syncs / prefill | "
              "router | experts | shared | glue | rest |", "|" + "---|" * 11]
    summ, _ = summary_rows(run)
    for s in summ:
        def f(x, p=3):
            return f"{x:.{p}g}" if isinstance(x, float) else str(x)

        lines.append(f"| {s['shape']} | {s['variant']} | {f(s['rel_l2'])} | {f(s['top1'], 4)} | {f(s['sync/tok'])} | "
                     f"{f(s['sync/pf'])} | {f(s['router'])} | {f(s['experts'])} | {f(s['shared'])} | "
                     f"{f(s['glue'])} | {f(s['rest'])} |")
    errors: dict[tuple[str, str], list[str]] = {}
    for r in run.rows:
        if str(r.get("status", "")).startswith(("error", "reference")):
            errors.setdefault((r["variant"], r["status"][:200]), []).append(f"{r['shape']} {r['metric']}")
    if errors:
        lines += ["", "Failed points:"] + [f"- {v}: {st} ({len(where)}: {', '.join(dict.fromkeys(where))[:200]})"
                                           for (v, st), where in errors.items()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def device_slug(run_device: torch.device) -> str:
    if run_device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(run_device).lower().replace("nvidia", "")
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "cuda"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="all", help=f"comma list of {','.join(SHAPE_ORDER)} or 'all'")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers per model (8; tiny 2); lowered to fit")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per point, median (10; quick 3)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="prefill / decode points: run the variants round-robin this many times and report the "
                         "median (the host's speed drifts; each variant samples the same stretch of it)")
    ap.add_argument("--decode-batches", default=None, help="comma list (1,16,64)")
    ap.add_argument("--prefill-T", default=None, help="comma list (512,2048,8192; quick 2048,8192)")
    ap.add_argument("--variants", default="hf,auto,triton_bi",
                    help="hf = unpatched; no_moe = every MoE block returns its input (prefill and decode: the "
                         "floor of the rest of the model); any other name is patch_model(model, experts=name) "
                         "(layer graphs on, its default); a '+eager' suffix patches with layer_graphs=False")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per generate (32; quick 16)")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens for generate (32)")
    ap.add_argument("--accuracy-T", type=int, default=None, help="tokens of the accuracy forward (256)")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the fp32 comparison (then more layers fit)")
    ap.add_argument("--graphs", action="store_true", help="also decode replayed from CUDA graphs (moeflow.hf.StaticDecoder; static cache)")
    ap.add_argument("--compiled", action="store_true",
                    help="also decode through transformers' compiled path (static cache + compile_config)")
    ap.add_argument("--compile-mode", default="reduce-overhead", help="torch.compile mode of --compiled")
    ap.add_argument("--compiled-hf-experts", default="grouped_mm,batched_mm",
                    help="transformers experts implementations the hf variant is compiled with (--compiled)")
    ap.add_argument("--fresh-prefill", action="store_true",
                    help="also prefill prompts of fresh lengths, one forward each (--fresh-T, --fresh-count)")
    ap.add_argument("--fresh-T", default=None, help="lo,hi of the fresh lengths (512,8192; tiny 16,128)")
    ap.add_argument("--fresh-count", type=int, default=8, help="fresh lengths per variant (8)")
    ap.add_argument("--points", default=None,
                    help="comma list of the point kinds to run (prefill,decode,accuracy,profile,decode_syncs,graphs,"
                         "compiled,fresh_prefill); "
                         "default: all that the other flags ask for")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (needs --tiny), fp32")
    ap.add_argument("--tiny", action="store_true", help="tiny configs (hidden 64, 4 experts, 2 layers)")
    ap.add_argument("--quick", action="store_true", help="fewer points and repeats for a first GPU run")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="stop adding points past this (GPU quick 330, GPU 540, CPU 50)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON rows (benchmarks/results/bench_e2e_<device>.json)")
    ap.add_argument("--md", default=None, help="markdown snippet for RESULTS.md (beside --out, .md)")
    args = ap.parse_args(argv)
    if args.cpu and not args.tiny:
        ap.error("--cpu runs only the tiny configs: add --tiny (the real shapes are tens of GiB)")
    tiny = args.tiny
    args.layers = args.layers or (2 if tiny else 8)
    args.repeats = args.repeats or (3 if args.quick or args.cpu else 10)
    args.decode_batches_list = _ints(args.decode_batches or ("1,4" if tiny else "1,16,64"))
    args.prefill_T_list = _ints(args.prefill_T or ("16,64" if tiny else "2048,8192" if args.quick else "512,2048,8192"))
    args.new_tokens = args.new_tokens or (4 if tiny else 16 if args.quick else 32)
    args.prompt_len = args.prompt_len or (8 if tiny else 32)
    args.accuracy_T = args.accuracy_T or (16 if tiny else 256)
    args.time_budget_s = args.time_budget_s or (50.0 if args.cpu else 330.0 if args.quick else 540.0)
    args.shapes_list = list(SHAPE_ORDER) if args.shapes == "all" else [s for s in args.shapes.split(",") if s]
    for s in args.shapes_list:
        if s not in SHAPE_ORDER:
            ap.error(f"--shapes: {s!r} is not one of {','.join(SHAPE_ORDER)}")
    variants = [v for v in args.variants.split(",") if v]
    args.variants_list = (["hf"] if "hf" in variants else []) + [v for v in variants if v != "hf"]
    kinds = ("prefill", "decode", "accuracy", "profile", "decode_syncs", "graphs", "compiled", "fresh_prefill")
    args.points_list = [k for k in (args.points or "").split(",") if k]
    for k in args.points_list:
        if k not in kinds:
            ap.error(f"--points: {k!r} is not one of {','.join(kinds)}")
    if "graphs" in args.points_list:
        args.graphs = True
    if "compiled" in args.points_list:
        args.compiled = True
    if "fresh_prefill" in args.points_list:
        args.fresh_prefill = True
    args.compiled_hf_experts_list = [v for v in args.compiled_hf_experts.split(",") if v]
    args.fresh_T_range = tuple(_ints(args.fresh_T or ("16,128" if tiny else "512,8192")))
    if len(args.fresh_T_range) != 2 or not 1 <= args.fresh_T_range[0] < args.fresh_T_range[1]:
        ap.error(f"--fresh-T: {args.fresh_T!r}, expected lo,hi with 1 <= lo < hi")
    most = (args.fresh_T_range[1] - args.fresh_T_range[0] - 1) // len(args.variants_list)
    if args.fresh_count < 1 or args.fresh_count > most:
        ap.error(f"--fresh-count: {args.fresh_count}, expected 1..{most} (each variant its own lengths)")
    if args.new_tokens < 2:
        ap.error("--new-tokens: at least 2 (decode = t(N) - t(1))")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)  # tiny models: one thread is faster and steadier on a busy machine
    else:
        if not torch.cuda.is_available():
            print("bench_e2e: needs CUDA (or --cpu --tiny for a CPU check of the script)", file=sys.stderr)
            return 2
        device, dtype = torch.device("cuda"), torch.bfloat16
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"bench_e2e_{device_slug(device)}.json")
    args.md = args.md or str(Path(args.out).with_suffix(".md"))
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    run = Run(args, device, dtype)
    print(f"bench_e2e: {run.meta['device']}, torch {run.meta['torch']}, transformers {run.meta['transformers']}, "
          f"triton {run.meta['triton']}; shapes {args.shapes_list}, variants {args.variants_list}, "
          f"decode B {args.decode_batches_list}, prefill T {args.prefill_T_list}, budget {args.time_budget_s:.0f}s",
          flush=True)
    try:
        with torch.no_grad():
            for i, name in enumerate(args.shapes_list):
                try:
                    run_shape(run, name, shapes_after=len(args.shapes_list) - i - 1)
                except Exception as e:  # anything run_shape did not catch itself: record, go to the next shape
                    run.add(shape=name, variant="-", metric="shape", value=None, status=_err(e),
                            traceback=traceback.format_exc()[-2000:])
                    print(f"[{run.elapsed():6.1f}s] {name}: {_err(e)}", flush=True)
                    _free(device)
    finally:
        run.save()
    summ, cols = summary_rows(run)
    print()
    print(format_table(summ, cols))
    print(f"\n(decode/prefill in tok/s; router..rest in ms/layer at T={_profile_T(args)}; "
          f"JSON {args.out}, markdown {args.md}; {run.elapsed():.0f}s"
          + (f"; stopped: {run.meta['stopped']}" if run.meta["stopped"] else "") + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
