"""Per-family checkpoint key adapters: where each MoE tensor of one layer lives on disk.

One `KeyAdapter` per family (a row of `_ADAPTERS`); the generic loader in
`moeflow.checkpoint.loader` reads only this table. Key names are relative to the
layer prefix (`model.layers.{i}.`); each adapter has the transformers 5 fused
layout (`save_pretrained(..., save_original_format=False)`) and, where
transformers has a conversion mapping for the family, the per-expert "original"
layout that `save_pretrained` writes by default (`save_original_format=True`) and
that released checkpoints hold. Checked against transformers 5.17 and 5.24
(`conversion_mapping.py`, each family's `modeling_*.py`).

Legend: E routed experts, Z LongCat zero experts, H hidden, I intermediate per
expert, Is shared-expert intermediate, V vocabulary, K experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Dims:
    """Sizes of one family's MoE layer, read from its HF (text) config."""

    E: int
    H: int
    I: int
    K: int
    Is: int = 0  # shared expert width (0: none)
    Z: int = 0  # zero experts (LongCat)
    V: int = 0  # vocabulary (hash tables)


@dataclass(frozen=True)
class Names:
    """Tensor names of one storage format, relative to `model.layers.{i}.`.

    owned:         prefixes under the layer whose keys all belong to the MoE block
                   (strict accounting runs over them).
    router:        router weight [E(+Z), H].
    gate_up/down:  fused experts (format "fused"); `expert` (format "per_expert"):
                   (gate, up, down) names with `{e}`: gate [I, H], up [I, H], down [H, I].
    shared:        (gate, up, down) of the shared expert: [Is, H], [Is, H], [H, Is].
    """

    owned: tuple[str, ...]
    router: str
    gate_up: str | None = None
    down: str | None = None
    expert: tuple[str, str, str] | None = None
    router_bias: str | None = None
    selection_bias: str | None = None
    hash_table: str | None = None
    expert_scale: str | None = None
    prenorm_weight: str | None = None
    gate_up_bias: str | None = None
    down_bias: str | None = None
    shared: tuple[str, str, str] | None = None
    shared_gate: str | None = None


@dataclass(frozen=True)
class KeyAdapter:
    """Everything the loader knows about one family.

    fused / per_expert: the two storage formats (per_expert None where HF keeps the
        fused tensors on disk too).
    layout, interleaved: of the fused tensors (see moeflow.config.ExpertWeights).
    dims(config) -> Dims; is_moe_layer(config, i); num_layers(config).
    layer_extras(config, i) -> the optional roles present in layer i (per-layer
        differences: DeepSeek-V4 hash layers have tid2eid and no bias).
    gate_up_rows(dims): first-dimension length of the fused gate_up on disk (LongCat
        stores E + Z rows, of which the last Z are unused).
    per_expert_extra(dims): per-expert names written for ids >= E that carry no
        expert (LongCat's gate/up rows of the zero experts): accounted, not loaded.
    ignored(config): names (either format) that may be present and that the HF module
        holds but never uses (LongCat's classifier bias): accounted, not loaded.
    """

    family: str
    model_types: tuple[str, ...]
    fused: Names
    per_expert: Names | None
    layout: str
    interleaved: bool
    dims: Callable[[Any], Dims]
    is_moe_layer: Callable[[Any, int], bool]
    num_layers: Callable[[Any], int]
    layer_extras: Callable[[Any, int], frozenset[str]]
    gate_up_rows: Callable[[Dims], int] = lambda d: d.E
    per_expert_extra: Callable[[Dims], list[tuple[int, tuple[str, ...]]]] = lambda d: []
    ignored: Callable[[Any], tuple[str, ...]] = lambda c: ()


def _n_layers(config: Any) -> int:
    return int(config.num_hidden_layers)


def _all_layers(config: Any, i: int) -> bool:
    return True


def _no_extras(config: Any, i: int) -> frozenset[str]:
    return frozenset()


def _qwen_sparse(config: Any, i: int) -> bool:
    return (i not in (config.mlp_only_layers or [])) and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0


def _after_dense(config: Any, i: int) -> bool:
    return i >= int(config.first_k_dense_replace or 0)


_SWIGLU = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
_QWEN_EXPERT = tuple(f"experts.{{e}}.{n}" for n in _SWIGLU)


def _mlp(prefix: str, names: tuple[str, str, str] = _SWIGLU) -> tuple[str, str, str]:
    return tuple(prefix + n for n in names)  # type: ignore[return-value]


def _fused(block: str, **kw) -> Names:
    return Names(owned=kw.pop("owned", (block,)), gate_up=f"{block}experts.gate_up_proj",
                 down=f"{block}experts.down_proj", **kw)


def _per_expert(block: str, expert: tuple[str, str, str], **kw) -> Names:
    return Names(owned=kw.pop("owned", (block,)), expert=tuple(block + n for n in expert), **kw)  # type: ignore[arg-type]


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


def _with(*roles: str) -> Callable[[Any, int], frozenset[str]]:
    fs = frozenset(roles)
    return lambda config, i: fs


_DS_SHARED = _mlp("mlp.shared_experts.")

_ADAPTERS: tuple[KeyAdapter, ...] = (
    KeyAdapter(
        family="mixtral", model_types=("mixtral",),
        fused=_fused("mlp.", router="mlp.gate.weight"),
        per_expert=_per_expert("block_sparse_moe.", ("experts.{e}.w1.weight", "experts.{e}.w3.weight",
                                                     "experts.{e}.w2.weight"),
                               router="block_sparse_moe.gate.weight"),
        layout="linear", interleaved=False,
        dims=lambda c: Dims(E=c.num_local_experts, H=c.hidden_size, I=c.intermediate_size, K=c.num_experts_per_tok),
        is_moe_layer=_all_layers, num_layers=_n_layers, layer_extras=_no_extras,
    ),
    KeyAdapter(
        family="qwen2_moe", model_types=("qwen2_moe",),
        fused=_fused("mlp.", router="mlp.gate.weight", shared=_mlp("mlp.shared_expert."),
                     shared_gate="mlp.shared_expert_gate.weight"),
        per_expert=_per_expert("mlp.", _QWEN_EXPERT, router="mlp.gate.weight", shared=_mlp("mlp.shared_expert."),
                               shared_gate="mlp.shared_expert_gate.weight"),
        layout="linear", interleaved=False,
        dims=lambda c: Dims(E=c.num_experts, H=c.hidden_size, I=c.moe_intermediate_size, K=c.num_experts_per_tok,
                            Is=c.shared_expert_intermediate_size),
        is_moe_layer=_qwen_sparse, num_layers=_n_layers, layer_extras=_with("shared", "shared_gate"),
    ),
    KeyAdapter(
        family="qwen3_moe", model_types=("qwen3_moe",),
        fused=_fused("mlp.", router="mlp.gate.weight"),
        per_expert=_per_expert("mlp.", _QWEN_EXPERT, router="mlp.gate.weight"),
        layout="linear", interleaved=False,
        dims=lambda c: Dims(E=c.num_experts, H=c.hidden_size, I=c.moe_intermediate_size, K=c.num_experts_per_tok),
        is_moe_layer=_qwen_sparse, num_layers=_n_layers, layer_extras=_no_extras,
    ),
    KeyAdapter(
        family="olmoe", model_types=("olmoe",),
        fused=_fused("mlp.", router="mlp.gate.weight"),
        per_expert=_per_expert("mlp.", _QWEN_EXPERT, router="mlp.gate.weight"),
        layout="linear", interleaved=False,
        dims=lambda c: Dims(E=c.num_experts, H=c.hidden_size, I=c.intermediate_size, K=c.num_experts_per_tok),
        is_moe_layer=_all_layers, num_layers=_n_layers, layer_extras=_no_extras,
    ),
    KeyAdapter(
        family="deepseek_v2", model_types=("deepseek_v2",),
        fused=_fused("mlp.", router="mlp.gate.weight", shared=_DS_SHARED),
        per_expert=_per_expert("mlp.", _QWEN_EXPERT, router="mlp.gate.weight", shared=_DS_SHARED),
        layout="linear", interleaved=False, dims=_ds_dims,
        is_moe_layer=_after_dense, num_layers=_n_layers, layer_extras=_with("shared"),
    ),
    *(
        KeyAdapter(
            family=fam, model_types=(fam,),
            fused=_fused("mlp.", router="mlp.gate.weight", selection_bias="mlp.gate.e_score_correction_bias",
                         shared=_DS_SHARED),
            per_expert=_per_expert("mlp.", _QWEN_EXPERT, router="mlp.gate.weight",
                                   selection_bias="mlp.gate.e_score_correction_bias", shared=_DS_SHARED),
            layout="linear", interleaved=False, dims=_ds_dims,
            is_moe_layer=_after_dense, num_layers=_n_layers, layer_extras=_with("shared", "selection_bias"),
        )
        for fam in ("deepseek_v3", "glm4_moe")
    ),
    KeyAdapter(
        family="gpt_oss", model_types=("gpt_oss",),
        fused=_fused("mlp.", router="mlp.router.weight", router_bias="mlp.router.bias",
                     gate_up_bias="mlp.experts.gate_up_proj_bias", down_bias="mlp.experts.down_proj_bias"),
        per_expert=None,  # transformers keeps the fused tensors on disk (no conversion mapping)
        layout="matmul", interleaved=True,
        dims=lambda c: Dims(E=c.num_local_experts, H=c.hidden_size, I=c.intermediate_size, K=c.num_experts_per_tok),
        is_moe_layer=_all_layers, num_layers=_n_layers, layer_extras=_with("router_bias", "expert_bias"),
    ),
    KeyAdapter(
        family="llama4", model_types=("llama4_text", "llama4"),
        fused=_fused("feed_forward.", router="feed_forward.router.weight", shared=_mlp("feed_forward.shared_expert.")),
        per_expert=None,
        layout="matmul", interleaved=False,
        dims=lambda c: Dims(E=c.num_local_experts, H=c.hidden_size, I=c.intermediate_size, K=c.num_experts_per_tok,
                            Is=c.intermediate_size),
        is_moe_layer=lambda c, i: i in (c.moe_layers or []), num_layers=_n_layers, layer_extras=_with("shared"),
    ),
    KeyAdapter(
        family="longcat_flash", model_types=("longcat_flash",),
        fused=_fused("mlp.", router="mlp.router.classifier.weight",
                     selection_bias="mlp.router.e_score_correction_bias"),
        per_expert=_per_expert("mlp.", _QWEN_EXPERT, router="mlp.router.classifier.weight",
                               selection_bias="mlp.router.e_score_correction_bias"),
        layout="linear", interleaved=False, dims=_longcat_dims,
        is_moe_layer=_all_layers, num_layers=lambda c: int(c.num_layers), layer_extras=_with("selection_bias"),
        gate_up_rows=lambda d: d.E + d.Z, per_expert_extra=_longcat_extra,
        # With config.router_bias the classifier has a bias that LongcatFlashTopkRouter.forward
        # never adds (F.linear with the weight only): accounted, not loaded, as in HF.
        ignored=lambda c: ("mlp.router.classifier.bias",) if getattr(c, "router_bias", False) else (),
    ),
    KeyAdapter(
        family="deepseek_v4", model_types=("deepseek_v4",),
        fused=_fused("mlp.", router="mlp.gate.weight", selection_bias="mlp.gate.e_score_correction_bias",
                     hash_table="mlp.gate.tid2eid", shared=_mlp("mlp.shared_experts.")),
        # transformers' original names: ffn.*, w1 gate / w3 up / w2 down, gate.bias.
        per_expert=_per_expert("ffn.", ("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
                               router="ffn.gate.weight", selection_bias="ffn.gate.bias",
                               hash_table="ffn.gate.tid2eid",
                               shared=_mlp("ffn.shared_experts.", ("w1.weight", "w3.weight", "w2.weight"))),
        layout="linear", interleaved=False,
        # HF's DeepseekV4MLP (the shared expert) is config.intermediate_size wide, which the
        # config maps onto moe_intermediate_size; n_shared_experts is not read.
        dims=lambda c: Dims(E=c.n_routed_experts, H=c.hidden_size, I=c.moe_intermediate_size,
                            K=c.num_experts_per_tok, Is=c.moe_intermediate_size, V=c.vocab_size),
        is_moe_layer=_all_layers, num_layers=_n_layers,
        layer_extras=lambda c, i: _ds_v4_extras(c, i) | {"shared"},
    ),
    KeyAdapter(
        family="gemma4", model_types=("gemma4_text", "gemma4"),
        # No block module: router and experts sit on the decoder layer itself.
        fused=_fused("", owned=("router.", "experts."), router="router.proj.weight",
                     expert_scale="router.per_expert_scale", prenorm_weight="router.scale"),
        per_expert=None,
        layout="linear", interleaved=False,
        dims=lambda c: Dims(E=c.num_experts, H=c.hidden_size, I=c.moe_intermediate_size, K=c.top_k_experts),
        is_moe_layer=lambda c, i: bool(c.enable_moe_block), num_layers=_n_layers,
        layer_extras=_with("expert_scale", "prenorm_weight"),
    ),
)

_BY_NAME: dict[str, KeyAdapter] = {}
for _a in _ADAPTERS:
    _BY_NAME[_a.family] = _a
    for _t in _a.model_types:
        _BY_NAME[_t] = _a

CHECKPOINT_FAMILIES: tuple[str, ...] = tuple(a.family for a in _ADAPTERS)


def adapter_for(family_or_model_type: str) -> KeyAdapter:
    """The KeyAdapter of a family name or HF model_type, or a ValueError listing the known ones."""
    adapter = _BY_NAME.get(family_or_model_type)
    if adapter is None:
        raise ValueError(
            f"family={family_or_model_type!r}: no checkpoint key adapter; known: {', '.join(sorted(_BY_NAME))}"
        )
    return adapter
