"""transformers integration: run every MoE block of a Hugging Face model through moeflow.

    model = AutoModelForCausalLM.from_pretrained(path)
    report = moeflow.patch_model(model)          # experts="auto" | "reference" | "grouped" | "triton"
    print(report)

Modules, one concern each:
    patch      patch_model / unpatch_model / PatchReport: find the blocks, build their
               MoELayers (EP and offload as stages), swap the block classes.
    patched    moe_layers / check_routing: what a patched model holds (re-exported by patch).
    blocks     the MoEBlock kinds a patched block gets (HF return signatures kept).
    interface  transformers' experts interface ("moeflow" experts under HF's routing).
    util       attribute paths, the families with an HF block description.
    graphs     StaticDecoder: greedy decode with a static KV cache, each step replayed from
               one CUDA graph (the host time of a patched step gone); enable_layer_graphs:
               each MoE layer step of an eager forward replayed from a per-T graph.

`import moeflow` registers "moeflow" in transformers' experts interface once transformers
loads it (without importing transformers itself); `import moeflow.hf` registers this
package's function directly (an explicit call of `register_experts_interface()`, a no-op
where transformers has no interface).
"""

from __future__ import annotations

from .blocks import MoEBlock
from .graphs import StaticDecoder, disable_layer_graphs, enable_layer_graphs
from .interface import moeflow_experts_forward, register_experts_interface
from .patch import PatchedBlock, PatchReport, check_routing, moe_layers, patch_model, unpatch_model
from .util import available_hf_families, hf_families

__all__ = [
    "HF_FAMILIES",
    "MoEBlock",
    "PatchReport",
    "PatchedBlock",
    "StaticDecoder",
    "available_hf_families",
    "check_routing",
    "disable_layer_graphs",
    "enable_layer_graphs",
    "hf_families",
    "moe_layers",
    "moeflow_experts_forward",
    "patch_model",
    "register_experts_interface",
    "unpatch_model",
]

# The family records with an HF block description (moeflow.families holds the table).
HF_FAMILIES = hf_families()

register_experts_interface()
