"""moeflow: exact, fast Mixture-of-Experts layers for LLM inference.

Public API (imported lazily so that `import moeflow` stays light and works
without Triton or transformers loaded):

    RouterSpec, RoutingResult, route, router_logits, predict_next, router_spec_from_hf
    MoEConfig, MoELayer, patch_model, PatchReport
    KernelOptions, KernelPlan, plan_step     (which kernel runs, and what a caller may choose)
    OffloadConfig
"""

from __future__ import annotations

from ._lazy import lazy_exports

__version__ = "0.1.0"

# name -> module that defines it. One place, so a rename is one line.
_EXPORTS: dict[str, str] = {
    "RouterSpec": "moeflow.routing.spec",
    "RoutingResult": "moeflow.types",
    "route": "moeflow.routing.select",
    "router_logits": "moeflow.routing.logits",
    "predict_next": "moeflow.routing.predict",
    "router_spec_from_hf": "moeflow.routing.families",
    "SUPPORTED_FAMILIES": "moeflow.routing.families",
    "MoEConfig": "moeflow.config",
    "ExpertWeights": "moeflow.config",
    "MoELayer": "moeflow.layer",
    "patch_model": "moeflow.hf",
    "PatchReport": "moeflow.hf",
    "unpatch_model": "moeflow.hf",
    "moe_layers": "moeflow.hf",
    "enable_layer_graphs": "moeflow.hf",
    "LayerGraphs": "moeflow.layer_graphs",
    "register_experts_interface": "moeflow.hf",
    "CheckpointIndex": "moeflow.checkpoint",
    "load_moe_layer": "moeflow.checkpoint",
    "CheckpointError": "moeflow.checkpoint",
    "run_experts": "moeflow.layer",
    "select_experts_impl": "moeflow.experts.select",
    "KernelOptions": "moeflow.experts.options",
    "KernelPlan": "moeflow.experts.plan",
    "plan_step": "moeflow.experts.plan",
    "OffloadConfig": "moeflow.offload.config",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__, __dir__ = lazy_exports("moeflow", globals(), _EXPORTS)
