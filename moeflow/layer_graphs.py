"""CUDA graphs of one MoE layer step, cached per token count (host time of eager prefill and decode).

Why: a patched model's MoE step is host-bound on small-expert shapes: ~20 aten ops and 5-8
Triton launches cost 0.45-0.9 ms of host time per layer on the H200's host while its GPU work
takes 0.04-0.55 ms (`PYTHONPATH=. python3 tools/diag_host_and_graphs.py --sections layer`), so
qwen3-30b-a3b prefill and every eager decode step wait on Python. A replayed graph costs one
input copy, one replay and one output copy per layer.

    graphs = LayerGraphs(max_shapes=8)            # one per model: the graphs share one memory pool
    layer.graphs = graphs                          # or moeflow.hf.enable_layer_graphs(model)

Per layer and token count T: the first `capture_after` steps run eagerly (Triton compiles and
tunes there), the next one is captured and replayed, later ones replay. At most `max_shapes`
token counts per layer are kept (least recently used evicted). Bits: a replay runs the same
kernels as the eager step of the same T on the same inputs, so its output equals the eager
output bit for bit (tests/test_layer_graphs.py).

What a replay must redo by hand, because no Python runs inside it:
  * `layer.last_routing` is the captured step's RoutingResult (its tensors are the graph's
    buffers: valid until the layer's next step, like a StaticDecoder's);
  * the routing status goes to the layer's RoutingMonitor ("deferred") or is checked now
    ("eager"), as an eager step would.

A step runs eagerly instead when any of these holds: not on CUDA, autograd recording, another
capture in progress (a StaticDecoder capturing the whole model), hash routing input ids or a
separate router input (gemma4), an expert-parallel dispatcher (collectives), an expert source
other than resident weights (offload refills between steps), an experts implementation not
marked `graph_capturable` (the reference and grouped ones sync on the host; the implementation
of the layer's latest step is asked), torch.compile tracing, or the capture of this T failed
once (`refused` keeps the reason; e.g. an experts implementation that synchronises).

Memory: each cached (layer, T) keeps its input copy, output and routing tensors; intermediates
live in the shared pool, which every graph of the LayerGraphs reuses (graphs replay one at a
time on one stream, in capture order within a forward). Why that order matters: a graph's kept
buffers (its routing status, read when the model's forward ends) may sit where a graph captured
earlier keeps intermediates, so that earlier graph must not replay between them and the end of
the forward. In a model forward every layer sees the same T and is captured in layer order (an
eviction evicts the same T in every layer), so a later layer's graph was never captured first;
driving the layers of one LayerGraphs in another order than they were captured voids this.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field

import torch

from .experts.source import ResidentExperts
from .parallel.local import LOCAL

__all__ = ["LayerGraphs"]


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    x_TH: torch.Tensor  # the captured input buffer [T, H]
    out_TH: torch.Tensor  # the captured output buffer [T, H]
    routing: object  # the captured RoutingResult


@dataclass
class _LayerState:
    seen: collections.Counter = field(default_factory=collections.Counter)  # eager steps per T
    entries: collections.OrderedDict = field(default_factory=collections.OrderedDict)  # T -> _Entry, LRU
    refused: dict = field(default_factory=dict)  # T -> why the capture failed


def _key(x_TH: torch.Tensor) -> tuple[int, bool]:
    """Cache key of a step: T, and whether it runs under torch.inference_mode (buffers captured
    there are inference tensors, which a step outside it may not copy into)."""
    return int(x_TH.shape[0]), torch.is_inference_mode_enabled()


class LayerGraphs:
    """Cache of captured MoE layer steps by (layer, T); see the module docstring.

    Args:
        max_shapes: token counts kept per layer (least recently used evicted), >= 1.
        capture_after: eager steps of a T before it is captured (>= 1: the first compiles).
        max_bytes: budget for the kept input / output buffers of all layers (a prefill of
            T = 2048 at H = 2048 keeps 16 MiB per layer); a capture that would exceed it is
            not made (that step stays eager, `refused` says why).
    Attributes:
        captures, replays, eager: counters over all layers (benchmarks, tests).
    """

    def __init__(self, *, max_shapes: int = 8, capture_after: int = 1, max_bytes: int = 4 << 30) -> None:
        if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"max_shapes={max_shapes!r}: expected an int >= 1")
        if isinstance(capture_after, bool) or not isinstance(capture_after, int) or capture_after < 1:
            raise ValueError(f"capture_after={capture_after!r}: expected an int >= 1 (the first step compiles)")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes!r}: expected an int >= 0")
        self.max_shapes = max_shapes
        self.capture_after = capture_after
        self.max_bytes = max_bytes
        self.bytes = 0  # input + output buffers kept now
        self._pool = None
        self._layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> _LayerState
        self.captures = self.replays = self.eager = 0

    def refused(self, layer) -> dict[int, str]:
        """T -> the reason its capture failed, for one layer."""
        st = self._layers.get(layer)
        return {T: why for (T, _), why in st.refused.items()} if st is not None else {}

    def clear(self) -> None:
        """Drop every captured graph (frees their buffers and the pool)."""
        self._layers.clear()
        self._pool = None
        self.bytes = 0

    @staticmethod
    def eligible(layer, x_TH: torch.Tensor, input_ids, router_input) -> bool:
        """Whether this step may run from a graph (module docstring: when it runs eagerly).

        Asked on every layer step: no imports or allocations here."""
        return (x_TH.is_cuda and input_ids is None and router_input is None and not torch.is_grad_enabled()
                and layer.dispatcher is LOCAL and isinstance(layer.source, ResidentExperts)
                and getattr(layer.last_impl, "graph_capturable", False)
                and not torch.cuda.is_current_stream_capturing() and not torch.compiler.is_compiling())

    def run(self, layer, x_TH: torch.Tensor, step) -> torch.Tensor:
        """out_TH [T, H] of `step(x_TH)` (the layer's eager step), replayed from a graph once T is cached.

        The caller checked `eligible`. x_TH: [T, H] on CUDA.
        """
        st = self._layers.get(layer)
        if st is None:
            st = self._layers[layer] = _LayerState()
        key = _key(x_TH)
        entry = st.entries.get(key)
        if entry is None:
            if key in st.refused or st.seen[key] < self.capture_after:
                st.seen[key] += 1
                self.eager += 1
                return step(x_TH)
            entry = self._capture(layer, st, x_TH, step)
            if entry is None:
                self.eager += 1
                return step(x_TH)
        else:
            st.entries.move_to_end(key)
            self._publish(layer, entry.routing)
        entry.x_TH.copy_(x_TH)
        entry.graph.replay()
        self.replays += 1
        if layer.check_routing == "eager" and hasattr(entry.routing, "check"):
            entry.routing.check()  # what the eager step does: one sync, a NaN raises now
        return entry.out_TH.clone()

    def _capture(self, layer, st: _LayerState, x_TH: torch.Tensor, step) -> _Entry | None:
        key = _key(x_TH)
        need = 2 * x_TH.numel() * x_TH.element_size()  # input copy + output (the routing's are small)
        if self.bytes + need > self.max_bytes:
            st.refused[key] = f"memory budget: {self.bytes} + {need} bytes > max_bytes={self.max_bytes}"
            return None
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        x_buf = x_TH.clone()
        graph = torch.cuda.CUDAGraph()
        try:
            # One step on a side stream first (what torch.cuda.graph's docs ask: lazy library
            # state, e.g. cuBLAS workspaces, is created outside the capture).
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step(x_buf)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph, pool=self._pool):
                out = step(x_buf)
        except Exception as exc:  # noqa: BLE001 - any capture failure: this T runs eagerly from now on
            st.refused[key] = f"{type(exc).__name__}: {exc}"
            torch.cuda.synchronize()
            return None
        # The capture ran the layer's Python once: its routing status went to the monitor (or was
        # left to the caller under capture), and last_routing is the graph's routing buffers.
        entry = _Entry(graph=graph, x_TH=x_buf, out_TH=out, routing=layer.last_routing)
        st.entries[key] = entry
        self.bytes += need
        if len(st.entries) > self.max_shapes:
            _, old = st.entries.popitem(last=False)
            self.bytes -= 2 * old.x_TH.numel() * old.x_TH.element_size()
        self.captures += 1
        return entry

    @staticmethod
    def _publish(layer, routing) -> None:
        """What the eager step's Python would have done with its routing result (module docstring)."""
        layer.__dict__["last_routing"] = routing
        status = getattr(routing, "status", None)
        if status is None:
            return
        if layer.check_routing == "deferred" and layer.routing_monitor is not None:
            layer.routing_monitor.add(status)
