"""The gated activations of every MoE family, in one place.

Legend: N rows (token, slot pairs), I intermediate size per expert.

Each branch mirrors the Hugging Face module it is checked against (transformers 5.x):
    "silu"         MixtralExperts / Qwen*Experts / LongcatFlashExperts: silu(gate) * up
    "gelu_tanh"    Gemma4TextExperts (hidden_activation "gelu_pytorch_tanh"):
                   gelu(gate, approximate="tanh") * up
    "swiglu_clamp" DeepseekV4Experts._apply_gate: gate.clamp(max=limit),
                   up.clamp(-limit, limit), silu(gate) * up
    "gptoss"       GptOssExperts._apply_gate: gate.clamp(max=limit), up.clamp(-limit, limit),
                   glu = gate * sigmoid(gate * alpha), (up + 1) * glu
Llama4TextExperts computes `up * silu(gate)`; the product commutes bit-exactly,
so "silu" covers it.

The split of the 2I axis is `config.interleaved`: halves (`chunk(2, -1)`: first I
gate, next I up) or interleaved (even columns gate, odd up: gpt-oss).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import MoEConfig


def split_gate_up(gate_up_N2I: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_NI, up_NI) views of gate_up [..., 2I]: halves, or even/odd columns when interleaved."""
    if interleaved:
        return gate_up_N2I[..., ::2], gate_up_N2I[..., 1::2]
    gate, up = gate_up_N2I.chunk(2, dim=-1)
    return gate, up


def apply_activation(gate_up_N2I: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """The gated activation of one family.

    Args:
        gate_up_N2I: [N, 2I] (any leading dims), the gate/up projection output
            (bias already added), in the compute dtype.
        config: the layer's MoEConfig (activation, swiglu_limit, gptoss_alpha, interleaved).

    Returns:
        act_NI: [N, I], same dtype and device as the input.
    """
    gate, up = split_gate_up(gate_up_N2I, config.interleaved)
    act = config.activation
    if act == "silu":
        return F.silu(gate) * up
    if act == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    limit = float(config.swiglu_limit)  # validated > 0 by MoEConfig for these two
    # Asymmetric on purpose (DeepSeek-V4 and gpt-oss alike): the gate has no lower bound.
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    if act == "swiglu_clamp":
        return F.silu(gate) * up
    if act == "gptoss":
        glu = gate * torch.sigmoid(gate * config.gptoss_alpha)
        return (up + 1) * glu
    raise ValueError(f"MoEConfig.activation={act!r}: no activation math for it")  # unreachable after validation
