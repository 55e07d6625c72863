"""Greedy decode of a transformers model from one captured CUDA graph (static KV cache).

    dec = StaticDecoder(model, batch_size=16, max_len=512)       # patched or not
    ids = dec.generate(prompt_BP, new_tokens=64)                 # [B, P + 64], the eager tokens

Why a class and not `generate(cache_implementation="static", compile_config=...)`: that path
runs torch.compile over the whole model, and moeflow's Triton launches and checks are plain
Python; capturing the eager step in a CUDA graph (what vLLM and SGLang do for decode) needs no
compiler and removes the per-layer host time (launches, Python) that bounds batch-1 decode.

The recipe, and the two traps it avoids:
  * The prompt is prefilled eagerly; every decode step runs the same tensors: a static token
    [B, 1], a static cache position [1] and a static attention mask [B, max_len] (ones up to
    the current position), updated in place before each replay.
  * transformers' static cache layers (5.x) place new keys at their own device counter
    (`cumulative_length`, advanced in place by every update), not at `cache_position`. The
    warm-up step that must run before a capture (kernel compiles, lazy buffers) advances it,
    so a recipe that does not rewind it writes every replayed step one slot late: the replays
    then attend to a stale copy of an earlier token instead of their own. The counters are
    snapshot before the warm-up and restored after it, and rewound to 0 at each generate.
    (Without the rewind and the mask, replayed tokens drift from eager at batch 16 on an
    H200, transformers 5.17; with both they equal eager at batch 1 and 16 on the real-shape
    models of `python benchmarks/bench_e2e.py --graphs`.)
  * A model offloaded with `OffloadConfig(sync_free=True)` fills its expert cache in
    `runtime.refill()`, which no replay runs: it is called before every replay.

Greedy only (argmax); sampling would need its random state inside the graph.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from .patched import check_routing, moe_layers

__all__ = ["StaticDecoder", "disable_layer_graphs", "enable_layer_graphs"]


def enable_layer_graphs(model: nn.Module, *, max_shapes: int = 8, capture_after: int = 1, max_bytes: int = 4 << 30):
    """Replay every MoE layer step of a patched model from CUDA graphs cached per token count.

    The eager forward (HF's `generate`, a prefill) keeps its Python for attention and the rest
    of the model; each MoE block's step (router, experts, shared expert: ~20 aten ops and 5-8
    Triton launches) becomes an input copy, one graph replay and an output copy once its token
    count has been seen `capture_after` times. Outputs equal the eager steps' bit for bit.
    One LayerGraphs serves all layers (one memory pool, `max_bytes` of kept buffers); see
    moeflow.layer_graphs for when a step stays eager. Returns it (counters `captures` /
    `replays` / `eager`; `clear()`); `disable_layer_graphs(model)` turns it off.

    `patch_model` calls this by default (`layer_graphs=True`, or a dict of these options);
    calling it again replaces the model's LayerGraphs (and drops its captured graphs).

    Raises ValueError if the model is not patched.
    """
    from ..layer_graphs import LayerGraphs

    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"enable_layer_graphs: {type(model).__name__} has no patched MoE layer "
                         "(call moeflow.patch_model first)")
    graphs = LayerGraphs(max_shapes=max_shapes, capture_after=capture_after, max_bytes=max_bytes)
    for layer in layers:
        layer.graphs = graphs
    return graphs


def disable_layer_graphs(model: nn.Module) -> None:
    """Every MoE layer step of a patched model eager again (the graphs are freed)."""
    for layer in moe_layers(model):
        if layer.graphs is not None:
            layer.graphs.clear()
        layer.graphs = None


def _static_cache(model: nn.Module, batch_size: int, max_len: int):
    """transformers' StaticCache across the 5.x signatures (config + max_cache_len; older: batch, device, dtype)."""
    from transformers import StaticCache

    try:
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # older signatures
        p = next(model.parameters())
        return StaticCache(config=model.config, max_batch_size=batch_size, max_cache_len=max_len, device=p.device,
                           dtype=p.dtype)


def _counters(cache) -> list[torch.Tensor]:
    """The cache layers' in-place write counters (tensor `cumulative_length`), where the version has them."""
    out = []
    for layer in getattr(cache, "layers", []):
        c = getattr(layer, "cumulative_length", None)
        if isinstance(c, torch.Tensor):
            out.append(c)
    return out


def _offload_runtimes(model: nn.Module, *, graph: bool) -> list:
    """The offload runtimes of the model's MoE layers that serve decode sync-free (refilled before
    each replay). graph=True: ValueError naming the first layer whose experts are refilled by host
    code inside its step (OffloadConfig(sync_free=False)): a replay would skip the refill and reuse
    the slots the capture saw (the capture itself fails: its host copies are not from pinned memory)."""
    from ..layer import MoELayer

    seen: dict[int, object] = {}
    for m in model.modules():
        rt = getattr(m, "offload", None) if isinstance(m, MoELayer) else None
        if rt is None:
            continue
        if getattr(rt, "graph", None) is None:
            if graph:
                raise ValueError(f"StaticDecoder.graph=True: MoE layer {m.layer_idx} is offloaded with "
                                 f"OffloadConfig(sync_free=False), whose step refills its expert slots from the "
                                 f"host; expected OffloadConfig(sync_free=True) (refilled between replays) or "
                                 f"graph=False")
            continue
        seen.setdefault(id(rt), rt)
    return list(seen.values())


def cache_kwarg(model: nn.Module) -> str:
    """The name of model.forward's KV-cache argument: `cache` where forward names it (transformers 5.24:
    `past_key_values` is deprecated there, to be removed in 5.40), else `past_key_values` (5.17 and earlier)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class StaticDecoder:
    """Greedy decode with a static KV cache, each step replayed from one CUDA graph (graph=True) or eager.

    model:      a transformers causal LM (patched by moeflow or not) with sdpa attention (its masks
                are built on the device; the eager attention path copies a CPU scalar, which a
                capture refuses), on CUDA when graph=True.
    batch_size: B, the batch every `generate` call decodes (the graph is captured for it).
    max_len:    the cache length: prompt + new tokens of any call must fit.
    graph:      False runs the very same steps eagerly (the reference a replay must equal).

    The graph is captured at the first decode step of the first `generate` and reused by
    every later call (prompts of any length up to max_len - new_tokens).
    """

    def __init__(self, model: nn.Module, *, batch_size: int, max_len: int, graph: bool = True) -> None:
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"StaticDecoder.model={type(model).__name__}: expected a transformers model")
        for name, v, lo in (("batch_size", batch_size, 1), ("max_len", max_len, 2)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"StaticDecoder.{name}={v!r}: expected an int >= {lo}")
        if not isinstance(graph, bool):
            raise TypeError(f"StaticDecoder.graph={graph!r}: expected a bool")
        device = next(model.parameters()).device
        cache = _static_cache(model, batch_size, max_len)
        sliding = sorted({type(la).__name__ for la in getattr(cache, "layers", []) if getattr(la, "is_sliding", False)})
        if graph and sliding:
            # their update keeps a host-side int position a replay would never advance
            raise ValueError(f"StaticDecoder.graph=True: the static cache has sliding-window layers {sliding} "
                             f"(model.config.sliding_window={getattr(model.config, 'sliding_window', None)!r}); "
                             f"expected full-attention layers only (or graph=False)")
        runtimes = _offload_runtimes(model, graph=graph)
        if graph and device.type != "cuda":
            raise ValueError(f"StaticDecoder.graph=True: the model is on {device}; CUDA graphs need a CUDA model "
                             f"(or graph=False)")
        attn = getattr(model.config, "_attn_implementation", None)
        if graph and attn not in (None, "sdpa"):
            raise ValueError(f"StaticDecoder.graph=True: model.config._attn_implementation={attn!r}; expected 'sdpa' "
                             f"(the other paths build masks on the host, which a capture refuses)")
        self.model, self.batch_size, self.max_len, self.graph = model, batch_size, max_len, graph
        self.device = device
        self.cache = cache
        self.tok_B1 = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        self.pos_1 = torch.zeros(1, dtype=torch.long, device=device)
        self.mask_BM = torch.zeros(batch_size, max_len, dtype=torch.long, device=device)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits_BV: torch.Tensor | None = None
        self._runtimes = runtimes
        self._cache_kw = cache_kwarg(model)

    @property
    def captured(self) -> bool:
        """True once the decode step's graph exists."""
        return self._graph is not None

    def _step(self) -> torch.Tensor:
        """One decode step on the static buffers -> logits [B, V] of the last position."""
        out = self.model(input_ids=self.tok_B1, **{self._cache_kw: self.cache}, use_cache=True,
                         cache_position=self.pos_1, attention_mask=self.mask_BM)
        return out.logits[:, -1]

    def _capture(self) -> None:
        counters = _counters(self.cache)
        saved = [c.clone() for c in counters]
        s = torch.cuda.Stream(device=self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):  # warm-up outside the capture: kernel compiles, lazy buffers
            self._step()
        torch.cuda.current_stream(self.device).wait_stream(s)
        for c, v in zip(counters, saved):  # the warm-up wrote one slot: rewind (module doc)
            c.copy_(v)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._logits_BV = self._step()
        self._graph = g

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, new_tokens: int, *, return_logits: bool = False,
                 on_step: Callable[[int], None] | None = None):
        """Greedy tokens [B, P + new_tokens] (and the decode steps' logits [new_tokens - 1, B, V] f32 if asked).

        input_ids:  int64 [B, P] on the model's device, B == batch_size, P + new_tokens <= max_len.
        on_step:    called with the step index after each decode step (tests read stats there).
        The first new token comes from the prefill; each later one from one decode step.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
            raise TypeError(f"StaticDecoder.generate: input_ids must be an int64 [B, P] tensor, got "
                            f"{getattr(input_ids, 'dtype', type(input_ids))} {tuple(getattr(input_ids, 'shape', ()))}")
        B, P = input_ids.shape
        if B != self.batch_size:
            raise ValueError(f"StaticDecoder.generate: input_ids batch {B}, expected batch_size={self.batch_size}")
        if not isinstance(new_tokens, int) or new_tokens < 1 or P < 1 or P + new_tokens > self.max_len:
            raise ValueError(f"StaticDecoder.generate: prompt {P} + new_tokens={new_tokens!r} must be >= 2 tokens and "
                             f"fit max_len={self.max_len}")
        for c in _counters(self.cache):
            c.zero_()
        self.mask_BM.zero_()
        self.mask_BM[:, :P] = 1
        out = self.model(input_ids=input_ids.to(self.device), **{self._cache_kw: self.cache}, use_cache=True,
                         cache_position=torch.arange(P, device=self.device), attention_mask=self.mask_BM)
        toks = [out.logits[:, -1].argmax(-1, keepdim=True)]
        logits = []
        for i in range(new_tokens - 1):
            self.tok_B1.copy_(toks[-1])
            self.pos_1.fill_(P + i)
            self.mask_BM[:, P + i] = 1
            if self.graph:
                if self._graph is None:
                    self._capture()
                for rt in self._runtimes:
                    rt.refill()
                self._graph.replay()
                step_logits = self._logits_BV
            else:
                step_logits = self._step()
            if return_logits:
                logits.append(step_logits.float().clone())
            toks.append(step_logits.argmax(-1, keepdim=True))
            if on_step is not None:
                on_step(i)
        if "_moeflow_routing" in self.model.__dict__:  # a patched model: its deferred routing check
            check_routing(self.model)
        ids = torch.cat([input_ids.to(self.device)] + toks, 1)
        if return_logits:
            return ids, (torch.stack(logits) if logits else torch.empty(0, B, 0, device=self.device))
        return ids
