"""The all-reduce expert-parallel plan (`ep_mode="all_reduce"`).

Legend: T tokens (the same T rows on every rank), K picks, P = T*K pairs, H hidden,
W ranks, E routed experts, L experts on this rank, N rows this rank computes.

Every rank holds the same x_TH (replicated activations, as after a tensor-parallel
attention block) and the same routing. Each rank runs only the pairs whose expert it
owns, sums them per token in slot order (the other slots contribute exactly 0), and
one all_reduce (in `reduce_dtype`, float32 by default) adds the W partial sums. Zero
experts (w * x) are added after the reduce, on every rank, so they count once; the
layer adds the shared expert after that, also once.

With redundant copies every rank picks the same copy for a pair (`plan.physical_ids` with
offset 0 on the same routing), so each pair is computed once.

The cross-rank sum runs in the backend's order, not in slot order, so this plan
matches the single-process layer within rounding (float32 accumulation of the partial
sums, one rounding to x's dtype at the end), not bit for bit; the all-to-all plan is
the bit-exact one.

`static=True` (decode / CUDA graphs): every one of the P pairs is a row (pairs owned
elsewhere get a zero input, sort after the real rows and are masked out), so no count
is read on the host. Otherwise the owned pairs are found with one `nonzero` (a sync).

The mode needs every rank to hold the same tokens. `dispatch` checks it with one tiny
collective (T and two float64 checksums of x per rank, all-gathered) and raises
EPInputMismatch on every rank when they differ, instead of a silently wrong sum or a
backend abort on mismatched shapes. `check_inputs=False` (or CUDA-graph capture, where
nothing may read back) skips the check. Use all_to_all when ranks hold different tokens.

Every step's collectives carry the step header of `dist_utils.EPStep`: C = 5 extra
float64 slots of that input check's all-gather (read with it), and hr header rows after
the T partial-sum rows of the all_reduce (per rank SUM_HEADER_LEN small digits in its own
block, exact in any float sum). A rank that refuses the step runs its remaining collectives
with a REFUSED / FAILED header; every rank then raises (EPStepAborted, or EPStepMismatch
when a rank is at another step or layer) and the group is marked broken. With
`check_inputs=False` the all_reduce's header is the only one: ranks out of step with
different T then meet in an all_reduce of different sizes, which the backend may abort on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..types import PairBatch, RoutingResult
from .dist_utils import (
    HEADER_LEN,
    SUM_HEADER_LEN,
    EPInputMismatch,
    EPStep,
    EPStepOwner,
    collective,
    group_device,
    group_rank,
    group_size,
    owes_nothing,
)
from .local import combine_TH
from .plan import EPPlan, Placement, ep_plan

__all__ = ["ARHandle", "AllReduceDispatcher", "AllReduceEP"]


@dataclass(frozen=True, eq=False)
class ARHandle:
    """The rows this rank computes under the all-reduce plan.

    plan:          EPPlan of the (replicated) routing.
    pair_N:        int64 [N] flat pair ids t*K+k of the rows, grouped stably by local expert
                   (static: all P pairs, owned ones first).
    recv_x_NH:     [N, H] input rows (the token row; zero for unowned rows in static mode).
    recv_expert_N: int64 [N] local expert index (unowned static rows: L-1).
    recv_weight_N: float32 [N] routing weight of each row.
    recv_valid_N:  bool [N] row is owned here (all True in the dynamic mode).
    x_TH, weights_TK: the layer input and weights (combine adds w*x for zero experts).
    """

    plan: EPPlan
    pair_N: torch.Tensor
    recv_x_NH: torch.Tensor
    recv_expert_N: torch.Tensor
    recv_weight_N: torch.Tensor
    recv_valid_N: torch.Tensor
    x_TH: torch.Tensor
    weights_TK: torch.Tensor
    rank: int
    world_size: int
    weight_on_input: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.x_TH.shape[0])

    static: bool = False
    step: EPStep | None = None  # the EP step the dispatch ran in (combine finishes it)

    @property
    def batch(self) -> PairBatch:
        """The rows this rank computes (static: every pair, unowned ones marked invalid)."""
        K = self.plan.top_k
        return PairBatch(self.recv_x_NH, self.recv_expert_N, self.recv_valid_N if self.static else None,
                         self.recv_weight_N, num_tokens=max(1, int(self.recv_x_NH.shape[0]) // max(1, K)))

    def bytes_moved(self, elem_size: int, reduce_elem_size: int = 4) -> int:
        """Bytes a ring all-reduce sends from this rank: 2 (W-1)/W of the [T, H] partial."""
        W = self.world_size
        return 2 * (W - 1) * self.num_tokens * int(self.x_TH.shape[1]) * reduce_elem_size // max(W, 1)


class AllReduceDispatcher(EPStepOwner):
    """Masked-local experts plus one all_reduce (the `Dispatcher` of `ep_mode="all_reduce"`).

    placement:    which rank owns each expert.
    group:        the EP process group.
    timeout_s:    per-collective timeout (EPCollectiveError past it), None: the group's own.
    static:       fixed-shape rows (no host read), see the module docstring.
    reduce_dtype: dtype of the partial sums on the wire (float32 keeps the f32 accumulation
                  of the single-process combine; bfloat16 halves the bytes).
    num_zero_experts: Z; when > 0 combine adds w * x for the zero-expert slots.
    check_inputs: check once per call that every rank holds the same tokens (one tiny
                  collective and a host read; skipped under CUDA-graph capture).
    """

    name = "all_reduce"
    fuses = False

    def __init__(
        self,
        placement: Placement,
        group: dist.ProcessGroup,
        *,
        timeout_s: float | None = None,
        static: bool = False,
        reduce_dtype: torch.dtype = torch.float32,
        num_zero_experts: int = 0,
        check_inputs: bool = True,
    ) -> None:
        if not isinstance(placement, Placement):
            raise TypeError(f"placement: expected a Placement, got {type(placement).__name__}")
        self.group = group
        self.rank = group_rank(group)
        self.world_size = group_size(group)
        if placement.world_size != self.world_size:
            raise ValueError(
                f"placement.world_size={placement.world_size} but the process group has {self.world_size} ranks"
            )
        if not reduce_dtype.is_floating_point:
            raise TypeError(f"reduce_dtype={reduce_dtype}: expected a floating dtype")
        self.placement = placement
        self.timeout_s = timeout_s
        self.static = bool(static)
        self.reduce_dtype = reduce_dtype
        self.num_local = placement.num_local(self.rank)
        self.num_zero_experts = int(num_zero_experts)
        if not isinstance(check_inputs, bool):
            raise TypeError(f"check_inputs={check_inputs!r}: expected a bool")
        self.check_inputs = check_inputs

    # ------------------------------------------------------------------ the EP step

    def _checks_inputs(self) -> bool:
        return self.check_inputs and not _capturing()

    def _owed_unstarted(self, step: EPStep, x_TH: torch.Tensor, K: int = 0):
        """What a step owes when this rank refuses it before sending anything: the input check's
        all-gather (every rank reads it and stops), else the all_reduce."""

        def owed(status: int, detail: int) -> bool:
            if self._checks_inputs():
                self._gather_check(step, x_TH, status, detail)
                return True
            return self._owed_reduce(step, x_TH, status, detail)

        return owed

    def _owed_reduce(self, step: EPStep, x_TH: torch.Tensor, status: int, detail: int) -> bool:
        T, H = int(x_TH.shape[0]), int(x_TH.shape[-1])
        hr = self._header_rows(H)
        wire = torch.zeros(T + hr, H, dtype=self.reduce_dtype, device=x_TH.device)
        step.write_sum_header(wire[T:].view(-1), self.rank, status, detail)
        collective("all_reduce(partial expert sums)", dist.all_reduce, wire, group=self.group,
                   timeout_s=self.timeout_s)
        return step.read_now(x_TH.device)

    def _header_rows(self, H: int) -> int:
        """Rows of H that hold the W ranks' digit blocks of the all_reduce's header."""
        return -(-(self.world_size * SUM_HEADER_LEN) // max(1, H))

    # ------------------------------------------------------------------ the Dispatcher protocol

    def dispatch(self, x_TH: torch.Tensor, routing: RoutingResult, spec, *, fused: bool = False) -> ARHandle:
        """Check that the ranks hold the same tokens (unless check_inputs=False), pick this rank's pairs.

        Collective: every rank calls it with the same x_TH [T, H].
        Raises EPInputMismatch on every rank when T or the tokens differ across ranks.
        """
        step = self._open(x_TH)
        try:
            if torch.is_grad_enabled() and x_TH.requires_grad:
                raise NotImplementedError(
                    "expert parallelism is inference-only: its collectives carry no autograd; run under "
                    "torch.no_grad() or torch.inference_mode()"
                )
            if self._checks_inputs():
                self._check_same_tokens(step, x_TH)
            h = self._dispatch_pairs(step, x_TH, routing.ids_TK, routing.weights_TK)
        except BaseException as exc:
            step.abort(exc)
            raise
        if spec.weight_on_input:
            from dataclasses import replace

            h = replace(h, weight_on_input=True)
        return h

    def combine(self, y_NH: torch.Tensor, handle: ARHandle) -> torch.Tensor:
        """out_TH [T, H] (x's dtype): the routed output of all ranks (zero experts included)."""
        return self.combine_pairs(y_NH, handle, weight_on_input=handle.weight_on_input)

    def token_stats(self, h: ARHandle) -> dict[str, int]:
        """Pair counts of a forward: every pair owned here is local; nothing travels (one host read)."""
        zero = int(h.plan.is_zero_TK[: h.num_tokens].sum())
        return {"local": int(h.recv_valid_N.sum()), "sent": 0, "received": 0, "zero": zero}

    def _gather_check(self, step: EPStep, x_TH: torch.Tensor, status: int = 0, detail: int = 0
                      ) -> list[torch.Tensor]:
        """All-gather (T, sum x, sum x * position, the step header) per rank: W float64 [3 + C] tensors."""
        dev = group_device(self.group)
        xd = x_TH.detach().to(torch.float64)
        T = int(x_TH.shape[0])
        pos = torch.arange(1, xd.numel() + 1, dtype=torch.float64, device=xd.device).view_as(xd) if xd.numel() \
            else xd
        mine = torch.cat([torch.stack([torch.tensor(float(T), dtype=torch.float64, device=xd.device), xd.sum(),
                                       (xd * pos).sum()]).to(dev),
                          step.header_tensor(dev, status, detail, dtype=torch.float64)])
        got = [torch.empty_like(mine) for _ in range(self.world_size)]
        collective("all_gather(all_reduce input check)", dist.all_gather, got, mine, group=self.group,
                   timeout_s=self.timeout_s)
        return got

    def _check_same_tokens(self, step: EPStep, x_TH: torch.Tensor) -> None:
        """All-gather (T, sum x, sum x * position, header) per rank; raise on every rank alike:
        EPStepMismatch / EPStepAborted when a rank is out of step or refused it, else
        EPInputMismatch when the tokens differ (the step ends cleanly; the group stays usable)."""
        got = self._gather_check(step, x_TH)
        step.started = True
        step.finish = None  # until the headers are read, what is owed is unknown
        # The check's one host read; the group's unread verdict (if any) comes with it.
        pending = step.pending_tensor(got[0].device, torch.float64)
        host = torch.cat(got + ([] if pending is None else [pending])).tolist()
        C = 3 + HEADER_LEN
        rows = [host[i * C: (i + 1) * C] for i in range(self.world_size)]
        step.check([[int(v) for v in r[3:]] for r in rows], pending=None if pending is None else int(host[-1]))
        step.finish = lambda status, detail: self._owed_reduce(step, x_TH, status, detail)
        rows = [r[:3] for r in rows]
        if any(r != rows[0] for r in rows):
            step.finish = owes_nothing
            step.close()
            Ts = [int(r[0]) for r in rows]
            what = f"T per rank = {Ts}" if len(set(Ts)) > 1 else "the same T but different tokens (checksums differ)"
            raise EPInputMismatch(
                f"ep_mode='all_reduce': every rank must hold the same tokens, got {what} "
                f"(this is rank {self.rank}). Use ep_mode='all_to_all' when ranks hold different tokens."
            )

    def __repr__(self) -> str:
        return f"AllReduceDispatcher(rank={self.rank}/{self.world_size}, static={self.static})"

    # ------------------------------------------------------------------ pairs in, sums out

    def dispatch_pairs(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> ARHandle:
        """Pick this rank's pairs (no communication; opens the EP step `combine_pairs` finishes)."""
        step = self._open(x_TH)
        try:
            return self._dispatch_pairs(step, x_TH, ids_TK, weights_TK)
        except BaseException as exc:
            step.abort(exc)
            raise

    def _dispatch_pairs(self, step: EPStep, x_TH: torch.Tensor, ids_TK: torch.Tensor,
                        weights_TK: torch.Tensor) -> ARHandle:
        if x_TH.dim() != 2 or ids_TK.dim() != 2 or ids_TK.shape[0] != x_TH.shape[0]:
            raise ValueError(f"x_TH {tuple(x_TH.shape)} / ids_TK {tuple(ids_TK.shape)}: expected [T, H] / [T, K]")
        T, K = ids_TK.shape
        plan = ep_plan(ids_TK, weights_TK, self.placement, validate=not self.static)
        mine_P = (plan.dest_rank_TK == self.rank).reshape(-1)
        local_P = plan.local_expert_TK.reshape(-1)
        L = self.num_local
        w_P = weights_TK.reshape(-1).to(torch.float32)
        device = x_TH.device
        if self.static:
            junk = max(L - 1, 0)
            key = torch.where(mine_P, local_P, torch.full_like(local_P, L))
            pair_N = torch.sort(key, stable=True).indices
            valid_N = mine_P[pair_N]
            expert_N = torch.where(valid_N, local_P[pair_N], torch.full_like(pair_N, junk))
            x_NH = x_TH.index_select(0, pair_N // K)
            x_NH = torch.where(valid_N.unsqueeze(1), x_NH, torch.zeros((), dtype=x_NH.dtype, device=device))
        else:
            owned = mine_P.nonzero().squeeze(1)
            order = torch.sort(local_P[owned], stable=True).indices
            pair_N = owned[order]
            expert_N = local_P[pair_N]
            valid_N = torch.ones(pair_N.shape, dtype=torch.bool, device=device)
            x_NH = x_TH.index_select(0, pair_N // K)
        return ARHandle(
            plan=plan,
            pair_N=pair_N,
            recv_x_NH=x_NH,
            recv_expert_N=expert_N,
            recv_weight_N=w_P[pair_N],
            recv_valid_N=valid_N,
            x_TH=x_TH,
            weights_TK=weights_TK,
            rank=self.rank,
            world_size=self.world_size,
            static=self.static,
            step=step,
        )

    def combine_pairs(self, y_NH: torch.Tensor, handle: ARHandle, *, weight_on_input: bool = False) -> torch.Tensor:
        """out_TH [T, H] (x's dtype): the routed output (zero experts included, shared not).

        y_NH: [N, H] unweighted outputs for `handle.recv_x_NH`'s rows (same order).
        One all_reduce of the [T, H] partial sum in `reduce_dtype`, the step's header rows
        after it. Raises EPStepAborted / EPStepMismatch (every rank alike) when a rank
        refused the step or is out of step; where the header cannot be read without a sync
        (CUDA without `timeout_s`) the output is NaN instead and the verdict is read later.
        """
        if not isinstance(handle, ARHandle):
            raise TypeError(f"handle: expected an ARHandle, got {type(handle).__name__}")
        step = handle.step
        if step is None or not step.live:
            raise ValueError("handle: its step is over (combined already, or refused); dispatch again")
        try:
            return self._combine(y_NH, handle, step, weight_on_input)
        except BaseException as exc:
            step.abort(exc)
            raise
        finally:
            step.close()

    def _combine(self, y_NH: torch.Tensor, handle: ARHandle, step: EPStep, weight_on_input: bool) -> torch.Tensor:
        x_TH, weights_TK, plan = handle.x_TH, handle.weights_TK, handle.plan
        T, H = int(x_TH.shape[0]), int(x_TH.shape[1])
        K = plan.top_k
        if y_NH.dim() != 2 or tuple(y_NH.shape) != (int(handle.pair_N.shape[0]), H):
            raise ValueError(f"y_NH: shape {tuple(y_NH.shape)}, expected [{int(handle.pair_N.shape[0])}, {H}]")
        y_masked = torch.where(handle.recv_valid_N.unsqueeze(1), y_NH,
                               torch.zeros((), dtype=y_NH.dtype, device=y_NH.device))
        y_PH = y_NH.new_zeros((T * K, H))
        # Each pair appears at most once in pair_N; unowned static rows write their masked 0.
        y_PH.index_copy_(0, handle.pair_N, y_masked)
        # [T + hr, H]: the partial sums, then the header rows (each rank's digits in its block).
        hr = self._header_rows(H)
        wire = torch.empty(T + hr, H, dtype=self.reduce_dtype, device=x_TH.device)
        # Slots owned elsewhere hold exactly 0 here; zero experts are added after the reduce.
        combine_TH(y_PH.view(T, K, H), weights_TK, weight_on_input=weight_on_input, out_TH=wire[:T])
        step.write_sum_header(wire[T:].view(-1), self.rank)
        collective("all_reduce(partial expert sums)", dist.all_reduce, wire,
                   group=self.group, timeout_s=self.timeout_s)
        step.finish = owes_nothing
        digits_WC = wire[T:].view(-1)[: self.world_size * SUM_HEADER_LEN].view(self.world_size, SUM_HEADER_LEN)
        bad = None
        if step.read_now(x_TH.device):
            step.check(step.rows_from_sum(digits_WC.float().tolist()))
        else:
            bad = step.device_verdict(step.sum_header_expected(x_TH.device, wire.dtype), [digits_WC])
            step.defer(bad)
        out32 = wire[:T].to(torch.float32)
        zero_TK = plan.is_zero_TK
        if self.num_zero_experts:
            # w * x for zero-expert slots, added once (every rank has the same x and weights).
            w0_TK = torch.where(zero_TK, weights_TK.to(torch.float32), torch.zeros((), device=x_TH.device))
            out32 = out32 + w0_TK.sum(1, keepdim=True) * x_TH.to(torch.float32)
        out = out32.to(x_TH.dtype)
        return out if bad is None else out.masked_fill(bad, float("nan"))


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# An older public name of the dispatcher, kept importable.
AllReduceEP = AllReduceDispatcher
