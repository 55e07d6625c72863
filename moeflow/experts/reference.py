"""`reference` experts: a plain loop over experts in torch, the oracle the others are tested against.

Legend: N (token, slot) rows, H hidden size, I intermediate size, E experts held.

Per expert e with rows R_e (in the order they come):
    gate_up = x[R_e] @ gate_up[e] (+ gate_up_bias[e])     layout-aware, see moeflow.config
    act     = apply_activation(gate_up, config)
    y[R_e]  = act @ down[e] (+ down_bias[e])
written exactly as the Hugging Face expert modules compute one expert (F.linear for
layout "linear", `@` for layout "matmul"), in the weights' dtype.

Quantized weights (`w.quant` set, any format of moeflow.quant): the rows run in f32 through
`w.dequantize(torch.float32)` (weight-only: activations are not quantized here), and the
result is cast back to the rows' dtype; bit-identical to running the dequantized f32
weights on the f32 rows.
"""

from __future__ import annotations

import torch

from ..config import ExpertWeights, MoEConfig
from ..quant.spec import FORMATS
from .activations import apply_activation
from .base import check_pairs, down_one, gate_up_one


class ReferenceExperts:
    """Loop over the experts that have rows; one host sync (the row counts) per call."""

    name = "reference"
    # Quantized formats it runs (through the dequantized f32 weights).
    quant_formats = FORMATS

    def supports(self, config: MoEConfig) -> tuple[bool, str]:
        return True, "reference runs every config on every device"

    def forward_pairs(
        self, x_NH: torch.Tensor, expert_N: torch.Tensor, w: ExpertWeights, config: MoEConfig
    ) -> torch.Tensor:
        """y_NH [N, H] (x's dtype): row n through expert expert_N[n], unweighted, rows in input order.

        Args:
            x_NH: [N, H] rows, dtype and device of the weights.
            expert_N: int [N], 0 <= id < w.num_experts.
            w: the experts' tensors.
            config: the layer's MoEConfig (activation and its constants).

        With quantized `w` the rows may have any floating dtype (the result has theirs).
        """
        if isinstance(w, ExpertWeights) and w.quant is not None and isinstance(x_NH, torch.Tensor):
            # The oracle for every quantized format: the exactly dequantized f32 weights, one path.
            y_NH = self.forward_pairs(x_NH.to(torch.float32), expert_N, w.dequantize(torch.float32), config)
            return y_NH.to(x_NH.dtype)
        check_pairs(x_NH, expert_N, w, config)
        y_NH = torch.empty_like(x_NH)
        if x_NH.shape[0] == 0:
            return y_NH
        # A stable sort keeps each expert's rows in their input order.
        expert_sorted_N, order_N = torch.sort(expert_N.long(), stable=True)
        counts = torch.bincount(expert_sorted_N, minlength=w.num_experts).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = order_N[start : start + n]
            act = apply_activation(gate_up_one(x_NH.index_select(0, rows), w, e), config)
            y_NH.index_copy_(0, rows, down_one(act, w, e))
            start += n
        return y_NH
