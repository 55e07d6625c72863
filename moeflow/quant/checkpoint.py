"""Quantized checkpoints for moeflow.checkpoint.loader: scale-key rules, expected slots, reads.

Legend: E experts (rows: E, or E + Z stored rows for LongCat), H hidden, I intermediate per
expert, Is shared-expert width, N output rows / K input columns of one projection,
P values packed per stored element (2 for FP4), bn x bk the FP8 block.

Scale keys derive from the weight keys of the family table by each format's rule, so the
table needs no quantization fields:

    fp8_block  per-expert  <p>.weight           + <p>.weight_scale_inv  [ceil(N/bn), ceil(K/bk)]
               fused       <p>.gate_up_proj     + <p>.gate_up_proj_scale_inv [E, 2*ceil(I/bn), ceil(H/bk)]
                           <p>.down_proj        + <p>.down_proj_scale_inv    [E, ceil(H/bn), ceil(I/bk)]
    mxfp4      fused       <p>.gate_up_proj  -> <p>.gate_up_proj_blocks uint8 [E, 2I, H/32, 16]
                                              + <p>.gate_up_proj_scales uint8 [E, 2I, H/32]
                           <p>.down_proj     -> <p>.down_proj_blocks [E, H, I/32, 16] + <p>.down_proj_scales
    nvfp4      per-expert  <p>.weight uint8 [N, K/2] + <p>.weight_scale float8_e4m3fn [N, K/16]
                           + <p>.weight_scale_2 f32 [] + <p>.input_scale f32 []   (ModelOpt; [1] accepted)

Every derived key is an expected slot of the strict key accounting: a missing scale is a
CheckpointError naming it, and a scale key is counted as used. The shared expert is
quantized when its first scale key is present (DeepSeek-V3 FP8 quantizes it; it is always
returned dequantized, since moeflow runs it as plain nn.Linear weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.files import ConfigError, read_json
from ..checkpoint.index import CheckpointError, CheckpointIndex
from .experts import scale_kind
from .formats import check_scales, dequantize_fp8_block, dequantize_nvfp4, scale_code_max
from .spec import QuantSpec, quant_spec_from_hf

# (role, key, shape, dtype) of one expected tensor; the loader wraps it in its slot type.
SlotSpec = tuple[str, str, tuple[int, ...], torch.dtype]

_SHARED = ("shared_gate_proj", "shared_up_proj", "shared_down_proj")


@dataclass(frozen=True)
class QuantLayerPlan:
    """What a quantized layer's plan adds: the spec, whether the shared expert is quantized, its dtype."""

    spec: QuantSpec
    shared_quantized: bool = False
    shared_dtype: torch.dtype = torch.float32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quant_spec_of(config: Any, directory: str | None) -> QuantSpec | None:
    """The checkpoint's QuantSpec: `quantization_config` of the config object (or its text config),
    else of `directory`/config.json. Raises CheckpointError (key "quantization_config.quant_method"
    or the field) for a method or setting moeflow cannot read."""
    qc = None
    for obj in (config, getattr(config, "text_config", None)):
        qc = getattr(obj, "quantization_config", None) if obj is not None else None
        if qc is not None:
            break
    if qc is None and directory is not None:
        path = os.path.join(directory, "config.json")
        if os.path.lexists(path):
            raw = read_json(path, "Hugging Face model config", error=ConfigError)
            qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    try:
        return quant_spec_from_hf(qc)
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        field = msg.split("=", 1)[0].split(":", 1)[0] if msg.startswith("quantization_config") else \
            "quantization_config"
        raise CheckpointError(f"{directory or 'config'}/config.json: {msg}", key=field) from exc


def storage_key(spec: QuantSpec | None, key: str, *, fused: bool) -> str:
    """The key that holds a weight's quantized data (mxfp4 fused: `<key>_blocks`; else the key itself)."""
    if spec is not None and spec.format == "mxfp4" and fused:
        return key + "_blocks"
    return key


def scale_keys(spec: QuantSpec, key: str, *, fused: bool) -> dict[str, str]:
    """The scale tensors of the weight `key` by the format's rule: {"scale": ..., ["scale_2", "input_scale"]}.

    Raises CheckpointError naming the key for a storage the format has no published layout for
    (per-expert MXFP4, fused NVFP4).
    """
    if spec.format == "fp8_block":
        if key.endswith(".weight"):
            return {"scale": key[: -len(".weight")] + ".weight_scale_inv"}
        return {"scale": key + "_scale_inv"}
    if spec.format == "mxfp4":
        if not fused:
            raise CheckpointError(f"{key}: MXFP4 is published for fused experts only (gpt-oss "
                                  "gate_up_proj_blocks / _scales); expected fused tensors", key=key)
        return {"scale": key + "_scales"}
    if fused or not key.endswith(".weight"):
        raise CheckpointError(f"{key}: NVFP4 (ModelOpt) is published for per-expert '.weight' tensors only; "
                              "expected per-expert names", key=key)
    base = key[: -len(".weight")]
    return {"scale": base + ".weight_scale", "scale_2": base + ".weight_scale_2", "input_scale": base + ".input_scale"}


def _scalar_shape(index: CheckpointIndex, key: str) -> tuple[int, ...]:
    # ModelOpt writes per-tensor scales 0-dim; [1] is accepted when that is what the header holds.
    if key in index and index.info(key).shape == (1,):
        return (1,)
    return ()


def _proj_slots(spec: QuantSpec, index: CheckpointIndex, role: str, key: str, n: int, k: int,
                rows: int | None) -> list[SlotSpec]:
    """Storage + scale slots of one [n, k] projection (rows: the fused leading dim, None per-expert)."""
    fused = rows is not None
    lead = (rows,) if fused else ()
    P = spec.pack
    if k % P:
        raise CheckpointError(f"{key}: K={k} is odd; {spec.format} packs two values a byte", key=key)
    if spec.format in ("mxfp4", "nvfp4"):
        group = spec.block[1]
        if k % group:
            raise CheckpointError(f"{key}: K={k} is not a multiple of {group}, the {spec.format} block", key=key)
    keys = scale_keys(spec, key, fused=fused)
    skey = storage_key(spec, key, fused=fused)
    if spec.format == "mxfp4":
        out: list[SlotSpec] = [(role, skey, (*lead, n, k // 32, 16), torch.uint8)]
    else:
        out = [(role, skey, (*lead, n, k // P), spec.weight_dtype)]
    if spec.format == "fp8_block":
        bn, bk = spec.block
        if role == "gate_up":  # fused: gate's grid then up's (see moeflow.quant.experts)
            grid = (2 * _cdiv(n // 2, bn), _cdiv(k, bk))
        else:
            grid = spec.scale_grid(n, k)
        out.append((f"{role}.scale", keys["scale"], (*lead, *grid), spec.scale_dtype))
    elif spec.format == "mxfp4":
        out.append((f"{role}.scale", keys["scale"], (*lead, n, k // 32), torch.uint8))
    else:
        out.append((f"{role}.scale", keys["scale"], (n, k // 16), torch.float8_e4m3fn))
        for part in ("scale_2", "input_scale"):
            out.append((f"{role}.{part}", keys[part], _scalar_shape(index, keys[part]), torch.float32))
    return out


def quantize_slots(spec: QuantSpec, index: CheckpointIndex, slots: list[tuple[str, str, tuple[int, ...]]], *,
                   H: int, I: int) -> tuple[list[SlotSpec], list[str], bool]:
    """Replace the expert (and, when quantized on disk, shared-expert) weight slots by their quantized forms.

    slots: (role, key, shape) of the loader's plan; roles "gate_up" / "down" (fused),
    "gate[e]" / "up[e]" / "down[e]" (per-expert), "shared_*_proj".
    Returns (quantized slots, roles replaced, shared_quantized).
    """
    shared_q = False
    shared_gate = next((key for role, key, _ in slots if role == "shared_gate_proj"), None)
    if shared_gate is not None and spec.format != "mxfp4":
        shared_q = scale_keys(spec, shared_gate, fused=False)["scale"] in index
    out: list[SlotSpec] = []
    replaced: list[str] = []
    for role, key, shape in slots:
        if role == "gate_up":
            rows, n, k = shape[0], 2 * I, H
        elif role == "down" and len(shape) == 3:
            rows, n, k = shape[0], H, I
        elif role.startswith(("gate[", "up[", "down[")):
            rows, (n, k) = None, shape
        elif role in _SHARED and shared_q:
            rows, (n, k) = None, shape
        else:
            continue
        out += _proj_slots(spec, index, role, key, n, k, rows)
        replaced.append(role)
    return out, replaced, shared_q


def _read_scale(index: CheckpointIndex, spec: QuantSpec, key: str, field: str, *, rows=None,
                device: str | torch.device = "cpu") -> torch.Tensor:
    t = index.get(key, rows=rows, device=device)
    try:
        check_scales(key, t, scale_kind(spec, field), code_max=scale_code_max(spec.format, field))
    except ValueError as exc:
        raise CheckpointError(str(exc), key=key) from exc
    return t


def read_quantized_experts(index: CheckpointIndex, spec: QuantSpec, by_role: dict[str, str], *, fmt: str,
                           ids: list[int], I: int, layout: str, interleaved: bool,
                           device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                           biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)):
    """The experts `ids` as a quantized ExpertWeights (dtype None) or dequantized to `dtype`.

    fmt: "fused" | "per_expert" (the plan's source format). Scales are read for the same
    experts and checked (NaN / inf / <= 0 / E8M0 255, or a scale whose largest code dequantizes
    to inf -> CheckpointError naming the key).
    biases: the already-read (gate_up_bias, down_bias) rows (gpt-oss), kept with the experts.
    """
    from ..config import ExpertWeights

    contiguous = ids == list(range(ids[0], ids[0] + len(ids)))
    rows = slice(ids[0], ids[0] + len(ids)) if contiguous else ids
    kw: dict[str, torch.Tensor] = {}
    if fmt == "fused":
        gu = index.get(by_role["gate_up"], rows=rows, device=device)
        dn = index.get(by_role["down"], rows=rows, device=device)
        # mxfp4 blocks [n, N, K/32, 16] -> [n, N, K/2] (a view: the 16 bytes of a block are contiguous).
        gu, dn = gu.flatten(-2) if gu.dim() == 4 else gu, dn.flatten(-2) if dn.dim() == 4 else dn
        kw["gate_up_scale"] = _read_scale(index, spec, by_role["gate_up.scale"], "gate_up_scale", rows=rows,
                                          device=device)
        kw["down_scale"] = _read_scale(index, spec, by_role["down.scale"], "down_scale", rows=rows, device=device)
    else:
        def proj(role: str, e: int) -> dict[str, torch.Tensor]:
            r = f"{role}[{e}]"
            field = "down_scale" if role == "down" else "gate_up_scale"
            got = {"w": index.get(by_role[r], device=device),
                   "scale": _read_scale(index, spec, by_role[f"{r}.scale"], field, device=device)}
            for part in ("scale_2", "input_scale"):
                key = by_role.get(f"{r}.{part}")
                if key is not None:
                    got[part] = _read_scale(index, spec, key, part, device=device).reshape(())
            return got

        # Each expert's reads go into the stacked fields as they arrive: one expert in flight, not
        # the layer three times over (its reads, their [gate; up] concatenations, the stack), which
        # set the host's peak when a whole model's experts are loaded for offload.
        out: dict[str, torch.Tensor] = {}

        def put(field: str, n: int, t: torch.Tensor) -> None:
            if field not in out:
                out[field] = torch.empty((len(ids), *t.shape), dtype=t.dtype, device=t.device)
            out[field][n].copy_(t)

        for n, e in enumerate(ids):
            p = {role: proj(role, e) for role in ("gate", "up", "down")}
            # gate_up[e] = [gate; up] rows; the scale grids stack the same way (gate's grid, then up's).
            put("gate_up", n, torch.cat((p["gate"]["w"], p["up"]["w"])))
            put("down", n, p["down"]["w"])
            put("gate_up_scale", n, torch.cat((p["gate"]["scale"], p["up"]["scale"])))
            put("down_scale", n, p["down"]["scale"])
            if spec.format == "nvfp4":
                put("gate_up_scale_2", n, torch.stack((p["gate"]["scale_2"], p["up"]["scale_2"])))
                put("down_scale_2", n, p["down"]["scale_2"])
                put("gate_up_input_scale", n, torch.stack((p["gate"]["input_scale"], p["up"]["input_scale"])))
                put("down_input_scale", n, p["down"]["input_scale"])
        gu, dn = out.pop("gate_up"), out.pop("down")
        kw.update(out)
    w = ExpertWeights(gu, dn, biases[0], biases[1], layout=layout, interleaved=interleaved, quant=spec, **kw)
    return w if dtype is None else w.dequantize(dtype)


def read_quantized_shared(index: CheckpointIndex, spec: QuantSpec, by_role: dict[str, str], *,
                          device: str | torch.device = "cpu", dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(gate_IH, up_IH, down_HI) of a quantized shared expert, dequantized to `dtype` (nn.Linear layout)."""
    out = []
    for role in _SHARED:
        w = index.get(by_role[role], device=device)
        s = _read_scale(index, spec, by_role[f"{role}.scale"], "gate_up_scale", device=device)
        if spec.format == "fp8_block":
            out.append(dequantize_fp8_block(w, s, spec.block, dtype))
        else:
            s2 = _read_scale(index, spec, by_role[f"{role}.scale_2"], "scale_2", device=device).reshape(())
            _read_scale(index, spec, by_role[f"{role}.input_scale"], "input_scale", device=device)
            out.append(dequantize_nvfp4(w, s, s2, dtype))
    return tuple(out)
