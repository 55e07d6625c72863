"""Compile a model's Triton kernels for every token count before the first real prompt.

    model = moeflow.from_pretrained(path)          # calls warmup(model) on CUDA
    moeflow.patch_model(hf_model); moeflow.warmup(hf_model, max_tokens=8192)

Why: the expert kernels' tile configuration follows T (the tuned tables hold one entry per
token-count bucket), and Triton specialises an integer argument on whether it is 1 and whether
it divides by 16; each new (bucket, specialisation) is a JIT compile of several kernels the
first time it is met. A prompt of a fresh length that lands in a bucket not yet met waits for
that compile: 1.5 s and 2.3 s for two qwen3-30b-a3b prompts (T = 2537, 6097) where the
compiled step takes 4 ms (`benchmarks/bench_e2e.py --points fresh_prefill`, H100). vLLM and
SGLang compile and capture at start-up for the same reason.

What runs: one MoE layer per distinct layer shape (every layer of a model usually shares one),
eagerly (no layer graph), on random activations, at each token count of `token_counts(max_tokens)`:
a log-spaced grid finer than the tuned tables' buckets, each once as a multiple of 16 and once
not. Routing, the experts (align, GEMMs, combine), the shared expert. The outputs are dropped;
the layer's weights and the model are not changed (`last_routing`, `impl_name` are left as they were).

Skipped, and named in the report: a layer whose experts are offloaded (random tokens would
refill its slot cache and skew its statistics), an expert-parallel layer (its step is a
collective every rank must join), a layer off CUDA (nothing to compile).

Legend: T tokens, H hidden.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["WarmupReport", "token_counts", "warmup"]

# Log-spaced (x1.5 / x1.33 steps): at least one point inside every bucket of a table whose keys
# are at least x1.5 apart (the tuned tables' are: 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, ...).
_GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
         3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152, 65536)


@dataclass
class WarmupReport:
    """What `warmup` ran: token counts, layers warmed ("layer <index>"), layers skipped (why)."""

    token_counts: tuple[int, ...] = ()
    layers: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0


def token_counts(max_tokens: int) -> tuple[int, ...]:
    """The T values warmup runs: the grid up to max_tokens, each also as T+1 (T not a multiple of 16
    where T is, and a different T below 16), ascending."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an int >= 1")
    out = set()
    for t in _GRID:
        if t > max_tokens:
            break
        out.add(t)
        if t + 1 <= max_tokens:
            out.add(t + 1)
    return tuple(sorted(out))


def _layers(model) -> list[tuple[str, nn.Module]]:
    from .layer import MoELayer

    if isinstance(model, MoELayer):
        return [("layer", model)]
    if isinstance(model, (list, tuple)):
        if not all(isinstance(m, MoELayer) for m in model):
            raise TypeError("model: a list must hold moeflow.MoELayer objects only")
        return [(f"layer {i}", m) for i, m in enumerate(model)]
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a patched nn.Module, a MoELayer or a list of them, got {type(model).__name__}")
    from .hf.patched import moe_layers

    out = [(f"layer {layer.layer_idx}", layer) for layer in moe_layers(model)]
    if not out:
        raise ValueError(f"model: {type(model).__name__} has no moeflow MoE layer (patch it with moeflow.patch_model)")
    return out


def _why_skipped(layer) -> str | None:
    w = layer.ref("router_weight")
    if w is None or w.device.type != "cuda":
        return "not on CUDA"
    if getattr(layer, "offload", None) is not None:
        return "experts offloaded (random tokens would refill the slot cache)"
    if layer.dispatcher.name != "local":
        return f"expert parallel ({layer.dispatcher.name}): its step is a collective"
    return None


def _shape_key(layer) -> tuple:
    """Layers with equal keys run the same kernels at every T."""
    src = layer.source
    return (repr(layer.config), str(getattr(src, "quant", None)), layer.experts_dtype, str(layer.experts_impl),
            repr(layer.kernel_options), layer.ref("router_weight").device, layer.shared_expert is not None)


@torch.no_grad()
def warmup(model, *, max_tokens: int = 8192, progress: bool = True, seed: int = 0) -> WarmupReport:
    """Run one layer of each distinct shape at every T of `token_counts(max_tokens)` (module docstring).

    Args:
        model: a patched model (moeflow.patch_model / from_pretrained), a MoELayer, or a list of them.
        max_tokens: the largest T a forward will send (prompt tokens x batch), >= 1.
        progress: a progress bar on stderr (tqdm) while it runs.
        seed: the random activations' seed.
    Returns: WarmupReport (token counts, layers warmed, layers skipped with the reason, seconds).
    """
    counts = token_counts(max_tokens)
    layers = _layers(model)
    report = WarmupReport(token_counts=counts)
    todo, keys = [], set()
    for path, layer in layers:
        why = _why_skipped(layer)
        if why is not None:
            report.skipped[path] = why
            continue
        key = _shape_key(layer)
        if key not in keys:
            keys.add(key)
            todo.append((path, layer))
    if not todo:
        return report
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    bar = tqdm(total=len(todo) * len(counts), desc="moeflow warmup", unit="step", disable=not progress)
    try:
        for path, layer in todo:
            dev = layer.ref("router_weight").device
            dtype = layer.experts_dtype or layer.ref("router_weight").dtype
            H = layer.config.hidden_size
            table = layer.ref("hash_table")
            g = torch.Generator(device=dev).manual_seed(seed)
            kept = {k: layer.__dict__.get(k) for k in ("last_routing", "last_impl", "impl_name")}
            try:
                for T in counts:
                    x = torch.randn(T, H, device=dev, dtype=torch.float32, generator=g).to(dtype)
                    ids = None
                    if layer.config.router.hash_routing and table is not None:
                        ids = torch.randint(0, table.shape[0], (T,), device=dev, generator=g)
                    layer(x, input_ids=ids, use_graphs=False)
                    bar.update(1)
            finally:
                layer.__dict__.update(kept)
            report.layers.append(path)
        torch.cuda.synchronize()
        monitor_check = {id(layer.routing_monitor): layer.routing_monitor for _, layer in todo
                         if getattr(layer, "routing_monitor", None) is not None}
        for monitor in monitor_check.values():
            monitor.check(wait=True)  # random activations: no NaN expected; a failure here is real
    finally:
        bar.close()
    report.seconds = time.perf_counter() - t0
    return report
