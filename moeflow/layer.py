"""MoELayer: router -> local dispatch -> experts -> combine (+ shared expert, added once).

Legend: B batch, S sequence, T = B*S tokens, H hidden size, E routed experts,
Z LongCat zero experts, E+Z router columns, K picks per token, I intermediate size
per expert, V vocabulary (hash layers), N (token, slot) pairs sent to routed experts.

Tensor storage (no copies): every tensor handed to the constructor is registered on
the layer by reference. An `nn.Parameter` is registered as that same Parameter object
(so it is shared with the model it came from, and `.to()` converts it in place for
both); a view along dim 0 of a Parameter (e.g. LongCat's `gate_up_proj[:E]`, whose
Parameter also holds rows for the zero experts) is stored as the whole Parameter plus
the row range and re-sliced at each use, so it too survives `.to()`; any other tensor
is registered as a buffer. Registered names: router_weight, router_bias,
selection_bias, expert_scale, prenorm_weight, hash_table, gate_up, down, gate_up_bias,
down_bias, shared_gate_weight (a narrowed Parameter is registered as `<name>_full`),
and the shared expert as the child module `shared_expert`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ExpertWeights, MoEConfig
from .experts.select import select_experts_impl
from .parallel.local import combine_TH, dispatch_rows, local_dispatch, unpermute_TKH
from .routing.logits import router_logits
from .routing.select import route
from .types import RoutingResult

__all__ = ["MoELayer", "run_experts"]

_EXPERT_TENSORS = ("gate_up", "down", "gate_up_bias", "down_bias")


def run_experts(
    x_TH: torch.Tensor,
    routing: RoutingResult,
    w: ExpertWeights,
    config: MoEConfig,
    impl,
) -> torch.Tensor:
    """The routed part of the layer: dispatch, experts, combine (no router, no shared expert).

    Args:
        x_TH: [T, H] expert input, dtype and device of the experts.
        routing: ids_TK int [T, K] (ids >= E are zero experts), weights_TK float [T, K].
        w: the experts' tensors (all E of them: ids index into w).
        config: the layer's MoEConfig.
        impl: an experts implementation (moeflow.experts.select).

    Returns:
        out_TH [T, H] in x's dtype: sum over k in slot order of w[t, k] * expert(x[t])
        (accumulated in f32); zero experts add w * x; with router.weight_on_input
        (llama4) the expert input is w * x and the combine weight is 1.
    """
    spec = config.router
    T, H = int(x_TH.shape[0]), int(x_TH.shape[1])
    ids_TK, weights_TK = routing.ids_TK, routing.weights_TK
    if ids_TK.shape != (T, spec.top_k) or weights_TK.shape != (T, spec.top_k):
        raise ValueError(
            f"routing: ids {tuple(ids_TK.shape)} / weights {tuple(weights_TK.shape)}, "
            f"expected ({T}, K={spec.top_k}) for x_TH {tuple(x_TH.shape)}"
        )
    if T == 0:
        return x_TH.new_zeros(0, H)
    fused = getattr(impl, "forward_tokens", None)
    if fused is not None and spec.num_zero_experts == 0:
        return fused(x_TH, ids_TK, weights_TK, w, config)
    d = local_dispatch(ids_TK, w.num_experts, num_zero_experts=spec.num_zero_experts)
    x_NH = dispatch_rows(x_TH, d)
    if spec.weight_on_input:
        # llama4 scales the expert input by the router score, in the activations' dtype.
        w_N1 = weights_TK.reshape(-1).index_select(0, d.order_N).to(x_TH.dtype).unsqueeze(1)
        x_NH = x_NH * w_N1
    y_NH = impl.forward_pairs(x_NH, d.expert_N, w, config)
    y_TKH = unpermute_TKH(y_NH, d)
    return combine_TH(
        y_TKH,
        weights_TK,
        x_TH=x_TH,
        zero_TK=d.zero_TK,
        weight_on_input=spec.weight_on_input,
        out_dtype=x_TH.dtype,
    )


def _check_tensor(name: str, t, shape: tuple[int, ...] | None, *, floating: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
    if floating and not t.dtype.is_floating_point:
        raise TypeError(f"{name}: dtype {t.dtype}, expected a floating dtype")
    if not floating and (t.dtype.is_floating_point or t.dtype == torch.bool):
        raise TypeError(f"{name}: dtype {t.dtype}, expected an integer dtype")


def _param_rows(t: torch.Tensor) -> tuple[nn.Parameter, int, int] | None:
    """(base, start, length) when t is base.narrow(0, start, length) of an nn.Parameter base."""
    base = t._base
    if not isinstance(base, nn.Parameter) or isinstance(t, nn.Parameter):
        return None
    if t.dim() != base.dim() or t.dim() == 0 or tuple(t.shape[1:]) != tuple(base.shape[1:]):
        return None
    if t.stride() != base.stride() or base.stride(0) == 0:
        return None
    delta = t.storage_offset() - base.storage_offset()
    if delta < 0 or delta % base.stride(0):
        return None
    start = delta // base.stride(0)
    if start + t.shape[0] > base.shape[0]:
        return None
    return base, start, int(t.shape[0])


class MoELayer(nn.Module):
    """One Mixture-of-Experts layer built from a MoEConfig and the model's own tensors.

    Args (E+Z: router columns, = E without LongCat zero experts):
        config: MoEConfig.
        router_weight_EH: [E+Z, H] router linear weight (any float dtype; logits in f32).
        experts: ExpertWeights holding all E routed experts, layout and interleaving as
            config says: "linear" gate_up [E, 2I, H], down [E, H, I]; "matmul"
            gate_up [E, H, 2I], down [E, I, H]; biases [E, 2I] / [E, H] iff
            config.expert_bias. The experts' dtype is the activations' dtype.
        router_bias_E: [E+Z] router linear bias added to the logits (gpt-oss), or None.
        selection_bias_E: [E+Z] e_score_correction_bias (selection key only); required
            iff config.router.use_bias.
        expert_scale_E: [E+Z] per-expert weight scale (gemma4); iff router.expert_scale.
        prenorm_weight_H: [H] the router's RMSNorm scale (gemma4); iff
            router.router_prenorm. The router input is then
            rmsnorm(x) * prenorm_weight * H**-0.5, rmsnorm without a scale, in f32,
            eps = config.router_prenorm_eps (Gemma4TextRouter).
        hash_table_VK: int [V, K] token id -> expert ids (DeepSeek-V4 hash layers); iff
            router.hash_routing (forward then needs input_ids).
        shared_expert: any module x_TH -> y_TH (e.g. the HF MLP itself), added once.
        shared_gate_weight_1H: [1, H] qwen2_moe's shared_expert_gate weight; iff
            config.shared_gated: the shared output is sigmoid(x @ w.T) * shared(x).
        experts_impl: "auto", "reference", "grouped" or "triton" (checked now; a refused
            choice raises ValueError with the implementation's reason).
        layer_idx: the layer's index (errors and traces name it).

    Attributes:
        last_routing: the latest forward's RoutingResult (None before the first).
        impl_name: name of the experts implementation the latest forward ran (before
            the first forward: the one chosen for a single token on the weights' device).
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        router_weight_EH: torch.Tensor,
        experts: ExpertWeights,
        router_bias_E: torch.Tensor | None = None,
        selection_bias_E: torch.Tensor | None = None,
        expert_scale_E: torch.Tensor | None = None,
        prenorm_weight_H: torch.Tensor | None = None,
        hash_table_VK: torch.Tensor | None = None,
        shared_expert: nn.Module | None = None,
        shared_gate_weight_1H: torch.Tensor | None = None,
        experts_impl: str = "auto",
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        # "eager": check the GPU routing status after each eager step (one host sync);
        # "never": leave it to the caller (decode loops that must not sync).
        self.check_routing = "eager"
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected MoEConfig, got {type(config).__name__}")
        if not isinstance(experts, ExpertWeights):
            raise TypeError(f"experts: expected ExpertWeights, got {type(experts).__name__}")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx={layer_idx!r}: expected an int >= 0")
        spec = config.router
        H, S = config.hidden_size, spec.num_slots
        experts.check_config(config)
        if experts.num_experts != config.num_experts:
            raise ValueError(
                f"experts: {experts.num_experts} experts (gate_up {tuple(experts.gate_up.shape)}), expected "
                f"config.router.num_experts={config.num_experts}"
            )
        _check_tensor("router_weight_EH", router_weight_EH, (S, H))

        def needed(name: str, t, flag: bool, why: str) -> None:
            if flag and t is None:
                raise ValueError(f"{name}: None, but {why} is set")
            if not flag and t is not None:
                raise ValueError(f"{name}: given, but {why} is not set")

        needed("selection_bias_E", selection_bias_E, spec.use_bias, "config.router.use_bias")
        needed("expert_scale_E", expert_scale_E, spec.expert_scale, "config.router.expert_scale")
        needed("prenorm_weight_H", prenorm_weight_H, spec.router_prenorm, "config.router.router_prenorm")
        needed("hash_table_VK", hash_table_VK, spec.hash_routing, "config.router.hash_routing")
        needed("shared_gate_weight_1H", shared_gate_weight_1H, config.shared_gated, "config.shared_gated")
        for name, t in (("router_bias_E", router_bias_E), ("selection_bias_E", selection_bias_E),
                        ("expert_scale_E", expert_scale_E)):
            if t is not None:
                _check_tensor(name, t, (S,))
        if prenorm_weight_H is not None:
            _check_tensor("prenorm_weight_H", prenorm_weight_H, (H,))
        if hash_table_VK is not None:
            _check_tensor("hash_table_VK", hash_table_VK, None, floating=False)
            if hash_table_VK.dim() != 2 or hash_table_VK.shape[1] != spec.top_k:
                raise ValueError(f"hash_table_VK: shape {tuple(hash_table_VK.shape)}, expected (V, K={spec.top_k})")
        if shared_gate_weight_1H is not None:
            _check_tensor("shared_gate_weight_1H", shared_gate_weight_1H, (1, H))
            if shared_expert is None:
                raise ValueError("shared_expert: None, but config.shared_gated needs the shared expert it gates")
        if shared_expert is not None and not isinstance(shared_expert, nn.Module):
            raise TypeError(f"shared_expert: expected an nn.Module, got {type(shared_expert).__name__}")
        if not isinstance(experts_impl, str):
            raise TypeError(f"experts_impl: expected a str, got {type(experts_impl).__name__}")

        self.config = config
        self.layer_idx = layer_idx
        self.experts_impl = experts_impl
        self._rows: dict[str, tuple[int, int]] = {}
        self._store("router_weight", router_weight_EH)
        for name, t in (
            ("router_bias", router_bias_E),
            ("selection_bias", selection_bias_E),
            ("expert_scale", expert_scale_E),
            ("prenorm_weight", prenorm_weight_H),
            ("hash_table", hash_table_VK),
            ("gate_up", experts.gate_up),
            ("down", experts.down),
            ("gate_up_bias", experts.gate_up_bias),
            ("down_bias", experts.down_bias),
            ("shared_gate_weight", shared_gate_weight_1H),
        ):
            self._store(name, t)
        self._layout = experts.layout
        self._interleaved = experts.interleaved
        self.shared_expert = shared_expert
        self.last_routing: RoutingResult | None = None
        # Validates a named choice now (ValueError with the impl's reason) rather than at
        # the first forward.
        self.impl_name: str = select_experts_impl(config, experts.device, 1, experts_impl).name

    # -- tensor storage ---------------------------------------------------------------

    def _store(self, name: str, t: torch.Tensor | None) -> None:
        if t is None:
            setattr(self, name, None)
            return
        if isinstance(t, nn.Parameter):
            self.register_parameter(name, t)
            return
        rows = _param_rows(t)
        if rows is not None:
            base, start, length = rows
            self.register_parameter(f"{name}_full", base)
            self._rows[name] = (start, length)
            return
        self.register_buffer(name, t, persistent=True)

    def _tensor(self, name: str) -> torch.Tensor | None:
        rows = self._rows.get(name)
        if rows is not None:
            return getattr(self, f"{name}_full").narrow(0, rows[0], rows[1])
        return getattr(self, name)

    @property
    def expert_weights(self) -> ExpertWeights:
        """The experts' tensors as they are now (rebuilt per call, so `.to()` and reassigned
        Parameters are always seen)."""
        return ExpertWeights(
            *(self._tensor(n) for n in _EXPERT_TENSORS), layout=self._layout, interleaved=self._interleaved
        )

    # -- pipeline ---------------------------------------------------------------------

    def router_input(self, x_TH: torch.Tensor) -> torch.Tensor:
        """What the router linear sees: x, or gemma4's rmsnorm(x) * scale * H**-0.5."""
        if not self.config.router.router_prenorm:
            return x_TH
        # Gemma4TextRouter: Gemma4RMSNorm(with_scale=False) in f32, cast back, then scale.
        xf = x_TH.float()
        ms = xf.pow(2).mean(-1, keepdim=True) + self.config.router_prenorm_eps
        normed = (xf * torch.pow(ms, -0.5)).type_as(x_TH)
        return normed * self._tensor("prenorm_weight") * (self.config.hidden_size**-0.5)

    def route(self, x_TH: torch.Tensor, input_ids: torch.Tensor | None = None) -> RoutingResult:
        """Router logits (f32, + router bias) and the family's selection for x_TH [T, H].

        input_ids: int, T ids in any shape; needed by hash layers, ignored otherwise.
        """
        # Detached: routing is an inference-time selection here, and the batch-invariant
        # logits kernel writes through `out=`, which autograd refuses on tensors that
        # require grad (HF Parameters do by default).
        logits = router_logits(self.router_input(x_TH).detach(), self._tensor("router_weight").detach())
        bias = self._tensor("router_bias")
        if bias is not None:
            logits = logits + bias.detach().to(torch.float32)
        spec = self.config.router
        result = route(
            logits,
            spec,
            bias=self._tensor("selection_bias"),
            expert_scale=self._tensor("expert_scale"),
            input_ids=input_ids if spec.hash_routing else None,
            hash_table=self._tensor("hash_table"),
            layer=self.layer_idx,
        )
        # The GPU selection reports NaN logits / bad hash ids through a device status,
        # not a sync. Eager steps check it here (one sync, so a NaN is never a silent
        # pick); under CUDA-graph capture, or with check_routing="never", the caller
        # owns the check (`self.last_routing.check()`).
        check = getattr(result, "check", None)
        if check is not None and self.check_routing == "eager" and not torch.cuda.is_current_stream_capturing():
            check()
        return result

    def experts_forward(self, x_TH: torch.Tensor, routing: RoutingResult) -> torch.Tensor:
        """The routed output [T, H] for a given routing (no shared expert); see `run_experts`."""
        w = self.expert_weights
        impl = select_experts_impl(self.config, x_TH.device, int(x_TH.shape[0]), self.experts_impl)
        self.impl_name = impl.name
        return run_experts(x_TH, routing, w, self.config, impl)

    def forward(
        self,
        x: torch.Tensor,
        *,
        input_ids: torch.Tensor | None = None,
        router_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output, same shape and dtype as x.

        Args:
            x: [B, S, H] or [T, H], the experts' dtype and device.
            input_ids: token ids (T of them, any shape), for hash-routed layers.
            router_input: optional [..., H] tensor (T rows) the router sees instead of x;
                gemma4 routes on the residual stream while its experts see a
                differently normalised copy of it.
        """
        H = self.config.hidden_size
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3) or x.shape[-1] != H:
            raise ValueError(f"x: shape {tuple(x.shape)}, expected [B, S, {H}] or [T, {H}] (hidden_size={H})")
        w_dtype = self._tensor("gate_up").dtype
        if x.dtype != w_dtype:
            raise TypeError(f"x: dtype {x.dtype}, expected the experts' dtype {w_dtype}")
        x_TH = x.reshape(-1, H)
        T = x_TH.shape[0]
        r_TH = x_TH
        if router_input is not None:
            if not isinstance(router_input, torch.Tensor) or router_input.shape[-1] != H or (
                router_input.numel() != T * H
            ):
                shape = tuple(router_input.shape) if isinstance(router_input, torch.Tensor) else None
                raise ValueError(f"router_input: shape {shape}, expected {T} rows of H={H}")
            r_TH = router_input.reshape(-1, H)
        if input_ids is not None and isinstance(input_ids, torch.Tensor) and input_ids.numel() != T:
            raise ValueError(f"input_ids: {input_ids.numel()} ids, expected one per token (T={T})")
        routing = self.route(r_TH, input_ids=input_ids)
        self.last_routing = routing
        out_TH = self.experts_forward(x_TH, routing)
        if self.shared_expert is not None:
            shared_TH = self.shared_expert(x_TH)
            gate_w = self._tensor("shared_gate_weight")
            if gate_w is not None:
                shared_TH = torch.sigmoid(F.linear(x_TH, gate_w)) * shared_TH
            out_TH = out_TH + shared_TH
        return out_TH.view(x.shape)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"layer={self.layer_idx}, E={c.num_experts}, K={c.top_k}, H={c.hidden_size}, I={c.intermediate_size}, "
            f"activation={c.activation!r}, layout={c.layout!r}, impl={self.impl_name!r}"
        )
