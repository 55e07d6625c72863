"""Load one MoE layer (or some of its experts) from a Hugging Face safetensors checkpoint.

    idx = CheckpointIndex("path/to/checkpoint")
    lw = load_moe_layer(idx, "mixtral", layer_idx=3, experts=range(0, 4))   # EP rank 0 of 2
    lw.experts.gate_up   # [4, 2I, H] (linear layout), whatever the on-disk format was

Both storage formats are read: transformers 5's fused tensors (`mlp.experts.gate_up_proj`
[E, 2I, H]) and the per-expert "original" names (`block_sparse_moe.experts.{e}.w1/w3/w2`,
`mlp.experts.{e}.gate_proj/up_proj/down_proj`, ...), which `save_pretrained` writes by
default in transformers 5.17-5.24 (`save_original_format=True`). Per-expert tensors are
fused on load into the same layout as the model's own parameters.

Strict key accounting over the layer's MoE block: every tensor under the block's
prefixes (`model.layers.{i}.mlp.`, ...) must be one the family expects, and every
expected tensor must be there; a wrong shape or dtype is an error naming the key,
what it is and what was expected. All of that is checked from the safetensors
headers before any tensor data is read.

Legend: E routed experts, Z zero experts, H hidden, I intermediate per expert,
Is shared-expert intermediate, V vocabulary, K experts per token, n experts loaded.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..routing.families import text_config
from .families import Dims, KeyAdapter, adapter_for
from .files import check_layer_claims, hf_config, layer_bound, layer_ids, read_config_json
from .index import CheckpointError, CheckpointIndex

# Dtype classes of the roles: "weight" tensors must all have the model's dtype; "aux"
# tensors (router weight, biases, scales) may also be float32 (HF keeps routers and
# e_score_correction_bias in fp32 in bf16 models); "index" tensors are integer tables.
_WEIGHT, _AUX, _INDEX = "weight", "aux", "index"


@dataclass(frozen=True, eq=False)
class SharedExpertWeights:
    """A shared expert's SwiGLU tensors in nn.Linear layout: gate_IH [Is, H], up_IH [Is, H], down_HI [H, Is]."""

    gate_IH: torch.Tensor
    up_IH: torch.Tensor
    down_HI: torch.Tensor

    def module(self, activation: str = "silu", swiglu_limit: float | None = None) -> nn.Module:
        """An nn.Module x_TH -> down(act(gate(x)) * up(x)) on these tensors (no copy), e.g. for
        MoELayer(shared_expert=...). activation "silu", or "swiglu_clamp" with swiglu_limit
        (DeepSeek-V4's shared expert clamps like its routed ones)."""
        return SharedSwiGLU(self, activation=activation, swiglu_limit=swiglu_limit)


class SharedSwiGLU(nn.Module):
    """A shared expert from checkpoint tensors: down(act(x @ gate.T) * (x @ up.T)), nn.Linear layout."""

    def __init__(self, w: SharedExpertWeights, *, activation: str = "silu", swiglu_limit: float | None = None):
        super().__init__()
        if activation not in ("silu", "swiglu_clamp"):
            raise ValueError(f"activation={activation!r}: expected 'silu' or 'swiglu_clamp'")
        if (activation == "swiglu_clamp") != (swiglu_limit is not None):
            raise ValueError(f"swiglu_limit={swiglu_limit!r}: give it exactly when activation='swiglu_clamp'")
        # requires_grad=False Parameters share the loaded storage (no copy) and move with .to().
        self.gate_IH = nn.Parameter(w.gate_IH, requires_grad=False)
        self.up_IH = nn.Parameter(w.up_IH, requires_grad=False)
        self.down_HI = nn.Parameter(w.down_HI, requires_grad=False)
        self.swiglu_limit = swiglu_limit

    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x_TH, self.gate_IH), F.linear(x_TH, self.up_IH)
        if self.swiglu_limit is not None:
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return F.linear(F.silu(gate) * up, self.down_HI)


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One MoE layer's tensors as loaded from a checkpoint.

    expert_ids:          global ids of the experts held, in row order of `experts`.
    router_weight_EH:    [E (+Z), H], always all experts (routing needs every logit).
    experts:             moeflow.config.ExpertWeights of the experts in `expert_ids`
                         (LongCat: the Z unused gate_up rows are not loaded).
    router_bias_E:       [E] gpt-oss router bias (added to the logits), else None.
    selection_bias_E:    [E (+Z)] e_score_correction_bias (selection key only), else None.
    expert_scale_E:      [E] gemma4 per-expert scale, else None.
    prenorm_weight_H:    [H] gemma4 router RMSNorm scale, else None.
    hash_table_VK:       [V, K] int DeepSeek-V4 hash layer tid2eid, else None.
    shared:              SharedExpertWeights or None.
    shared_gate_weight_1H: [1, H] qwen2_moe shared-expert gate, else None.
    source_format:       "fused" | "per_expert", what was on disk.
    keys:                every checkpoint key accounted for this block (sorted).
    """

    family: str
    layer_idx: int
    expert_ids: tuple[int, ...]
    router_weight_EH: torch.Tensor
    experts: Any
    router_bias_E: torch.Tensor | None = None
    selection_bias_E: torch.Tensor | None = None
    expert_scale_E: torch.Tensor | None = None
    prenorm_weight_H: torch.Tensor | None = None
    hash_table_VK: torch.Tensor | None = None
    shared: SharedExpertWeights | None = None
    shared_gate_weight_1H: torch.Tensor | None = None
    source_format: str = "fused"
    keys: tuple[str, ...] = ()

    @property
    def num_experts(self) -> int:
        """Experts held (len(expert_ids)), not the model's E."""
        return len(self.expert_ids)


@dataclass(frozen=True)
class _Slot:
    role: str
    key: str
    shape: tuple[int, ...]
    dclass: str
    dtype: torch.dtype | None = None  # an exact dtype (quantized weights and their scales)


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's MoE block must hold on disk (built from headers only)."""

    adapter: KeyAdapter
    dims: Dims
    layer_idx: int
    prefix: str  # e.g. "model.layers.3."
    source_format: str
    slots: tuple[_Slot, ...]  # everything except per-expert tensors
    expert_keys: tuple[tuple[str, str, str], ...]  # per_expert format: (gate, up, down) key per expert
    optional: tuple[_Slot, ...]  # accounted if present (LongCat zero-expert padding)
    owned: tuple[str, ...]  # full prefixes whose keys are accounted
    quant: Any = None  # moeflow.quant.checkpoint.QuantLayerPlan of a quantized checkpoint, else None


def _as_index(src: str | os.PathLike | CheckpointIndex) -> CheckpointIndex:
    return src if isinstance(src, CheckpointIndex) else CheckpointIndex(src)


def _resolve_config(index: CheckpointIndex, family_or_config: Any) -> tuple[KeyAdapter, Any]:
    """(adapter, text config) from a family name, a model_type, or an HF config object."""
    if family_or_config is None or isinstance(family_or_config, str):
        config_path = os.path.join(index.directory, "config.json")
        if not os.path.lexists(config_path):
            raise CheckpointError(
                f"load_moe_layer: no config.json in {index.directory!r}; pass the model's HF config instead "
                f"of family={family_or_config!r}"
            )
        # The claims transformers would act on are checked against the tensor names first.
        check_layer_claims(read_config_json(config_path), layer_ids(index.keys()), config_path)
        config = hf_config(index.directory)
    else:
        config = family_or_config
    tc = text_config(config)
    model_type = getattr(tc, "model_type", None) or getattr(config, "model_type", None)
    adapter = adapter_for(model_type)
    if isinstance(family_or_config, str) and adapter_for(family_or_config) is not adapter:
        raise CheckpointError(
            f"load_moe_layer: family={family_or_config!r} but {index.directory}/config.json says "
            f"model_type={model_type!r}"
        )
    return adapter, tc


def _model_dtype(config: Any) -> torch.dtype | None:
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else None


def _find_prefix(index: CheckpointIndex, adapter: KeyAdapter, layer_idx: int) -> str:
    routers = [adapter.fused.router] + ([adapter.per_expert.router] if adapter.per_expert else [])
    tails = {f"layers.{layer_idx}.{r}" for r in routers}
    found = sorted({k[: -len(t)] + f"layers.{layer_idx}." for k in index.keys() for t in tails if k.endswith(t)})
    if not found:
        want = " or ".join(sorted(f"model.{t}" for t in tails))
        raise CheckpointError(
            f"{family_msg(adapter, layer_idx)}: missing key {want} (the router weight) in {index.directory}",
            key=f"model.layers.{layer_idx}.{adapter.fused.router}",
        )
    if len(found) > 1:
        raise CheckpointError(
            f"{family_msg(adapter, layer_idx)}: several layer prefixes hold a router weight: {found}; "
            "pass prefix= to choose one"
        )
    return found[0]


def family_msg(adapter: KeyAdapter, layer_idx: int) -> str:
    return f"{adapter.family} layer {layer_idx}"


def plan_layer(
    src: str | os.PathLike | CheckpointIndex, family_or_config: Any, layer_idx: int, *, prefix: str | None = None
) -> LayerPlan:
    """Check one layer's MoE keys, shapes and dtypes against the family (headers only).

    Raises CheckpointError (a ValueError) naming the first missing, unexpected,
    wrong-shape or wrong-dtype key.
    """
    index = _as_index(src)
    adapter, config = _resolve_config(index, family_or_config)
    n_layers = adapter.num_layers(config)
    if not isinstance(layer_idx, int) or isinstance(layer_idx, bool) or not 0 <= layer_idx < n_layers:
        raise ValueError(f"layer_idx={layer_idx!r}: expected an int in [0, {n_layers}) for {adapter.family}")
    if not adapter.is_moe_layer(config, layer_idx):
        raise CheckpointError(f"{family_msg(adapter, layer_idx)} is a dense layer (no MoE block) in this config")
    d = _checked_dims(adapter, config, layer_idx)
    if prefix is None:
        prefix = _find_prefix(index, adapter, layer_idx)
    elif not prefix.endswith("."):
        raise ValueError(f"prefix={prefix!r}: expected a key prefix ending in '.' such as 'model.layers.0.'")
    from ..quant.checkpoint import quant_spec_of, storage_key

    # The checkpoint's quantization (config.json quantization_config), None when unquantized.
    qspec = quant_spec_of(config if family_or_config is None or isinstance(family_or_config, str)
                          else family_or_config, index.directory)

    # Which format: the fused gate_up, or expert 0's gate under the per-expert names.
    fused_key = prefix + adapter.fused.gate_up
    per = adapter.per_expert
    if storage_key(qspec, fused_key, fused=True) in index:
        names, fmt = adapter.fused, "fused"
    elif per is not None and prefix + per.expert[0].format(e=0) in index:
        names, fmt = per, "per_expert"
    else:
        alt = f" (nor the per-expert {prefix + per.expert[0].format(e=0)})" if per is not None else ""
        raise CheckpointError(f"{family_msg(adapter, layer_idx)}: missing key {fused_key}{alt}", key=fused_key)

    # The router's header shape backs the expert count with stored bytes: checked before any
    # list proportional to E (3 E per-expert slots) is built.
    _check_router_claim(index, prefix + names.router, d, f"{family_msg(adapter, layer_idx)} ({fmt} format)")
    extras = adapter.layer_extras(config, layer_idx)
    E, H, I = d.E, d.H, d.I
    slots: list[_Slot] = [_Slot("router_weight", prefix + names.router, (E + d.Z, H), _AUX)]

    def add(role: str, name: str | None, shape: tuple[int, ...], dclass: str, needed: str) -> None:
        if needed not in extras:
            return
        if name is None:
            raise AssertionError(f"adapter {adapter.family}: role {role} has no key name")  # table bug
        slots.append(_Slot(role, prefix + name, shape, dclass))

    add("router_bias", names.router_bias, (E,), _AUX, "router_bias")
    add("selection_bias", names.selection_bias, (E + d.Z,), _AUX, "selection_bias")
    add("hash_table", names.hash_table, (d.V, d.K), _INDEX, "hash_table")
    add("expert_scale", names.expert_scale, (E,), _AUX, "expert_scale")
    add("prenorm_weight", names.prenorm_weight, (H,), _AUX, "prenorm_weight")
    if names.shared is not None:
        g, u, dn = names.shared
        add("shared_gate_proj", g, (d.Is, H), _WEIGHT, "shared")
        add("shared_up_proj", u, (d.Is, H), _WEIGHT, "shared")
        add("shared_down_proj", dn, (H, d.Is), _WEIGHT, "shared")
    add("shared_gate", names.shared_gate, (1, H), _WEIGHT, "shared_gate")

    expert_keys: list[tuple[str, str, str]] = []
    optional: list[_Slot] = []
    if fmt == "fused":
        rows = adapter.gate_up_rows(d)
        if adapter.layout == "linear":
            slots.append(_Slot("gate_up", prefix + names.gate_up, (rows, 2 * I, H), _WEIGHT))
            slots.append(_Slot("down", prefix + names.down, (E, H, I), _WEIGHT))
        else:
            slots.append(_Slot("gate_up", prefix + names.gate_up, (rows, H, 2 * I), _WEIGHT))
            slots.append(_Slot("down", prefix + names.down, (E, I, H), _WEIGHT))
        add("gate_up_bias", names.gate_up_bias, (E, 2 * I), _WEIGHT, "expert_bias")
        add("down_bias", names.down_bias, (E, H), _WEIGHT, "expert_bias")
    else:
        for e in range(E):
            g, u, dn = (prefix + n.format(e=e) for n in names.expert)
            expert_keys.append((g, u, dn))
            slots += [_Slot(f"gate[{e}]", g, (I, H), _WEIGHT), _Slot(f"up[{e}]", u, (I, H), _WEIGHT),
                      _Slot(f"down[{e}]", dn, (H, I), _WEIGHT)]
        for e, extra_names in adapter.per_expert_extra(d):
            optional += [_Slot(f"unused[{e}]", prefix + n.format(e=e), (I, H), _WEIGHT) for n in extra_names]
    optional += [_Slot("ignored", prefix + n, (E + d.Z,), _AUX) for n in adapter.ignored(config)]
    quant = None
    if qspec is not None:
        slots, quant = _quantized_slots(index, qspec, slots, d, _model_dtype(config))

    # Both formats' prefixes are accounted, so that a stray tensor of the other format is caught.
    all_owned = adapter.fused.owned + (per.owned if per is not None else ())
    owned = tuple(dict.fromkeys(prefix + o for o in all_owned))
    plan = LayerPlan(adapter=adapter, dims=d, layer_idx=layer_idx, prefix=prefix, source_format=fmt,
                     slots=tuple(slots), expert_keys=tuple(expert_keys), optional=tuple(optional), owned=owned,
                     quant=quant)
    _account(index, plan, _model_dtype(config))
    return plan


def _checked_dims(adapter: KeyAdapter, config: Any, layer_idx: int) -> Dims:
    """The family's Dims of `config`, each an int in range, or a CheckpointError naming it."""
    d = adapter.dims(config)
    for name, low in (("E", 1), ("H", 1), ("I", 1), ("K", 1), ("Is", 0), ("Z", 0), ("V", 0)):
        v = getattr(d, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise CheckpointError(f"{family_msg(adapter, layer_idx)}: the config gives {name}={v!r}, expected an "
                                  f"int >= {low} (legend: E experts, H hidden, I intermediate, K experts per token, "
                                  "Is shared intermediate, Z zero experts, V vocabulary)")
    return d


def _check_router_claim(index: CheckpointIndex, key: str, d: Dims, where: str) -> None:
    """CheckpointError unless the router weight's stored shape is [E + Z, H] as the config claims."""
    if key not in index:
        return  # the accounting names the missing key
    shape = index.info(key).shape
    if shape != (d.E + d.Z, d.H):
        z = f" + Z={d.Z}" if d.Z else ""
        raise CheckpointError(f"{where}: {key}: shape {list(shape)}, expected {[d.E + d.Z, d.H]} (the config's "
                              f"E={d.E}{z} experts, H={d.H})", key=key)


def _num_layers(index: CheckpointIndex, adapter: KeyAdapter, config: Any) -> int:
    """The config's layer count, refused (CheckpointError) above the layers the tensor names hold."""
    n = adapter.num_layers(config)
    bound, held = layer_bound(layer_ids(index.keys()))
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= bound:
        raise CheckpointError(f"{adapter.family}: config num_hidden_layers={n!r}, but {index.directory}'s tensors "
                              f"hold {held}; expected an int at most the layers present")
    return n


def _quantized_slots(index: CheckpointIndex, qspec: Any, slots: list[_Slot], d: Dims,
                     model_dtype: torch.dtype | None) -> tuple[list[_Slot], Any]:
    """The plan's slots with the expert (and quantized shared-expert) weights in their quantized form
    plus their scale tensors (rules: moeflow.quant.checkpoint)."""
    from ..quant.checkpoint import QuantLayerPlan, quantize_slots

    qslots, replaced, shared_q = quantize_slots(qspec, index, [(s.role, s.key, s.shape) for s in slots],
                                                H=d.H, I=d.I)
    kept = [s for s in slots if s.role not in replaced]
    kept += [_Slot(role, key, shape, "exact", dtype) for role, key, shape, dtype in qslots]
    plan = QuantLayerPlan(spec=qspec, shared_quantized=shared_q, shared_dtype=model_dtype or torch.float32)
    return kept, plan


def _account(index: CheckpointIndex, plan: LayerPlan, model_dtype: torch.dtype | None) -> None:
    """Strict key accounting plus shape and dtype checks, from headers only."""
    where = f"{family_msg(plan.adapter, plan.layer_idx)} ({plan.source_format} format)"
    expected = {s.key: s for s in plan.slots}
    optional = {s.key: s for s in plan.optional}
    present = sorted({k for o in plan.owned for k in index.keys_with_prefix(o)})
    missing = sorted(k for k in expected if k not in index)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing key {missing[0]}{more}", key=missing[0])
    unexpected = [k for k in present if k not in expected and k not in optional]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(
            f"{where}: unexpected key {unexpected[0]}{more} under {', '.join(plan.owned)}", key=unexpected[0]
        )
    # The layer's weight dtype: the config's, else what its first expert tensor holds.
    checked = [expected[k] for k in sorted(expected)] + [optional[k] for k in sorted(optional) if k in index]
    weight_dtype = model_dtype
    if weight_dtype is None:
        # (A quantized layer may have no plain weight but its router.)
        first = next((s for s in plan.slots if s.dclass == _WEIGHT), plan.slots[0])
        weight_dtype = index.info(first.key).dtype
    for s in checked:
        info = index.info(s.key)
        if info.shape != s.shape:
            raise CheckpointError(f"{where}: {s.key}: shape {list(info.shape)}, expected {list(s.shape)}", key=s.key)
        if s.dtype is not None:
            ok, want = info.dtype == s.dtype, str(s.dtype)
        elif s.dclass == _WEIGHT:
            ok, want = info.dtype == weight_dtype, str(weight_dtype)
        elif s.dclass == _AUX:
            ok, want = info.dtype in (weight_dtype, torch.float32), f"{weight_dtype} or torch.float32"
        else:
            ok = not info.dtype.is_floating_point and info.dtype != torch.bool
            want = "an integer dtype"
        if not ok:
            raise CheckpointError(f"{where}: {s.key}: dtype {info.dtype}, expected {want}", key=s.key)


def _expert_ids(experts: Iterable[int] | range | None, E: int) -> list[int]:
    if experts is None:
        return list(range(E))
    if isinstance(experts, torch.Tensor):
        experts = experts.tolist()
    try:
        ids = list(experts)
    except TypeError as exc:
        raise TypeError(f"experts={experts!r}: expected None or a sequence of expert ids") from exc
    for e in ids:
        # operator.index takes ints (numpy's too) and refuses floats: 1.7 is no expert id.
        if isinstance(e, bool) or not hasattr(type(e), "__index__"):
            raise TypeError(f"experts: id {e!r} ({type(e).__name__}), expected an int expert id")
    ids = [operator.index(e) for e in ids]
    if not ids:
        raise ValueError("experts=[]: expected at least one expert id")
    bad = [e for e in ids if not 0 <= e < E]
    if bad:
        raise ValueError(f"experts: id {bad[0]} outside [0, {E})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"experts={ids}: ids repeat")
    return ids


def _target_dtype(dtype: Any) -> torch.dtype | None:
    """load_moe_layer's dtype as a torch.dtype (a name such as "bfloat16" resolved), or a TypeError naming it."""
    if dtype is None:
        return None
    want = "a floating torch.dtype of 16 bits or more (torch.bfloat16, ...) or its name ('bfloat16'), or None"
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise TypeError(f"dtype={dtype!r}: not a torch dtype name; expected {want}")
        dtype = resolved
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r} ({type(dtype).__name__}): expected {want}")
    if not dtype.is_floating_point or dtype.itemsize < 2:
        # An integer or float8 target would be a bare cast of the weights, never a dequantization.
        raise TypeError(f"dtype={dtype}: expected {want}")
    return dtype


def load_moe_layer(
    src: str | os.PathLike | CheckpointIndex,
    family_or_config: Any,
    layer_idx: int,
    *,
    experts: Iterable[int] | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    prefix: str | None = None,
) -> LayerWeights:
    """Read MoE layer `layer_idx` (its router, the `experts` asked for, biases, shared expert).

    src:              checkpoint directory / .safetensors file / index JSON, or a CheckpointIndex
                      (reuse one across layers: shards stay memory-mapped).
    family_or_config: an HF config (or its text config), or a family / model_type name (then
                      the checkpoint's config.json supplies the sizes).
    experts:          global ids to load (expert parallelism, offload); None = all. Only their
                      bytes are read; the router weight is always read whole.
    dtype:            cast the expert, shared-expert and router weights to this dtype (biases,
                      scales and hash tables keep theirs): a floating torch.dtype of 16 bits or
                      more, or its name as in config.json ("bfloat16"). None keeps the stored dtype.
                      Quantized checkpoints (config.json quantization_config: FP8 block, MXFP4,
                      ModelOpt NVFP4; moeflow.quant): None keeps the experts quantized (an
                      ExpertWeights with `quant` and its scales); a dtype dequantizes them with
                      their scales (never a bare cast). A quantized shared expert is always
                      dequantized (to `dtype`, else the config's dtype, else float32).
    prefix:           the layer's key prefix ("model.layers.3."), found automatically if None.

    Raises CheckpointError (a ValueError) naming the key on a missing, unexpected,
    wrong-shape or wrong-dtype tensor; nothing is read before the whole block checks out.
    """
    from ..config import ExpertWeights

    dtype = _target_dtype(dtype)
    index = _as_index(src)
    plan = plan_layer(index, family_or_config, layer_idx, prefix=prefix)
    adapter, d = plan.adapter, plan.dims
    ids = _expert_ids(experts, d.E)
    by_role = {s.role: s.key for s in plan.slots}

    def read(role: str, *, cast: bool = False, rows=None) -> torch.Tensor | None:
        key = by_role.get(role)
        if key is None:
            return None
        return index.get(key, rows=rows, device=device, dtype=dtype if cast else None)

    # Contiguous ascending ids -> one slice read per fused tensor; else row by row.
    contiguous = ids == list(range(ids[0], ids[0] + len(ids)))
    rows = slice(ids[0], ids[0] + len(ids)) if contiguous else ids
    experts = None
    if plan.quant is not None:
        from ..quant.checkpoint import read_quantized_experts

        experts = read_quantized_experts(
            index, plan.quant.spec, by_role, fmt=plan.source_format, ids=ids, I=d.I, layout=adapter.layout,
            interleaved=adapter.interleaved, device=device, dtype=dtype,
            biases=(read("gate_up_bias", rows=rows), read("down_bias", rows=rows)))
    elif plan.source_format == "fused":
        gate_up = read("gate_up", cast=True, rows=rows)
        down = read("down", cast=True, rows=rows)
        gate_up_bias = read("gate_up_bias", cast=True, rows=rows)
        down_bias = read("down_bias", cast=True, rows=rows)
    else:
        # Per-expert 2-D tensors fused into the model's layout: gate_up[e] = [gate; up].
        first_gate = plan.expert_keys[0][0]
        out_dtype = dtype or index.info(first_gate).dtype
        gate_up = torch.empty((len(ids), 2 * d.I, d.H), dtype=out_dtype)
        down = torch.empty((len(ids), d.H, d.I), dtype=out_dtype)
        for n, e in enumerate(ids):
            g, u, dn = plan.expert_keys[e]
            gate_up[n, : d.I].copy_(index.get(g))
            gate_up[n, d.I:].copy_(index.get(u))
            down[n].copy_(index.get(dn))
        gate_up, down = gate_up.to(device), down.to(device)
        gate_up_bias = down_bias = None

    shared = None
    if plan.quant is not None and plan.quant.shared_quantized:
        from ..quant.checkpoint import read_quantized_shared

        shared = SharedExpertWeights(*read_quantized_shared(index, plan.quant.spec, by_role, device=device,
                                                            dtype=dtype or plan.quant.shared_dtype))
    elif "shared_gate_proj" in by_role:
        shared = SharedExpertWeights(read("shared_gate_proj", cast=True), read("shared_up_proj", cast=True),
                                     read("shared_down_proj", cast=True))
    return LayerWeights(
        family=adapter.family,
        layer_idx=layer_idx,
        expert_ids=tuple(ids),
        router_weight_EH=read("router_weight", cast=True),
        experts=experts if experts is not None else ExpertWeights(
            gate_up, down, gate_up_bias, down_bias, layout=adapter.layout, interleaved=adapter.interleaved),
        router_bias_E=read("router_bias"),
        selection_bias_E=read("selection_bias"),
        expert_scale_E=read("expert_scale"),
        prenorm_weight_H=read("prenorm_weight"),
        hash_table_VK=read("hash_table"),
        shared=shared,
        shared_gate_weight_1H=read("shared_gate", cast=True),
        source_format=plan.source_format,
        keys=tuple(sorted(s.key for s in plan.slots)),
    )


def moe_layer_indices(src: str | os.PathLike | CheckpointIndex, family_or_config: Any) -> list[int]:
    """The layer ids that hold an MoE block in this config (dense layers left out)."""
    index = _as_index(src)
    adapter, config = _resolve_config(index, family_or_config)
    return [i for i in range(_num_layers(index, adapter, config)) if adapter.is_moe_layer(config, i)]


__all__ = ["LayerPlan", "LayerWeights", "SharedExpertWeights", "SharedSwiGLU", "load_moe_layer", "moe_layer_indices", "plan_layer"]
