"""The family table: one record per MoE model family, the only place that knows model names.

A record says everything moeflow needs about a family:
    name, model_types   the HF `model_type`s it covers
    router              the router rule (moeflow.routing.rules): HF config, layer -> RouterSpec
    layout, interleaved, expert_bias   the fused experts' tensors (moeflow.config.ExpertWeights)
    activation          (HF config, experts module or None) -> (activation, swiglu_limit, alpha)
    shared              the shared-expert kind: "none" | "swiglu" | "gated_swiglu" (qwen2_moe's
                        sigmoid gate) | "clamped_swiglu" (DeepSeek-V4) | "hf_module" (the HF MLP)
    hf                  where the block's tensors sit in the HF module (HFBlock), or None
    checkpoint          the checkpoint key names (moeflow.checkpoint.keys.KeyAdapter), or None
It is read by routing (`router_spec_from_hf`), the HF adapter (`moeflow.hf`) and the
checkpoint loader (`moeflow.checkpoint`). A new family is one record here and its tests.

Legend: E routed experts, Z LongCat zero experts, H hidden, I intermediate per expert,
Is shared-expert intermediate, V vocabulary, K experts per token.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .checkpoint.keys import (
    Dims,
    KeyAdapter,
    all_layers,
    fused,
    mlp,
    n_layers,
    no_extras,
    per_expert,
    with_roles,
)
from .routing import rules
from .routing.spec import RouterSpec

__all__ = ["Family", "HFBlock", "FAMILIES", "ROUTER_MODEL_TYPES", "family_for", "SHARED_KINDS"]

SHARED_KINDS: tuple[str, ...] = ("none", "swiglu", "gated_swiglu", "clamped_swiglu", "hf_module")


# ----------------------------------------------------------------------------- activations


def _act_silu(config: Any, experts: Any, *, attr: str = "hidden_act") -> tuple[str, float | None, float]:
    act = getattr(config, attr, None)
    if act not in ("silu", "swish"):
        raise ValueError(f"config.{attr}={act!r}: moeflow runs SiLU-gated experts here ('silu'), not {act!r}")
    return "silu", None, 1.702


def _act_gemma4(config: Any, experts: Any) -> tuple[str, float | None, float]:
    act = getattr(config, "hidden_activation", None)
    if act not in ("gelu_pytorch_tanh", "gelu_python_tanh"):
        raise ValueError(f"config.hidden_activation={act!r}: moeflow's gemma4 experts run gelu-tanh only")
    return "gelu_tanh", None, 1.702


def _act_deepseek_v4(config: Any, experts: Any) -> tuple[str, float | None, float]:
    _act_silu(config, experts)
    limit = getattr(experts, "limit", None) if experts is not None else None
    if limit is None:
        limit = getattr(config, "swiglu_limit", None)
    return "swiglu_clamp", float(limit), 1.702


def _act_gpt_oss(config: Any, experts: Any) -> tuple[str, float | None, float]:
    # 5.17 hard-codes limit/alpha on the experts module, 5.24 reads them from the config:
    # the module's attributes are right in both.
    if experts is not None:
        return "gptoss", float(experts.limit), float(experts.alpha)
    return "gptoss", float(getattr(config, "swiglu_limit", 7.0)), float(getattr(config, "alpha", 1.702))


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class HFBlock:
    """Where one family's HF MoE block keeps its tensors (attribute paths relative to the block).

    module, block_class: where the HF block class lives (looked up with getattr, so a
        transformers version that lacks the family is skipped).
    router: the router module; router_weight etc.: tensors, as attribute paths.
    returns: "tensor" (out, x's shape) | "out_scores" (gpt-oss: out, router scores
        [T, K]) | "out_logits" (llama4: out [T, H], router logits [T, E]).
    takes_input_ids: the block's forward takes `input_ids` (DeepSeek-V4 hash layers).
    zero_expert_rows: the fused gate_up holds E + Z rows of which only E are experts.
    decoder_level: gemma4: the "block" is the decoder layer's (router, experts) pair.
    """

    module: str
    block_class: str
    router: str
    router_weight: str
    experts: str = "experts"
    router_bias: str | None = None
    selection_bias: str | None = None
    hash_table: str | None = None
    expert_scale: str | None = None
    prenorm_weight: str | None = None
    shared: str | None = None
    shared_gate: str | None = None
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


@dataclass(frozen=True)
class Family:
    """One MoE family (see the module docstring for each field)."""

    name: str
    model_types: tuple[str, ...]
    router: Callable[[Any, int], RouterSpec]
    activation: Callable[[Any, Any], tuple[str, float | None, float]] = _act_silu
    layout: str = "linear"
    interleaved: bool = False
    expert_bias: bool = False
    shared: str = "none"
    hf: HFBlock | None = None
    checkpoint: KeyAdapter | None = None

    def __post_init__(self) -> None:
        if self.shared not in SHARED_KINDS:
            raise ValueError(f"Family({self.name}).shared={self.shared!r}: expected one of {SHARED_KINDS}")


def _m(name: str) -> str:
    return f"transformers.models.{name}.modeling_{name}"


def _family(name: str, model_types: tuple[str, ...], router, *, checkpoint: dict | None = None,
            **fields: Any) -> Family:
    """A record; its checkpoint KeyAdapter takes the record's name, model types and layout."""
    adapter = None
    if checkpoint is not None:
        adapter = KeyAdapter(family=name, model_types=model_types, layout=fields.get("layout", "linear"),
                             interleaved=fields.get("interleaved", False), **checkpoint)
    return Family(name=name, model_types=model_types, router=router, checkpoint=adapter, **fields)


# ---- family-specific checkpoint helpers ----------------------------------------------------

_QWEN_EXPERT = tuple(f"experts.{{e}}.{n}" for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"))
_W132 = ("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight")
_DS_SHARED = mlp("mlp.shared_experts.")


def _qwen_sparse(config: Any, i: int) -> bool:
    return (i not in (config.mlp_only_layers or [])) and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0


def _after_dense(config: Any, i: int) -> bool:
    return i >= int(config.first_k_dense_replace or 0)


def _ds_dims(config: Any) -> Dims:
    return Dims(E=config.n_routed_experts, H=config.hidden_size, I=config.moe_intermediate_size,
                K=config.num_experts_per_tok, Is=config.moe_intermediate_size * config.n_shared_experts)


def _longcat_dims(config: Any) -> Dims:
    return Dims(E=config.n_routed_experts, H=config.hidden_size, I=config.expert_ffn_hidden_size,
                K=config.num_experts_per_tok, Z=int(config.zero_expert_num or 0))


def _longcat_extra(d: Dims) -> list[tuple[int, tuple[str, ...]]]:
    # transformers' reverse conversion splits the [E + Z, 2I, H] gate_up into E + Z
    # gate/up pairs; the zero experts' pairs are padding that nothing reads.
    names = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")
    return [(e, names) for e in range(d.E, d.E + d.Z)]


def _ds_v4_extras(config: Any, i: int) -> frozenset[str]:
    types = list(config.mlp_layer_types or [])
    return frozenset({"hash_table"}) if i < len(types) and types[i] == "hash_moe" else frozenset({"selection_bias"})


def _ds_v3_like(name: str) -> Family:
    """DeepSeek-V3's block (sigmoid + bias + groups, shared experts): deepseek_v3 and glm4_moe."""
    return _family(
        name, (name,), rules.deepseek_v3, shared="hf_module",
        hf=HFBlock(_m(name), {"deepseek_v3": "DeepseekV3MoE", "glm4_moe": "Glm4MoeMoE"}[name], "gate",
                   "gate.weight", selection_bias="gate.e_score_correction_bias", shared="shared_experts"),
        checkpoint=dict(
            fused=fused("mlp.", router="mlp.gate.weight", selection_bias="mlp.gate.e_score_correction_bias",
                        shared=_DS_SHARED),
            per_expert=per_expert("mlp.", _QWEN_EXPERT, router="mlp.gate.weight",
                                  selection_bias="mlp.gate.e_score_correction_bias", shared=_DS_SHARED),
            dims=_ds_dims, is_moe_layer=_after_dense, num_layers=n_layers,
            layer_extras=with_roles("shared", "selection_bias")),
    )


FAMILIES: tuple[Family, ...] = (
    _family(
        "mixtral", ("mixtral",), rules.mixtral,
        hf=HFBlock(_m("mixtral"), "MixtralSparseMoeBlock", "gate", "gate.weight"),
        checkpoint=dict(
            fused=fused("mlp.", router="mlp.gate.weight"),
            per_expert=per_expert("block_sparse_moe.", _W132, router="block_sparse_moe.gate.weight"),
            dims=lambda c: Dims(E=c.num_local_experts, H=c.hidden_size, I=c.intermediate_size,
                                K=c.num_experts_per_tok),
            is_moe_layer=all_layers, num_layers=n_layers, layer_extras=no_extras),
    ),
    _family(
        "qwen2_moe", ("qwen2_moe",), rules.qwen_olmoe, shared="gated_swiglu",
        hf=HFBlock(_m("qwen2_moe"), "Qwen2MoeSparseMoeBlock", "gate", "gate.weight", shared="shared_expert",
                   shared_gate="shared_expert_gate.weight"),
        checkpoint=dict(
            fused=fused("mlp.", router="mlp.gate.weight", shared=mlp("mlp.shared_expert."),
                        shared_gate="mlp.shared_expert_gate.weight"),
            per_expert=per_expert("mlp.", _QWEN_EXPERT, router="mlp.gate.weight", shared=mlp("mlp.shared_expert."),
                                  shared_gate="mlp.shared_expert_gate.weight"),
            dims=lambda c: Dims(E=c.num_experts, H=c.hidden_size, I=c.moe_intermediate_size,
                                K=c.num_experts_per_tok, Is=c.shared_expert_intermediate_size),
            is_moe_layer=_qwen_sparse, num_layers=n_layers, layer_extras=with_roles("shared", "shared_gate")),
    ),
    _family(
        "qwen3_moe", ("qwen3_moe",), rules.qwen_olmoe,
        hf=HFBlock(_m("qwen3_moe"), "Qwen3MoeSparseMoeBlock", "gate", "gate.weight"),
        checkpoint=dict(
            fused=fused("mlp.", router="mlp.gate.weight"),
            per_expert=per_expert("mlp.", _QWEN_EXPERT, router="mlp.gate.weight"),
            dims=lambda c: Dims(E=c.num_experts, H=c.hidden_size, I=c.moe_intermediate_size,
                                K=c.num_experts_per_tok),
            is_moe_layer=_qwen_sparse, num_layers=n_layers, layer_extras=no_extras),
    ),
    _family(
        "olmoe", ("olmoe",), rules.qwen_olmoe,
        hf=HFBlock(_m("olmoe"), "OlmoeSparseMoeBlock", "gate", "gate.weight"),
        checkpoint=dict(
            fused=fused("mlp.", router="mlp.gate.weight"),
            per_expert=per_expert("mlp.", _QWEN_EXPERT, router="mlp.gate.weight"),
            dims=lambda c: Dims(E=c.num_experts, H=c.hidden_size, I=c.intermediate_size, K=c.num_experts_per_tok),
            is_moe_layer=all_layers, num_layers=n_layers, layer_extras=no_extras),
    ),
    _family(
        "deepseek_v2", ("deepseek_v2",), rules.deepseek_v2, shared="hf_module",
        hf=HFBlock(_m("deepseek_v2"), "DeepseekV2Moe", "gate", "gate.weight", shared="shared_experts"),
        checkpoint=dict(
            fused=fused("mlp.", router="mlp.gate.weight", shared=_DS_SHARED),
            per_expert=per_expert("mlp.", _QWEN_EXPERT, router="mlp.gate.weight", shared=_DS_SHARED),
            dims=_ds_dims, is_moe_layer=_after_dense, num_layers=n_layers, layer_extras=with_roles("shared")),
    ),
    _ds_v3_like("deepseek_v3"),
    _ds_v3_like("glm4_moe"),
    # DeepSeek-V3's router; no HF block or checkpoint adapter of their own here.
    _family("kimi_k2", ("kimi_k2",), rules.deepseek_v3, shared="hf_module"),
    _family("dots1", ("dots1",), rules.deepseek_v3, shared="hf_module"),
    _family(
        "deepseek_v4", ("deepseek_v4",), rules.deepseek_v4, activation=_act_deepseek_v4, shared="clamped_swiglu",
        # selection_bias / hash_table: present on the learned / hash-routed layers respectively.
        hf=HFBlock(_m("deepseek_v4"), "DeepseekV4SparseMoeBlock", "gate", "gate.weight",
                   selection_bias="gate.e_score_correction_bias", hash_table="gate.tid2eid",
                   shared="shared_experts", takes_input_ids=True),
        checkpoint=dict(
            fused=fused("mlp.", router="mlp.gate.weight", selection_bias="mlp.gate.e_score_correction_bias",
                        hash_table="mlp.gate.tid2eid", shared=mlp("mlp.shared_experts.")),
            # transformers' original names: ffn.*, w1 gate / w3 up / w2 down, gate.bias.
            per_expert=per_expert("ffn.", _W132, router="ffn.gate.weight", selection_bias="ffn.gate.bias",
                                  hash_table="ffn.gate.tid2eid",
                                  shared=mlp("ffn.shared_experts.", ("w1.weight", "w3.weight", "w2.weight"))),
            # HF's DeepseekV4MLP (the shared expert) is config.intermediate_size wide, which the
            # config maps onto moe_intermediate_size; n_shared_experts is not read.
            dims=lambda c: Dims(E=c.n_routed_experts, H=c.hidden_size, I=c.moe_intermediate_size,
                                K=c.num_experts_per_tok, Is=c.moe_intermediate_size, V=c.vocab_size),
            is_moe_layer=all_layers, num_layers=n_layers,
            layer_extras=lambda c, i: _ds_v4_extras(c, i) | {"shared"}),
    ),
    _family(
        "gpt_oss", ("gpt_oss",), rules.gpt_oss, activation=_act_gpt_oss, layout="matmul", interleaved=True,
        expert_bias=True,
        hf=HFBlock(_m("gpt_oss"), "GptOssMLP", "router", "router.weight", router_bias="router.bias",
                   returns="out_scores"),
        checkpoint=dict(
            fused=fused("mlp.", router="mlp.router.weight", router_bias="mlp.router.bias",
                        gate_up_bias="mlp.experts.gate_up_proj_bias", down_bias="mlp.experts.down_proj_bias"),
            per_expert=None,  # transformers keeps the fused tensors on disk (no conversion mapping)
            dims=lambda c: Dims(E=c.num_local_experts, H=c.hidden_size, I=c.intermediate_size,
                                K=c.num_experts_per_tok),
            is_moe_layer=all_layers, num_layers=n_layers, layer_extras=with_roles("router_bias", "expert_bias")),
    ),
    _family(
        "llama4", ("llama4_text", "llama4"), rules.llama4, layout="matmul", shared="hf_module",
        hf=HFBlock(_m("llama4"), "Llama4TextMoe", "router", "router.weight", shared="shared_expert",
                   returns="out_logits"),
        checkpoint=dict(
            fused=fused("feed_forward.", router="feed_forward.router.weight",
                        shared=mlp("feed_forward.shared_expert.")),
            per_expert=None,
            dims=lambda c: Dims(E=c.num_local_experts, H=c.hidden_size, I=c.intermediate_size,
                                K=c.num_experts_per_tok, Is=c.intermediate_size),
            is_moe_layer=lambda c, i: i in (c.moe_layers or []), num_layers=n_layers,
            layer_extras=with_roles("shared")),
    ),
    _family(
        "longcat_flash", ("longcat_flash",), rules.longcat_flash,
        # HF builds the classifier with `router_bias` but its forward never adds it: neither do we.
        hf=HFBlock(_m("longcat_flash"), "LongcatFlashMoE", "router", "router.classifier.weight",
                   selection_bias="router.e_score_correction_bias", zero_expert_rows=True),
        checkpoint=dict(
            fused=fused("mlp.", router="mlp.router.classifier.weight",
                        selection_bias="mlp.router.e_score_correction_bias"),
            per_expert=per_expert("mlp.", _QWEN_EXPERT, router="mlp.router.classifier.weight",
                                  selection_bias="mlp.router.e_score_correction_bias"),
            dims=_longcat_dims, is_moe_layer=all_layers, num_layers=lambda c: int(c.num_layers),
            layer_extras=with_roles("selection_bias"), gate_up_rows=lambda d: d.E + d.Z,
            per_expert_extra=_longcat_extra,
            # With config.router_bias the classifier has a bias that LongcatFlashTopkRouter.forward
            # never adds (F.linear with the weight only): accounted, not loaded, as in HF.
            ignored=lambda c: ("mlp.router.classifier.bias",) if getattr(c, "router_bias", False) else ()),
    ),
    _family(
        "gemma4", ("gemma4_text", "gemma4"), rules.gemma4, activation=_act_gemma4,
        hf=HFBlock(_m("gemma4"), "Gemma4TextDecoderLayer", "router", "router.proj.weight",
                   expert_scale="router.per_expert_scale", prenorm_weight="router.scale", decoder_level=True),
        checkpoint=dict(
            # No block module: router and experts sit on the decoder layer itself.
            fused=fused("", owned=("router.", "experts."), router="router.proj.weight",
                        expert_scale="router.per_expert_scale", prenorm_weight="router.scale"),
            per_expert=None,
            dims=lambda c: Dims(E=c.num_experts, H=c.hidden_size, I=c.moe_intermediate_size, K=c.top_k_experts),
            is_moe_layer=lambda c, i: bool(c.enable_moe_block), num_layers=n_layers,
            layer_extras=with_roles("expert_scale", "prenorm_weight")),
    ),
)

_BY_NAME: dict[str, Family] = {}
for _f in FAMILIES:
    for _n in dict.fromkeys((_f.name, *_f.model_types)):
        if _n in _BY_NAME:
            raise RuntimeError(f"family table: {_n!r} appears twice")
        _BY_NAME[_n] = _f

# Every HF model_type routing accepts (sorted: what error messages list).
ROUTER_MODEL_TYPES: tuple[str, ...] = tuple(sorted({t for f in FAMILIES for t in f.model_types}))


def family_for(name_or_model_type: str, *, missing_ok: bool = False) -> Family | None:
    """The record of a family name or HF model_type (ValueError listing the known ones, or None)."""
    fam = _BY_NAME.get(name_or_model_type)
    if fam is None and not missing_ok:
        raise ValueError(f"family={name_or_model_type!r}: not a supported MoE family; known: "
                         f"{', '.join(sorted(_BY_NAME))}")
    return fam
