"""`moeflow info` and `moeflow route`: look at a checkpoint without (info) or with (route) its weights.

`checkpoint_info` reads config.json and the safetensors headers only (the JSON
header at the start of each file): no tensor is loaded.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from .checkpoint.files import (
    CheckpointError,
    check_layer_claims,
    check_regular_file,
    hf_config,
    layer_ids,
    read_config_json,
)

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5}
_LAYER_RE = re.compile(r"layers\.(\d+)\.")
_EXPERT_ID_RE = re.compile(r"\.experts\.(\d+)\.")


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of one .safetensors file: name -> {dtype, shape, data_offsets} (no data read).

    ValueError naming the file when it is not a safetensors file or is shorter than its
    header says (a truncated download): the sizes `info` prints come from this table.
    """
    check_regular_file(path, "safetensors file")  # a FIFO would block the read forever
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a safetensors header (truncated or not safetensors)")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: header of {n} bytes, but the file holds {size} bytes (truncated?)")
        try:
            header = json.loads(f.read(n))
        except RecursionError:
            raise CheckpointError(f"{path}: safetensors header nested too deeply to parse; the file is corrupt") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: safetensors header is not valid JSON ({exc}); the file is corrupt") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is {type(header).__name__}, expected a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, entry in header.items():
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            entry["shape"], entry["dtype"]  # noqa: B018 - presence check
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: header entry {name!r} lacks dtype/shape/data_offsets: {entry!r}") from exc
        if end > data_bytes:
            raise ValueError(f"{path}: tensor {name!r} ends at data byte {end}, but the file holds {data_bytes} "
                             f"data bytes (truncated: {size} bytes on disk, {8 + n + end} expected at least)")
        if entry["dtype"] in _DTYPE_BYTES and end - begin != _tensor_bytes(entry):
            raise ValueError(f"{path}: tensor {name!r} {entry['dtype']}{list(entry['shape'])} needs "
                             f"{_tensor_bytes(entry)} bytes, its data_offsets hold {end - begin}")
    return header


def _tensor_bytes(entry: dict) -> int:
    numel = 1
    for d in entry["shape"]:
        numel *= d
    return int(numel * _DTYPE_BYTES.get(entry["dtype"], 2))


@dataclass(frozen=True)
class CheckpointInfo:
    """What `moeflow info` prints. Byte counts are of the tensors as stored."""

    path: str
    family: str
    router: object
    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    expert_bytes: int  # one routed expert of one layer
    routed_bytes: int  # all routed experts of all layers
    other_bytes: int  # everything else (attention, embeddings, routers, shared experts)
    active_bytes_per_token: int
    slots: int | None
    quant: str | None = None  # the experts' stored format (config.json quantization_config), None: plain
    num_experts_total: int = 0  # routed experts of every MoE layer (the most a shared cache holds)
    embed_bytes: int = 0  # the input embedding table(s) ("embed_tokens" in the name), part of other_bytes
    lm_head_stored: bool = False  # an output head stored apart from the embedding (untied)

    @property
    def total_bytes(self) -> int:
        return self.routed_bytes + self.other_bytes

    @property
    def offload_bytes(self) -> int | None:
        """GPU bytes with experts offloaded to a cache of `slots` whole experts."""
        return None if self.slots is None else self.other_bytes + self.slots * self.expert_bytes


def _config_json(path: Path) -> tuple[Path, dict]:
    """(path/config.json, its parsed dict): FileNotFoundError when absent, ConfigError when unreadable."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory (expected a checkpoint dir with config.json)")
    cfg_file = path / "config.json"
    if not os.path.lexists(cfg_file):
        raise FileNotFoundError(f"no config.json in {path}")
    return cfg_file, read_config_json(cfg_file)


def load_config(path: Path, *, layers: set[int] | None = None):
    """The checkpoint's transformers config; ConfigError (a ValueError) naming config.json and the fault.

    layers: the decoder-layer ids the checkpoint's tensor names hold; given, a config.json
    that claims more layers is refused before transformers builds per-layer lists of them.
    """
    cfg_file, raw = _config_json(path)
    if layers is not None:
        check_layer_claims(raw, layers, str(cfg_file))
    return hf_config(path)


def _stored_experts(root: Path, layer: int, names: dict[str, dict]) -> tuple[set[int], int]:
    """(expert counts the layer's routed tensors store, bytes of one expert) from header entries.

    Per-expert keys `experts.{e}.` count their distinct ids (which must be 0..n-1) and give
    expert 0's bytes; a fused [E, ...] tensor counts its first dimension and gives 1/E of itself.
    """
    ids: set[int] = set()
    per_expert_bytes = 0
    counts: set[int] = set()
    fused_share = 0
    for n, e in names.items():
        m = _EXPERT_ID_RE.search(n)
        if m:
            ids.add(int(m.group(1)))
            if m.group(1) == "0":  # expert 0 is always a routed one (LongCat's zero-expert rows come last)
                per_expert_bytes += _tensor_bytes(e)
        elif e["shape"]:
            counts.add(int(e["shape"][0]))
            fused_share += _tensor_bytes(e) // max(1, int(e["shape"][0]))
    if ids:
        if ids != set(range(max(ids) + 1)):
            missing = sorted(set(range(max(ids) + 1)) - ids)
            raise ValueError(f"{root}: layer {layer}: experts {missing[:8]} missing among stored experts "
                             f"0..{max(ids)}")
        counts.add(len(ids))
        fused_share += per_expert_bytes
    return counts, fused_share


def checkpoint_info(path: str | Path, *, slots: int | None = None) -> CheckpointInfo:
    """Describe a checkpoint directory from config.json and safetensors headers."""
    from .routing.families import family_of, router_spec_from_hf

    root = Path(path)
    _, raw = _config_json(root)  # a missing or broken config.json is named before the weights
    if raw["model_type"] != "kimi_k25":  # (a wrapper: its family is its text_config's, known after parsing)
        family_of(SimpleNamespace(model_type=raw["model_type"]))  # an unsupported family, likewise
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {root} (the weights are missing)")
    headers = [read_safetensors_header(f) for f in files]
    # The headers first: config.json's claims are checked against the stored tensors before
    # transformers reads it.
    config = load_config(root, layers=layer_ids(name for h in headers for name in h))
    family = family_of(config)
    routed_by_layer: dict[int, int] = defaultdict(int)
    routed_names: dict[int, dict[str, dict]] = defaultdict(dict)
    other = embed = 0
    lm_head = False
    for header in headers:
        for name, entry in header.items():
            m = _LAYER_RE.search(name)
            is_routed = ".experts." in name and "shared" not in name
            if m and is_routed:
                routed_by_layer[int(m.group(1))] += _tensor_bytes(entry)
                routed_names[int(m.group(1))][name] = entry
            else:
                other += _tensor_bytes(entry)
                if "embed_tokens" in name:
                    embed += _tensor_bytes(entry)
                lm_head = lm_head or name.startswith("lm_head.")
    moe_layers = tuple(sorted(routed_by_layer))
    if not moe_layers:
        raise ValueError(f"{root}: no routed expert tensors ('.experts.' in the name) found")
    spec = router_spec_from_hf(config, moe_layers[0])
    E, K = spec.num_experts, spec.top_k
    expert_bytes = 0
    all_experts = 0  # routed experts of every MoE layer: the most a cache shared by the layers can hold
    for layer in moe_layers:
        # The sizes below come from the stored expert count: a config that disagrees with the
        # tensors would print plausible, wrong numbers.
        stored, one_expert = _stored_experts(root, layer, routed_names[layer])
        s = router_spec_from_hf(config, layer)
        # transformers' LongCat also stores (unused) rows for its Z zero experts in some tensors
        bad = sorted(stored - {s.num_experts, s.num_slots})
        if bad:
            z = f" (+ {s.num_zero_experts} zero experts)" if s.num_zero_experts else ""
            raise ValueError(f"{root}: config.json says E={s.num_experts} routed experts{z}, but layer {layer}'s "
                             f"expert tensors store {bad[0]}")
        all_experts += s.num_experts
        if layer == moe_layers[0]:
            expert_bytes = one_expert
    routed = sum(routed_by_layer.values())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if slots is not None and (not isinstance(slots, int) or isinstance(slots, bool) or not K <= slots <= all_experts):
        # the cache is shared by the layers: beyond every routed expert of every layer a slot holds
        # nothing, and the bytes printed would exceed the resident model's
        raise ValueError(f"--slots={slots}: expected an int in [K={K}, {all_experts}] (K: one token's experts of one "
                         f"layer; {all_experts}: the routed experts of all {len(moe_layers)} MoE layers, which a "
                         f"cache of that many slots holds whole)")
    return CheckpointInfo(
        path=str(root),
        family=family,
        router=spec,
        num_layers=int(getattr(text, "num_hidden_layers", len(moe_layers))),
        moe_layers=moe_layers,
        num_experts=E,
        top_k=K,
        expert_bytes=expert_bytes,
        routed_bytes=routed,
        other_bytes=other,
        active_bytes_per_token=other + len(moe_layers) * K * expert_bytes,
        slots=slots,
        quant=_quant_format(text),
        num_experts_total=all_experts,
        embed_bytes=embed,
        lm_head_stored=lm_head,
    )


def model_bytes(info: CheckpointInfo):
    """The checkpoint's moeflow.predict.ModelBytes: its stored byte counts. A decode step reads every
    non-expert tensor but the input embedding table (one row of it), unless no output head is
    stored apart from it (tied: the table is the head, read whole)."""
    from .predict import ModelBytes

    decode_other = info.other_bytes - info.embed_bytes if info.lm_head_stored else info.other_bytes
    return ModelBytes(expert_bytes=info.expert_bytes, num_experts=info.num_experts_total or
                      info.num_experts * len(info.moe_layers), routed_bytes=info.routed_bytes,
                      moe_layers=len(info.moe_layers), top_k=info.top_k, non_expert_bytes=info.other_bytes,
                      decode_non_expert_bytes=decode_other)


def predict_checkpoint(path: str | Path, *, gpu_budget_bytes: int | None = None, device: str = "h100",
                       reserve_bytes: int | None = None) -> dict:
    """`moeflow info --gpu-budget`'s prediction as a dict: the model's bytes, the memory at the budget
    (default: the device's memory) and the decode floor per token (moeflow.predict; headers only)."""
    from .predict import DEFAULT_RESERVE_BYTES, decode_floor, device_bandwidth, predict_memory

    dev = device_bandwidth(device)
    info = checkpoint_info(path)
    mb = model_bytes(info)
    budget = dev.memory_bytes if gpu_budget_bytes is None else gpu_budget_bytes
    mem = predict_memory(mb, gpu_budget_bytes=budget,
                         reserve_bytes=DEFAULT_RESERVE_BYTES if reserve_bytes is None else reserve_bytes)
    floor = decode_floor(mb, dev, resident_fraction=mem.resident_fraction)
    resident = decode_floor(mb, dev) if mem.offloaded else floor
    return {"checkpoint": str(path), "family": info.family, "quant": info.quant, "device": dev.name,
            "device_source": dev.source, "model": dict(mb.__dict__, step_bytes=mb.step_bytes),
            "memory": mem.as_dict(), "decode_floor": floor.as_dict(),
            "decode_floor_resident": resident.as_dict()}


def format_prediction(pred: dict) -> str:
    """The human-readable lines of `predict_checkpoint`'s dict."""
    m, f, r, mb = pred["memory"], pred["decode_floor"], pred["decode_floor_resident"], pred["model"]
    lines = [
        f"budget          {_human(m['gpu_budget_bytes'])} on {pred['device']} ({pred['device_source']})",
        f"reserve         {_human(m['reserve_bytes'])} (KV cache, activations, workspace: an allowance)",
        f"GPU at budget   {_human(m['gpu_bytes'])}: non-expert {_human(m['non_expert_bytes'])} + "
        f"{m['slots']} of {mb['num_experts']} experts {_human(m['resident_expert_bytes'])} + reserve",
        f"host offloaded  {_human(m['offloaded_expert_bytes'])}"
        + (f" ({1 - m['resident_fraction']:.1%} of the experts, pinned)" if m["offloaded"] else " (all experts fit)"),
        f"read / token    {_human(f['step_bytes'])} at batch 1 (non-expert read + {mb['moe_layers']} x "
        f"K={mb['top_k']} experts, stored bytes)",
        f"decode floor    {f['floor_s'] * 1e3:.4g} ms/token ({f['tokens_per_s']:.4g} tokens/s): HBM "
        f"{f['hbm_s'] * 1e3:.4g} ms at {f['hbm_bytes_per_s'] / 1e12:.2f} TB/s",
    ]
    if m["offloaded"]:
        lines[-1] += (f" + PCIe {f['pcie_s'] * 1e3:.4g} ms for {f['expected_misses']:.2f} expected misses "
                      f"({_human(f['miss_bytes'])}) at {f['pcie_bytes_per_s'] / 1e9:.1f} GB/s")
        lines.append(f"                hit rate assumed = resident fraction {m['resident_fraction']:.3f} "
                     f"(uniform routing); all resident: {r['floor_s'] * 1e3:.4g} ms/token")
    return "\n".join(lines)


def _quant_format(config) -> str | None:
    """A one-line description of the checkpoint's quantized expert format, or None (plain weights)."""
    from .quant.spec import quant_spec_from_hf

    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    spec = quant_spec_from_hf(qc)  # ValueError naming the field for a format moeflow cannot read
    if spec is None:
        return None
    stored = {"fp8_block": "float8_e4m3fn", "mxfp4": "packed E2M1 (uint8, 2 a byte)",
              "nvfp4": "packed E2M1 (uint8, 2 a byte)"}[spec.format]
    bn, bk = spec.block
    return (f"{spec.format}: {stored}, {bn}x{bk} blocks of {str(spec.scale_dtype).removeprefix('torch.')} "
            f"scales, activations {spec.activation_scheme}")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_info(info: CheckpointInfo) -> str:
    s = info.router
    lines = [
        f"checkpoint      {info.path}",
        f"family          {info.family}",
        f"routing         {s.score_fn}, K={s.top_k} of E={s.num_experts}"
        + (f" (+{s.num_zero_experts} zero experts)" if s.num_zero_experts else "")
        + (f", groups {s.topk_group}/{s.n_group}" if s.n_group > 1 else "")
        + (", bias" if s.use_bias else "")
        + (", renorm" if s.renorm else "")
        + (f", x{s.scaling_factor:g}" if s.scaling_factor != 1.0 else ""),
        f"layers          {info.num_layers} ({len(info.moe_layers)} MoE: {_ranges(info.moe_layers)})",
        f"experts stored  {info.quant or 'plain floating weights'}",
        f"expert bytes    {_human(info.expert_bytes)} each, {_human(info.routed_bytes)} routed in all",
        f"other bytes     {_human(info.other_bytes)} (attention, embeddings, routers, shared experts)",
        f"active / token  {_human(info.active_bytes_per_token)}",
        f"GPU, resident   {_human(info.total_bytes)}",
    ]
    if info.slots is not None:
        lines.append(f"GPU, offloaded  {_human(info.offload_bytes)} with a cache of {info.slots} expert slots")
    return "\n".join(lines)


def _ranges(ids: tuple[int, ...]) -> str:
    out, start, prev = [], None, None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(out)


def encode_prompt(path: Path, prompt: str | bytes, vocab_size: int):
    """int64 [1, N] token ids for `prompt`: the checkpoint's tokenizer if it ships one, else UTF-8 bytes.

    bytes are used as they are by a byte-level model, decoded as UTF-8 for a tokenizer.
    """
    import torch

    data = prompt if isinstance(prompt, bytes) else prompt.encode("utf-8")
    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.is_file() and "ByT5Tokenizer" in tok_cfg.read_text():
        # Byte-level (the embedded model): pad 0, eos 1, unk 2, byte b -> b + 3.
        return torch.tensor([[b + 3 for b in data]], dtype=torch.long).reshape(1, -1)
    if (path / "tokenizer.json").is_file() or tok_cfg.is_file():
        from transformers import AutoTokenizer

        text = data.decode("utf-8", errors="replace")
        return AutoTokenizer.from_pretrained(str(path))(text, return_tensors="pt").input_ids
    if vocab_size < 256:
        raise ValueError(f"{path}: no tokenizer and vocab_size={vocab_size} < 256, cannot byte-encode the prompt")
    return torch.tensor([list(data)], dtype=torch.long).reshape(1, -1)


def route_prompt(path: str | Path, prompt: str, *, max_tokens: int | None = None) -> str:
    """Run the model on the prompt and tabulate, per MoE layer, each token's experts and the load.

    max_tokens: route only the first N tokens (said in the first line of the table);
    None routes the whole prompt. A prompt longer than the model's context
    (max_position_embeddings) is refused rather than cut.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from .hf import patch_model
    from .layer import MoELayer

    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens < 1):
        raise ValueError(f"--max-tokens={max_tokens!r}: expected an int >= 1 (tokens of the prompt to route)")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"--prompt={prompt!r}: expected a non-empty text to route")
    root = Path(path)
    # Headers only: config.json, the family, weights present and matching the config, before
    # transformers loads (or silently re-initialises) anything.
    checkpoint_info(root)
    text_cfg = load_config(root).get_text_config()
    ids = encode_prompt(root, prompt, text_cfg.vocab_size)
    n_prompt = ids.shape[1]
    if n_prompt == 0:
        raise ValueError(f"--prompt={prompt!r}: the tokenizer gives 0 tokens, expected at least one")
    if max_tokens is not None:
        ids = ids[:, :max_tokens]
    check_context(text_cfg, ids.shape[1], "--prompt")
    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32)
    model.eval()
    patch_model(model)
    with torch.no_grad():
        model(input_ids=ids)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    toks = ids[0].tolist()
    shown = f"{len(toks)} tokens" if len(toks) == n_prompt else \
        f"{len(toks)} tokens (first {len(toks)} of the prompt's {n_prompt}, --max-tokens {max_tokens})"
    lines = [f"{shown}, {len(layers)} MoE layers; rows: layer, columns: tokens; cell: expert ids"]
    for layer in layers:
        r = layer.last_routing
        ids_TK = r.ids_TK.cpu()
        cells = ["/".join(str(int(e)) for e in row) for row in ids_TK]
        E = layer.config.num_experts
        load = torch.bincount(ids_TK.flatten().long().clamp(max=E), minlength=E + 1)[:E]
        balance = float(load.max()) / max(1e-9, float(load.float().mean()))
        lines.append(f"L{layer.layer_idx:<3} " + " ".join(f"{c:>7}" for c in cells))
        lines.append(f"     load {load.tolist()}  max/mean={balance:.2f}")
    return "\n".join(lines)


def check_context(text_config, n_tokens: int, name: str, hint: str | None = None) -> None:
    """PromptTooLongError when n_tokens exceed the model's context (max_position_embeddings), if it has one.

    A position past the context is no error in torch (RoPE extrapolates): the routing
    shown would be of positions the model never saw, so the CLI refuses instead.
    """
    context = getattr(text_config, "max_position_embeddings", None)
    if context is not None and n_tokens > context:
        raise PromptTooLongError(
            f"{name}: {n_tokens} tokens exceed the model's context of {context} (max_position_embeddings "
            f"in config.json)",
            hint or f"shorten the prompt, or pass --max-tokens {context} to route its first {context} tokens")


class PromptTooLongError(ValueError):
    """More tokens than the model's context; `hint` says what to do instead."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint
