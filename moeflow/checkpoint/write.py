"""Write Hugging Face safetensors checkpoints in a stored format's exact tensor names.

What the tests and `benchmarks/bench_models.py` use to build checkpoints a loader must read
as released ones are: experts (and, optionally, the dense linear weights) quantized by
moeflow's own quantizers (`moeflow.quant.formats`) under each format's key rule
(`moeflow.quant.checkpoint`), the expert key names of the family table
(`moeflow.families` -> `KeyAdapter`), sharded like `save_pretrained` with an index JSON.

    w = ShardWriter(directory, shard_bytes=2**30)
    w.add_all(expert_tensors("qwen3_moe", 3, q_weights, fmt="fused"))   # tensor by tensor
    w.close()                                                          # shards + index
    write_config(directory, hf_config, quantization_config={...})

Legend: E experts, H hidden, I intermediate per expert, N output rows / K input columns of
one projection.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .families import adapter_for
from .keys import KeyAdapter

__all__ = ["ShardWriter", "expert_tensors", "dense_tensors", "write_config", "write_model_checkpoint",
           "QUANTIZATION_CONFIGS"]

# config.json `quantization_config` of each stored format as released checkpoints write it
# (block sizes of fp8 are the caller's: weight_block_size).
QUANTIZATION_CONFIGS: dict[str, dict[str, Any]] = {
    "fp8_block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [128, 128]},
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                   "model.layers.*.mlp.router", "model.embed_tokens",
                                                                   "lm_head"]},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "producer": {"name": "modelopt"}},
}


class ShardWriter:
    """Tensors written to safetensors shards of at most `shard_bytes` each (a tensor larger than
    that gets a shard of its own), then `model.safetensors.index.json` (several shards) or one
    `model.safetensors`. Host memory held: the current shard's tensors only.
    """

    def __init__(self, directory: str | os.PathLike, *, shard_bytes: int = 2 ** 30) -> None:
        if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes <= 0:
            raise ValueError(f"shard_bytes={shard_bytes!r}: expected a positive int")
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.shard_bytes = shard_bytes
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._files: list[tuple[str, list[str]]] = []  # (temporary name, keys)
        self._seen: set[str] = set()
        self.total_bytes = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        """Queue one tensor (moved to the CPU, made contiguous); flushes a full shard first."""
        if key in self._seen:
            raise ValueError(f"ShardWriter.add: key {key!r} written twice")
        nbytes = t.numel() * t.element_size()
        if self._buf and self._buf_bytes + nbytes > self.shard_bytes:
            self._flush()
        self._seen.add(key)
        self._buf[key] = t.detach().to("cpu").contiguous()
        self._buf_bytes += nbytes
        self.total_bytes += nbytes

    def add_all(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        for key, t in (tensors.items() if isinstance(tensors, Mapping) else tensors):
            self.add(key, t)

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"shard-{len(self._files):05d}.tmp"
        save_file(self._buf, os.path.join(self.directory, name), metadata={"format": "pt"})
        self._files.append((name, sorted(self._buf)))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> list[str]:
        """Write what is queued, give the shards their final names; returns the shard paths."""
        if self._buf or not self._files:
            self._flush()
        n = len(self._files)
        final = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, keys), name in zip(self._files, final):
            os.replace(os.path.join(self.directory, tmp), os.path.join(self.directory, name))
            weight_map.update(dict.fromkeys(keys, name))
        if n > 1:
            with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as fh:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, fh)
        return [os.path.join(self.directory, f) for f in final]


def _adapter(family: str | KeyAdapter) -> KeyAdapter:
    return family if isinstance(family, KeyAdapter) else adapter_for(family)


def _names(adapter: KeyAdapter, fmt: str):
    if fmt not in ("fused", "per_expert"):
        raise ValueError(f"fmt={fmt!r}: expected 'fused' or 'per_expert'")
    names = adapter.fused if fmt == "fused" else adapter.per_expert
    if names is None:
        raise ValueError(f"fmt='per_expert': {adapter.family} has no per-expert names (its checkpoints are fused)")
    return names


def expert_tensors(family: str | KeyAdapter, layer_idx: int, w: Any, *, fmt: str = "fused",
                   prefix: str = "model.layers.{i}.", input_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one layer's routed experts `w` (a moeflow ExpertWeights, all E).

    fmt "fused": `<block>experts.gate_up_proj` [E, ...] (+ `_scale_inv` fp8_block; mxfp4:
    `_blocks` [E, N, K/32, 16] + `_scales`); "per_expert": the family's per-expert names
    (`experts.{e}.gate_proj.weight`, `w1/w3/w2`, ...), with `weight_scale_inv` (fp8_block) or
    ModelOpt's `weight_scale` / `weight_scale_2` / `input_scale` (nvfp4; input_scale: this
    value, as a 0-dim f32). Unquantized per-expert weights are split from the linear,
    non-interleaved layout. Expert biases (gpt-oss) are written fused.
    """
    from ..quant.checkpoint import scale_keys, storage_key

    adapter = _adapter(family)
    names = _names(adapter, fmt)
    p = prefix.format(i=layer_idx)
    spec = w.quant
    E, I, H = w.num_experts, w.intermediate_size, w.hidden_size
    out: dict[str, torch.Tensor] = {}
    if fmt == "fused":
        gu_key, dn_key = p + names.gate_up, p + names.down
        if spec is None:
            out[gu_key], out[dn_key] = w.gate_up, w.down
        elif spec.format == "mxfp4":
            out[storage_key(spec, gu_key, fused=True)] = w.gate_up.reshape(E, 2 * I, -1, 16)
            out[storage_key(spec, dn_key, fused=True)] = w.down.reshape(E, H, -1, 16)
        else:
            out[gu_key], out[dn_key] = w.gate_up, w.down
        if spec is not None:
            out[scale_keys(spec, gu_key, fused=True)["scale"]] = w.gate_up_scale
            out[scale_keys(spec, dn_key, fused=True)["scale"]] = w.down_scale
        if w.gate_up_bias is not None:
            out[p + names.gate_up_bias] = w.gate_up_bias
            out[p + names.down_bias] = w.down_bias
        return out
    if w.layout != "linear" or w.interleaved:
        raise ValueError(f"fmt='per_expert': experts in layout {(w.layout, w.interleaved)}; per-expert names hold "
                         "the linear, non-interleaved layout")
    gi = w.gate_up_scale.shape[1] // 2 if spec is not None else None  # gate's scale rows
    for e in range(E):
        g_key, u_key, d_key = (p + t.format(e=e) for t in names.expert)
        parts = [(g_key, w.gate_up[e, :I], slice(None, gi), 0), (u_key, w.gate_up[e, I:], slice(gi, None), 1),
                 (d_key, w.down[e], None, None)]
        for key, t, rows, half in parts:
            out[key] = t
            if spec is None:
                continue
            sk = scale_keys(spec, key, fused=False)
            out[sk["scale"]] = w.down_scale[e] if rows is None else w.gate_up_scale[e, rows]
            if spec.format == "nvfp4":
                out[sk["scale_2"]] = (w.down_scale_2[e] if half is None else w.gate_up_scale_2[e, half]).reshape(())
                out[sk["input_scale"]] = torch.tensor(float(input_scale), dtype=torch.float32)
    return out


def dense_tensors(key: str, w_NK: torch.Tensor, spec: Any) -> dict[str, torch.Tensor]:
    """One dense linear weight `key` (`....weight` [N, K]) quantized by `spec` (fp8_block / nvfp4) with its scales
    under the format's names; spec None: the weight as it is."""
    from ..quant.checkpoint import scale_keys
    from ..quant.formats import quantize_fp8_block, quantize_nvfp4

    if spec is None:
        return {key: w_NK}
    if spec.format == "fp8_block":
        q, s = quantize_fp8_block(w_NK, spec.block, ue8m0=spec.scale_dtype != torch.float32)
        return {key: q, scale_keys(spec, key, fused=False)["scale"]: s}
    if spec.format == "nvfp4":
        q, s, s2 = quantize_nvfp4(w_NK)
        sk = scale_keys(spec, key, fused=False)
        return {key: q, sk["scale"]: s, sk["scale_2"]: s2.reshape(()), sk["input_scale"]: torch.tensor(1.0)}
    raise ValueError(f"spec.format={spec.format!r}: dense weights are quantized as fp8_block or nvfp4 only "
                     "(MXFP4 checkpoints keep dense layers unquantized)")


def write_config(directory: str | os.PathLike, config: Any, *, quantization_config: dict | None = None) -> str:
    """config.json of `config` (a transformers config or a dict) with `quantization_config` set; its path."""
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "config.json")
    if isinstance(config, Mapping):
        raw = dict(config)
    else:
        config.save_pretrained(directory)  # transformers' own serialisation of the config
        with open(path) as fh:
            raw = json.load(fh)
    if quantization_config is not None:
        raw["quantization_config"] = quantization_config
    with open(path, "w") as fh:
        json.dump(raw, fh, indent=1, default=str)
    return path


def _is_dense_linear(key: str, t: torch.Tensor) -> bool:
    return key.endswith(".weight") and t.dim() == 2 and ".layers." in key and "norm" not in key


def write_model_checkpoint(directory: str | os.PathLike, model: Any, family: str, *, spec: Any = None,
                           quantization_config: dict | None = None, fmt: str = "fused", layers: Iterable[int] | None = None,
                           dense: bool = False, shard_bytes: int = 2 ** 30, shards: int | None = None, edit=None
                           ) -> tuple[str, dict[int, Any], dict[str, tuple]]:
    """Save a transformers model (fused experts, as transformers 5 holds them) as a checkpoint in a stored format.

    spec: a moeflow QuantSpec (experts of `layers`, default every MoE layer, quantized by
    moeflow's quantizer) or None (bf16/fp16/fp32 as the model holds them). fmt: the experts'
    names ("fused" | "per_expert", see `expert_tensors`). dense: also quantize the dense linear
    weights inside the decoder layers (attention, dense MLPs, shared experts; not routers) as
    fp8_block / nvfp4 checkpoints do; without it only a shared expert is quantized (under
    spec fp8_block / nvfp4), as in the DeepSeek-V3 FP8 release. edit(tensors): a last change
    before writing (tests corrupt one tensor with it). shards: about this many shards of equal
    bytes (instead of shard_bytes).

    Returns (directory, {layer: the ExpertWeights written}, {quantized dense key: its tensors}).
    """
    from ..config import ExpertWeights
    from ..families import family_for
    from ..hf.util import attr_path
    from ..quant import quantize_experts
    from ..routing.families import text_config

    fam = family_for(family)
    adapter = fam.checkpoint
    names = _names(adapter, fmt)
    config = text_config(model.config)
    moe_ids = [i for i in range(adapter.num_layers(config)) if adapter.is_moe_layer(config, i)]
    layers = moe_ids if layers is None else list(layers)
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    written: dict[int, Any] = {}
    for i in layers:
        block = model.model.layers[i].mlp
        ex = attr_path(block, fam.hf.experts)
        biases = (ex.gate_up_proj_bias.detach(), ex.down_proj_bias.detach()) if fam.expert_bias else (None, None)
        w = ExpertWeights(ex.gate_up_proj.detach(), ex.down_proj.detach(), *biases, layout=fam.layout,
                          interleaved=fam.interleaved)
        q = quantize_experts(w, spec) if spec is not None else w
        written[i] = q
        p = f"model.layers.{i}."
        for k in [k for k in tensors if k.startswith(p + "mlp.experts.")]:
            del tensors[k]
        tensors.update(expert_tensors(adapter, i, q, fmt=fmt))
        if fmt == "per_expert" and names.router != adapter.fused.router:
            # the per-expert names put the whole block elsewhere (mixtral: block_sparse_moe.)
            old, new = p + adapter.fused.owned[0], p + names.owned[0]
            for k in [k for k in tensors if k.startswith(old)]:
                tensors[new + k[len(old):]] = tensors.pop(k)
    quantized: dict[str, tuple] = {}
    if spec is not None and spec.format != "mxfp4":
        for key in sorted(tensors):
            t = tensors[key]
            shared = ".shared_expert" in key and key.endswith("_proj.weight")
            if (dense and _is_dense_linear(key, t) and ".gate." not in key and ".router." not in key
                    and t.dtype.is_floating_point and t.element_size() > 1) or shared:
                if any(key.startswith(f"model.layers.{i}.") for i in layers) or dense:
                    parts = dense_tensors(key, t, spec)
                    del tensors[key]
                    tensors.update(parts)
                    quantized[key] = tuple(parts.values())[:3]  # (q, scale[, scale_2])
    if edit is not None:
        edit(tensors)
    if shards is not None:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        shard_bytes = max(1, -(-total // shards))
    writer = ShardWriter(directory, shard_bytes=shard_bytes)
    writer.add_all(sorted(tensors.items()))
    writer.close()
    qc = quantization_config
    if qc is None and spec is not None:
        qc = dict(QUANTIZATION_CONFIGS[spec.format])
        if spec.format == "fp8_block":
            qc["weight_block_size"] = list(spec.block)
    write_config(directory, model.config, quantization_config=qc)
    return os.fspath(directory), written, quantized
