"""patch_model: run every MoE block of a Hugging Face model through moeflow.

    model = AutoModelForCausalLM.from_pretrained(path)
    report = moeflow.patch_model(model)          # experts="auto" | "reference" | "grouped" | "triton"
    print(report)

Each MoE block is found by its HF class (the family table `moeflow.families`, field
`hf`), a `MoELayer` is built on its own tensors (shared by reference, never copied) and
the block's class is swapped for a `MoEBlock` kind (moeflow.hf.blocks). Expert
parallelism (`ep_group`) picks the layers' dispatcher and offload (`offload`) their
expert source: both are stages of the same layer, so they compose.

An MoE-looking module (one with an `experts` child, or an `...Experts` class) that no
family covers raises ValueError naming it, before anything is changed: nothing is
silently left unpatched. The routing spec of each block comes from
`moeflow.routing.families.router_spec_from_hf`.

Legend: B batch, S sequence, T = B*S tokens, H hidden, E routed experts, Z zero experts,
K picks per token, I intermediate per expert.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..config import ExpertWeights, MoEConfig
from ..experts.options import KernelOptions
from ..families import Family
from ..layer import MoELayer
from ..offload.attach import attach_offload, check_offload
from ..offload.config import OffloadConfig
from ..parallel.ep import shard_layer
from ..parallel.ep_parts import check_ep_fingerprint
from ..quant.hf import experts_from_hf_module
from ..routing.families import router_spec_from_hf, text_config
from ..routing.monitor import RoutingMonitor
from ..routing.spec import RouterSpec
from .blocks import BlockState, MoEBlock, block_kinds, patched_class
from .graphs import enable_layer_graphs
from .patched import check_routing, moe_layers, patched_modules
from .util import attr_path as _attr
from .util import available_hf_families, hf_families

__all__ = ["PatchReport", "PatchedBlock", "patch_model", "unpatch_model", "moe_layers", "check_routing"]

EP_MODES = ("all_to_all", "all_reduce")


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
    runner: str  # "MoELayer": every block runs one MoELayer (EP and offload are its stages)
    dispatcher: str = "local"  # "local" | "all_to_all" | "all_reduce"
    source: str = "resident"  # "resident" | "offload"


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


def _quantized_experts(experts: nn.Module) -> bool:
    """A transformers quantized experts module (FP8Experts, Mxfp4GptOssExperts), by its scale tensors."""
    return hasattr(experts, "gate_up_proj_scale_inv") or hasattr(experts, "gate_up_proj_precision_config")


def _sources(fam: Family, block: nn.Module, spec: RouterSpec, own_experts: bool = True
             ) -> dict[str, torch.Tensor | None]:
    """The block's tensors by MoELayer storage name (read fresh each call). Quantized experts, and
    experts given to patch_model (own_experts False), are held by the layer: none are listed here."""
    experts = _attr(block, fam.hf.experts)
    if not own_experts or _quantized_experts(experts):
        quantized = {"gate_up": None, "down": None, "gate_up_bias": None, "down_bias": None}
    else:
        quantized = {}
    out = {
        "router_weight": _attr(block, fam.hf.router_weight),
        "router_bias": _attr(block, fam.hf.router_bias),
        "selection_bias": _attr(block, fam.hf.selection_bias) if spec.use_bias else None,
        "hash_table": _attr(block, fam.hf.hash_table) if spec.hash_routing else None,
        "expert_scale": _attr(block, fam.hf.expert_scale),
        "prenorm_weight": _attr(block, fam.hf.prenorm_weight),
        "gate_up": None if quantized else experts.gate_up_proj,
        "down": None if quantized else experts.down_proj,
        "gate_up_bias": experts.gate_up_proj_bias if fam.expert_bias and not quantized else None,
        "down_bias": experts.down_proj_bias if fam.expert_bias and not quantized else None,
        "shared_gate_weight": _attr(block, fam.hf.shared_gate),
    }
    out.update(quantized)
    return out


def _build_layer(fam: Family, block: nn.Module, config: Any, layer_idx: int, experts_impl: str,
                 path: str, kernel_options: KernelOptions | None = None, given: ExpertWeights | None = None,
                 ep: tuple[Any, str, dict[str, Any]] | None = None) -> MoELayer:
    """The block's MoELayer; `given`: its experts instead of the block's (with `ep` = (group, mode,
    options): the rank's experts only, the layer built expert-parallel around them)."""
    spec = router_spec_from_hf(config, layer_idx)
    experts = _attr(block, fam.hf.experts)
    try:
        activation, limit, alpha = fam.activation(config, experts)
    except ValueError as exc:
        raise ValueError(f"patch_model: {path} ({type(block).__name__}): {exc}") from None
    if spec.hash_routing and (fam.hf.hash_table is None or not hasattr(block.gate, "tid2eid")):
        raise ValueError(f"patch_model: {path}: the config says hash routing but the block has no tid2eid table")
    src = _sources(fam, block, spec, own_experts=given is None)
    E = spec.num_experts
    if given is not None:
        w = given
    elif _quantized_experts(experts):
        # transformers' FP8 / MXFP4 experts modules: their stored quantized tensors and scales,
        # read in place where the module's layout allows it (moeflow.quant.hf).
        try:
            w = experts_from_hf_module(experts)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"patch_model: {path} ({type(experts).__name__}): {exc}") from None
        if (w.layout, w.interleaved) != (fam.layout, fam.interleaved):
            raise ValueError(f"patch_model: {path}: quantized experts in layout {(w.layout, w.interleaved)}, "
                             f"expected {fam.name}'s {(fam.layout, fam.interleaved)}")
    else:
        gate_up, down = src["gate_up"], src["down"]
        if fam.hf.zero_expert_rows and gate_up.shape[0] != E:
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
        shared_gated=fam.hf.shared_gate is not None,
        router_prenorm_eps=float(getattr(_attr(block, fam.hf.router), "eps", 1e-6)),
    )
    dispatcher = None
    if ep is not None:
        from ..parallel.ep_parts import local_source, make_dispatcher

        group, mode, opts = ep
        dispatcher = make_dispatcher(cfg, group=group, mode=mode, **opts)
        w = local_source(dispatcher.placement, dispatcher.rank, static=opts.get("static_tokens") is not None, local=w)
    return MoELayer(
        cfg,
        router_weight_EH=src["router_weight"],
        experts=w,
        dispatcher=dispatcher,
        router_bias_E=src["router_bias"],
        selection_bias_E=src["selection_bias"],
        expert_scale_E=src["expert_scale"],
        prenorm_weight_H=src["prenorm_weight"],
        hash_table_VK=src["hash_table"],
        shared_expert=_attr(block, fam.hf.shared),
        shared_gate_weight_1H=src["shared_gate_weight"],
        experts_impl=experts_impl,
        layer_idx=layer_idx,
        kernel_options=kernel_options,
    )


def _looks_moe(module: nn.Module) -> bool:
    return "experts" in module._modules or type(module).__name__.endswith("Experts")


def _find_blocks(model: nn.Module) -> list[tuple[str, nn.Module, Family]]:
    types = [(f, f.hf.block_type()) for f in hf_families()]
    types = [(f, t) for f, t in types if t is not None]
    found = []
    for path, module in model.named_modules():
        if isinstance(module, MoEBlock):
            raise ValueError(f"patch_model: {path or type(model).__name__} is already patched "
                             "(call moeflow.hf.unpatch_model first)")
        for fam, t in types:
            if isinstance(module, t):
                if fam.hf.decoder_level and not getattr(module, "enable_moe_block", False):
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


def patch_model(
    model: nn.Module,
    *,
    experts: str = "auto",
    ep_group: Any = None,
    ep_mode: str = "all_to_all",
    ep_options: dict[str, Any] | None = None,
    offload: Any = None,
    layer_graphs: bool | dict[str, Any] = True,
    kernel_options: KernelOptions | None = None,
    expert_weights: Mapping[int, ExpertWeights] | None = None,
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
        layer_graphs: replay each MoE block's step from a CUDA graph per token count once that
            count has been seen (moeflow.hf.enable_layer_graphs; a dict passes its max_shapes /
            capture_after / max_bytes). Why on by default: a patched step is host-bound on the
            small-expert shapes (qwen3 prefill at T = 512: 1.05x HF eager, 1.57x with it, in
            one run of `python benchmarks/bench_e2e.py --shapes qwen3-30b-a3b --points prefill
            --prefill-T 512 --variants hf,auto,auto+eager`); outputs equal the eager step bit for
            bit. Steps that cannot replay run eagerly on their own (CPU, autograd, offload, expert
            parallelism, hash routing): see moeflow.layer_graphs. False: every step eager.
        kernel_options: a moeflow.KernelOptions for the fused Triton experts of every block (tma /
            pdl / fast_launch / pinned kernel variants: what a benchmark or a user may choose);
            None: the defaults. Which kernel each step then runs is the kernel plan's
            (moeflow.experts.plan; `moeflow info PATH --kernels` prints it).
        expert_weights: layer index -> the ExpertWeights each block runs instead of its own
            expert tensors (moeflow.from_pretrained passes the checkpoint's experts in their
            stored format). With ep_group: this rank's experts only (the placement's
            experts_of(rank), in that order); ep_options then takes placement / static_tokens /
            timeout_s / reduce_dtype / check_inputs / check_config.

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
    if kernel_options is not None and not isinstance(kernel_options, KernelOptions):
        raise TypeError(f"kernel_options: expected a moeflow.KernelOptions or None, got "
                        f"{type(kernel_options).__name__}")
    if ep_mode not in EP_MODES:
        raise ValueError(f"ep_mode={ep_mode!r}: expected one of {EP_MODES}")
    if ep_options is not None and (ep_group is None or not isinstance(ep_options, dict)):
        raise ValueError(f"ep_options={ep_options!r}: expected a dict, and only together with ep_group")
    if ep_group is not None:
        import torch.distributed as dist

        if not dist.is_available() or not isinstance(ep_group, dist.ProcessGroup):
            raise TypeError(f"ep_group: expected a torch.distributed ProcessGroup (e.g. dist.group.WORLD), "
                            f"got {type(ep_group).__name__}")
    if offload is not None and not isinstance(offload, OffloadConfig):
        raise TypeError(f"offload: expected an OffloadConfig, got {type(offload).__name__}")
    if not isinstance(layer_graphs, (bool, dict)):
        raise TypeError(f"layer_graphs: expected a bool or a dict of enable_layer_graphs options, "
                        f"got {type(layer_graphs).__name__}")
    graph_options = layer_graphs if isinstance(layer_graphs, dict) else {}
    if graph_options:
        from ..layer_graphs import LayerGraphs

        LayerGraphs(**graph_options)  # a bad option raises here, before the model is touched
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"patch_model: {type(model).__name__} has no .config (expected a transformers model)")
    config = text_config(config)
    blocks = _find_blocks(model)
    if not blocks:
        raise ValueError(f"patch_model: no MoE block found in {type(model).__name__} "
                         f"(model_type={getattr(config, 'model_type', None)!r})")
    # Build and check everything first: a refusal leaves the model as it was.
    plans = []
    given_all = dict(expert_weights) if expert_weights is not None else {}
    for path, block, fam in blocks:
        layer_idx = _layer_idx(path, block)
        given = given_all.get(layer_idx)
        if given is not None and ep_group is not None:
            opts = dict(ep_options or {})
            check = opts.pop("check_config", True)
            layer = _build_layer(fam, block, config, layer_idx, experts, path, kernel_options, given,
                                 ep=(ep_group, ep_mode, opts))
            if check:
                check_ep_fingerprint(layer)
        else:
            layer = _build_layer(fam, block, config, layer_idx, experts, path, kernel_options, given)
            if ep_group is not None:
                layer = shard_layer(layer, group=ep_group, mode=ep_mode, **(ep_options or {}))
        plans.append((path, block, fam, layer_idx, layer))
    layers = [layer for *_, layer in plans]
    if offload is not None:
        check_offload(layers, offload)
        # Installs the slot-cache sources on the (not yet installed) layers; the expert
        # storage shared with the model is released last, after every check passed.
        attach_offload(layers, offload)

    # One routing status flag per model forward instead of a host sync per layer. The first and
    # last patched blocks poll and flush it (moeflow.hf.blocks, moeflow.hf.op), not forward hooks on
    # the model: torch.compile of the model's __call__ (what transformers' generate compiles) makes
    # each hook a dynamo frame of its own, two more guard checks per decode step.
    monitor = RoutingMonitor()
    for layer in layers:
        layer.check_routing = "deferred"
        layer.routing_monitor = monitor
        layer.prepare_compiled()  # what a step under torch.compile keeps (moeflow.hf.op)
    model.__dict__["_moeflow_routing"] = monitor

    rows = []
    for path, block, fam, layer_idx, layer in plans:
        spec = layer.config.router
        block_class = type(block).__name__ + (".router+experts" if fam.hf.decoder_level else "")
        targets = block_kinds(fam, block)
        # One state per block, shared by gemma4's two modules (the EP stash passes between them).
        own = layer_idx not in given_all
        state = BlockState(fam, layer, (lambda b=block, f=fam, s=spec, o=own: _sources(f, b, s, o)), path)
        for module, kind in targets:
            module.__dict__["_moeflow"] = state
            module.__class__ = patched_class(kind, type(module))
        state.exposed_by = targets[-1][0]
        state.hook_handle = block.register_load_state_dict_post_hook(lambda mod, incompatible, st=state: st.resync())
        state.first_in_model = not rows
        state.last_in_model = len(rows) == len(plans) - 1
        rows.append(PatchedBlock(
            path=path or "<root>", family=fam.name, block_class=block_class,
            layer_idx=layer_idx, num_experts=spec.num_experts, num_zero_experts=spec.num_zero_experts,
            top_k=spec.top_k, impl=layer.impl_name, shared_expert=layer.shared_expert is not None,
            runner=type(layer).__name__, dispatcher=layer.dispatcher.name,
            source="offload" if offload is not None else "resident",
        ))
    if offload is not None:
        # the experts' Parameters were released to the offload store: load_state_dict writes them there
        hook = layers[0].offload.state_dict_hook([(layer, block, path) for path, block, _, _, layer in plans])
        if hook is not None:
            model.register_load_state_dict_pre_hook(hook)
    if layer_graphs is not False:
        enable_layer_graphs(model, **graph_options)
    return PatchReport(
        model_class=type(model).__name__,
        experts=experts,
        blocks=tuple(rows),
        ep_mode=ep_mode if ep_group is not None else None,
        offload=offload is not None,
        families=tuple(dict.fromkeys(r.family for r in rows)),
    )


def unpatch_model(model: nn.Module) -> int:
    """Give every patched module its HF class back; returns how many modules were restored.

    Refused (ValueError) for a model whose experts were offloaded (their storage is gone).
    """
    mods = patched_modules(model)
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
    model.__dict__.pop("_moeflow_routing", None)
    return len(mods)

