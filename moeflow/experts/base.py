"""The experts-implementation interface and the helpers its implementations share.

Legend: N (token, slot) rows, H hidden size, I intermediate size per expert,
E experts held by the ExpertWeights at hand (a subset under expert parallelism),
T tokens and K slots per token (forward_tokens: N = T*K, pair n = t*K + k).

An implementation is an object with:
    name: str
    supports(config) -> (ok: bool, reason: str)
    forward_pairs(x_NH, expert_N, w, config) -> y_NH
        N rows, row n run through expert expert_N[n] (0 <= id < w.num_experts),
        unweighted, output rows in input order. Each expert sees its rows in the order
        they come, so the same rows in the same order give the same bits wherever
        they come from (what makes expert parallelism bit-identical).
and optionally
    device_types: tuple[str, ...]   device types it runs on (absent: any)
    graph_capturable: bool          its forward makes no host sync and allocates only through
                                    torch, so a CUDA graph may capture it (absent: False;
                                    moeflow.layer_graphs replays only such steps)
    forward_tokens(x_TH, ids_TK, weights_TK, w, config) -> out_TH
        a fused dispatch + experts + combine (no zero experts, no shared expert);
        it must honour config.router.weight_on_input.
"""

from __future__ import annotations

import copy
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from ..config import ExpertWeights, MoEConfig


@runtime_checkable
class ExpertsImpl(Protocol):
    name: str

    def supports(self, config: MoEConfig) -> tuple[bool, str]: ...

    def forward_pairs(
        self, x_NH: torch.Tensor, expert_N: torch.Tensor, w: ExpertWeights, config: MoEConfig
    ) -> torch.Tensor: ...


def check_pairs(x_NH: torch.Tensor, expert_N: torch.Tensor, w: ExpertWeights, config: MoEConfig) -> None:
    """Raise TypeError/ValueError naming the argument `forward_pairs` refuses.

    The id range is checked on the host only for CPU tensors: on CUDA it would cost
    a device sync per call, and dispatch produces in-range ids by construction.
    """
    if not isinstance(w, ExpertWeights):
        raise TypeError(f"w: expected ExpertWeights, got {type(w).__name__}")
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected MoEConfig, got {type(config).__name__}")
    w.check_config(config)
    if not isinstance(x_NH, torch.Tensor) or not isinstance(expert_N, torch.Tensor):
        raise TypeError("x_NH/expert_N: expected torch.Tensors")
    if x_NH.dim() != 2 or x_NH.shape[1] != w.hidden_size:
        raise ValueError(f"x_NH: shape {tuple(x_NH.shape)}, expected (N, H={w.hidden_size})")
    if x_NH.dtype != w.dtype:
        raise TypeError(f"x_NH: dtype {x_NH.dtype}, expected the experts' dtype {w.dtype}")
    if x_NH.device != w.device:
        raise ValueError(f"x_NH: on {x_NH.device}, expected the experts' device {w.device}")
    if expert_N.dim() != 1 or expert_N.shape[0] != x_NH.shape[0]:
        raise ValueError(f"expert_N: shape {tuple(expert_N.shape)}, expected ({x_NH.shape[0]},) (one id per row)")
    if expert_N.dtype.is_floating_point or expert_N.dtype == torch.bool:
        raise TypeError(f"expert_N: dtype {expert_N.dtype}, expected an integer dtype")
    if expert_N.device != x_NH.device:
        raise ValueError(f"expert_N: on {expert_N.device}, expected x_NH's device {x_NH.device}")
    if expert_N.device.type == "cpu" and expert_N.numel():
        lo, hi = int(expert_N.min()), int(expert_N.max())
        if lo < 0 or hi >= w.num_experts:
            bad = lo if lo < 0 else hi
            raise ValueError(f"expert_N: id {bad} outside [0, {w.num_experts}) (zero experts are never sent here)")


def check_tokens(x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 hidden_size: int) -> tuple[int, int]:
    """(T, K) of a `forward_tokens` call; raise ValueError/TypeError naming the argument it refuses.

    Args:
        x_TH: [T, H=hidden_size] (a non-tensor or another shape: ValueError).
        ids_TK: [T, K], any integer dtype (float or bool: TypeError).
        weights_TK: [T, K], any floating dtype (integer or bool: TypeError).

    Shapes and dtypes only. x's dtype, device and strides against the experts are each impl's
    own check, and ids/weights against x's device are `check_token_devices`' (the triton impls
    run their x check between the two, so each refusal names the argument it always has).
    """
    if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2 or x_TH.shape[1] != hidden_size:
        raise ValueError(f"x_TH: shape {tuple(getattr(x_TH, 'shape', ()))}, expected (T, H={hidden_size})")
    T = int(x_TH.shape[0])
    if not isinstance(ids_TK, torch.Tensor) or ids_TK.dim() != 2 or ids_TK.shape[0] != T:
        raise ValueError(f"ids_TK: shape {tuple(getattr(ids_TK, 'shape', ()))}, expected (T={T}, K)")
    if ids_TK.dtype.is_floating_point or ids_TK.dtype == torch.bool:
        raise TypeError(f"ids_TK: dtype {ids_TK.dtype}, expected an integer dtype")
    K = int(ids_TK.shape[1])
    if not isinstance(weights_TK, torch.Tensor) or tuple(weights_TK.shape) != (T, K):
        raise ValueError(f"weights_TK: shape {tuple(getattr(weights_TK, 'shape', ()))}, expected ({T}, {K})")
    if not weights_TK.dtype.is_floating_point:
        raise TypeError(f"weights_TK: dtype {weights_TK.dtype}, expected a floating dtype")
    return T, K


def check_token_devices(x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> None:
    """Raise ValueError naming ids_TK or weights_TK (in that order) when it is not on x_TH's device."""
    for name, t in (("ids_TK", ids_TK), ("weights_TK", weights_TK)):
        if t.device != x_TH.device:
            raise ValueError(f"{name}: on {t.device}, expected x_TH's device {x_TH.device}")


def flat_pairs(ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_N int32 [N], wts_N [N] in weights_TK's dtype), both contiguous, pair n = t*K + k.

    ids_TK: integer [T, K]; weights_TK: floating [T, K] (as `check_tokens` accepts). No host
    sync (a copy only where the dtype or the strides need one), so a CUDA graph may capture it.
    """
    ids_N = ids_TK.reshape(-1)
    if ids_N.dtype != torch.int32:
        ids_N = ids_N.to(torch.int32)
    return ids_N.contiguous(), weights_TK.reshape(-1).contiguous()


def gate_up_one(x_MH: torch.Tensor, w: ExpertWeights, e: int, *, bias: bool = True) -> torch.Tensor:
    """[M, 2I] = x @ gate_up[e] (layout-aware) + gate_up_bias[e] (when `bias`); expert e's first projection."""
    if w.layout == "linear":
        y = F.linear(x_MH, w.gate_up[e])
    else:
        y = x_MH @ w.gate_up[e]
    if bias and w.gate_up_bias is not None:
        y = y + w.gate_up_bias[e]
    return y


def down_one(act_MI: torch.Tensor, w: ExpertWeights, e: int, *, bias: bool = True) -> torch.Tensor:
    """[M, H] = act @ down[e] (layout-aware) + down_bias[e] (when `bias`); expert e's second projection."""
    if w.layout == "linear":
        y = F.linear(act_MI, w.down[e])
    else:
        y = act_MI @ w.down[e]
    if bias and w.down_bias is not None:
        y = y + w.down_bias[e]
    return y


def gate_up_as_KN(w: ExpertWeights) -> torch.Tensor:
    """gate_up as [E, H, 2I] (a view: transposed for layout "linear"), the (in, out) form of matmul."""
    return w.gate_up.transpose(1, 2) if w.layout == "linear" else w.gate_up


def down_as_KN(w: ExpertWeights) -> torch.Tensor:
    """down as [E, I, H] (a view: transposed for layout "linear")."""
    return w.down.transpose(1, 2) if w.layout == "linear" else w.down


def tiling_experts(impl, w: ExpertWeights) -> int:
    """The expert count an impl picks its tiles (and kernel path) by: its `tiling_experts` if set, else w's E."""
    E = getattr(impl, "tiling_experts", None)
    return w.num_experts if E is None else E


def tiled_as(impl, num_experts: int):
    """`impl`, or a cached copy that picks tiles and paths as for a layer of `num_experts` experts.

    Why: a tiled impl (triton, triton_quant) chooses its tile configuration by (E, H, I, K, T)
    and the bits of a row depend on that configuration. An offload cache hands the impl its
    slot pool (E = number of slots), so without this the offloaded layer could run other tiles
    than the resident one and lose bit identity. Impls without tiles are returned unchanged.
    """
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"tiled_as: num_experts={num_experts!r}, expected an int >= 1")
    if not hasattr(impl, "tiling_experts") or impl.tiling_experts == num_experts:
        return impl
    cache = impl.__dict__.setdefault("_tiled_copies", {})
    c = cache.get(num_experts)
    if c is None:
        c = copy.copy(impl)
        c.__dict__.pop("_tiled_copies", None)
        c.tiling_experts = num_experts
        c._plans = {}
        cache[num_experts] = c
    return c
