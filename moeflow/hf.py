"""transformers integration: run every MoE block of a Hugging Face model through moeflow.

    model = AutoModelForCausalLM.from_pretrained(path)
    report = moeflow.patch_model(model)          # experts="auto" | "reference" | "grouped" | "triton"
    print(report)

`patch_model` turns each MoE block (MixtralSparseMoeBlock, DeepseekV3MoE, GptOssMLP, ...)
into a moeflow-backed module *in place*: the block object keeps its children (gate,
experts, shared experts), its parameters and buffers (so `state_dict()` keys, `.to()`,
`save_pretrained` and hooks are unchanged), its attributes and `isinstance` checks; its
class becomes a subclass of the HF class whose `forward` runs a `moeflow.MoELayer` built
on the block's own tensors (shared by reference, never copied). Each block keeps its HF
return signature: gpt-oss returns (out, router_scores [T, K]), llama4 (out [T, H],
router_logits [T, E]), DeepSeek-V4 takes `input_ids` (hash layers). gemma4 has no block
module (its router and experts sit on the decoder layer, the router reading the residual
stream and the experts a differently normalised copy): its `router` and `experts` modules
are patched the same way and share one MoELayer.

An MoE-looking module (one with an `experts` child, or an `...Experts` class) that no
family below covers raises ValueError naming it, before anything is changed: nothing is
silently left unpatched. The routing spec of each block comes from
`moeflow.routing.families.router_spec_from_hf`.

`import moeflow.hf` also registers "moeflow" in transformers' experts interface (where the
installed transformers has one), so `from_pretrained(..., experts_implementation="moeflow")`
runs moeflow's experts under HF's own routing for every family that uses the interface.

Legend: B batch, S sequence, T = B*S tokens, H hidden, E routed experts, Z zero experts,
K picks per token, I intermediate per expert.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ExpertWeights, MoEConfig
from .layer import MoELayer, run_experts
from .routing.families import router_spec_from_hf, text_config
from .routing.spec import RouterSpec
from .types import RoutingResult

__all__ = [
    "MoEBlock",
    "PatchReport",
    "PatchedBlock",
    "HF_FAMILIES",
    "available_hf_families",
    "moe_layers",
    "patch_model",
    "unpatch_model",
    "register_experts_interface",
    "moeflow_experts_forward",
]

EP_MODES = ("all_to_all", "all_reduce")


# ----------------------------------------------------------------------------- family table


def _act_silu(config: Any, experts: nn.Module, *, attr: str = "hidden_act") -> tuple[str, float | None, float]:
    act = getattr(config, attr, None)
    if act not in ("silu", "swish"):
        raise ValueError(f"config.{attr}={act!r}: moeflow runs SiLU-gated experts here ('silu'), not {act!r}")
    return "silu", None, 1.702


def _act_gemma4(config: Any, experts: nn.Module) -> tuple[str, float | None, float]:
    act = getattr(config, "hidden_activation", None)
    if act not in ("gelu_pytorch_tanh", "gelu_python_tanh"):
        raise ValueError(f"config.hidden_activation={act!r}: moeflow's gemma4 experts run gelu-tanh only")
    return "gelu_tanh", None, 1.702


def _act_deepseek_v4(config: Any, experts: nn.Module) -> tuple[str, float | None, float]:
    _act_silu(config, experts)
    return "swiglu_clamp", float(experts.limit), 1.702


def _act_gpt_oss(config: Any, experts: nn.Module) -> tuple[str, float | None, float]:
    # 5.17 hard-codes limit/alpha on the experts module, 5.24 reads them from the config:
    # the module's attributes are right in both.
    return "gptoss", float(experts.limit), float(experts.alpha)


def _attr(obj: Any, path: str | None) -> Any:
    if path is None:
        return None
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class HFFamily:
    """How one family's HF MoE block is wired (attribute paths relative to the block).

    module, block_class: where the HF block class lives (looked up with getattr, so a
        transformers version that lacks the family is skipped).
    router: the router module; router_weight etc.: tensors, as attribute paths.
    returns: "tensor" (out, x's shape) | "out_scores" (gpt-oss: out, router scores
        [T, K]) | "out_logits" (llama4: out [T, H], router logits [T, E]).
    takes_input_ids: the block's forward takes `input_ids` (DeepSeek-V4 hash layers).
    zero_expert_rows: the fused gate_up holds E + Z rows of which only E are experts.
    decoder_level: gemma4: the "block" is the decoder layer's (router, experts) pair.
    """

    family: str
    module: str
    block_class: str
    router: str
    router_weight: str
    activation: Callable[[Any, nn.Module], tuple[str, float | None, float]]
    experts: str = "experts"
    router_bias: str | None = None
    selection_bias: str | None = None
    hash_table: str | None = None
    expert_scale: str | None = None
    prenorm_weight: str | None = None
    shared: str | None = None
    shared_gate: str | None = None
    layout: str = "linear"
    interleaved: bool = False
    expert_bias: bool = False
    returns: str = "tensor"
    takes_input_ids: bool = False
    zero_expert_rows: bool = False
    decoder_level: bool = False

    def block_type(self) -> type | None:
        try:
            mod = importlib.import_module(self.module)
        except ImportError:
            return None
        return getattr(mod, self.block_class, None)


def _m(family: str) -> str:
    return f"transformers.models.{family}.modeling_{family}"


HF_FAMILIES: tuple[HFFamily, ...] = (
    HFFamily("mixtral", _m("mixtral"), "MixtralSparseMoeBlock", "gate", "gate.weight", _act_silu),
    HFFamily("qwen2_moe", _m("qwen2_moe"), "Qwen2MoeSparseMoeBlock", "gate", "gate.weight", _act_silu,
             shared="shared_expert", shared_gate="shared_expert_gate.weight"),
    HFFamily("qwen3_moe", _m("qwen3_moe"), "Qwen3MoeSparseMoeBlock", "gate", "gate.weight", _act_silu),
    HFFamily("olmoe", _m("olmoe"), "OlmoeSparseMoeBlock", "gate", "gate.weight", _act_silu),
    HFFamily("deepseek_v2", _m("deepseek_v2"), "DeepseekV2Moe", "gate", "gate.weight", _act_silu,
             shared="shared_experts"),
    HFFamily("deepseek_v3", _m("deepseek_v3"), "DeepseekV3MoE", "gate", "gate.weight", _act_silu,
             selection_bias="gate.e_score_correction_bias", shared="shared_experts"),
    HFFamily("glm4_moe", _m("glm4_moe"), "Glm4MoeMoE", "gate", "gate.weight", _act_silu,
             selection_bias="gate.e_score_correction_bias", shared="shared_experts"),
    HFFamily("gpt_oss", _m("gpt_oss"), "GptOssMLP", "router", "router.weight", _act_gpt_oss,
             router_bias="router.bias", layout="matmul", interleaved=True, expert_bias=True, returns="out_scores"),
    HFFamily("llama4", _m("llama4"), "Llama4TextMoe", "router", "router.weight", _act_silu,
             shared="shared_expert", layout="matmul", returns="out_logits"),
    # HF builds the classifier with `router_bias` but its forward never adds it: neither do we.
    HFFamily("longcat_flash", _m("longcat_flash"), "LongcatFlashMoE", "router", "router.classifier.weight",
             _act_silu, selection_bias="router.e_score_correction_bias", zero_expert_rows=True),
    # selection_bias / hash_table: present on the learned / hash-routed layers respectively.
    HFFamily("deepseek_v4", _m("deepseek_v4"), "DeepseekV4SparseMoeBlock", "gate", "gate.weight",
             _act_deepseek_v4, selection_bias="gate.e_score_correction_bias", hash_table="gate.tid2eid",
             shared="shared_experts", takes_input_ids=True),
    HFFamily("gemma4", _m("gemma4"), "Gemma4TextDecoderLayer", "router", "router.proj.weight", _act_gemma4,
             expert_scale="router.per_expert_scale", prenorm_weight="router.scale", decoder_level=True),
)


def available_hf_families() -> list[str]:
    """Families of HF_FAMILIES whose block class the installed transformers has."""
    return [f.family for f in HF_FAMILIES if f.block_type() is not None]


# ----------------------------------------------------------------------------- report


@dataclass(frozen=True)
class PatchedBlock:
    """One replaced block: where it is, what it is, what runs it."""

    path: str
    family: str
    block_class: str
    layer_idx: int
    num_experts: int
    num_zero_experts: int
    top_k: int
    impl: str
    shared_expert: bool
    runner: str  # "MoELayer" | "EPMoELayer"


@dataclass(frozen=True)
class PatchReport:
    """What patch_model did: the model, the options, and every block it replaced (model order)."""

    model_class: str
    experts: str
    blocks: tuple[PatchedBlock, ...]
    ep_mode: str | None = None
    offload: bool = False
    families: tuple[str, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self):
        return iter(self.blocks)

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(b.path for b in self.blocks)

    def __str__(self) -> str:
        extras = []
        if self.ep_mode is not None:
            extras.append(f"ep={self.ep_mode}")
        if self.offload:
            extras.append("offload")
        head = (
            f"moeflow.patch_model: {self.model_class} ({', '.join(self.families)}): {len(self.blocks)} MoE "
            f"block(s) replaced, experts={self.experts!r}" + (f" [{', '.join(extras)}]" if extras else "")
        )
        rows = [("module", "class", "layer", "E", "K", "impl", "shared")]
        for b in self.blocks:
            e = f"{b.num_experts}+{b.num_zero_experts}z" if b.num_zero_experts else str(b.num_experts)
            rows.append((b.path, b.block_class, str(b.layer_idx), e, str(b.top_k), b.impl,
                         "yes" if b.shared_expert else "no"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join([head, *lines])


# ----------------------------------------------------------------------------- block state


def _router_logits_requested() -> bool:
    """True while a transformers output collector wants `router_logits` (output_router_logits)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # older/newer transformers without the recorder: nothing to feed
        return False
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


class _State:
    """What a patched module carries (kept out of the module tree: no new state_dict keys)."""

    def __init__(self, fam: HFFamily, layer: MoELayer, runner: nn.Module,
                 sources: Callable[[], dict[str, torch.Tensor | None]], path: str):
        self.fam = fam
        self.layer = layer
        self.runner = runner
        self.sources = sources
        self.path = path
        self.hook_handle = None
        self.exposed_by: nn.Module | None = None  # the one module that lists the layer in named_modules
        self.stash: torch.Tensor | None = None  # gemma4 + EP: the router input of this step

    def resync(self) -> None:
        """Point the MoELayer back at the HF module's current tensors.

        `.to()` replaces buffers (e_score_correction_bias, tid2eid) with new tensors and
        `load_state_dict(assign=True)` replaces Parameters; the MoELayer is not part of
        the module tree, so it is re-pointed here instead.
        """
        layer = self.layer
        rows = getattr(layer, "_rows", {})
        for name, t in self.sources().items():
            if t is None:
                continue
            target = f"{name}_full" if name in rows else name
            if target in layer._parameters and isinstance(t, nn.Parameter):
                layer._parameters[target] = t
            elif target in layer._buffers:
                layer._buffers[target] = t


class MoEBlock(nn.Module):
    """Base of the classes patch_model gives to HF MoE modules (mixed in before the HF class).

    `moe_layer` is the MoELayer sharing the block's tensors (`last_routing`, `impl_name`);
    `moe_runner` is what forward calls (the MoELayer, or its EPMoELayer under expert
    parallelism).
    """

    _moeflow: _State

    @property
    def moe_layer(self) -> MoELayer:
        return self.__dict__["_moeflow"].layer

    @property
    def moe_runner(self) -> nn.Module:
        return self.__dict__["_moeflow"].runner

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
        state.resync()
        if state.runner is not state.layer:
            state.runner._apply(fn, *args, **kwargs)
        return out


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class _TensorBlock(MoEBlock):
    """mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2/v3, glm4_moe, longcat_flash."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        state = self.__dict__["_moeflow"]
        if _router_logits_requested():
            _attr(self, state.fam.router)(_flat(hidden_states))  # its recorder hook captures the logits
        return state.runner(hidden_states)


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
        return state.runner(hidden_states, input_ids=input_ids)


class _GptOssBlock(MoEBlock):
    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.__dict__["_moeflow"]
        if _router_logits_requested():
            self.router(_flat(hidden_states))
        out = state.runner(hidden_states)
        # HF returns the softmax over the K picked logits, [T, K], in the activations' dtype.
        return out, state.runner.last_routing.weights_TK.to(hidden_states.dtype)


class _Llama4Block(MoEBlock):
    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.__dict__["_moeflow"]
        x_TH = _flat(hidden_states)
        # Llama4TextMoe returns [T, H] and the router's raw logits (nn.Linear, x's dtype);
        # calling the router module also feeds its recorder hook when one listens.
        router_logits = F.linear(x_TH, self.router.weight) if not _router_logits_requested() else self.router(x_TH)[1]
        return state.runner(x_TH), router_logits


class _Gemma4Router(MoEBlock):
    """Gemma4TextRouter patched: moeflow's routing of the residual stream."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        state = self.__dict__["_moeflow"]
        x_TH = _flat(hidden_states)
        state.stash = x_TH if state.runner is not state.layer else None
        routing = state.layer.route(x_TH)
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
        if state.runner is not state.layer:  # expert parallel: one collective call, routing inside
            residual, state.stash = state.stash, None
            if residual is None:
                raise ValueError(f"{state.path}: gemma4 experts called without its patched router first")
            return state.runner(hidden_states, router_input=residual)
        return state.layer.experts_forward(hidden_states, RoutingResult(top_k_index, top_k_weights))


_KIND = {"tensor": _TensorBlock, "out_scores": _GptOssBlock, "out_logits": _Llama4Block}
_CLASS_CACHE: dict[tuple[type, type], type] = {}


def _patched_class(kind: type, hf_class: type) -> type:
    key = (kind, hf_class)
    cls = _CLASS_CACHE.get(key)
    if cls is None:
        cls = type(f"Moeflow{hf_class.__name__}", (kind, hf_class), {"__module__": __name__})
        _CLASS_CACHE[key] = cls
    return cls


# ----------------------------------------------------------------------------- building


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _layer_idx(path: str, module: nn.Module) -> int:
    found = _LAYER_RE.findall(path)
    if found:
        return int(found[-1])
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int):
        return idx
    raise ValueError(f"patch_model: cannot tell the layer index of {path!r} (no 'layers.<i>' in its path)")


def _sources(fam: HFFamily, block: nn.Module, spec: RouterSpec) -> dict[str, torch.Tensor | None]:
    """The block's tensors by MoELayer storage name (read fresh each call)."""
    experts = _attr(block, fam.experts)
    out = {
        "router_weight": _attr(block, fam.router_weight),
        "router_bias": _attr(block, fam.router_bias),
        "selection_bias": _attr(block, fam.selection_bias) if spec.use_bias else None,
        "hash_table": _attr(block, fam.hash_table) if spec.hash_routing else None,
        "expert_scale": _attr(block, fam.expert_scale),
        "prenorm_weight": _attr(block, fam.prenorm_weight),
        "gate_up": experts.gate_up_proj,
        "down": experts.down_proj,
        "gate_up_bias": experts.gate_up_proj_bias if fam.expert_bias else None,
        "down_bias": experts.down_proj_bias if fam.expert_bias else None,
        "shared_gate_weight": _attr(block, fam.shared_gate),
    }
    return out


def _build_layer(fam: HFFamily, block: nn.Module, config: Any, layer_idx: int, experts_impl: str,
                 path: str) -> MoELayer:
    spec = router_spec_from_hf(config, layer_idx)
    experts = _attr(block, fam.experts)
    try:
        activation, limit, alpha = fam.activation(config, experts)
    except ValueError as exc:
        raise ValueError(f"patch_model: {path} ({type(block).__name__}): {exc}") from None
    if spec.hash_routing and (fam.hash_table is None or not hasattr(block.gate, "tid2eid")):
        raise ValueError(f"patch_model: {path}: the config says hash routing but the block has no tid2eid table")
    src = _sources(fam, block, spec)
    gate_up, down = src["gate_up"], src["down"]
    E = spec.num_experts
    if fam.zero_expert_rows and gate_up.shape[0] != E:
        gate_up = gate_up.narrow(0, 0, E)  # LongCat: the zero experts' rows are never read
    w = ExpertWeights(gate_up, down, src["gate_up_bias"], src["down_bias"], layout=fam.layout,
                      interleaved=fam.interleaved)
    cfg = MoEConfig(
        hidden_size=w.hidden_size,
        intermediate_size=w.intermediate_size,
        router=spec,
        activation=activation,
        swiglu_limit=limit,
        gptoss_alpha=alpha,
        layout=fam.layout,
        interleaved=fam.interleaved,
        expert_bias=fam.expert_bias,
        shared_gated=fam.shared_gate is not None,
        router_prenorm_eps=float(getattr(_attr(block, fam.router), "eps", 1e-6)),
    )
    return MoELayer(
        cfg,
        router_weight_EH=src["router_weight"],
        experts=w,
        router_bias_E=src["router_bias"],
        selection_bias_E=src["selection_bias"],
        expert_scale_E=src["expert_scale"],
        prenorm_weight_H=src["prenorm_weight"],
        hash_table_VK=src["hash_table"],
        shared_expert=_attr(block, fam.shared),
        shared_gate_weight_1H=src["shared_gate_weight"],
        experts_impl=experts_impl,
        layer_idx=layer_idx,
    )


def _looks_moe(module: nn.Module) -> bool:
    return "experts" in module._modules or type(module).__name__.endswith("Experts")


def _find_blocks(model: nn.Module) -> list[tuple[str, nn.Module, HFFamily]]:
    types = [(f, f.block_type()) for f in HF_FAMILIES]
    types = [(f, t) for f, t in types if t is not None]
    found = []
    for path, module in model.named_modules():
        if isinstance(module, MoEBlock):
            raise ValueError(f"patch_model: {path or type(model).__name__} is already patched "
                             "(call moeflow.hf.unpatch_model first)")
        for fam, t in types:
            if isinstance(module, t):
                if fam.decoder_level and not getattr(module, "enable_moe_block", False):
                    break  # a dense gemma4 layer
                found.append((path, module, fam))
                break
    covered = [p for p, _, _ in found]
    for path, module in model.named_modules():
        if not _looks_moe(module):
            continue
        if any(path == c or path.startswith(c + ".") for c in covered if c) or ("" in covered):
            continue
        known = ", ".join(available_hf_families())
        raise ValueError(
            f"patch_model: {path or '<root>'} ({type(module).__name__}) looks like an MoE block that moeflow "
            f"cannot patch (families it patches with this transformers: {known})"
        )
    return found


def _shard_hook():
    try:
        from .parallel.ep import shard_layer
    except ImportError as exc:
        raise ValueError(f"patch_model(ep_group=...): moeflow.parallel.ep.shard_layer is not available ({exc})") from None
    return shard_layer


def _offload_hook():
    try:
        from .offload.attach import attach_offload
    except ImportError as exc:
        raise ValueError(
            f"patch_model(offload=...): moeflow.offload.attach.attach_offload is not available ({exc})"
        ) from None
    return attach_offload


def patch_model(
    model: nn.Module,
    *,
    experts: str = "auto",
    ep_group: Any = None,
    ep_mode: str = "all_to_all",
    ep_options: dict[str, Any] | None = None,
    offload: Any = None,
) -> PatchReport:
    """Replace every MoE block of a transformers model by moeflow, sharing its weights.

    Args:
        model: a transformers model (CausalLM, base model, or a multimodal wrapper).
        experts: experts implementation for every block: "auto", "reference", "grouped",
            "triton" (a refused choice raises ValueError with the reason).
        ep_group: a torch.distributed process group: shard each block's experts over it
            (moeflow.parallel.ep.shard_layer, collective: call on every rank). None: local.
        ep_mode: "all_to_all" or "all_reduce" (with ep_group).
        ep_options: extra keyword arguments for every block's shard_layer, e.g.
            placement= (an expert->rank map when the world size does not divide E),
            timeout_s= (a hung rank becomes an error naming the collective), static_tokens=.
        offload: an OffloadConfig: serve the experts from host memory through a device
            slot cache (moeflow.offload.attach.attach_offload over all blocks, in model order).

    Returns:
        PatchReport listing each replaced block (module path, family, implementation).

    Raises:
        ValueError naming the module: an MoE-looking module no family covers, a block whose
        activation or layout moeflow does not run, an already patched model, a model with
        no MoE block, or an unavailable ep/offload hook. The model is left untouched then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(experts, str):
        raise TypeError(f"experts: expected a str such as 'auto', got {type(experts).__name__}")
    if ep_mode not in EP_MODES:
        raise ValueError(f"ep_mode={ep_mode!r}: expected one of {EP_MODES}")
    if ep_options is not None and (ep_group is None or not isinstance(ep_options, dict)):
        raise ValueError(f"ep_options={ep_options!r}: expected a dict, and only together with ep_group")
    if ep_group is not None and offload is not None:
        raise ValueError("patch_model: ep_group and offload together are not supported (offload runs one device)")
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"patch_model: {type(model).__name__} has no .config (expected a transformers model)")
    config = text_config(config)
    blocks = _find_blocks(model)
    if not blocks:
        raise ValueError(f"patch_model: no MoE block found in {type(model).__name__} "
                         f"(model_type={getattr(config, 'model_type', None)!r})")
    shard_layer = _shard_hook() if ep_group is not None else None
    attach_offload = _offload_hook() if offload is not None else None

    # Build everything first: a refusal leaves the model as it was.
    plans = []
    for path, block, fam in blocks:
        layer_idx = _layer_idx(path, block)
        layer = _build_layer(fam, block, config, layer_idx, experts, path)
        plans.append((path, block, fam, layer_idx, layer))
    runners = [shard_layer(layer, group=ep_group, mode=ep_mode, **(ep_options or {})) if shard_layer else layer
               for _, _, _, _, layer in plans]

    rows = []
    for (path, block, fam, layer_idx, layer), runner in zip(plans, runners):
        spec = layer.config.router
        block_class = type(block).__name__ + (".router+experts" if fam.decoder_level else "")
        if fam.decoder_level:
            targets = [(block.router, _Gemma4Router), (block.experts, _Gemma4Experts)]
        elif fam.takes_input_ids:
            targets = [(block, _DeepseekV4Block)]
        else:
            targets = [(block, _KIND[fam.returns])]
        # One state per block, shared by gemma4's two modules (the EP stash passes between them).
        state = _State(fam, layer, runner, (lambda b=block, f=fam, s=spec: _sources(f, b, s)), path)
        for module, kind in targets:
            module.__dict__["_moeflow"] = state
            module.__class__ = _patched_class(kind, type(module))
        state.exposed_by = targets[-1][0]
        state.hook_handle = block.register_load_state_dict_post_hook(lambda mod, incompatible, st=state: st.resync())
        rows.append(PatchedBlock(
            path=path or "<root>", family=fam.family, block_class=block_class,
            layer_idx=layer_idx, num_experts=spec.num_experts, num_zero_experts=spec.num_zero_experts,
            top_k=spec.top_k, impl=layer.impl_name, shared_expert=layer.shared_expert is not None,
            runner=type(runner).__name__,
        ))
    if attach_offload is not None:
        attach_offload([layer for *_, layer in plans], offload)
    return PatchReport(
        model_class=type(model).__name__,
        experts=experts,
        blocks=tuple(rows),
        ep_mode=ep_mode if ep_group is not None else None,
        offload=offload is not None,
        families=tuple(dict.fromkeys(r.family for r in rows)),
    )


def _patched_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, MoEBlock)]


def moe_layers(model: nn.Module) -> list[MoELayer]:
    """The MoELayers of a patched model, one per replaced block, in model order."""
    seen: dict[int, MoELayer] = {}
    for _, m in _patched_modules(model):
        layer = m.moe_layer
        seen.setdefault(id(layer), layer)
    return list(seen.values())


def unpatch_model(model: nn.Module) -> int:
    """Give every patched module its HF class back; returns how many modules were restored.

    Refused (ValueError) for a model whose experts were offloaded (their storage is gone).
    """
    mods = _patched_modules(model)
    for path, m in mods:
        if getattr(m.moe_layer, "offload", None) is not None:
            raise ValueError(f"unpatch_model: {path} is offloaded (its expert storage was released)")
    handles = set()
    for _, m in mods:
        state = m.__dict__.pop("_moeflow")
        m.__class__ = next(c for c in type(m).__mro__[1:] if not issubclass(c, MoEBlock))
        if state.hook_handle is not None and id(state.hook_handle) not in handles:
            handles.add(id(state.hook_handle))
            state.hook_handle.remove()
    return len(mods)


# ----------------------------------------------------------------------------- experts interface


def _interface_config(module: nn.Module) -> tuple[MoEConfig, str]:
    """(MoEConfig, family) describing an HF `@use_experts_implementation` experts module."""
    cached = module.__dict__.get("_moeflow_experts_config")
    if cached is not None:
        return cached
    name = type(module).__name__
    family = type(module).__module__.rsplit(".", 1)[-1].removeprefix("modeling_")
    fam = next((f for f in HF_FAMILIES if f.family == family), None)
    if fam is None:
        raise ValueError(f"experts_implementation='moeflow': {name} (family {family!r}) is not a family moeflow runs")
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"experts_implementation='moeflow': {name} has no gate or a post-expert norm")
    layout = "matmul" if getattr(module, "is_transposed", False) else "linear"
    interleaved = not getattr(module, "is_concatenated", True)
    bias = bool(getattr(module, "has_bias", False))
    if (layout, interleaved, bias) != (fam.layout, fam.interleaved, fam.expert_bias):
        raise ValueError(f"experts_implementation='moeflow': {name}: layout flags {(layout, interleaved, bias)} "
                         f"differ from moeflow's {fam.family} table")
    config = text_config(module.config)
    activation, limit, alpha = fam.activation(config, module)
    gu = module.gate_up_proj
    two_i = gu.shape[1] if layout == "linear" else gu.shape[2]
    H = gu.shape[2] if layout == "linear" else gu.shape[1]
    E = int(module.num_experts)
    spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=1)  # only E matters; K is per call
    cfg = MoEConfig(hidden_size=int(H), intermediate_size=int(two_i) // 2, router=spec, activation=activation,
                    swiglu_limit=limit, gptoss_alpha=alpha, layout=layout, interleaved=interleaved,
                    expert_bias=bias)
    module.__dict__["_moeflow_experts_config"] = (cfg, family)
    return cfg, family


def moeflow_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                            top_k_weights: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers ExpertsInterface entry: HF routing in, moeflow experts + combine out.

    hidden_states [T, H]; top_k_index int [T, K]; top_k_weights float [T, K]. Returns [T, H].
    (gpt-oss passes them as router_indices / routing_weights.)
    """
    if top_k_index is None:
        top_k_index = kwargs.pop("router_indices")
    if top_k_weights is None:
        top_k_weights = kwargs.pop("routing_weights")
    if getattr(self, "_is_expert_parallel", False):
        raise ValueError("experts_implementation='moeflow' does not run under transformers' expert parallelism; "
                         "use moeflow.patch_model(model, ep_group=...) instead")
    from .experts.select import select_experts_impl

    cfg, _ = _interface_config(self)
    K = int(top_k_index.shape[-1])
    cfg_k = cfg if cfg.router.top_k == K else _with_top_k(self, cfg, K)
    w = ExpertWeights(self.gate_up_proj, self.down_proj,
                      getattr(self, "gate_up_proj_bias", None) if cfg.expert_bias else None,
                      getattr(self, "down_proj_bias", None) if cfg.expert_bias else None,
                      layout=cfg.layout, interleaved=cfg.interleaved)
    impl = select_experts_impl(cfg_k, hidden_states.device, int(hidden_states.shape[0]), "auto")
    routing = RoutingResult(top_k_index, top_k_weights.to(torch.float32))
    return run_experts(hidden_states, routing, w, cfg_k, impl)


def _with_top_k(module: nn.Module, cfg: MoEConfig, K: int) -> MoEConfig:
    from dataclasses import replace

    new = replace(cfg, router=cfg.router.replace(top_k=K))
    module.__dict__["_moeflow_experts_config"] = (new, module.__dict__["_moeflow_experts_config"][1])
    return new


def register_experts_interface() -> bool:
    """Register "moeflow" with transformers' ExpertsInterface; False where transformers has none."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register("moeflow", moeflow_experts_forward)
    return True


register_experts_interface()
