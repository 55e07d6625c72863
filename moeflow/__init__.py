"""moeflow: exact, fast Mixture-of-Experts layers for LLM inference.

Public API (imported lazily so that `import moeflow` stays light and works
without Triton or transformers loaded):

    RouterSpec, RoutingResult, route, router_logits, predict_next, router_spec_from_hf
    MoEConfig, MoELayer, patch_model, PatchReport
    from_pretrained                          (a checkpoint -> a patched model, experts as stored)
    warmup                                   (compile the kernels for every token count up front)
    KernelOptions, KernelPlan, plan_step     (which kernel runs, and what a caller may choose)
    OffloadConfig

`import moeflow` also makes `from_pretrained(..., experts_implementation="moeflow")` work: the
name is registered with transformers' experts interface as soon as transformers loads it
(transformers is not imported here; the experts code loads on the first call).
"""

from __future__ import annotations

from ._lazy import after_import, lazy_exports

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
    "from_pretrained": "moeflow.pretrained",
    "warmup": "moeflow.warming",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


__getattr__, __dir__ = lazy_exports("moeflow", globals(), _EXPORTS)


def _register_experts_interface(moe_module) -> None:
    """Register "moeflow" with transformers.integrations.moe's ExpertsInterface (once transformers loads it).

    The registered function imports moeflow.hf.interface on its first call; `import moeflow.hf`
    registers that module's function itself.
    """
    interface = getattr(moe_module, "ExpertsInterface", None)
    if interface is None or "moeflow" in getattr(interface, "_global_mapping", {}):
        return

    def moeflow_experts(self, *args, **kwargs):
        from .hf.interface import moeflow_experts_forward

        return moeflow_experts_forward(self, *args, **kwargs)

    interface.register("moeflow", moeflow_experts)


after_import("transformers.integrations.moe", _register_experts_interface)
