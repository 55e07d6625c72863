"""Expert computation behind one interface (see `moeflow.experts.base`).

    reference.py    ReferenceExperts: loop over experts in torch, the oracle.
    grouped.py      GroupedExperts: grouped GEMM over rows sorted by expert / per-row bmm.
    triton.py       fused Triton kernels (GPU; optional, imported lazily).
    activations.py  apply_activation: every family's gated activation, in one place.
    select.py       select_experts_impl / get_impl: the pure choice of an implementation.

Nothing is imported here, so `import moeflow.experts` stays light.
"""
