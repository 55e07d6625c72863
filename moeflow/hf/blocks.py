"""The classes patch_model gives to HF MoE modules: each forward runs the block's MoELayer.

`patch_model` turns each MoE block (MixtralSparseMoeBlock, DeepseekV3MoE, GptOssMLP, ...)
into a moeflow-backed module *in place*: the block object keeps its children (gate,
experts, shared experts), its parameters and buffers (so `state_dict()` keys, `.to()`,
`save_pretrained` and hooks are unchanged), its attributes and `isinstance` checks; its
class becomes a subclass of the HF class (a `MoEBlock` kind mixed in first) whose
`forward` runs a `moeflow.MoELayer` built on the block's own tensors. Each keeps its HF
return signature: gpt-oss returns (out, router_scores [T, K]), llama4 (out [T, H],
router_logits [T, E]), DeepSeek-V4 takes `input_ids` (hash layers). gemma4 has no block
module (its router and experts sit on the decoder layer): its `router` and `experts`
modules are patched the same way and share one MoELayer.

Legend: T tokens, H hidden, E routed experts, K picks per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..families import Family
from ..layer import MoELayer
from ..types import RoutingResult
from . import op
from .util import attr_path as _attr

__all__ = ["MoEBlock", "BlockState", "patched_class", "block_kinds"]


def _router_logits_requested() -> bool:
    """True while a transformers output collector wants `router_logits` (output_router_logits)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # older/newer transformers without the recorder: nothing to feed
        return False
    if torch.compiler.is_compiling() and not getattr(_active_collector, "compiling", False):
        # Traced with no transformers forward around it (a block compiled alone): no collector was
        # set, and a plain ContextVar.get would break the graph.
        return False
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


class BlockState:
    """What a patched module carries (kept out of the module tree: no new state_dict keys)."""

    def __init__(self, fam: Family, layer: MoELayer, sources: Callable[[], dict[str, torch.Tensor | None]],
                 path: str):
        self.fam = fam
        self.layer = layer
        self.sources = sources
        self.path = path
        self.hook_handle = None
        self.exposed_by: nn.Module | None = None  # the one module that lists the layer in named_modules
        self.stash: torch.Tensor | None = None  # gemma4 + EP: the router input of this step
        # Under torch.compile the block's step is a custom op that finds this state by id
        # (moeflow.hf.op); the first and last blocks of a model poll / flush its routing monitor there.
        self.op_id = op.register(self)
        self.first_in_model = False
        self.last_in_model = False

    def __setstate__(self, d: dict) -> None:
        # A copy (copy.deepcopy, pickle) gets its own op id: it must never run the original's layer.
        self.__dict__.update(d)
        self.op_id = op.register(self)

    def resync(self) -> None:
        """Point the MoELayer back at the HF module's current tensors.

        `.to()` replaces buffers (e_score_correction_bias, tid2eid) with new tensors and
        `load_state_dict(assign=True)` replaces Parameters; the MoELayer is not part of
        the module tree, so it is re-pointed here instead.
        """
        self.layer.rebind(**self.sources())

    @property
    def expert_parallel(self) -> bool:
        return self.layer.dispatcher.name != "local"


class MoEBlock(nn.Module):
    """Base of the classes patch_model gives to HF MoE modules (mixed in before the HF class).

    `moe_layer` is the MoELayer sharing the block's tensors (`last_routing`, `impl_name`,
    its `dispatcher` and `source`); `moe_runner` is the same layer (an older public name for
    what forward calls, kept).
    """

    _moeflow: BlockState

    @property
    def moe_layer(self) -> MoELayer:
        return self.__dict__["_moeflow"].layer

    @property
    def moe_runner(self) -> nn.Module:
        return self.__dict__["_moeflow"].layer

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        # The MoELayer is listed by modules()/named_modules() as "<block>.moe_layer" (so code
        # that looks for MoELayers finds them), but it is not a child: its tensors are the
        # block's own, and registering it would give state_dict() a second copy of each key.
        if memo is None:
            memo = set()
        yield from super().named_modules(memo, prefix, remove_duplicate)
        state = self.__dict__["_moeflow"]
        if state.exposed_by is self:
            yield from state.layer.named_modules(memo, f"{prefix}.moe_layer" if prefix else "moe_layer",
                                                 remove_duplicate)

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        state = self.__dict__["_moeflow"]
        # The layer's own tensors (a rank's expert copies, a static spare) move too; the ones
        # it shares with this block were converted above (fn is idempotent on them).
        state.layer._apply(fn, *args, **kwargs)
        state.resync()
        return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _eager(state: BlockState, step: Callable[[], Any], *, poll: bool = True, flush: bool = True) -> Any:
    """step() outside torch.compile, between the model's routing-monitor poll (first block) and its
    flush (last block): what the custom op does under compile (moeflow.hf.op)."""
    if poll:
        op.poll_routing(state)
    out = step()
    if flush:
        op.flush_routing(state)
    return out


class _TensorBlock(MoEBlock):
    """mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2/v3, glm4_moe, longcat_flash."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        state = self.__dict__["_moeflow"]
        if _router_logits_requested():
            _attr(self, state.fam.hf.router)(_flat(hidden_states))  # its recorder hook captures the logits
        if torch.compiler.is_compiling():
            return op.moe_block(hidden_states, None, state.op_id)
        return _eager(state, lambda: state.layer(hidden_states))


class _DeepseekV4Block(MoEBlock):
    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        state = self.__dict__["_moeflow"]
        if state.layer.config.router.hash_routing and input_ids is None:
            raise ValueError(
                f"{state.path}: DeepSeek-V4 hash-routed layer needs input_ids (tid2eid[input_ids]); "
                "the model was called with inputs_embeds only"
            )
        if _router_logits_requested() and not state.layer.config.router.hash_routing:
            self.gate(hidden_states)
        if torch.compiler.is_compiling():
            ids = input_ids if state.layer.config.router.hash_routing else None
            return op.moe_block(hidden_states, ids, state.op_id)
        return _eager(state, lambda: state.layer(hidden_states, input_ids=input_ids))


class _GptOssBlock(MoEBlock):
    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.__dict__["_moeflow"]
        if _router_logits_requested():
            self.router(_flat(hidden_states))
        if torch.compiler.is_compiling():
            out_TH, weights_TK = op.moe_block_scores(_flat(hidden_states), state.op_id)
            return out_TH.view(hidden_states.shape), weights_TK
        out = _eager(state, lambda: state.layer(hidden_states))
        # HF returns the softmax over the K picked logits, [T, K], in the activations' dtype.
        return out, state.layer.last_routing.weights_TK.to(hidden_states.dtype)


class _Llama4Block(MoEBlock):
    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.__dict__["_moeflow"]
        x_TH = _flat(hidden_states)
        # Llama4TextMoe returns [T, H] and the router's raw logits (nn.Linear, x's dtype);
        # calling the router module also feeds its recorder hook when one listens.
        router_logits = F.linear(x_TH, self.router.weight) if not _router_logits_requested() else self.router(x_TH)[1]
        if torch.compiler.is_compiling():
            return op.moe_block(x_TH, None, state.op_id), router_logits
        return _eager(state, lambda: state.layer(x_TH)), router_logits


class _Gemma4Router(MoEBlock):
    """Gemma4TextRouter patched: moeflow's routing of the residual stream."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        state = self.__dict__["_moeflow"]
        x_TH = _flat(hidden_states)
        if torch.compiler.is_compiling():  # (with expert parallelism the op refuses: moeflow.hf.op)
            weights_TK, ids_TK = op.moe_route(x_TH, state.op_id)
            routing = RoutingResult(ids_TK, weights_TK)
        else:
            state.stash = x_TH if state.expert_parallel else None
            routing = _eager(state, lambda: state.layer.route(x_TH), flush=False)
            state.layer.last_routing = routing
        probs = None
        if _router_logits_requested():
            # HF's first output (what its recorder keeps): softmax of all E logits, f32.
            logits = F.linear(state.layer.router_input(x_TH), self.proj.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        return probs, routing.weights_TK, routing.ids_TK.long()


class _Gemma4Experts(MoEBlock):
    """Gemma4TextExperts patched: moeflow's experts on the router's picks."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        state = self.__dict__["_moeflow"]
        if torch.compiler.is_compiling():
            return op.moe_experts(hidden_states, top_k_index, top_k_weights, state.op_id)
        if state.expert_parallel:  # expert parallel: one collective call, routing inside
            residual, state.stash = state.stash, None
            if residual is None:
                raise ValueError(f"{state.path}: gemma4 experts called without its patched router first")
            return _eager(state, lambda: state.layer(hidden_states, router_input=residual), poll=False)
        return _eager(state, lambda: state.layer.experts_forward(hidden_states, RoutingResult(top_k_index, top_k_weights)),
                      poll=False)


_KIND = {"tensor": _TensorBlock, "out_scores": _GptOssBlock, "out_logits": _Llama4Block}
_CLASS_CACHE: dict[tuple[type, type], type] = {}


def patched_class(kind: type, hf_class: type) -> type:
    key = (kind, hf_class)
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        cls = type(f"Moeflow{hf_class.__name__}", (kind, hf_class), {"__module__": __name__})
        _CLASS_CACHE[key] = cls
    return cls



def block_kinds(fam: Family, block: nn.Module) -> list[tuple[nn.Module, type]]:
    """The (module, MoEBlock kind) pairs patch_model patches for one HF block of family `fam`."""
    if fam.hf.decoder_level:
        return [(block.router, _Gemma4Router), (block.experts, _Gemma4Experts)]
    if fam.hf.takes_input_ids:
        return [(block, _DeepseekV4Block)]
    return [(block, _KIND[fam.hf.returns])]
