"""Checkpoint key types: where each MoE tensor of one layer lives on disk (no model names here).

A `KeyAdapter` per family is the `checkpoint` part of that family's record in
`moeflow.families` (the one family table); the generic loader in
`moeflow.checkpoint.loader` reads only those records. Key names are relative to the
layer prefix (`model.layers.{i}.`); each adapter has the transformers 5 fused layout
(`save_pretrained(..., save_original_format=False)`) and, where transformers has a
conversion mapping for the family, the per-expert "original" layout that
`save_pretrained` writes by default (`save_original_format=True`) and that released
checkpoints hold.

Legend: E routed experts, Z LongCat zero experts, H hidden, I intermediate per
expert, Is shared-expert intermediate, V vocabulary, K experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Dims", "Names", "KeyAdapter", "SWIGLU", "n_layers", "all_layers", "no_extras", "with_roles", "mlp",
           "fused", "per_expert"]


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


SWIGLU = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def n_layers(config: Any) -> int:
    return int(config.num_hidden_layers)


def all_layers(config: Any, i: int) -> bool:
    return True


def no_extras(config: Any, i: int) -> frozenset[str]:
    return frozenset()


def with_roles(*roles: str) -> Callable[[Any, int], frozenset[str]]:
    """layer_extras for a family whose every MoE layer has these optional roles."""
    fs = frozenset(roles)
    return lambda config, i: fs


def mlp(prefix: str, names: tuple[str, str, str] = SWIGLU) -> tuple[str, str, str]:
    """(gate, up, down) key names of a SwiGLU MLP under `prefix`."""
    return tuple(prefix + n for n in names)  # type: ignore[return-value]


def fused(block: str, **kw) -> Names:
    """Names of the transformers-5 fused experts (`<block>experts.gate_up_proj` / `down_proj`)."""
    return Names(owned=kw.pop("owned", (block,)), gate_up=f"{block}experts.gate_up_proj",
                 down=f"{block}experts.down_proj", **kw)


def per_expert(block: str, expert: tuple[str, str, str], **kw) -> Names:
    """Names of per-expert (original-format) tensors, `expert` holding `{e}` templates."""
    return Names(owned=kw.pop("owned", (block,)), expert=tuple(block + n for n in expert), **kw)  # type: ignore[arg-type]
