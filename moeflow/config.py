"""MoEConfig (what one MoE layer computes) and ExpertWeights (the tensors it computes with).

Legend: T tokens, H hidden size, E routed experts (of the weights at hand),
K picks per token, I intermediate size per routed expert, N (token, slot) pairs.

Expert weight layouts (transformers 5 fused "experts" modules, `docs/experts.md`):

    layout "linear" (F.linear, y = x @ W[e].T; mixtral, qwen*, deepseek*, glm4_moe, gemma4, ...):
        gate_up [E, 2I, H]    down [E, H, I]
    layout "matmul" (y = x @ W[e]; gpt_oss, llama4):
        gate_up [E, H, 2I]    down [E, I, H]

The 2I axis holds gate then up as two halves (`chunk(2, -1)`), or, with
`interleaved=True` (gpt-oss), gate in the even and up in the odd columns.
Optional biases (gpt-oss): gate_up_bias [E, 2I], down_bias [E, H].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from .quant.spec import QuantSpec
from .quant.storage import check_quantized, dequantized_tensors
from .routing.spec import RouterSpec
from .weight_checks import check_expert_biases

ACTIVATIONS: tuple[str, ...] = ("silu", "gelu_tanh", "swiglu_clamp", "gptoss")
LAYOUTS: tuple[str, ...] = ("linear", "matmul")
# Activations whose math reads `swiglu_limit`; the others refuse one so that a
# clamp is never silently dropped.
_CLAMPED = ("swiglu_clamp", "gptoss")


def _finite_number(v: object) -> bool:
    """v is an int or float (not a bool) and finite: inf passes every `> 0` test, and a clamp limit,
    sigmoid slope or RMSNorm eps of inf turns a layer's outputs into inf or NaN."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_pos_int(owner: str, name: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{owner}.{name}={v!r}: expected an int >= 1")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """What one MoE layer computes (the tensors live in `ExpertWeights` / `MoELayer`).

    hidden_size:        H.
    intermediate_size:  I, width of one routed expert.
    router:             the layer's RouterSpec (E = router.num_experts, K = router.top_k).
    activation:         "silu"         act = silu(gate) * up                 (SwiGLU; most families)
                        "gelu_tanh"    act = gelu(gate, approximate="tanh") * up   (gemma4)
                        "swiglu_clamp" gate <= limit, -limit <= up <= limit, silu(gate) * up
                                       (DeepSeek-V4; needs swiglu_limit)
                        "gptoss"       gate <= limit, -limit <= up <= limit,
                                       (up + 1) * gate * sigmoid(alpha * gate)
                                       (needs swiglu_limit; alpha = gptoss_alpha)
    swiglu_limit:       clamp limit of "swiglu_clamp" / "gptoss"; must be None otherwise.
    gptoss_alpha:       the sigmoid's slope in "gptoss" (1.702 in gpt-oss).
    layout:             "linear" (gate_up [E, 2I, H], down [E, H, I]) or
                        "matmul" (gate_up [E, H, 2I], down [E, I, H]).
    interleaved:        gate/up columns interleaved (even gate, odd up) instead of halves.
    expert_bias:        the experts carry gate_up_bias [E, 2I] and down_bias [E, H] (gpt-oss).
    shared_gated:       the shared expert is gated: sigmoid(x @ shared_gate_weight_1H.T) * shared(x)
                        (qwen2_moe).
    router_prenorm_eps: eps of the router's own RMSNorm when router.router_prenorm (gemma4's
                        rms_norm_eps); unused otherwise.
    """

    hidden_size: int
    intermediate_size: int
    router: RouterSpec
    activation: str
    swiglu_limit: float | None = None
    gptoss_alpha: float = 1.702
    layout: str = "linear"
    interleaved: bool = False
    expert_bias: bool = False
    shared_gated: bool = False
    router_prenorm_eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_pos_int("MoEConfig", "hidden_size", self.hidden_size)
        _check_pos_int("MoEConfig", "intermediate_size", self.intermediate_size)
        if not isinstance(self.router, RouterSpec):
            raise TypeError(f"MoEConfig.router: expected a RouterSpec, got {type(self.router).__name__}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig.activation={self.activation!r}: expected one of {ACTIVATIONS}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"MoEConfig.layout={self.layout!r}: expected one of {LAYOUTS}")
        for name in ("interleaved", "expert_bias", "shared_gated"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MoEConfig.{name}={getattr(self, name)!r}: expected a bool")
        if self.activation in _CLAMPED:
            lim = self.swiglu_limit
            if not _finite_number(lim) or not lim > 0:
                raise ValueError(
                    f"MoEConfig.swiglu_limit={lim!r}: activation {self.activation!r} needs a finite float > 0"
                )
        elif self.swiglu_limit is not None:
            raise ValueError(
                f"MoEConfig.swiglu_limit={self.swiglu_limit!r}: only used by activations {_CLAMPED}, "
                f"got activation={self.activation!r} (use 'swiglu_clamp' for a clamped SiLU)"
            )
        a = self.gptoss_alpha
        if not _finite_number(a) or not a > 0:
            raise ValueError(f"MoEConfig.gptoss_alpha={a!r}: expected a finite float > 0")
        eps = self.router_prenorm_eps
        if not _finite_number(eps) or not eps >= 0:
            raise ValueError(f"MoEConfig.router_prenorm_eps={eps!r}: expected a finite float >= 0")

    @property
    def num_experts(self) -> int:
        """E, routed experts with weights (LongCat zero experts not counted)."""
        return self.router.num_experts

    @property
    def top_k(self) -> int:
        """K, picks per token."""
        return self.router.top_k


# eq=False: tensors have no boolean ==; two holders are equal only if they are the same object.
@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """The routed experts' tensors, held by reference (views of a model's parameters, never copies).

    gate_up:      layout "linear": [E, 2I, H] (y = x @ gate_up[e].T);
                  layout "matmul": [E, H, 2I] (y = x @ gate_up[e]).
    down:         layout "linear": [E, H, I];  layout "matmul": [E, I, H].
    gate_up_bias: [E, 2I] or None (gpt-oss).
    down_bias:    [E, H] or None (gpt-oss).
    layout:       "linear" | "matmul".
    interleaved:  gate/up columns of the 2I axis interleaved (gpt-oss) instead of halves.

    All tensors share one floating dtype and one device. E counts the experts held
    here: after `subset` (expert parallelism) it is the local count, not the model's.

    Quantized experts (`quant` a moeflow.quant.QuantSpec; table in moeflow.quant.storage):
    gate_up / down then hold the stored quantized data as checkpoints do, [E, 2I, H/P] and
    [E, H, I/P] ([E, out, in], P = 2 packed FP4 values a byte, 1 for FP8) whatever the
    layout, which names the form `dequantize(dtype)` returns. `dtype` is then the storage
    dtype (float8_e4m3fn / uint8); biases keep a floating dtype of their own.
    quant:               QuantSpec or None (plain floating weights).
    gate_up_scale:       block scales of gate_up (fp8_block: gate's grid then up's).
    down_scale:          block scales of down.
    gate_up_scale_2:     nvfp4 weight_scale_2 [E, 2] f32 (gate, up), else None.
    down_scale_2:        nvfp4 weight_scale_2 [E] f32, else None.
    gate_up_input_scale: nvfp4 input_scale [E, 2] f32 (static activation scale) or None.
    down_input_scale:    nvfp4 input_scale [E] f32 or None.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    layout: str = "linear"
    interleaved: bool = False
    quant: QuantSpec | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    gate_up_scale_2: torch.Tensor | None = None
    down_scale_2: torch.Tensor | None = None
    gate_up_input_scale: torch.Tensor | None = None
    down_input_scale: torch.Tensor | None = None
    # Derived sizes, filled by __post_init__ (frozen: set through object.__setattr__).
    _sizes: tuple[int, int, int] = field(default=(0, 0, 0), init=False, repr=False, compare=False)
    # Every per-expert tensor field (leading dim E), in one place for subset / nbytes.
    TENSOR_FIELDS: ClassVar[tuple[str, ...]] = (
        "gate_up", "down", "gate_up_bias", "down_bias", "gate_up_scale", "down_scale", "gate_up_scale_2",
        "down_scale_2", "gate_up_input_scale", "down_input_scale")

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"ExpertWeights.layout={self.layout!r}: expected one of {LAYOUTS}")
        if not isinstance(self.interleaved, bool):
            raise TypeError(f"ExpertWeights.interleaved={self.interleaved!r}: expected a bool")
        if self.quant is not None or any(getattr(self, n) is not None for n in self.TENSOR_FIELDS[4:]):
            # Quantized storage has its own shape and dtype rules (one place: moeflow.quant.storage).
            object.__setattr__(self, "_sizes", check_quantized(self))
            return
        for name in ("gate_up", "down"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"ExpertWeights.{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3:
                raise ValueError(f"ExpertWeights.{name}: shape {tuple(t.shape)}, expected a 3-D tensor [E, ., .]")
        gu, dn = self.gate_up, self.down
        if not gu.dtype.is_floating_point:
            raise TypeError(f"ExpertWeights.gate_up: dtype {gu.dtype}, expected a floating dtype")
        E = int(gu.shape[0])
        if self.layout == "linear":
            two_i, H = int(gu.shape[1]), int(gu.shape[2])
            want_down = (E, H, two_i // 2)
            names = "gate_up [E, 2I, H], down [E, H, I]"
        else:
            H, two_i = int(gu.shape[1]), int(gu.shape[2])
            want_down = (E, two_i // 2, H)
            names = "gate_up [E, H, 2I], down [E, I, H]"
        if two_i % 2 or two_i == 0:
            raise ValueError(
                f"ExpertWeights.gate_up: shape {tuple(gu.shape)} has an odd or empty 2I axis ({two_i}) "
                f"for layout {self.layout!r} ({names})"
            )
        if tuple(dn.shape) != want_down:
            raise ValueError(
                f"ExpertWeights.down: shape {tuple(dn.shape)}, expected {want_down} to match "
                f"gate_up {tuple(gu.shape)} in layout {self.layout!r} ({names})"
            )
        I = two_i // 2
        check_expert_biases(self, E, H, I)
        for name in ("down", "gate_up_bias", "down_bias"):
            t = getattr(self, name)
            if t is None:
                continue
            if t.dtype != gu.dtype:
                raise TypeError(f"ExpertWeights.{name}: dtype {t.dtype}, expected gate_up's dtype {gu.dtype}")
            if t.device != gu.device:
                raise ValueError(f"ExpertWeights.{name}: on {t.device}, expected gate_up's device {gu.device}")
        if (self.gate_up_bias is None) != (self.down_bias is None):
            raise ValueError(
                "ExpertWeights.gate_up_bias/down_bias: give both or neither "
                f"(gate_up_bias={'None' if self.gate_up_bias is None else 'tensor'}, "
                f"down_bias={'None' if self.down_bias is None else 'tensor'})"
            )
        object.__setattr__(self, "_sizes", (E, H, I))

    @property
    def num_experts(self) -> int:
        """E, experts held here."""
        return self._sizes[0]

    @property
    def hidden_size(self) -> int:
        """H."""
        return self._sizes[1]

    @property
    def intermediate_size(self) -> int:
        """I."""
        return self._sizes[2]

    @property
    def has_bias(self) -> bool:
        return self.gate_up_bias is not None

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.dtype

    @property
    def device(self) -> torch.device:
        return self.gate_up.device

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor held (weights, biases, scales), as stored."""
        return sum(t.numel() * t.element_size() for n in self.TENSOR_FIELDS if (t := getattr(self, n)) is not None)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (nbytes / E): what an offload slot or an EP transfer moves per expert."""
        return self.nbytes // self.num_experts

    def dequantize(self, dtype: torch.dtype) -> ExpertWeights:
        """Plain (unquantized) weights of `dtype` in this layout, values computed in f32 from the scales.

        Unquantized weights are cast (self when every tensor already has `dtype`). The
        numerical contract per format is in moeflow.quant.formats.
        """
        if self.quant is not None:
            return ExpertWeights(*dequantized_tensors(self, dtype), layout=self.layout, interleaved=self.interleaved)
        names = ("gate_up", "down", "gate_up_bias", "down_bias")
        if all(getattr(self, n) is None or getattr(self, n).dtype == dtype for n in names):
            return self
        return ExpertWeights(*(None if getattr(self, n) is None else getattr(self, n).to(dtype) for n in names),
                             layout=self.layout, interleaved=self.interleaved)

    def check_config(self, config: MoEConfig) -> None:
        """Raise ValueError naming the field where these weights disagree with `config`.

        The expert count is not compared: a subset (expert parallelism) holds fewer.
        """
        checks = (
            ("hidden_size", self.hidden_size, config.hidden_size),
            ("intermediate_size", self.intermediate_size, config.intermediate_size),
            ("layout", self.layout, config.layout),
            ("interleaved", self.interleaved, config.interleaved),
            ("expert_bias", self.has_bias, config.expert_bias),
        )
        for name, got, want in checks:
            if got != want:
                raise ValueError(
                    f"ExpertWeights.{name}={got!r} disagrees with MoEConfig.{name}={want!r} "
                    f"(gate_up {tuple(self.gate_up.shape)}, down {tuple(self.down.shape)})"
                )

    def subset(self, expert_ids: range | slice | Sequence[int] | torch.Tensor) -> ExpertWeights:
        """The weights of some experts, renumbered 0..len-1 in the order given.

        A contiguous ascending run (range / slice with step 1 / consecutive ids) gives
        views (no copy: what expert parallelism uses for its rank's range); any other
        selection is an index copy.
        """
        E = self.num_experts
        if isinstance(expert_ids, slice):
            start, stop, step = expert_ids.indices(E)
            ids = list(range(start, stop, step))
        elif isinstance(expert_ids, torch.Tensor):
            if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool or expert_ids.dim() != 1:
                raise TypeError(
                    f"expert_ids: {expert_ids.dtype}{tuple(expert_ids.shape)}, expected a 1-D integer tensor"
                )
            ids = [int(i) for i in expert_ids.tolist()]
        else:
            ids = [int(i) for i in expert_ids]
        if not ids:
            raise ValueError("expert_ids: empty, expected at least one expert")
        bad = [i for i in ids if not 0 <= i < E]
        if bad:
            raise ValueError(f"expert_ids: {bad[0]} outside [0, {E})")
        contiguous = ids == list(range(ids[0], ids[0] + len(ids)))

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if contiguous:
                return t.narrow(0, ids[0], len(ids))
            return t.index_select(0, torch.tensor(ids, dtype=torch.long, device=t.device))

        return ExpertWeights(
            take(self.gate_up),
            take(self.down),
            take(self.gate_up_bias),
            take(self.down_bias),
            layout=self.layout,
            interleaved=self.interleaved,
            quant=self.quant,
            **{n: take(getattr(self, n)) for n in self.TENSOR_FIELDS[4:]},
        )
