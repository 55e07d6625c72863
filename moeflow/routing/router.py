"""The router stage of one layer: its tensors in one frozen holder, and the step that routes x.

Legend: T tokens, H hidden size, E routed experts, Z zero experts, S = E + Z router
columns, K picks per token, V vocabulary (hash layers).

    rw = RouterWeights(weight_EH=w, selection_bias_E=b)      # checked against the spec
    rw.check(spec, hidden_size=H)
    routing = run_router(rw, spec, x_TH, layer=3)             # RoutingResult

`run_router` is the only place that turns a layer input into a routing: gemma4's router
RMSNorm, the f32 batch-invariant logits, gpt-oss's linear bias, the family's selection.
On CUDA (with Triton) it runs the fused router step (`moeflow.routing.gpu.router_step_cuda`,
no host sync); elsewhere the torch reference.
The offload prefetcher predicts the next layer from the same holder (`router_input`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton import triton_available
from ..types import RoutingResult
from .hash import check_hash_table
from .logits import router_logits
from .select import route
from .spec import RouterSpec
from .validate import check_finite_vector

__all__ = ["RouterWeights", "run_router", "router_input"]


def _check_tensor(name: str, t, shape: tuple[int, ...] | None, *, floating: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
    if floating and not t.dtype.is_floating_point:
        raise TypeError(f"{name}: dtype {t.dtype}, expected a floating dtype")
    if not floating and (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise TypeError(f"{name}: dtype {t.dtype}, expected an integer dtype")


@dataclass(frozen=True, eq=False)
class RouterWeights:
    """A layer's router tensors (held by reference).

    weight_EH:        [E+Z, H] router linear weight (any float dtype; logits are f32).
    router_bias_E:    [E+Z] linear bias added to the logits (gpt-oss), or None.
    selection_bias_E: [E+Z] e_score_correction_bias (selection key only); iff spec.use_bias.
    expert_scale_E:   [E+Z] per-expert weight scale (gemma4); iff spec.expert_scale.
    prenorm_weight_H: [H] the router's RMSNorm scale (gemma4); iff spec.router_prenorm.
                      The router input is then rmsnorm(x) * prenorm_weight * H**-0.5
                      (rmsnorm without a scale, in f32, eps = prenorm_eps).
    hash_table_VK:    int [V, K] token id -> expert ids (DeepSeek-V4 hash layers); iff
                      spec.hash_routing.
    prenorm_eps:      eps of the router RMSNorm (gemma4's rms_norm_eps).
    """

    weight_EH: torch.Tensor
    router_bias_E: torch.Tensor | None = None
    selection_bias_E: torch.Tensor | None = None
    expert_scale_E: torch.Tensor | None = None
    prenorm_weight_H: torch.Tensor | None = None
    hash_table_VK: torch.Tensor | None = None
    prenorm_eps: float = 1e-6

    def check(self, spec: RouterSpec, *, hidden_size: int) -> None:
        """Raise TypeError/ValueError naming the tensor that disagrees with `spec` / H."""
        if not isinstance(spec, RouterSpec):
            raise TypeError(f"spec: expected a RouterSpec, got {type(spec).__name__}")
        H, S = hidden_size, spec.num_slots
        _check_tensor("router_weight_EH", self.weight_EH, (S, H))

        def needed(name: str, t, flag: bool, why: str) -> None:
            if flag and t is None:
                raise ValueError(f"{name}: None, but {why} is set")
            if not flag and t is not None:
                raise ValueError(f"{name}: given, but {why} is not set")

        needed("selection_bias_E", self.selection_bias_E, spec.use_bias, "config.router.use_bias")
        needed("expert_scale_E", self.expert_scale_E, spec.expert_scale, "config.router.expert_scale")
        needed("prenorm_weight_H", self.prenorm_weight_H, spec.router_prenorm, "config.router.router_prenorm")
        needed("hash_table_VK", self.hash_table_VK, spec.hash_routing, "config.router.hash_routing")
        for name in ("router_bias_E", "selection_bias_E", "expert_scale_E"):
            t = getattr(self, name)
            if t is not None:
                _check_tensor(name, t, (S,))
        if self.prenorm_weight_H is not None:
            _check_tensor("prenorm_weight_H", self.prenorm_weight_H, (H,))
        # Values read on the host once, here: the CUDA selection does not look at them per call.
        for name in ("router_bias_E", "selection_bias_E", "expert_scale_E", "prenorm_weight_H"):
            t = getattr(self, name)
            if t is not None:
                check_finite_vector(name, t, unit="hidden channel" if name == "prenorm_weight_H" else "expert")
        if self.hash_table_VK is not None:
            t = self.hash_table_VK
            _check_tensor("hash_table_VK", t, None, floating=False)
            if t.dim() != 2 or t.shape[1] != spec.top_k:
                raise ValueError(f"hash_table_VK: shape {tuple(t.shape)}, expected (V, K={spec.top_k})")
            # ids in range and distinct per row (read on the host once, here, not per forward)
            check_hash_table(t, S, top_k=spec.top_k, name="hash_table_VK")
        eps = self.prenorm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"prenorm_eps={eps!r}: expected a float >= 0")


def router_input(rw: RouterWeights, x_TH: torch.Tensor) -> torch.Tensor:
    """What the router linear sees: x, or gemma4's rmsnorm(x) * scale * H**-0.5."""
    if rw.prenorm_weight_H is None:
        return x_TH
    # Gemma4TextRouter: Gemma4RMSNorm(with_scale=False) in f32, cast back, then scale.
    xf = x_TH.float()
    ms = xf.pow(2).mean(-1, keepdim=True) + rw.prenorm_eps
    normed = (xf * torch.pow(ms, -0.5)).type_as(x_TH)
    return normed * rw.prenorm_weight_H * (int(x_TH.shape[-1]) ** -0.5)


def run_router(rw: RouterWeights, spec: RouterSpec, x_TH: torch.Tensor, *,
               input_ids: torch.Tensor | None = None, layer: int | None = None,
               status_out: torch.Tensor | None = None) -> RoutingResult:
    """Router logits (f32, + router bias) and the family's selection for x_TH [T, H].

    input_ids: int, T ids in any shape; needed by hash layers, ignored otherwise.
    On CUDA the selection reports NaN logits / bad hash ids through a device status
    (`result.check()`), not a host sync; status_out (int32 [T], CUDA) receives it where
    given (the GPU path only: the CPU path raises instead).
    """
    # Detached: routing is an inference-time selection here, and the batch-invariant
    # logits kernel writes through `out=`, which autograd refuses on tensors that
    # require grad (HF Parameters do by default).
    r_TH = router_input(rw, x_TH).detach()
    if r_TH.is_cuda and triton_available():
        # The router step: the batch-invariant logits GEMM and the selection (which adds
        # gpt-oss's router bias): one launch for T <= gpu.FUSED_MAX_T, else two; the same bits
        # as router_logits + route either way.
        from .gpu import router_step_cuda

        if r_TH.dim() == 2 and r_TH.shape[1] > 1 and r_TH.stride(1) != 1:
            r_TH = r_TH.contiguous()
        w_EH = rw.weight_EH.detach()
        if w_EH.stride(-1) != 1:
            w_EH = w_EH.contiguous()
        step = router_step_cuda(
            r_TH, w_EH, spec, router_bias=None if rw.router_bias_E is None else rw.router_bias_E.detach(),
            bias=rw.selection_bias_E, expert_scale=rw.expert_scale_E,
            input_ids=input_ids if spec.hash_routing else None, hash_table=rw.hash_table_VK, layer=layer,
            status_out=status_out,
        )
        return step.routing
    logits = router_logits(r_TH, rw.weight_EH.detach())
    if rw.router_bias_E is not None:
        logits = logits + rw.router_bias_E.detach().to(torch.float32)
    return route(
        logits,
        spec,
        bias=rw.selection_bias_E,
        expert_scale=rw.expert_scale_E,
        input_ids=input_ids if spec.hash_routing else None,
        hash_table=rw.hash_table_VK,
        layer=layer,
    )
