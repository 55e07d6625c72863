"""`moeflow info` and `moeflow route`: look at a checkpoint without (info) or with (route) its weights.

`checkpoint_info` reads config.json and the safetensors headers only (the JSON
header at the start of each file): no tensor is loaded.
"""

from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5}
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensor table of one .safetensors file: name -> {dtype, shape, data_offsets} (no data read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
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

    @property
    def total_bytes(self) -> int:
        return self.routed_bytes + self.other_bytes

    @property
    def offload_bytes(self) -> int | None:
        """GPU bytes with experts offloaded to a cache of `slots` whole experts."""
        return None if self.slots is None else self.other_bytes + self.slots * self.expert_bytes


def _load_config(path: Path):
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def checkpoint_info(path: str | Path, *, slots: int | None = None) -> CheckpointInfo:
    """Describe a checkpoint directory from config.json and safetensors headers."""
    from .routing.families import family_of, router_spec_from_hf

    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory (expected a checkpoint dir with config.json)")
    config = _load_config(root)
    family = family_of(config)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {root}")
    routed_by_layer: dict[int, int] = defaultdict(int)
    other = 0
    for f in files:
        for name, entry in read_safetensors_header(f).items():
            m = _LAYER_RE.search(name)
            is_routed = ".experts." in name and "shared" not in name
            if m and is_routed:
                routed_by_layer[int(m.group(1))] += _tensor_bytes(entry)
            else:
                other += _tensor_bytes(entry)
    moe_layers = tuple(sorted(routed_by_layer))
    if not moe_layers:
        raise ValueError(f"{root}: no routed expert tensors ('.experts.' in the name) found")
    spec = router_spec_from_hf(config, moe_layers[0])
    E, K = spec.num_experts, spec.top_k
    expert_bytes = routed_by_layer[moe_layers[0]] // E
    routed = sum(routed_by_layer.values())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if slots is not None and (not isinstance(slots, int) or slots < K):
        raise ValueError(f"--slots={slots}: expected an int >= K={K} (one token's experts of one layer)")
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
    )


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


def encode_prompt(path: Path, prompt: str, vocab_size: int):
    """Token ids for `prompt`: the checkpoint's tokenizer if it ships one, else UTF-8 bytes."""
    import torch

    tok_cfg = path / "tokenizer_config.json"
    if tok_cfg.is_file() and "ByT5Tokenizer" in tok_cfg.read_text():
        # Byte-level (the embedded model): pad 0, eos 1, unk 2, byte b -> b + 3.
        return torch.tensor([[b + 3 for b in prompt.encode("utf-8")]], dtype=torch.long)
    if (path / "tokenizer.json").is_file() or tok_cfg.is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))(prompt, return_tensors="pt").input_ids
    data = list(prompt.encode("utf-8"))
    if vocab_size < 256:
        raise ValueError(f"{path}: no tokenizer and vocab_size={vocab_size} < 256, cannot byte-encode the prompt")
    return torch.tensor([data], dtype=torch.long)


def route_prompt(path: str | Path, prompt: str, *, max_tokens: int = 32) -> str:
    """Run the model on the prompt and tabulate, per MoE layer, each token's experts and the load."""
    import torch
    from transformers import AutoModelForCausalLM

    from .hf import patch_model
    from .layer import MoELayer

    root = Path(path)
    _load_config(root)
    model = AutoModelForCausalLM.from_pretrained(str(root), dtype=torch.float32)
    model.eval()
    patch_model(model)
    ids = encode_prompt(root, prompt, model.config.get_text_config().vocab_size)[:, :max_tokens]
    with torch.no_grad():
        model(input_ids=ids)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    toks = ids[0].tolist()
    lines = [f"{len(toks)} tokens, {len(layers)} MoE layers; rows: layer, columns: tokens; cell: expert ids"]
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
