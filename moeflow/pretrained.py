"""moeflow.from_pretrained: a checkpoint directory to a generating transformers model, experts as stored.

    model = moeflow.from_pretrained("path/to/gpt-oss-120b")          # MXFP4 experts stay MXFP4
    out = model.generate(ids, max_new_tokens=64)

Every MoE block runs moeflow (`patch_model`) on experts read by moeflow's checkpoint reader
in the checkpoint's stored format (bf16 / fp16 / fp32, FP8 block, MXFP4, NVFP4: never
dequantized); the rest of the model is transformers' own modules. Order of work:

1. headers only: the index and every shard's header (a missing shard is a CheckpointError),
   config.json (ConfigError), the quantization config (an unknown method is a
   CheckpointError), every MoE layer's strict key plan (`moeflow.checkpoint.plan_layer`: a
   missing / unexpected key, a wrong shape or dtype, a scale grid that does not match its
   weight), and every other tensor against the model skeleton's parameter of that name.
2. the skeleton: transformers builds the model from its config with every parameter on the
   meta device (no memory; buffers such as RoPE tables are computed as usual).
3. tensor by tensor from the memory-mapped shards straight to their place: dense weights to
   `device` (FP8-block / NVFP4 dense weights dequantized there to `dtype`), each MoE layer's
   experts to `device`, or to pinned host memory when `offload` is given. A progress bar
   (tqdm when installed, else one line per layer) counts the bytes.
4. `patch_model(model, expert_weights=...)` installs the layers (expert parallelism and
   offload are stages of the same layers).

Why not transformers' `from_pretrained` with a registered quantizer
(`register_quantization_config` / `register_quantizer`) or `experts_implementation=`: the
quantizer hooks (`_process_model_before_weight_loading`, `create_quantized_param`, weight
conversions) are private, differ between transformers 5.17 and 5.24, and run per parameter
of transformers' own experts modules, whose shapes are the dequantized ones; the per-expert
-> fused key conversions of released checkpoints (mixtral's w1/w3/w2, DeepSeek's
experts.{e}.*) have no public hook that would take scale tensors along. `experts_implementation`
chooses the forward of transformers' experts modules, but their parameters are still
allocated and loaded at the dequantized size (MXFP4 without the hub `kernels` package:
bf16). So the skeleton and the non-expert weights are transformers', the expert bytes
moeflow's reader's.

Legend: E experts, L experts on this rank, H hidden.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import nn

__all__ = ["from_pretrained", "LoadReport"]


class LoadReport:
    """What from_pretrained read: bytes per kind, the stored format, the patch report, wall seconds."""

    def __init__(self) -> None:
        self.format: str = "unquantized"
        self.expert_bytes = 0  # stored bytes of the routed experts read (this rank's)
        self.dense_bytes = 0  # bytes of everything else as loaded (dequantized dense weights at `dtype`)
        self.offloaded_bytes = 0  # expert bytes placed in host memory
        self.seconds = 0.0  # reading, placing and patching (not the warm-up)
        self.patch = None  # moeflow.PatchReport
        self.warmup = None  # moeflow.warming.WarmupReport (its .seconds: the kernels' compile at load)

    def __repr__(self) -> str:
        gib = 2 ** 30
        return (f"LoadReport(format={self.format!r}, experts={self.expert_bytes / gib:.3f} GiB, "
                f"dense={self.dense_bytes / gib:.3f} GiB, offloaded={self.offloaded_bytes / gib:.3f} GiB, "
                f"{self.seconds:.1f} s" + (f", warm-up {self.warmup.seconds:.1f} s" if self.warmup else "") + ")")


class _Progress:
    """Bytes loaded: a tqdm bar when tqdm is installed, else one plain line per MoE layer (stderr)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.bar = total, 0, None
        self.enabled = enabled
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                desc="moeflow.from_pretrained")

    def update(self, n: int, what: str | None = None) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and what is not None:
            print(f"moeflow.from_pretrained: {what}: {self.done / 2 ** 30:.2f} / {self.total / 2 ** 30:.2f} GiB",
                  file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters registered inside are moved to the meta device as they are registered (before any
    init touches their memory); buffers stay real, so tables computed at construction (RoPE
    inv_freq) are right. transformers' own meta init (`get_init_context`) would leave those
    buffers on meta for its private loader to recompute."""
    orig = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        orig(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = orig  # type: ignore[method-assign]


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    mod_path, _, leaf = name.rpartition(".")
    return (root.get_submodule(mod_path) if mod_path else root), leaf


def _put(root: nn.Module, name: str, t: torch.Tensor) -> None:
    """Set parameter or buffer `name` (dotted, from root) to `t` (a Parameter without grad for parameters)."""
    mod, leaf = _owner(root, name)
    old = _tensor_at(mod, leaf)
    if old is None:
        raise AttributeError(f"{name}: no parameter or buffer of that name")
    # nn.Module.__setattr__ replaces a registered parameter / buffer (a buffer keeps its persistence)
    setattr(mod, leaf, nn.Parameter(t, requires_grad=False) if isinstance(old, nn.Parameter) else t)


def _tensor_at(mod: nn.Module, leaf: str) -> torch.Tensor | None:
    """The module's own parameter or buffer `leaf`, None when it has neither."""
    own = dict(mod.named_parameters(recurse=False))
    own.update(mod.named_buffers(recurse=False))
    return own.get(leaf)


def _resolve_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError) as exc:
        raise TypeError(f"device={device!r}: expected a torch.device or a name such as 'cuda' / 'cpu'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: CUDA is not available here; expected 'cpu' or None")
    return dev


def _dense_plan(index, model: nn.Module, moe_owned: tuple[str, ...], block_paths: tuple[str, ...], qspec,
                directory: str) -> tuple[list[tuple[str, str, dict[str, str]]], list[str]]:
    """[(checkpoint key, model name, scale keys)] of every tensor outside the MoE blocks, checked against the
    skeleton (shapes; quantized dense weights by their scale grids), and the skeleton names nothing fills.

    Raises CheckpointError naming the key: a tensor the model has no place for, a shape that differs, a
    quantized dense weight without its scales or with a scale grid that does not match.
    """
    from .checkpoint.index import CheckpointError
    from .quant.checkpoint import scale_keys

    names = dict(model.named_parameters(remove_duplicate=False))
    names.update({n: b for n, b in model.named_buffers(remove_duplicate=False)})
    # MoE-block parameters are filled from the layer loads (the experts' own are dropped).
    wanted = {n for n in names if not n.startswith(block_paths)}
    scale_of: dict[str, dict[str, str]] = {}
    if qspec is not None and qspec.format in ("fp8_block", "nvfp4"):
        for key in index.keys():
            if key.endswith(".weight") and not key.startswith(moe_owned):
                sk = scale_keys(qspec, key, fused=False)
                if sk["scale"] in index:
                    scale_of[key] = sk
    scale_names = {k for sk in scale_of.values() for k in sk.values()}
    # what transformers itself skips (DeepSeek-V3's multi-token-prediction layer past num_hidden_layers)
    ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    plan = []
    for key in index.keys():
        if key.startswith(moe_owned) or key in scale_names or any(p.search(key) for p in ignored):
            continue
        if key not in names:
            raise CheckpointError(f"{directory}: unexpected key {key}: the {type(model).__name__} built from "
                                  "config.json has no parameter or buffer of that name", key=key)
        info, want = index.info(key), tuple(names[key].shape)
        shape = info.shape
        sk = scale_of.get(key, {})
        if not sk and names[key].is_floating_point() and (info.dtype.itemsize == 1):
            # a quantized weight whose scales are not there: a bare cast would give wrong values
            what = (f"its scale {scale_keys(qspec, key, fused=False)['scale']} is missing"
                    if qspec is not None and qspec.format in ("fp8_block", "nvfp4") and key.endswith(".weight")
                    else "the checkpoint's quantization_config names no format with scales for it")
            raise CheckpointError(f"{directory}: {key}: stored as {info.dtype} (quantized) but {what}", key=key)
        if sk:
            n, k = shape[0], shape[1] * qspec.pack
            shape = (n, k)
            grid = (qspec.scale_grid(n, k) if qspec.format == "fp8_block" else (n, k // 16))
            for skey in sk.values():
                if skey not in index:
                    raise CheckpointError(f"{directory}: {key} is quantized but {skey} is missing", key=skey)
            got = index.info(sk["scale"]).shape
            if tuple(got) != tuple(grid):
                raise CheckpointError(f"{directory}: {sk['scale']}: shape {list(got)}, expected {list(grid)} (the "
                                      f"{qspec.format} scale grid of {key} {list(shape)}, block {qspec.block})",
                                      key=sk["scale"])
        if tuple(shape) != want:
            raise CheckpointError(f"{directory}: {key}: shape {list(shape)}, expected {list(want)} (the model's "
                                  "parameter of that name)", key=key)
        plan.append((key, key, sk))
    loaded = {k for k, _, _ in plan}
    missing = sorted(n for n in wanted if n not in loaded)
    return plan, missing


def _read_dense(index, key: str, sk: dict[str, str], qspec, *, device: torch.device, dtype: torch.dtype
                ) -> torch.Tensor:
    """One dense tensor on `device`: floating tensors cast to `dtype`, quantized weights dequantized to it."""
    from .quant.formats import dequantize_fp8_block, dequantize_nvfp4

    t = index.get(key, device=device)
    if not sk:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
    s = index.get(sk["scale"], device=device)
    if qspec.format == "fp8_block":
        return dequantize_fp8_block(t, s, qspec.block, dtype)
    s2 = index.get(sk["scale_2"], device=device).reshape(())
    return dequantize_nvfp4(t, s, s2, dtype)


def _pinned_copy(w: Any, pin: bool) -> Any:
    """The ExpertWeights `w` (CPU) with every tensor in page-locked host memory (one copy each)."""
    from .config import ExpertWeights

    def host(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or not pin:
            return t
        dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return dst.copy_(t)

    fields = {n: host(getattr(w, n)) for n in ExpertWeights.TENSOR_FIELDS}
    return ExpertWeights(**fields, layout=w.layout, interleaved=w.interleaved, quant=w.quant)


def _fill_block(block: nn.Module, fam, lw, *, device: torch.device, dtype: torch.dtype) -> int:
    """Put one loaded layer's router / shared-expert tensors into the HF block; returns the bytes placed."""
    from .hf.util import attr_path

    nbytes = 0

    def put(path: str | None, t: torch.Tensor | None, cast: bool = True) -> None:
        nonlocal nbytes
        if path is None or t is None:
            return
        mod, leaf = _owner(block, path)
        old = _tensor_at(mod, leaf)
        # the skeleton's dtype (transformers keeps some router tensors in fp32)
        want = old.dtype if old is not None and old.is_floating_point() and cast else t.dtype
        t = t.to(device=device, dtype=want if t.is_floating_point() else t.dtype)
        _put(block, path, t)
        nbytes += t.numel() * t.element_size()

    h = fam.hf
    put(h.router_weight, lw.router_weight_EH)
    put(h.router_bias, lw.router_bias_E)
    put(h.selection_bias, lw.selection_bias_E)
    put(h.expert_scale, lw.expert_scale_E)
    put(h.prenorm_weight, lw.prenorm_weight_H)
    put(h.hash_table, lw.hash_table_VK, cast=False)
    put(h.shared_gate, lw.shared_gate_weight_1H)
    if lw.shared is not None:
        if h.shared is None:
            raise ValueError(f"{fam.name}: the checkpoint has a shared expert but the HF block has none")
        shared = attr_path(block, h.shared)
        prefix = h.shared + "."
        for name, t in (("gate_proj.weight", lw.shared.gate_IH), ("up_proj.weight", lw.shared.up_IH),
                        ("down_proj.weight", lw.shared.down_HI)):
            if not hasattr(shared, name.split(".")[0]):
                raise ValueError(f"{fam.name}: shared expert module {type(shared).__name__} has no {name}")
            put(prefix + name, t)
    return nbytes


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    experts: str = "auto",
    offload: Any = None,
    ep_group: Any = None,
    ep_mode: str = "all_to_all",
    ep_options: dict[str, Any] | None = None,
    kernel_options: Any = None,
    layer_graphs: bool | dict[str, Any] = True,
    progress: bool = True,
    warmup_tokens: int | None = 8192,
    **hf_kwargs: Any,
) -> nn.Module:
    """Load a Hugging Face MoE checkpoint with every MoE block on moeflow, experts in their stored format.

    Args:
        path: a checkpoint directory (config.json + safetensors shards / index).
        dtype: the activations' dtype (and of the non-expert weights; unquantized experts are
            cast to it, quantized ones stay as stored): a floating torch.dtype or its name.
            None: the checkpoint's config dtype, else float32.
        device: where the model runs; None: CUDA when available, else CPU.
        experts: the experts implementation of every block ("auto", "reference", "grouped", "triton").
        offload: a moeflow.OffloadConfig: the experts are read into (pinned, on CUDA) host memory
            and served through its device slot cache. With store "auto" the host copy read here
            is the store itself (no second copy: store "model").
        ep_group / ep_mode / ep_options: expert parallelism (moeflow.patch_model's arguments);
            each rank reads only its experts (ep_options' placement, default equal ranges).
        kernel_options, layer_graphs: as moeflow.patch_model.
        progress: a progress bar over the bytes read (tqdm, else a line per MoE layer on stderr).
        warmup_tokens: on CUDA, compile the Triton kernels for every token count up to this many
            tokens per forward before returning (`moeflow.warmup`): a prompt of a fresh length then
            never waits for a JIT compile. None or 0: no warm-up (the first forward of each new
            token-count bucket compiles).
        **hf_kwargs: passed to transformers' `AutoModelForCausalLM.from_config` (e.g.
            attn_implementation="sdpa", trust_remote_code=...).

    Returns:
        the transformers CausalLM in eval mode, patched; `model.moeflow_load` is a LoadReport
        (bytes read, seconds, the PatchReport).

    Raises:
        CheckpointError / ConfigError (ValueErrors naming the key or field) for a missing shard,
        key or scale, a shape or scale grid that does not match, an unknown quantization method;
        TypeError / ValueError for bad arguments. All of them before any tensor data is read
        or any device memory is taken.
    """
    import time

    from .checkpoint.files import check_layer_claims, hf_config, layer_ids, read_config_json
    from .checkpoint.index import CheckpointError, CheckpointIndex
    from .checkpoint.loader import _model_dtype, _target_dtype, load_moe_layer, moe_layer_indices, plan_layer
    from .families import family_for
    from .hf.patch import EP_MODES, patch_model
    from .offload.config import OffloadConfig
    from .quant.checkpoint import quant_spec_of
    from .routing.families import text_config

    t0 = time.perf_counter()
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a checkpoint directory (str or os.PathLike), got {type(path).__name__}")
    directory = os.fspath(path)
    if not os.path.isdir(directory):
        raise CheckpointError(f"from_pretrained: path={directory!r} is not a directory (expected a checkpoint "
                              "directory with config.json and safetensors shards)")
    act_dtype = _target_dtype(dtype)
    dev = _resolve_device(device)
    if offload is not None and not isinstance(offload, OffloadConfig):
        raise TypeError(f"offload: expected a moeflow.OffloadConfig or None, got {type(offload).__name__}")
    if ep_mode not in EP_MODES:
        raise ValueError(f"ep_mode={ep_mode!r}: expected one of {EP_MODES}")
    if not isinstance(experts, str):
        raise TypeError(f"experts: expected a str such as 'auto', got {type(experts).__name__}")
    if warmup_tokens is not None and (isinstance(warmup_tokens, bool) or not isinstance(warmup_tokens, int)
                                      or warmup_tokens < 0):
        raise ValueError(f"warmup_tokens={warmup_tokens!r}: expected None or an int >= 0")

    # ---- 1. headers only
    index = CheckpointIndex(directory)
    for key in index.keys():
        index.info(key)  # opens every shard's header: a missing or unreadable shard is named here
    config_path = os.path.join(directory, "config.json")
    if not os.path.lexists(config_path):
        raise CheckpointError(f"from_pretrained: no config.json in {directory!r}")
    check_layer_claims(read_config_json(config_path), layer_ids(index.keys()), config_path)
    config = hf_config(directory)
    tc = text_config(config)
    qspec = quant_spec_of(config, directory)
    fam = family_for(getattr(tc, "model_type", None) or config.model_type, missing_ok=True)
    if fam is None or fam.checkpoint is None or fam.hf is None:
        raise CheckpointError(f"{config_path}: model_type={config.model_type!r}: moeflow has no checkpoint and "
                              "transformers description for it (moeflow.families)", key="model_type")
    if act_dtype is None:
        act_dtype = _model_dtype(tc) or _model_dtype(config) or torch.float32
    moe_ids = moe_layer_indices(index, config)
    plans = {i: plan_layer(index, config, i) for i in moe_ids}
    moe_owned = tuple(o for p in plans.values() for o in p.owned)

    # expert parallelism: which experts this rank reads
    mine: list[int] | None = None
    if ep_group is not None:
        import torch.distributed as dist

        from .parallel.ep_parts import resolve_placement

        if not dist.is_available() or not isinstance(ep_group, dist.ProcessGroup):
            raise TypeError(f"ep_group: expected a torch.distributed ProcessGroup, got {type(ep_group).__name__}")
        E = next(iter(plans.values())).dims.E
        placement = resolve_placement((ep_options or {}).get("placement"), E, dist.get_world_size(ep_group))
        mine = list(placement.experts_of(dist.get_rank(ep_group)))
        ep_options = {**(ep_options or {}), "placement": placement}

    # ---- 2. the skeleton (parameters on meta)
    from transformers import AutoModelForCausalLM

    # A copy: from_config writes the activations' dtype into the config it is given, and the
    # expert reader below checks unquantized experts against the checkpoint's own dtype.
    skel_config = copy.deepcopy(config)
    if getattr(config, "quantization_config", None) is not None:
        del skel_config.quantization_config  # transformers would build its own quantized experts
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(skel_config, dtype=act_dtype, **hf_kwargs)
    model.eval()
    blocks = {}
    for name, module in model.named_modules():
        bt = fam.hf.block_type()
        if bt is not None and isinstance(module, bt):
            idx = int(name.split("layers.")[-1].split(".")[0])
            blocks[idx] = (name, module)
    if sorted(blocks) != sorted(moe_ids):
        raise CheckpointError(f"{directory}: the checkpoint's MoE layers {moe_ids} differ from the model's MoE blocks "
                              f"{sorted(blocks)}")
    block_paths = tuple(f"{name}." for name, _ in blocks.values())
    dense, missing = _dense_plan(index, model, moe_owned, block_paths, qspec, directory)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    tied |= {"lm_head.weight"} if getattr(tc, "tie_word_embeddings", False) else set()
    missing = [m for m in missing if m not in tied and _is_meta(model, m)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{directory}: missing key {missing[0]}{more} (a parameter of the model built from "
                              "config.json that no checkpoint tensor fills)", key=missing[0])

    # ---- 3. tensor by tensor
    report = LoadReport()
    report.format = qspec.format if qspec is not None else "unquantized"
    pin = offload is not None and torch.cuda.is_available()
    expert_dev = torch.device("cpu") if offload is not None else dev
    total = sum(index.info(k).nbytes for k in index.keys())
    bar = _Progress(total, progress)
    try:
        for key, name, sk in dense:
            t = _read_dense(index, key, sk, qspec, device=dev, dtype=_param_dtype(model, name, act_dtype))
            _put(model, name, t)
            nb = index.info(key).nbytes + sum(index.info(s).nbytes for s in sk.values())
            report.dense_bytes += t.numel() * t.element_size()
            bar.update(nb)
        bar.update(0, "dense weights")
        index.close()  # unmaps the shards read so far: host RSS holds no file pages between layers
        given = {}
        for i in moe_ids:
            bname, block = blocks[i]
            # dtype None: quantized experts stay as stored (an unquantized layer is cast below)
            lw = load_moe_layer(index, config, i, experts=mine, device=expert_dev)
            w = lw.experts
            if w.quant is None and w.dtype != act_dtype:
                w = _cast(w, act_dtype)
            if offload is not None:
                w = _pinned_copy(w, pin)
                report.offloaded_bytes += w.nbytes
            report.expert_bytes += w.nbytes
            report.dense_bytes += _fill_block(block, fam, lw, device=dev, dtype=act_dtype)
            ex = block.get_submodule(fam.hf.experts)
            for pname in [n for n, p in ex.named_parameters(recurse=False) if p.device.type == "meta"]:
                delattr(ex, pname)  # the experts live in the MoELayer (their stored format)
            given[i] = w
            del lw, w  # (offload: this layer's unpinned read goes before the next layer's is made)
            index.close()
            bar.update(sum(index.info(k).nbytes for k in _plan_keys(index, plans[i])), f"layer {i}")
    finally:
        bar.close()
    if tied:
        model.tie_weights()
    for name, b in list(model.named_buffers()):
        if b.device != dev:
            _put(model, name, b.to(dev))
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise CheckpointError(f"{directory}: {left[0]} was not filled by any checkpoint tensor", key=left[0])

    # ---- 4. moeflow on every block
    off = offload
    if offload is not None and offload.store == "auto" and not offload.sync_free:
        off = replace(offload, store="model")  # the host copy read above is the store
    report.patch = patch_model(model, experts=experts, ep_group=ep_group, ep_mode=ep_mode,
                               ep_options=ep_options if ep_group is not None else None, offload=off,
                               layer_graphs=layer_graphs, kernel_options=kernel_options, expert_weights=given)
    report.seconds = time.perf_counter() - t0
    if warmup_tokens and dev.type == "cuda":
        from .warming import warmup

        report.warmup = warmup(model, max_tokens=warmup_tokens, progress=progress)
    model.__dict__["moeflow_load"] = report
    return model


def _is_meta(model: nn.Module, name: str) -> bool:
    mod, leaf = _owner(model, name)
    t = _tensor_at(mod, leaf)
    return t is not None and t.device.type == "meta"


def _param_dtype(model: nn.Module, name: str, default: torch.dtype) -> torch.dtype:
    mod, leaf = _owner(model, name)
    t = _tensor_at(mod, leaf)
    return t.dtype if t is not None and t.is_floating_point() else default


def _cast(w: Any, dtype: torch.dtype) -> Any:
    """Unquantized ExpertWeights cast to the activations' dtype (the kernels run one dtype)."""
    from .config import ExpertWeights

    fields = {n: (t.to(dtype) if t is not None else None) for n in ExpertWeights.TENSOR_FIELDS[:4]
              for t in [getattr(w, n)]}
    return ExpertWeights(**fields, layout=w.layout, interleaved=w.interleaved)


def _plan_keys(index, plan) -> list[str]:
    return sorted({k for o in plan.owned for k in index.keys_with_prefix(o)})
