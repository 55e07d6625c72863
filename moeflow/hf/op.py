"""A patched MoE block's step as a torch custom op: torch.compile sees one node per block.

    model = AutoModelForCausalLM.from_pretrained(path)
    moeflow.patch_model(model)
    fast = torch.compile(model, fullgraph=True)      # 0 graph breaks; each MoE block one op call

What dynamo traces of a patched block (moeflow.hf.blocks) is one call of an op below; the op's
real implementation is the block's eager step (`MoELayer.forward`: routing, dispatch, experts,
combine, shared expert, the Triton kernels or the CPU code behind them), run as plain Python
when the compiled graph reaches it. Outside torch.compile a patched block calls its MoELayer
directly (no dispatcher round trip: the eager host time stays what it was).

    moeflow::moe_block(x, input_ids?, block) -> out                 the whole step (x [..., H] -> out [..., H])
    moeflow::moe_block_scores(x_TH, block) -> (out_TH, weights_TK)  gpt-oss: + the routing weights
    moeflow::moe_route(x_TH, block) -> (weights_TK f32, ids_TK i64)  gemma4's router (routing only)
    moeflow::moe_experts(x_TH, ids_TK, weights_TK, block) -> out_TH  gemma4's experts (given routing)

gemma4 is two ops per block because transformers' decoder layer runs a norm between its
router and its experts; every other family is one. gemma4 with expert parallelism raises
CompiledStepError at its first compiled step (its EP step needs the router's input inside the
experts' collective call, which only Python between the two modules can carry).

Why an int `block` and a registry: an op's arguments are tensors and scalars, not modules.
Each patched block's state gets a process-unique int at patch time (`register`); the op looks
the state up by it. Dynamo reads the int as a constant of the module it traces (guarded, like
any attribute), so a compiled graph names each block's op call with its own constant, needs no
context object around the call (vLLM's `moe_forward` takes a layer name looked up in a forward
context that its model runner sets; a transformers forward has none), and a CUDA graph that
cudagraph trees record around the call replays the kernels the real implementation launched.
The registry holds weak references: a dropped model's blocks leave it. A copied block state
(copy.deepcopy, pickle) registers under a new id, so a copy never runs the original's layer.

The layer's own per-T CUDA graphs (`layer_graphs`, moeflow.layer_graphs) are not used inside
the op: under torch.compile the CUDA graphs are torch.compile's (mode="reduce-overhead"), and a
capture of the layer's own during cudagraph trees' warm-up run would nest two graph mechanisms
over one memory pool.

Honest about effects: the ops mutate none of their tensor arguments (`mutates_args=()`) and
return fresh tensors (never an argument or a buffer kept across calls). They read the layer's
weights, which are not arguments (inference: they do not change inside a compiled graph), and
they do bookkeeping the graph never sees: the routing status rows and the routing monitor, an
offload cache's refills, an expert-parallel step's collectives. Under torch.compile's default
mode all of that runs inside the op, as it does eagerly. Inside a CUDA graph that torch.compile
records (mode="reduce-overhead") the Python of a step runs once, at the recording, so a layer
whose step needs host work per call (an offloaded expert source: refills; an expert-parallel
dispatcher: collectives sized on the host) raises `CompiledStepError` naming the layer and the
reason, never replays stale state.

Routing status: on CPU a NaN logit or a bad hash id raises the named ValueError (layer, row)
from inside the op. On CUDA the status goes to the model's RoutingMonitor as in eager, and as
in eager the first patched block checks the previous forward's flag and the last one flushes
this forward's (`poll_routing`, `flush_routing`). The router writes a compiled step's status into rows the layer
keeps (`MoELayer.prepare_compiled`, made at patch time outside any CUDA-graph pool), so the
monitor may hold them past the call. Inside a recorded CUDA graph nothing is flushed:
`moeflow.hf.check_routing(model)` checks the latest replay's statuses (as after StaticDecoder
replays).

Memory under mode="reduce-overhead": torch.compile's cudagraph trees allocate everything a
recorded call makes from their pool and refuse a pool tensor that outlives the call without
being an output. So a compiled step leaves none of its tensors behind: the status rows are the
layer's own, `layer.last_routing` is None after the op (forward hooks on the MoELayer still see
it during the step), and the GPU router's per-device buffers are made at patch time.

Dynamic T: the fake implementations give shapes in terms of x's (symbolic) shape, so a
prefill length never specialises the op; dynamo's automatic dynamic shapes recompile once,
at the second distinct length (see docs/compile.md for the count over T = 17..2048).

Legend: T tokens, H hidden, K picks per token.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any

import torch

__all__ = ["CompiledStepError", "register", "lookup", "moe_block", "moe_block_scores", "moe_route", "moe_experts"]


class CompiledStepError(RuntimeError):
    """A patched block's step cannot run where torch.compile put it (names the layer and why)."""


_LOCK = threading.Lock()
_IDS = itertools.count(1)
_BLOCKS: dict[int, weakref.ref] = {}


def register(state: Any) -> int:
    """A new process-unique id for a patched block's state (weakly held)."""
    with _LOCK:
        i = next(_IDS)
        _BLOCKS[i] = weakref.ref(state, lambda _, i=i: _BLOCKS.pop(i, None))
    return i


def lookup(block: int) -> Any:
    """The block state registered under `block` (ValueError if it is gone or never was)."""
    ref = _BLOCKS.get(block)
    state = ref() if ref is not None else None
    if state is None:
        raise ValueError(f"moeflow op: block={block} names no live patched block (was its model deleted or "
                         f"unpatched?)")
    return state


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_capturable(state: Any) -> None:
    """Refuse a step that needs host work per call inside a CUDA graph torch.compile records."""
    if not _capturing():
        return
    layer = state.layer
    why = None
    if getattr(layer, "offload", None) is not None:
        why = ("its experts are offloaded: the slot cache is refilled by host code before each step, which a "
               "replayed graph skips")
    elif layer.dispatcher.name != "local":
        why = (f"it is expert parallel ({layer.dispatcher.name}): its collectives are sized and checked on the "
               f"host per step")
    if why is not None:
        raise CompiledStepError(
            f"{state.path} (layer {layer.layer_idx}): a patched MoE step cannot run inside a CUDA graph recorded by "
            f"torch.compile (mode='reduce-overhead' or cudagraphs), because {why}; compile with mode='default' "
            f"(the step then runs in the op as in eager)")


def _enter(state: Any) -> None:
    if state.fam.hf.decoder_level and state.expert_parallel:
        # gemma4's EP step routes inside the experts' collective call, on the router's input that
        # a Python stash carries between its two modules: no op boundary can pass it.
        raise CompiledStepError(f"{state.path} (layer {state.layer.layer_idx}): gemma4 with expert parallelism does "
                                f"not run under torch.compile; run it eagerly")
    _check_capturable(state)
    # The previous forward's flag (a no-op under capture). Waited for, not only polled: this
    # forward's router rewrites the status rows that flag would name.
    poll_routing(state, wait=True)


def poll_routing(state: Any, *, wait: bool = False) -> None:
    """The first patched block of a model: check the previous forwards' routing flags (the model's
    RoutingMonitor; wait=False reads only flags that have landed, no sync)."""
    monitor = state.layer.routing_monitor if state.first_in_model else None
    if monitor is not None:
        monitor.poll(wait=wait)


def flush_routing(state: Any) -> None:
    """The last patched block of a model: enqueue this forward's one routing flag (no sync;
    nothing under CUDA-graph capture)."""
    monitor = state.layer.routing_monitor if state.last_in_model else None
    if monitor is not None:
        monitor.end_forward()


def _run(state: Any, step):
    """step(layer) inside the op: the status rows the layer keeps (prepare_compiled), and nothing
    of the step's own tensors left on the layer afterwards (`last_routing` is None): a tensor made
    inside a CUDA graph that torch.compile records must not outlive the call."""
    _enter(state)
    layer = state.layer
    layer.__dict__["_in_compiled_step"] = True
    try:
        result = step(layer)
    finally:
        layer.__dict__["_in_compiled_step"] = False
        layer.__dict__["last_routing"] = None
    flush_routing(state)
    return result


def _fresh(t: torch.Tensor, like: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """t, or a copy where it shares storage with an argument (an op's output may not alias one)."""
    if any(t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() for a in like if a is not None):
        return t.clone()
    return t.contiguous()


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("moeflow::moe_block", mutates_args=())
def moe_block(x: torch.Tensor, input_ids: torch.Tensor | None, block: int) -> torch.Tensor:
    """A patched block's step: out, x's shape and dtype. x: [B, S, H] or [T, H]; input_ids: int, T of them
    (DeepSeek-V4 hash layers) or None."""
    out = _run(lookup(block), lambda layer: layer(x, input_ids=input_ids, use_graphs=False))
    return _fresh(out, (x, input_ids))


@moe_block.register_fake
def _(x: torch.Tensor, input_ids: torch.Tensor | None, block: int) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("moeflow::moe_block_scores", mutates_args=())
def moe_block_scores(x_TH: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: (out_TH [T, H], the routing weights [T, K] in x's dtype); x_TH [T, H]."""
    def step(layer):
        out = layer(x_TH, use_graphs=False)
        return out, layer.last_routing.weights_TK.to(x_TH.dtype, copy=True)

    out, weights = _run(lookup(block), step)
    return _fresh(out, (x_TH,)), weights


@moe_block_scores.register_fake
def _(x_TH: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    K = lookup(block).layer.config.router.top_k
    return x_TH.new_empty(x_TH.shape), x_TH.new_empty((x_TH.shape[0], K))


@torch.library.custom_op("moeflow::moe_route", mutates_args=())
def moe_route(x_TH: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gemma4's router: (weights_TK f32 [T, K], ids_TK int64 [T, K]) for x_TH [T, H]."""
    routing = _run(lookup(block), lambda layer: layer.route(x_TH))
    return routing.weights_TK.to(torch.float32, copy=True), routing.ids_TK.to(torch.int64, copy=True)


@moe_route.register_fake
def _(x_TH: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    K = lookup(block).layer.config.router.top_k
    T = x_TH.shape[0]
    return x_TH.new_empty((T, K), dtype=torch.float32), x_TH.new_empty((T, K), dtype=torch.int64)


@torch.library.custom_op("moeflow::moe_experts", mutates_args=())
def moe_experts(x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, block: int) -> torch.Tensor:
    """gemma4's experts on a given routing: out_TH [T, H] in x's dtype (no shared expert)."""
    from ..types import RoutingResult

    out = _run(lookup(block), lambda layer: layer.experts_forward(x_TH, RoutingResult(ids_TK, weights_TK)))
    return _fresh(out, (x_TH, ids_TK, weights_TK))


@moe_experts.register_fake
def _(x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor, block: int) -> torch.Tensor:
    return x_TH.new_empty(x_TH.shape)
