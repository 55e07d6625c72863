"""Expert computation behind one interface (see `moeflow.experts.base`).

    reference.py    ReferenceExperts: loop over experts in torch, the oracle.
    grouped.py      GroupedExperts: grouped GEMM over rows sorted by expert / per-row bmm.
    triton.py       TritonExperts: fused Triton kernels for plain weights (GPU; optional, imported lazily).
    triton_quant.py TritonQuantExperts: the same for FP8 block / MXFP4 / NVFP4 weights.
    fused.py        their base: plan a step, run the plan (one launcher per kernel variant).
    plan.py         the kernel plan: the registry of variants and the pure plan_step (which kernel, tile,
                    path each stage runs, and why); KernelPlan.explain().
    options.py      KernelOptions: what a caller may choose (tma, pdl, fast launch, pinned variants).
    devices.py      DeviceFacts of a torch.device; plan_report.py: a checkpoint's plans (moeflow info --kernels).
    activations.py  apply_activation: every family's gated activation, in one place.
    select.py       select_experts_impl / get_impl: the pure choice of an implementation.

Nothing is imported here, so `import moeflow.experts` stays light.
"""
