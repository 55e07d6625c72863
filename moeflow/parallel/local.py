"""Local (one-device) dispatch and combine: permute (token, slot) pairs by expert, and back.

Legend: T tokens, K picks per token, H hidden size, E routed experts, Z zero experts,
P = T*K (token, slot) pairs flattened row-major (pair p = t*K + k), N pairs that go to
a routed expert (P minus the zero-expert pairs).

    d      = local_dispatch(ids_TK, E, num_zero_experts=Z)
    x_NH   = dispatch_rows(x_TH, d)                  # row n is token d.token_N[n]
    y_NH   = impl.forward_pairs(x_NH, d.expert_N, w, config)
    y_TKH  = unpermute_TKH(y_NH, d)
    out_TH = combine_TH(y_TKH, weights_TK, x_TH=x_TH, zero_TK=d.zero_TK)

Expert parallelism reuses `combine_TH` on the source rank with the partial outputs it
gathered, so both paths sum in the same slot order and give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..types import PairBatch, RoutingResult, TokenBatch

__all__ = [
    "LocalDispatch", "local_dispatch", "dispatch_rows", "unpermute_TKH", "combine_TH", "LocalDispatcher",
    "LocalHandle", "LOCAL",
]


@dataclass(frozen=True, eq=False)
class LocalDispatch:
    """The permutation of one call's (token, slot) pairs, grouped by expert.

    num_tokens:  T.
    top_k:       K.
    num_experts: E (routed; ids >= E are zero experts and are not dispatched).
    order_N:     int64 [N], flat pair index p = t*K + k of each dispatched row. Rows are
                 sorted stably by expert, so each expert sees its rows in (token, slot) order.
    expert_N:    int64 [N], expert of each row, non-decreasing.
    token_N:     int64 [N], token of each row (order_N // K).
    counts_E:    int64 [E], rows per expert (on the ids' device; reading it is a sync).
    zero_TK:     bool [T, K], True at zero-expert picks; None when the layer has no zero
                 experts (then N = P and building the dispatch needed no host sync).
    """

    num_tokens: int
    top_k: int
    num_experts: int
    order_N: torch.Tensor
    expert_N: torch.Tensor
    token_N: torch.Tensor
    counts_E: torch.Tensor
    zero_TK: torch.Tensor | None

    @property
    def num_rows(self) -> int:
        """N, rows sent to routed experts."""
        return int(self.order_N.shape[0])


def local_dispatch(ids_TK: torch.Tensor, num_experts: int, *, num_zero_experts: int = 0) -> LocalDispatch:
    """Group the (token, slot) pairs of `ids_TK` by expert (stable), skipping zero experts.

    Args:
        ids_TK: int [T, K] picks (any integer dtype); ids in [0, E + Z), where ids >= E
            are zero (identity) experts.
        num_experts: E.
        num_zero_experts: Z. With Z = 0 every pair is dispatched and no host sync
            happens; with Z > 0 the count of real pairs is read back (one sync on CUDA).

    Raises:
        ValueError/TypeError naming the argument for a bad shape, dtype or (CPU only,
        where checking costs no sync) an id outside [0, E + Z).
    """
    if not isinstance(ids_TK, torch.Tensor):
        raise TypeError(f"ids_TK: expected a torch.Tensor, got {type(ids_TK).__name__}")
    if ids_TK.dim() != 2:
        raise ValueError(f"ids_TK: shape {tuple(ids_TK.shape)}, expected 2-D [T, K]")
    if ids_TK.dtype.is_floating_point or ids_TK.dtype == torch.bool:
        raise TypeError(f"ids_TK: dtype {ids_TK.dtype}, expected an integer dtype")
    for name, v, lo in (("num_experts", num_experts, 1), ("num_zero_experts", num_zero_experts, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r}: expected an int >= {lo}")
    T, K = int(ids_TK.shape[0]), int(ids_TK.shape[1])
    E, S = num_experts, num_experts + num_zero_experts
    if ids_TK.device.type == "cpu" and ids_TK.numel():
        lo, hi = int(ids_TK.min()), int(ids_TK.max())
        if lo < 0 or hi >= S:
            raise ValueError(
                f"ids_TK: id {lo if lo < 0 else hi} outside [0, {S}) "
                f"(num_experts={E} + num_zero_experts={num_zero_experts})"
            )
    ids_P = ids_TK.reshape(-1).long()
    zero_TK = None
    if num_zero_experts:
        zero_TK = ids_TK >= E
        # Every zero expert sorts into one bin past the routed ones, so the routed
        # rows form the prefix of the stable sort.
        ids_P = ids_P.clamp(max=E)
    expert_P, order_P = torch.sort(ids_P, stable=True)
    # scatter_add, not bincount: bincount sizes its output from the max id (a sync).
    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids_TK.device)
    counts.scatter_add_(0, expert_P, torch.ones_like(expert_P))
    counts_E = counts[:E]
    if num_zero_experts:
        n = T * K - int(counts[E])
        expert_P, order_P = expert_P[:n], order_P[:n]
    return LocalDispatch(
        num_tokens=T,
        top_k=K,
        num_experts=E,
        order_N=order_P,
        expert_N=expert_P,
        token_N=torch.div(order_P, K, rounding_mode="floor") if K > 1 else order_P,
        counts_E=counts_E,
        zero_TK=zero_TK,
    )


def dispatch_rows(x_TH: torch.Tensor, d: LocalDispatch) -> torch.Tensor:
    """x_NH [N, H]: the token row of each dispatched pair (a gather, x's dtype)."""
    if x_TH.dim() != 2 or x_TH.shape[0] != d.num_tokens:
        raise ValueError(f"x_TH: shape {tuple(x_TH.shape)}, expected ({d.num_tokens}, H) for this dispatch")
    return x_TH.index_select(0, d.token_N)


def unpermute_TKH(y_NH: torch.Tensor, d: LocalDispatch) -> torch.Tensor:
    """y_TKH [T, K, H]: each dispatched row put back at its (token, slot); zero-expert slots hold 0."""
    if y_NH.dim() != 2 or y_NH.shape[0] != d.num_rows:
        raise ValueError(f"y_NH: shape {tuple(y_NH.shape)}, expected ({d.num_rows}, H) for this dispatch")
    T, K, H = d.num_tokens, d.top_k, int(y_NH.shape[1])
    # zeros only where some slots stay unwritten (zero experts); else every slot is written.
    alloc = torch.zeros if d.zero_TK is not None else torch.empty
    y_PH = alloc(T * K, H, dtype=y_NH.dtype, device=y_NH.device)
    y_PH.index_copy_(0, d.order_N, y_NH)
    return y_PH.view(T, K, H)


def combine_TH(
    y_TKH: torch.Tensor,
    weights_TK: torch.Tensor,
    *,
    x_TH: torch.Tensor | None = None,
    zero_TK: torch.Tensor | None = None,
    weight_on_input: bool = False,
    out_dtype: torch.dtype | None = None,
    out_TH: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum over k = 0..K-1, in that order, of weights[t, k] * y[t, k], accumulated in f32.

    Args:
        y_TKH: [T, K, H] unweighted expert outputs per (token, slot). Values at
            zero-expert slots are ignored (never multiplied: NaN there cannot leak).
        weights_TK: float [T, K] combine weights (RoutingResult.weights_TK).
        x_TH: [T, H] the layer input; needed when `zero_TK` marks any slot.
        zero_TK: bool [T, K] zero-expert (identity) slots, or None. Such a slot
            contributes weights[t, k] * x[t].
        weight_on_input: llama4: the weight already scaled the expert input, so routed
            slots combine with weight 1 (zero-expert slots still take w * x).
        out_dtype: result dtype; default y's dtype.
        out_TH: [T, H] tensor the result is written into (rows of a larger buffer a
            collective sends, say); its dtype is the result's. A float32 one is the
            accumulator itself (no copy). Same sums, same bits.

    Returns:
        out_TH [T, H] in out_dtype. The shared expert is not included (added once, after).
    """
    if y_TKH.dim() != 3:
        raise ValueError(f"y_TKH: shape {tuple(y_TKH.shape)}, expected 3-D [T, K, H]")
    T, K, H = (int(s) for s in y_TKH.shape)
    if weights_TK.shape != (T, K):
        raise ValueError(f"weights_TK: shape {tuple(weights_TK.shape)}, expected ({T}, {K}) to match y_TKH")
    if not weights_TK.dtype.is_floating_point:
        raise TypeError(f"weights_TK: dtype {weights_TK.dtype}, expected a floating dtype")
    if zero_TK is not None:
        if zero_TK.shape != (T, K) or zero_TK.dtype != torch.bool:
            raise ValueError(f"zero_TK: {zero_TK.dtype}{tuple(zero_TK.shape)}, expected bool ({T}, {K})")
        if x_TH is None:
            raise ValueError("x_TH: None, but zero_TK is given (zero experts contribute w * x)")
        if x_TH.shape != (T, H):
            raise ValueError(f"x_TH: shape {tuple(x_TH.shape)}, expected ({T}, {H})")
    if out_TH is not None:
        if tuple(out_TH.shape) != (T, H):
            raise ValueError(f"out_TH: shape {tuple(out_TH.shape)}, expected ({T}, {H})")
        if out_dtype is not None and out_dtype != out_TH.dtype:
            raise ValueError(f"out_dtype={out_dtype} but out_TH has dtype {out_TH.dtype}")
        return _combine_into(y_TKH, weights_TK, out_TH, x_TH=x_TH, zero_TK=zero_TK,
                             weight_on_input=weight_on_input)
    out_dtype = out_dtype or y_TKH.dtype
    acc_TH = torch.empty(T, H, dtype=torch.float32, device=y_TKH.device)
    _combine_into(y_TKH, weights_TK, acc_TH, x_TH=x_TH, zero_TK=zero_TK, weight_on_input=weight_on_input)
    return acc_TH.to(out_dtype)


def _combine_into(y_TKH, weights_TK, out_TH, *, x_TH, zero_TK, weight_on_input) -> torch.Tensor:
    """`combine_TH`'s sum into out_TH: f32 adds in slot order, in place (a float32 out_TH is the accumulator;
    another dtype gets the f32 sum copied in once)."""
    T, K, H = (int(s) for s in y_TKH.shape)
    acc_TH = out_TH.zero_() if out_TH.dtype == torch.float32 else \
        torch.zeros(T, H, dtype=torch.float32, device=y_TKH.device)
    w_TK = weights_TK.to(torch.float32)
    for k in range(K):
        y_TH = y_TKH[:, k].to(torch.float32)
        w_T1 = w_TK[:, k : k + 1]
        if zero_TK is not None:
            z_T1 = zero_TK[:, k : k + 1]
            # where, not arithmetic masking: garbage at a zero slot never touches the sum.
            y_TH = torch.where(z_T1, x_TH.to(torch.float32), y_TH)
            if weight_on_input:
                w_T1 = torch.where(z_T1, w_T1, torch.ones_like(w_T1))
            acc_TH.add_(w_T1 * y_TH)
        elif weight_on_input:
            acc_TH.add_(y_TH)
        else:
            acc_TH.add_(w_T1 * y_TH)
    if acc_TH is not out_TH:
        out_TH.copy_(acc_TH)
    return out_TH


# ----------------------------------------------------------------------------- the dispatcher


@dataclass(frozen=True, eq=False)
class LocalHandle:
    """What `LocalDispatcher.dispatch` hands out.

    batch:      PairBatch (rows grouped by expert) or TokenBatch (the fused form).
    dispatch:   the LocalDispatch permutation (None in the fused form).
    x_TH, weights_TK: the layer input and combine weights (zero experts add w * x).
    weight_on_input: llama4 (the experts saw w * x; routed slots combine with weight 1).
    """

    batch: PairBatch | TokenBatch
    dispatch: LocalDispatch | None
    x_TH: torch.Tensor
    weights_TK: torch.Tensor
    weight_on_input: bool

    @property
    def num_tokens(self) -> int:
        return int(self.x_TH.shape[0])


class LocalDispatcher:
    """One device: permute the (token, slot) pairs by expert and back (no communication).

    Stateless: one instance serves every layer (`LOCAL`).
    """

    name = "local"
    fuses = True

    def dispatch(self, x_TH: torch.Tensor, routing: RoutingResult, spec, *, fused: bool = False) -> LocalHandle:
        """Group the pairs of `routing` by expert (or, `fused` and no zero experts, hand out the
        tokens for an impl that dispatches itself). No host sync unless the layer has zero experts."""
        ids_TK, weights_TK = routing.ids_TK, routing.weights_TK
        if fused and spec.num_zero_experts == 0:
            return LocalHandle(TokenBatch(x_TH, ids_TK, weights_TK), None, x_TH, weights_TK, spec.weight_on_input)
        d = local_dispatch(ids_TK, spec.num_experts, num_zero_experts=spec.num_zero_experts)
        w_N = None
        if spec.weight_on_input:
            w_N = weights_TK.reshape(-1).index_select(0, d.order_N).to(torch.float32)
        batch = PairBatch(dispatch_rows(x_TH, d), d.expert_N, None, w_N, num_tokens=int(x_TH.shape[0]))
        return LocalHandle(batch, d, x_TH, weights_TK, spec.weight_on_input)

    def combine(self, y: torch.Tensor, handle: LocalHandle) -> torch.Tensor:
        """out_TH [T, H] (x's dtype): y itself in the fused form, else unpermute + slot-order sum."""
        if handle.dispatch is None:
            return y
        d = handle.dispatch
        return combine_TH(unpermute_TKH(y, d), handle.weights_TK, x_TH=handle.x_TH, zero_TK=d.zero_TK,
                          weight_on_input=handle.weight_on_input, out_dtype=handle.x_TH.dtype)

    def token_stats(self, handle: LocalHandle) -> dict[str, int]:
        """Pair counts of a forward (one host read): every routed pair is local here."""
        T, K = handle.num_tokens, int(handle.weights_TK.shape[1])
        zero = 0 if handle.dispatch is None or handle.dispatch.zero_TK is None else int(handle.dispatch.zero_TK.sum())
        return {"local": T * K - zero, "sent": 0, "received": 0, "zero": zero}

    def __repr__(self) -> str:
        return "LocalDispatcher()"


LOCAL = LocalDispatcher()
