"""Shared experts through a moeflow experts impl: one dense SwiGLU expert as E=1, K=1.

Legend: T tokens, H hidden, Is shared-expert intermediate size.

A shared expert is a dense SwiGLU MLP (HF `...MLP` with gate_proj / up_proj / down_proj,
no bias). Run by cuBLAS, a row's bits depend on the batch (the GEMM's tiles and split
follow T), so a block with a shared expert is not batch-invariant even when its routed
experts are (`experts="triton_bi"`). `SharedExpertRunner` runs it through the same
batch-invariant fused kernels, as one expert that every token picks with weight 1:

    gate_up [1, 2Is, H] = [gate_proj.weight; up_proj.weight]   (one fused copy, rebuilt
                                                                  when either changes)
    down    [1, H, Is]  = down_proj.weight (a view)
    y_TH = impl.forward_tokens(x_TH, ids 0, weights 1.0)       (x 1.0 is exact)

qwen2_moe's sigmoid gate runs on `router_logits` (f32, batch-invariant by construction),
then sigmoid and the product elementwise (per element, so batch-invariant on the GPU).

Memory: the fused gate_up copy costs 2 * Is * H elements per layer (the HF Parameters stay
as they are, so state_dict and `.to()` are unchanged).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ExpertWeights, MoEConfig
from ..routing.logits import router_logits
from ..routing.spec import RouterSpec

__all__ = ["SharedExpertRunner", "swiglu_parts"]


def swiglu_parts(module: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
    """(gate_proj, up_proj, down_proj) of a bias-free SwiGLU MLP module, or None when it is not one."""
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in parts):
        return None
    g, u, d = parts
    if g.weight.shape != u.weight.shape or d.weight.shape[1] != g.weight.shape[0]:
        return None
    return g, u, d  # type: ignore[return-value]


class SharedExpertRunner:
    """Runs a SwiGLU shared-expert module through `impl` as one expert (see the module docstring).

    module: the HF shared MLP (gate_proj, up_proj, down_proj nn.Linear, no bias).
    impl: an experts impl with forward_tokens (the layer's batch-invariant Triton impl).
    activation / swiglu_limit: "silu", or DeepSeek-V4's "swiglu_clamp" with its limit.
    gate_weight_1H: qwen2_moe's shared_expert_gate weight [1, H], or None.
    """

    def __init__(self, module: nn.Module, impl, *, activation: str = "silu", swiglu_limit: float | None = None,
                 gate_weight_1H: torch.Tensor | None = None) -> None:
        parts = swiglu_parts(module)
        if parts is None:
            raise ValueError(f"shared_expert: {type(module).__name__} is not a bias-free SwiGLU MLP "
                             f"(gate_proj / up_proj / down_proj nn.Linear)")
        if getattr(impl, "forward_tokens", None) is None:
            raise ValueError(f"impl {getattr(impl, 'name', impl)!r}: needs forward_tokens to run a shared expert")
        self.gate, self.up, self.down = parts
        self.impl = impl
        Is, H = (int(s) for s in self.gate.weight.shape)
        self.config = MoEConfig(hidden_size=H, intermediate_size=Is, activation=activation,
                                swiglu_limit=swiglu_limit,
                                router=RouterSpec(score_fn="softmax", num_experts=1, top_k=1))
        self.gate_weight_1H = gate_weight_1H
        self._fused: tuple[tuple, torch.Tensor] | None = None

    def _gate_up(self) -> torch.Tensor:
        """[1, 2Is, H] gate then up, rebuilt when a weight was replaced, moved or edited in place."""
        g, u = self.gate.weight, self.up.weight
        key = (g.data_ptr(), u.data_ptr(), g._version, u._version, g.dtype, g.device)
        if self._fused is None or self._fused[0] != key:
            with torch.no_grad():
                self._fused = (key, torch.cat([g.detach(), u.detach()]).unsqueeze(0).contiguous())
        return self._fused[1]

    def __call__(self, x_TH: torch.Tensor, gate_weight_1H: torch.Tensor | None = None) -> torch.Tensor:
        """y_TH [T, H] in x's dtype: the shared expert (times qwen2_moe's sigmoid gate)."""
        T = int(x_TH.shape[0])
        w = ExpertWeights(self._gate_up(), self.down.weight.detach().unsqueeze(0))
        ids_TK = torch.zeros(T, 1, dtype=torch.int32, device=x_TH.device)
        ones_TK = torch.ones(T, 1, dtype=torch.float32, device=x_TH.device)
        y_TH = self.impl.forward_tokens(x_TH, ids_TK, ones_TK, w, self.config)
        gate_w = gate_weight_1H if gate_weight_1H is not None else self.gate_weight_1H
        if gate_w is not None:
            g_T1 = router_logits(x_TH.detach(), gate_w.detach()).to(x_TH.dtype)
            y_TH = torch.sigmoid(g_T1) * y_TH
        return y_TH

