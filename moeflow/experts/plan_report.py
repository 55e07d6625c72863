"""The kernel plan of a checkpoint's MoE layers per T, before loading any weight (`moeflow info PATH --kernels`).

The shapes come from config.json (through the family record's dims), the stored format from its
quantization_config; the device is the one at hand (its name, compute capability and SM count) or a
named one (`--device h100`: NAMED_DEVICES). Weights are assumed stored as the loader places them
(contiguous, aligned), so the plan is what a loaded layer runs.
"""

from __future__ import annotations

from pathlib import Path

from ..families import family_for
from ..routing.families import family_of, router_spec_from_hf, text_config
from .options import KernelOptions
from .plan import NAMED_DEVICES, DeviceFacts, KernelPlan, StepShape, plan_step

REPORT_TOKENS = (1, 8, 64, 512, 2048, 8192)


def device_for_report(name: str | None) -> DeviceFacts:
    """The device a report plans for: a named one (h100, h200, a100, cpu), else the CUDA device at hand,
    else the H100's facts (the plan a typical GPU run gets; the report says which)."""
    if name is not None:
        key = name.lower()
        if key not in NAMED_DEVICES and key != "cuda":
            raise ValueError(f"--device {name!r}: expected 'cuda' or one of {sorted(NAMED_DEVICES)}")
        if key != "cuda":
            return NAMED_DEVICES[key]
    import torch

    if torch.cuda.is_available():
        from .devices import device_facts

        return device_facts(torch.device("cuda"))
    if name is not None:
        raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    return NAMED_DEVICES["h100"]


def checkpoint_plans(path: str | Path, *, tokens=REPORT_TOKENS, device: DeviceFacts | None = None,
                     batch_invariant: bool = False, options: KernelOptions | None = None,
                     act_dtype: str = "bfloat16") -> list[KernelPlan]:
    """One KernelPlan per T for the first MoE layer of the checkpoint at `path` (the layers share a shape).

    act_dtype: the activations' dtype name (plain checkpoints: also the weights'; bfloat16 by default, what
    moeflow.from_pretrained and patch_model run).
    """
    from ..inspect import checkpoint_info, load_config
    from ..quant.spec import quant_spec_from_hf

    info = checkpoint_info(path)  # config claims checked against the stored tensors first
    config = text_config(load_config(Path(path)))
    fam = family_for(family_of(config))
    dims = fam.checkpoint.dims(config)
    spec = router_spec_from_hf(config, info.moe_layers[0])
    try:
        activation = fam.activation(config, None)[0]
    except (ValueError, TypeError, AttributeError):
        activation = "silu"
    qc = getattr(config, "quantization_config", None)
    q = quant_spec_from_hf(qc) if qc is not None else None
    fmt = "plain" if q is None else q.format
    if q is None:
        group, sbn, f32 = 0, 0, True
    elif fmt == "fp8_block":
        import torch

        group, sbn, f32 = q.block[1], q.block[0], q.scale_dtype == torch.float32
    else:
        group, sbn, f32 = {"mxfp4": 32, "nvfp4": 16}[fmt], 0, True
    device = device or device_for_report(None)
    impl = ("triton_quant" if q is not None else "triton") + ("_bi" if batch_invariant else "")
    plans = []
    for T in tokens:
        shape = StepShape(
            fmt=fmt, dtype=act_dtype, num_experts=spec.num_experts, tiling_experts=spec.num_experts,
            hidden_size=dims.H, intermediate_size=dims.I, top_k=spec.top_k, tokens=T, pairs=T * spec.top_k,
            layout=fam.layout, interleaved=fam.interleaved, gate_up_bias=fam.expert_bias, down_bias=fam.expert_bias,
            activation=activation, group=group, scale_block_n=sbn, scale_f32=f32, batch_invariant=batch_invariant)
        plans.append(plan_step(shape, device, impl=impl, options=options or KernelOptions()))
    return plans


def format_plans(plans: list[KernelPlan]) -> str:
    return "\n\n".join(p.explain() for p in plans)
