"""transformers' experts interface: `from_pretrained(..., experts_implementation="moeflow")`.

`register_experts_interface()` registers "moeflow" with transformers' ExpertsInterface
(where the installed transformers has one); `import moeflow.hf` calls it, and `import
moeflow` registers a stand-in that loads this module on its first call. Under HF's own
routing, the experts of every family that uses the interface then run through moeflow's
dispatch, experts and combine (`run_experts`).

Legend: T tokens, H hidden, K picks per token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import ExpertWeights, MoEConfig
from ..experts.select import select_experts_impl
from ..families import family_for
from ..layer import run_experts
from ..routing.families import text_config
from ..routing.spec import RouterSpec
from ..types import RoutingResult

__all__ = ["moeflow_experts_forward", "register_experts_interface"]


def _interface_config(module: nn.Module) -> tuple[MoEConfig, str]:
    """(MoEConfig, family) describing an HF `@use_experts_implementation` experts module."""
    cached = module.__dict__.get("_moeflow_experts_config")
    if cached is not None:
        return cached
    name = type(module).__name__
    family = type(module).__module__.rsplit(".", 1)[-1].removeprefix("modeling_")
    fam = family_for(family, missing_ok=True)
    if fam is None or fam.hf is None:
        raise ValueError(f"experts_implementation='moeflow': {name} (family {family!r}) is not a family moeflow runs")
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        raise ValueError(f"experts_implementation='moeflow': {name} has no gate or a post-expert norm")
    layout = "matmul" if getattr(module, "is_transposed", False) else "linear"
    interleaved = not getattr(module, "is_concatenated", True)
    bias = bool(getattr(module, "has_bias", False))
    if (layout, interleaved, bias) != (fam.layout, fam.interleaved, fam.expert_bias):
        raise ValueError(f"experts_implementation='moeflow': {name}: layout flags {(layout, interleaved, bias)} "
                         f"differ from moeflow's {fam.name} table")
    config = text_config(module.config)
    activation, limit, alpha = fam.activation(config, module)
    gu = module.gate_up_proj
    two_i = gu.shape[1] if layout == "linear" else gu.shape[2]
    H = gu.shape[2] if layout == "linear" else gu.shape[1]
    E = int(module.num_experts)
    spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=1)  # only E matters; K is per call
    cfg = MoEConfig(hidden_size=int(H), intermediate_size=int(two_i) // 2, router=spec, activation=activation,
                    swiglu_limit=limit, gptoss_alpha=alpha, layout=layout, interleaved=interleaved,
                    expert_bias=bias)
    module.__dict__["_moeflow_experts_config"] = (cfg, family)
    return cfg, family


def moeflow_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                            top_k_weights: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers ExpertsInterface entry: HF routing in, moeflow experts + combine out.

    hidden_states [T, H]; top_k_index int [T, K]; top_k_weights float [T, K]. Returns [T, H].
    (gpt-oss passes them as router_indices / routing_weights.)
    """
    if top_k_index is None:
        top_k_index = kwargs.pop("router_indices")
    if top_k_weights is None:
        top_k_weights = kwargs.pop("routing_weights")
    if getattr(self, "_is_expert_parallel", False):
        raise ValueError("experts_implementation='moeflow' does not run under transformers' expert parallelism; "
                         "use moeflow.patch_model(model, ep_group=...) instead")
    cfg, _ = _interface_config(self)
    K = int(top_k_index.shape[-1])
    cfg_k = cfg if cfg.router.top_k == K else _with_top_k(self, cfg, K)
    w = ExpertWeights(self.gate_up_proj, self.down_proj,
                      getattr(self, "gate_up_proj_bias", None) if cfg.expert_bias else None,
                      getattr(self, "down_proj_bias", None) if cfg.expert_bias else None,
                      layout=cfg.layout, interleaved=cfg.interleaved)
    impl = select_experts_impl(cfg_k, hidden_states.device, int(hidden_states.shape[0]), "auto")
    routing = RoutingResult(top_k_index, top_k_weights.to(torch.float32))
    return run_experts(hidden_states, routing, w, cfg_k, impl)


def _with_top_k(module: nn.Module, cfg: MoEConfig, K: int) -> MoEConfig:
    from dataclasses import replace

    new = replace(cfg, router=cfg.router.replace(top_k=K))
    module.__dict__["_moeflow_experts_config"] = (new, module.__dict__["_moeflow_experts_config"][1])
    return new


def register_experts_interface() -> bool:
    """Register "moeflow" with transformers' ExpertsInterface; False where transformers has none."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:
        return False
    ExpertsInterface.register("moeflow", moeflow_experts_forward)
    return True
