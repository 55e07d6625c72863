"""`grouped` experts: one grouped GEMM per projection over rows sorted by expert, or a bmm for small T.

Legend: N (token, slot) rows, H hidden size, I intermediate size, E experts held,
M rows of one expert.

Two paths, fixed per instance (`GroupedExperts(path=...)`), never switched on N inside
`forward_pairs`: a path change changes bits, and expert parallelism relies on the same
rows in the same order giving the same bits whatever else is in the call. Which path a
layer runs is chosen from T by `moeflow.experts.select.select_experts_impl`.

"grouped_mm": stable sort by expert, then `torch.nn.functional.grouped_mm` (torch >= 2.10)
    or `torch._grouped_mm` (2.9) with int32 offsets, for x @ gate_up and act @ down; the
    bias rows (gpt-oss) are gathered and added after each GEMM, as the HF modules add
    them. torch's grouped GEMM refuses operands whose row strides or base pointers are
    not 16-byte aligned (e.g. fp32 with H or I not a multiple of 4, or mmap'd
    safetensors on CPU torch <= 2.10), and on CUDA its fast kernel is bf16 on sm80+
    only; for those a projection falls back to one GEMM per non-empty expert (the
    `reference` loop, one host sync for the counts). The choice depends only on
    dtypes, strides and devices, so it is the same for the same tensors.
"bmm": no sort; each row gathers its expert's weights and runs as its own [1, H] GEMM
    (`torch.bmm`). No host sync and no grouping work, and every row's result depends
    on that row alone. It copies N experts' weights, so select only picks it for
    small N (decode).

On CPU the activation runs per expert block ("grouped_mm") or per row ("bmm"): CPU
elementwise kernels round their vectorised body and scalar tail differently, so an
activation over all N rows would make a row's bits depend on the rest of the call.
The two paths give different bits from each other: bit-identity across calls (expert
parallelism) needs the same path on both sides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ExpertWeights, MoEConfig
from .activations import apply_activation
from .base import check_pairs, down_as_KN, down_one, gate_up_as_KN, gate_up_one

PATHS: tuple[str, ...] = ("grouped_mm", "bmm")


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _grouped_mm_fn():
    """F.grouped_mm (torch >= 2.10), else torch._grouped_mm (2.9), else None."""
    fn = getattr(F, "grouped_mm", None)
    if fn is None:
        fn = getattr(torch, "_grouped_mm", None)
    return fn


def _aligned_2d(t: torch.Tensor) -> bool:
    """The last two dims are row- or column-major with a 16-byte leading stride (torch's check)."""
    align = 16 // t.element_size()
    s = t.stride()
    rows, cols = t.shape[-2], t.shape[-1]
    if s[-1] == 1 and s[-2] >= max(1, cols):
        return s[-2] % align == 0
    if s[-2] == 1 and s[-1] >= max(1, rows):
        return s[-1] % align == 0
    return False


def grouped_mm_usable(a_NK: torch.Tensor, b_EKM: torch.Tensor) -> tuple[bool, str]:
    """Whether torch's grouped GEMM takes (a [N, K] 2-D, b [E, K, M] 3-D) on this build, and why not."""
    fn = _grouped_mm_fn()
    if fn is None:
        return False, f"torch {torch.__version__} has neither F.grouped_mm nor torch._grouped_mm"
    dev = b_EKM.device
    if dev.type == "cpu":
        # No CPU kernel before 2.9 (pytorch issue 172440).
        if _torch_version() < (2, 9):
            return False, f"torch {torch.__version__} has no CPU grouped_mm kernel (needs >= 2.9)"
        if b_EKM.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False, f"dtype {b_EKM.dtype} not taken by the CPU grouped_mm"
    elif dev.type == "cuda":
        # Other dtypes go through torch's own per-expert loop: no better than ours.
        if b_EKM.dtype != torch.bfloat16:
            return False, f"dtype {b_EKM.dtype}: the CUDA grouped_mm kernel is bf16 only"
        if torch.cuda.get_device_capability(dev) < (8, 0):
            return False, "CUDA grouped_mm needs compute capability >= 8.0"
    else:
        return False, f"device type {dev.type!r} not handled"
    if a_NK.dtype != b_EKM.dtype:
        return False, f"operand dtypes differ ({a_NK.dtype} vs {b_EKM.dtype})"
    for name, t in (("rows", a_NK), ("weights", b_EKM)):
        if not _aligned_2d(t):
            return False, f"{name} stride {t.stride()} (shape {tuple(t.shape)}) is not 16-byte aligned"
        if t.data_ptr() % 16:
            return False, f"{name} base pointer is not 16-byte aligned"
    return True, ""


def _grouped_project(
    x_sorted_NK: torch.Tensor,
    b_EKM: torch.Tensor,
    offs_E: torch.Tensor,
    per_expert,
) -> torch.Tensor:
    """x_sorted @ b[e] for each expert's contiguous row block: grouped GEMM, or the per-expert loop."""
    ok, _ = grouped_mm_usable(x_sorted_NK, b_EKM)
    if ok:
        return _grouped_mm_fn()(x_sorted_NK, b_EKM, offs=offs_E)
    return per_expert(x_sorted_NK)


class GroupedExperts:
    """Grouped-GEMM experts (`path="grouped_mm"`) or per-row bmm experts (`path="bmm"`)."""

    name = "grouped"

    def __init__(self, path: str = "grouped_mm") -> None:
        if path not in PATHS:
            raise ValueError(f"GroupedExperts.path={path!r}: expected one of {PATHS}")
        self.path = path

    def __repr__(self) -> str:
        return f"GroupedExperts(path={self.path!r})"

    def supports(self, config: MoEConfig) -> tuple[bool, str]:
        return True, "grouped runs every activation, layout and bias on CPU and CUDA"

    def forward_pairs(
        self, x_NH: torch.Tensor, expert_N: torch.Tensor, w: ExpertWeights, config: MoEConfig
    ) -> torch.Tensor:
        """y_NH [N, H] (x's dtype): row n through expert expert_N[n], unweighted, rows in input order.

        Args:
            x_NH: [N, H] rows, dtype and device of the weights.
            expert_N: int [N], 0 <= id < w.num_experts.
            w: the experts' tensors.
            config: the layer's MoEConfig (activation and its constants).
        """
        check_pairs(x_NH, expert_N, w, config)
        if x_NH.shape[0] == 0:
            return torch.empty_like(x_NH)
        if self.path == "bmm":
            return self._bmm(x_NH, expert_N.long(), w, config)
        return self._grouped(x_NH, expert_N.long(), w, config)

    def _bmm(self, x_NH: torch.Tensor, expert_N: torch.Tensor, w: ExpertWeights, config: MoEConfig) -> torch.Tensor:
        gate_up_NKM = gate_up_as_KN(w).index_select(0, expert_N)  # [N, H, 2I], a copy
        gu_N2I = torch.bmm(x_NH.unsqueeze(1), gate_up_NKM).squeeze(1)
        if w.gate_up_bias is not None:
            gu_N2I = gu_N2I + w.gate_up_bias.index_select(0, expert_N)
        if x_NH.device.type == "cpu":
            # One row at a time: CPU elementwise kernels round differently in their
            # vectorised body and scalar tail, so a row's bits would depend on N.
            act_NI = torch.cat([apply_activation(gu_N2I[n : n + 1], config) for n in range(gu_N2I.shape[0])])
        else:
            act_NI = apply_activation(gu_N2I, config)
        down_NKM = down_as_KN(w).index_select(0, expert_N)  # [N, I, H]
        y_NH = torch.bmm(act_NI.unsqueeze(1), down_NKM).squeeze(1)
        if w.down_bias is not None:
            y_NH = y_NH + w.down_bias.index_select(0, expert_N)
        return y_NH

    def _grouped(
        self, x_NH: torch.Tensor, expert_N: torch.Tensor, w: ExpertWeights, config: MoEConfig
    ) -> torch.Tensor:
        E = w.num_experts
        # Stable: each expert's rows stay in input order (the bit-identity contract).
        expert_sorted_N, order_N = torch.sort(expert_N, stable=True)
        # scatter_add instead of bincount: bincount sizes its output from the max id,
        # a device sync on CUDA.
        counts_E = torch.zeros(E, dtype=torch.int64, device=x_NH.device)
        counts_E.scatter_add_(0, expert_sorted_N, torch.ones_like(expert_sorted_N))
        offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
        host_counts: list[int] | None = None

        def loop(project):
            # Fallback: one GEMM per non-empty expert over its contiguous block (bias added below).
            def run(rows_NK: torch.Tensor) -> torch.Tensor:
                nonlocal host_counts
                if host_counts is None:
                    host_counts = counts_E.tolist()
                parts, start = [], 0
                for e, n in enumerate(host_counts):
                    if n:
                        parts.append(project(rows_NK[start : start + n], w, e, bias=False))
                        start += n
                return torch.cat(parts, dim=0)

            return run

        x_sorted_NH = x_NH.index_select(0, order_N)
        gu_N2I = _grouped_project(x_sorted_NH, gate_up_as_KN(w), offs_E, loop(gate_up_one))
        if w.gate_up_bias is not None:
            gu_N2I = gu_N2I + w.gate_up_bias.index_select(0, expert_sorted_N)
        if x_NH.device.type == "cpu":
            # One expert block at a time: CPU elementwise kernels (exp, tanh) round
            # differently in their vectorised body and scalar tail, so over all N rows an
            # expert's bits would depend on the other experts' rows. Per block they do not
            # (the counts are host memory here, no sync).
            if host_counts is None:
                host_counts = counts_E.tolist()
            blocks, start = [], 0
            for n in host_counts:
                if n:
                    blocks.append(apply_activation(gu_N2I[start : start + n], config))
                    start += n
            act_NI = torch.cat(blocks)
        else:
            # CUDA elementwise kernels compute each element the same way wherever it sits.
            act_NI = apply_activation(gu_N2I, config).contiguous()
        ys_NH = _grouped_project(act_NI, down_as_KN(w), offs_E, loop(down_one))
        if w.down_bias is not None:
            ys_NH = ys_NH + w.down_bias.index_select(0, expert_sorted_N)
        y_NH = torch.empty_like(x_NH)
        y_NH.index_copy_(0, order_N, ys_NH.to(x_NH.dtype))
        return y_NH
