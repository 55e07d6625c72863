"""Validation of the router's inputs, shared by the CPU reference and the CUDA launchers.

Legend: T tokens, E routed experts, Z zero experts, S = E + Z logit columns, K picks
per token, V vocabulary size.
"""

from __future__ import annotations

import torch

from .hash import check_distinct_rows
from .spec import RouterSpec

__all__ = ["check_finite_vector", "validate_route_inputs"]


def _check_vector(name: str, t: torch.Tensor | None, length: int, spec: RouterSpec) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected ({length},) for {spec.num_slots} logit columns")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name}: dtype {t.dtype}, expected a floating dtype")
    if not t.is_cuda:
        check_finite_vector(name, t)


def check_finite_vector(name: str, t: torch.Tensor, *, unit: str = "expert") -> None:
    """ValueError naming `name` and the first `unit` (index) whose value is NaN or infinite (reads `t`).

    A NaN ranks (or weighs) experts as silently as a NaN logit; an infinite selection bias
    does too: two of opposite sign in one group make its top-2 sum inf - inf = NaN, which
    the group ranking puts first. No checkpoint holds either.
    """
    if not t.numel():
        return
    bad = ~torch.isfinite(t.detach())
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        v = float(t[i])
        raise ValueError(f"{name}: {'NaN' if v != v else v} at {unit} {i}, expected finite values "
                         f"({int(bad.sum())} of {t.numel()} are not)")


def validate_route_inputs(
    logits_TS: torch.Tensor,
    spec: RouterSpec,
    *,
    bias: torch.Tensor | None,
    expert_scale: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    hash_table: torch.Tensor | None,
    check_nan: bool = True,
    layer: int | None = None,
) -> None:
    """Raise TypeError/ValueError naming the field for every input `route` refuses.

    `check_nan` reads the logits on the host (one sync on CUDA); the GPU path
    passes False and uses a device-side flag instead.
    """
    if not isinstance(spec, RouterSpec):
        raise TypeError(f"spec: expected RouterSpec, got {type(spec).__name__}")
    if not isinstance(logits_TS, torch.Tensor):
        raise TypeError(f"logits_TE: expected a torch.Tensor, got {type(logits_TS).__name__}")
    if logits_TS.dtype != torch.float32:
        raise TypeError(f"logits_TE: dtype {logits_TS.dtype}, expected torch.float32 (router logits are f32)")
    if logits_TS.dim() != 2 or logits_TS.shape[1] != spec.num_slots:
        raise ValueError(
            f"logits_TE: shape {tuple(logits_TS.shape)}, expected (T, {spec.num_slots}) "
            f"(num_experts={spec.num_experts} + num_zero_experts={spec.num_zero_experts})"
        )
    if spec.use_bias and bias is None:
        raise ValueError("bias: None, but spec.use_bias=True (pass e_score_correction_bias)")
    if bias is not None and not spec.use_bias:
        raise ValueError("bias: given, but spec.use_bias=False")
    _check_vector("bias", bias, spec.num_slots, spec)
    if spec.expert_scale and expert_scale is None:
        raise ValueError("expert_scale: None, but spec.expert_scale=True")
    if expert_scale is not None and not spec.expert_scale:
        raise ValueError("expert_scale: given, but spec.expert_scale=False")
    _check_vector("expert_scale", expert_scale, spec.num_slots, spec)
    T = logits_TS.shape[0]
    if spec.hash_routing:
        if hash_table is None or input_ids is None:
            raise ValueError(
                f"hash_table/input_ids: spec.hash_routing=True needs both, got "
                f"hash_table={'None' if hash_table is None else 'tensor'}, input_ids={'None' if input_ids is None else 'tensor'}"
            )
        for n, t in (("hash_table", hash_table), ("input_ids", input_ids)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
        if hash_table.dim() != 2 or hash_table.shape[1] != spec.top_k:
            raise ValueError(f"hash_table: shape {tuple(hash_table.shape)}, expected (vocab, K={spec.top_k})")
        if hash_table.dtype.is_floating_point or hash_table.dtype == torch.bool:
            raise TypeError(f"hash_table: dtype {hash_table.dtype}, expected an integer dtype")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids: dtype {input_ids.dtype}, expected an integer dtype")
        if input_ids.numel() != T:
            raise ValueError(f"input_ids: {input_ids.numel()} ids for T={T} logit rows")
        if check_nan and T:
            vocab = hash_table.shape[0]
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(f"input_ids: id {bad} out of the hash table's vocabulary [0, {vocab})")
            tlo, thi = int(hash_table.min()), int(hash_table.max())
            if tlo < 0 or thi >= spec.num_slots:
                raise ValueError(f"hash_table: expert id {tlo if tlo < 0 else thi} outside [0, {spec.num_slots})")
            # Only the rows this batch looks up (T x K, cheap per call); the whole table is
            # checked once by `check_hash_table` where a layer is built.
            flat_ids = input_ids.reshape(-1).long()
            check_distinct_rows(hash_table[flat_ids], name="hash_table", row_ids=flat_ids)
    if check_nan and T:
        nan_rows = torch.isnan(logits_TS).any(dim=1)
        if bool(nan_rows.any()):
            row = int(nan_rows.nonzero()[0, 0])
            where = f" of layer {layer}" if layer is not None else ""
            raise ValueError(f"logits_TE: NaN logit in token row {row}{where} ({int(nan_rows.sum())} rows hold NaN)")
