"""All-to-all expert-parallel dispatch / combine over torch.distributed (`ep_mode="all_to_all"`).

Legend: T tokens on this rank, K picks, P = T*K pairs, H hidden, W ranks, E routed
experts, L experts on this rank, U token rows sent (one per (token, destination rank)),
N pair rows (one per routed (token, slot)), Tm the static token budget of the decode mode.

Two modes, one interface (`dispatch(x, ids, weights) -> handle`, the caller runs its
local experts on `handle.recv_x_NH` / `handle.recv_expert_N`, `combine(y_NH, handle)`):

dynamic (prefill; `static_tokens=None`):
    1. all_to_all of the counts ([W, 2] int64: token rows and pairs per destination), read
       once on the host (the split sizes a variable all_to_all needs);
    2. one all_to_all_single of packed byte rows, one per (token, destination rank) that
       owns at least one of the token's experts (so K slots on one rank cost one row of
       H): [x_t | t | K local expert ids, -1 for slots not for that rank | K weights];
    3. the receiver expands rows to pairs in (source rank, token, slot) order; the
       experts implementation groups them stably by expert, so every expert sees its rows
       in the order the single-process layer gives them for the ranks' tokens
       concatenated in rank order: same rows, same order, same bits;
    4. combine: all_to_all_single of y back (N rows), scattered to y_TKH [T, K, H] on the
       source rank. The weighted sum in slot order is the caller's (the layer's combine).

static (decode; `static_tokens=Tm`): worst-case fixed buffers, no host read of any
count, every shape a function of (W, Tm, K, H) only, so one step can be captured in a
CUDA graph on NCCL. Each rank sends its Tm (padded) token rows packed with their (id,
weight) picks to every rank (one all_to_all_single, equal splits); each rank computes the
pairs it owns out of the W*Tm*K candidates (the others are junk rows, placed after the
real rows, zero input, and masked out), sends y back as [Tm, K, H] per source, and the
source gathers each pair's row from its owner's block.

Redundant copies (a placement with E + R physical experts): the source picks each pair's copy
(`plan.physical_ids`, offset by its rank) and sends to the copy's rank; the static mode's rows
carry physical ids. Zero experts (ids >= E) are never sent: their y rows stay zero here and the caller's
combine adds w*x. The handles are frozen dataclasses; nothing here knows about experts.

Every step's collectives carry the step header of `dist_utils.EPStep` (C = 5 int64:
magic, step, layer, status, detail), in exchanges made anyway:
    dynamic: C extra columns of the counts all_to_all ([W, 2 + C], read with the counts);
             hr header rows before each destination's rows of the combine all_to_all;
    static:  C * 8 extra bytes per dispatch row (a column), and per combine row.
A rank that refuses the step (bad input, too many tokens, an error in its experts) runs
the step's remaining collectives with a REFUSED / FAILED header (`abort_step`, or the
dispatcher's own guard); every rank then raises (EPStepAborted; EPStepMismatch when a
rank is at another step or layer) and the group is marked broken. The dynamic mode stops
every rank at the counts (their host read exists); the static mode always runs both of its
collectives, so that no rank leaves one early whatever it can read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..types import PairBatch, RoutingResult
from .dist_utils import (
    HEADER_BYTES,
    HEADER_LEN,
    EPStep,
    EPStepOwner,
    collective,
    group_rank,
    group_size,
    owes_nothing,
)
from .local import combine_TH
from .plan import EPPlan, Placement, ep_plan

__all__ = ["A2AHandle", "A2AStaticHandle", "AllToAllDispatcher"]


def _tokens_of(x_NH: torch.Tensor, K: int) -> int:
    """Tokens-equivalent of N rows (what the experts impl is tuned by)."""
    return max(1, int(x_NH.shape[0]) // max(1, K))


def _as_bytes(t_RC: torch.Tensor) -> torch.Tensor:
    """A contiguous [R, C] tensor as uint8 [R, C * itemsize] (a view)."""
    t_RC = t_RC.contiguous()
    return t_RC.view(torch.uint8).view(int(t_RC.shape[0]), int(t_RC.shape[1]) * t_RC.element_size())


def _header_cols(elem_size: int) -> int:
    """Columns of a row of `elem_size`-byte elements that hold one step header."""
    return -(-HEADER_BYTES // elem_size)


def _header_rows(row_bytes: int) -> int:
    """Rows of `row_bytes` bytes that hold one step header (the dynamic combine's per-destination rows)."""
    return -(-HEADER_BYTES // max(1, row_bytes))


def _read_header(b_RB: torch.Tensor) -> torch.Tensor:
    """int64 [R, HEADER_LEN]: the header in the first HEADER_BYTES bytes of each row of uint8 [R, >= HEADER_BYTES]."""
    return b_RB[:, :HEADER_BYTES].contiguous().view(torch.int64)




@dataclass(frozen=True, eq=False)
class A2AHandle:
    """What `AllToAllDispatcher.dispatch` (dynamic mode) hands to the experts and to `combine`.

    Received rows, in (source rank, token, slot) order:
        recv_x_NH:      [N_recv, H] the token row of each pair (x's dtype).
        recv_expert_N:  int64 [N_recv] local expert index (0 <= id < L).
        recv_src_N:     int64 [N_recv] source rank.
        recv_token_N:   int64 [N_recv] token index on the source rank.
        recv_slot_N:    int64 [N_recv] slot k on the source rank.
        recv_weight_N:  float32 [N_recv] routing weight of the pair (llama4 applies it to the input).
    Bookkeeping (host ints, read once at dispatch):
        send_pair_splits / recv_pair_splits: pairs per destination / per source.
        send_token_splits / recv_token_splits: token rows per destination / per source.
    plan: this rank's EPPlan (the inverse permutation combine uses).
    """

    plan: EPPlan
    recv_x_NH: torch.Tensor
    recv_expert_N: torch.Tensor
    recv_src_N: torch.Tensor
    recv_token_N: torch.Tensor
    recv_slot_N: torch.Tensor
    recv_weight_N: torch.Tensor
    send_pair_splits: tuple[int, ...]
    recv_pair_splits: tuple[int, ...]
    send_token_splits: tuple[int, ...]
    recv_token_splits: tuple[int, ...]
    rank: int
    num_tokens: int
    hidden_size: int
    row_bytes: int
    # Set by the protocol entry `dispatch` (what `combine` needs for the slot-order sum).
    x_TH: torch.Tensor | None = None
    weights_TK: torch.Tensor | None = None
    weight_on_input: bool = False
    has_zero_experts: bool = False
    # The EP step the dispatch ran in (combine finishes it) and the header this rank sends.
    step: EPStep | None = None
    header: torch.Tensor | None = None

    @property
    def recv_valid_N(self) -> None:
        """Every received row is real in the dynamic mode (see A2AStaticHandle)."""
        return None

    @property
    def batch(self) -> PairBatch:
        """The rows this rank's experts compute (local expert ids)."""
        return PairBatch(self.recv_x_NH, self.recv_expert_N, None, self.recv_weight_N,
                         num_tokens=_tokens_of(self.recv_x_NH, self.plan.top_k))

    def local_pairs(self) -> int:
        """Pairs this rank computes for its own tokens."""
        return self.recv_pair_splits[self.rank]

    def remote_pairs_in(self) -> int:
        """Pairs other ranks sent here."""
        return sum(self.recv_pair_splits) - self.recv_pair_splits[self.rank]

    def remote_pairs_out(self) -> int:
        """Pairs of this rank's tokens computed elsewhere."""
        return sum(self.send_pair_splits) - self.send_pair_splits[self.rank]

    def bytes_moved(self, elem_size: int) -> int:
        """Bytes this rank sends to other ranks (counts and headers + packed dispatch rows + combine rows)."""
        me = self.rank
        tok = sum(self.send_token_splits) - self.send_token_splits[me]
        back = sum(self.recv_pair_splits) - self.recv_pair_splits[me]
        W = len(self.send_pair_splits)
        hr = _header_rows(self.hidden_size * elem_size)
        return (W - 1) * ((2 + HEADER_LEN) * 8 + hr * self.hidden_size * elem_size) + tok * self.row_bytes \
            + back * self.hidden_size * elem_size


@dataclass(frozen=True, eq=False)
class A2AStaticHandle:
    """What `AllToAllDispatcher.dispatch` (static decode mode) hands out. Fixed shapes, N = W*Tm*K.

    Rows sorted so that this rank's real pairs come first, grouped stably by local
    expert (within an expert in (source rank, token, slot) order); junk rows follow with
    a zero input and expert L-1, so a stable grouping puts them after every real row.
        recv_x_NH, recv_expert_N, recv_src_N, recv_token_N, recv_slot_N, recv_weight_N:
                        as in A2AHandle, [N] rows.
        recv_valid_N:   bool [N], True for a pair this rank owns.
        order_N:        int64 [N], sorted row n is candidate order_N[n] of the flat
                        [W(src), Tm, K] candidates.
    """

    plan: EPPlan
    recv_x_NH: torch.Tensor
    recv_expert_N: torch.Tensor
    recv_src_N: torch.Tensor
    recv_token_N: torch.Tensor
    recv_slot_N: torch.Tensor
    recv_weight_N: torch.Tensor
    recv_valid_N: torch.Tensor
    order_N: torch.Tensor
    rank: int
    world_size: int
    num_tokens: int
    static_tokens: int
    hidden_size: int
    x_TH: torch.Tensor | None = None
    weights_TK: torch.Tensor | None = None
    weight_on_input: bool = False
    has_zero_experts: bool = False
    # The EP step, the header this rank sent and the W headers the dispatch received
    # (uint8 [W, HEADER_BYTES] views; combine checks them with its own when they were not read).
    step: EPStep | None = None
    header: torch.Tensor | None = None
    recv_header_WB: torch.Tensor | None = None

    @property
    def batch(self) -> PairBatch:
        """Every candidate row (real ones first; junk rows have valid_N False)."""
        return PairBatch(self.recv_x_NH, self.recv_expert_N, self.recv_valid_N, self.recv_weight_N,
                         num_tokens=_tokens_of(self.recv_x_NH, self.plan.top_k))

    def bytes_moved(self, elem_size: int) -> int:
        """Bytes this rank sends to other ranks (fixed: the worst case; headers included)."""
        W, K, H = self.world_size, self.plan.top_k, self.hidden_size
        per_peer = self.static_tokens * (H * elem_size + K * 8 + HEADER_BYTES
                                         + K * (H + _header_cols(elem_size)) * elem_size)
        return (W - 1) * per_peer


class AllToAllDispatcher(EPStepOwner):
    """Dispatch tokens to the ranks owning their experts and bring the results back.

    placement:     which rank owns each routed expert (E = placement.num_experts).
    group:         the expert-parallel process group (passed in, never the global default
                   implicitly; torch.distributed.group.WORLD is fine).
    timeout_s:     seconds each collective may take before EPCollectiveError (None: only
                   the process group's own timeout).
    static_tokens: None for the dynamic mode; Tm for the static decode mode (every rank
                   must pass at most Tm tokens per step, and the same Tm).

    One dispatch ... combine is one EP step (see the module docstring). `MoELayer` opens it
    with `begin_step(layer_idx)` before routing and calls `abort_step` when its step raises;
    a direct caller of `dispatch_pairs` gets a step opened for it (layer -1).
    """

    def __init__(
        self,
        placement: Placement,
        group: dist.ProcessGroup,
        *,
        timeout_s: float | None = None,
        static_tokens: int | None = None,
    ) -> None:
        if not isinstance(placement, Placement):
            raise TypeError(f"placement: expected a moeflow.parallel.plan.Placement, got {type(placement).__name__}")
        self.group = group
        self.rank = group_rank(group)
        self.world_size = group_size(group)
        if placement.world_size != self.world_size:
            raise ValueError(
                f"placement.world_size={placement.world_size} but the process group has {self.world_size} ranks"
            )
        if static_tokens is not None and (
            not isinstance(static_tokens, int) or isinstance(static_tokens, bool) or static_tokens < 1
        ):
            raise ValueError(f"static_tokens={static_tokens!r}: expected None (dynamic) or an int >= 1")
        self.placement = placement
        self.timeout_s = timeout_s
        self.static_tokens = static_tokens
        self.num_local = placement.num_local(self.rank)

    # ------------------------------------------------------------------ helpers

    def _check_inputs(self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> None:
        if not isinstance(x_TH, torch.Tensor) or x_TH.dim() != 2:
            raise ValueError(f"x_TH: expected a 2-D tensor [T, H], got shape {tuple(getattr(x_TH, 'shape', ()))}")
        if ids_TK.dim() != 2 or ids_TK.shape[0] != x_TH.shape[0]:
            raise ValueError(f"ids_TK: shape {tuple(ids_TK.shape)}, expected [T={x_TH.shape[0]}, K]")
        if self.static_tokens is not None and x_TH.shape[0] > self.static_tokens:
            raise ValueError(
                f"x_TH has T={x_TH.shape[0]} tokens, more than static_tokens={self.static_tokens} "
                f"(the decode mode's fixed buffer)"
            )

    def _a2a(self, name: str, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None) -> None:
        if out_splits is None:
            collective(name, dist.all_to_all_single, out, inp, group=self.group, timeout_s=self.timeout_s)
        else:
            collective(name, dist.all_to_all_single, out, inp, list(out_splits), list(in_splits),
                       group=self.group, timeout_s=self.timeout_s)

    # ------------------------------------------------------------------ the EP step

    def _owed_unstarted(self, step: EPStep, x_TH: torch.Tensor, K: int):
        """What a step owes when this rank refuses it before sending anything: the dynamic mode's
        counts exchange (every rank reads it and stops), or both static exchanges."""
        H = int(x_TH.shape[-1]) if isinstance(x_TH, torch.Tensor) and x_TH.dim() >= 1 else 0
        dtype = x_TH.dtype if isinstance(x_TH, torch.Tensor) else torch.float32
        device = x_TH.device if isinstance(x_TH, torch.Tensor) else torch.device("cpu")
        W = self.world_size

        def dynamic(status: int, detail: int) -> bool:
            send = torch.cat([torch.zeros(W, 2, dtype=torch.int64, device=device),
                              step.header_tensor(device, status, detail).expand(W, HEADER_LEN)], 1)
            self._a2a("all_to_all_single(counts)", torch.empty_like(send), send)
            return True

        def static(status: int, detail: int) -> bool:
            hdr = step.header_tensor(device, status, detail)
            self._owed_static_dispatch(hdr, H, dtype, K, device)
            return self._owed_static_combine(step, hdr, H, dtype, K, device)

        return dynamic if self.static_tokens is None else static

    # ------------------------------------------------------------------ the Dispatcher protocol

    name = "all_to_all"
    fuses = False

    def dispatch(self, x_TH: torch.Tensor, routing: RoutingResult, spec, *, fused: bool = False
                 ) -> A2AHandle | A2AStaticHandle:
        """The layer's entry: `dispatch_pairs`, plus what `combine` needs for the slot-order sum.

        Collective (every rank of the group calls it; T may differ, even 0). Refuses
        tensors that require grad: the collectives carry no autograd.
        """
        step = self._open(x_TH, int(spec.top_k))
        try:
            if torch.is_grad_enabled() and x_TH.requires_grad:
                raise NotImplementedError(
                    "expert parallelism is inference-only: its collectives carry no autograd; run under "
                    "torch.no_grad() or torch.inference_mode()"
                )
            h = self._dispatch(step, x_TH, routing.ids_TK, routing.weights_TK)
        except BaseException as exc:
            step.abort(exc)
            raise
        return replace(h, x_TH=x_TH, weights_TK=routing.weights_TK, weight_on_input=spec.weight_on_input,
                       has_zero_experts=spec.num_zero_experts > 0)

    def combine(self, y_NH: torch.Tensor, handle: A2AHandle | A2AStaticHandle) -> torch.Tensor:
        """out_TH [T, H] (x's dtype): the experts' rows brought home, summed in slot order (f32),
        zero experts adding w * x: the single-process layer's combine, so the same bits."""
        if handle.x_TH is None:
            raise ValueError("handle: made by dispatch_pairs; the layer's combine needs dispatch(x, routing, spec)")
        y_TKH = self.combine_pairs(y_NH, handle)
        T = handle.num_tokens
        zero_TK = handle.plan.is_zero_TK[:T] if handle.has_zero_experts else None
        return combine_TH(y_TKH, handle.weights_TK, x_TH=handle.x_TH, zero_TK=zero_TK,
                          weight_on_input=handle.weight_on_input, out_dtype=handle.x_TH.dtype)

    def token_stats(self, h: A2AHandle | A2AStaticHandle) -> dict[str, int]:
        """Pair counts of a forward: local (computed here for this rank's own tokens), sent (this
        rank's pairs computed elsewhere), received (other ranks' pairs computed here), zero
        (zero-expert pairs kept home). One host read."""
        zero = int(h.plan.is_zero_TK[: h.num_tokens].sum())
        if isinstance(h, A2AHandle):
            return {"local": h.local_pairs(), "sent": h.remote_pairs_out(), "received": h.remote_pairs_in(),
                    "zero": zero}
        valid = h.recv_valid_N
        local = int((valid & (h.recv_src_N == self.rank)).sum())
        dest = h.plan.dest_rank_TK[: h.num_tokens]
        return {"local": local, "sent": int(((dest >= 0) & (dest != self.rank)).sum()),
                "received": int(valid.sum()) - local, "zero": zero}

    def __repr__(self) -> str:
        return (f"AllToAllDispatcher(rank={self.rank}/{self.world_size}, static_tokens={self.static_tokens}, "
                f"timeout_s={self.timeout_s})")

    # ------------------------------------------------------------------ pairs in, pairs out

    def dispatch_pairs(
        self, x_TH: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor
    ) -> A2AHandle | A2AStaticHandle:
        """Send each routed pair's token row to its expert's rank.

        x_TH:       [T, H] this rank's tokens (any floating dtype the backend carries).
        ids_TK:     int32/int64 [T, K] routing ids (>= E: zero expert, not sent).
        weights_TK: float [T, K] routing weights (travel as float32 with the pair).
        Dynamic mode: one host read (the exchanged counts and headers). Static mode: none
        (CPU tensors, or a set `timeout_s`: the headers are read too, at no extra sync).
        """
        step = self._open(x_TH, int(ids_TK.shape[-1]) if ids_TK.dim() else 1)
        try:
            return self._dispatch(step, x_TH, ids_TK, weights_TK)
        except BaseException as exc:
            step.abort(exc)
            raise

    def _dispatch(self, step: EPStep, x_TH, ids_TK, weights_TK) -> A2AHandle | A2AStaticHandle:
        self._check_inputs(x_TH, ids_TK, weights_TK)
        if self.static_tokens is None:
            return self._dispatch_dynamic(step, x_TH, ids_TK, weights_TK)
        return self._dispatch_static(step, x_TH, ids_TK, weights_TK)

    def combine_pairs(self, y_NH: torch.Tensor, handle: A2AHandle | A2AStaticHandle) -> torch.Tensor:
        """Bring the experts' rows home: y_TKH [T, K, H] on the source rank (y's dtype).

        y_NH: [N_recv, H] outputs for `handle.recv_x_NH`'s rows, same order (unweighted).
        Rows of zero-expert pairs are 0 (the caller's combine adds w*x for them).
        Raises EPStepAborted / EPStepMismatch (every rank alike) when a rank refused the step
        or is out of step; where the headers cannot be read without a sync (CUDA without
        `timeout_s`) the rows are NaN instead and the verdict is read later.
        """
        if not isinstance(handle, (A2AHandle, A2AStaticHandle)):
            raise TypeError(f"handle: expected an A2AHandle or A2AStaticHandle, got {type(handle).__name__}")
        step = handle.step
        if step is None or not step.live:
            raise ValueError("handle: its step is over (combined already, or refused); dispatch again")
        try:
            if isinstance(handle, A2AHandle):
                return self._combine_dynamic(y_NH, handle)
            return self._combine_static(y_NH, handle)
        except BaseException as exc:
            step.abort(exc)
            raise
        finally:
            step.close()

    # ------------------------------------------------------------------ dynamic

    def _dispatch_dynamic(self, step: EPStep, x_TH, ids_TK, weights_TK) -> A2AHandle:
        W, me = self.world_size, self.rank
        T, K = ids_TK.shape
        H = x_TH.shape[1]
        device = x_TH.device
        plan = ep_plan(ids_TK, weights_TK, self.placement, copy_offset=me)
        dest_TK = plan.dest_rank_TK
        # Which ranks each token must visit (once per rank, whatever its number of slots there).
        visit_TW = torch.zeros(T, W + 1, dtype=torch.bool, device=device)
        visit_TW.scatter_(1, torch.where(dest_TK < 0, W, dest_TK), True)
        visit_TW = visit_TW[:, :W]
        tok_counts_W = visit_TW.sum(0, dtype=torch.int64)
        hdr = step.header_tensor(device)
        # [W, 2 + C]: token rows and pairs for each destination, and this step's header.
        counts_WC = torch.cat([tok_counts_W.unsqueeze(1), plan.send_counts_R.unsqueeze(1),
                               hdr.expand(W, HEADER_LEN)], 1)
        recv_counts_WC = torch.empty_like(counts_WC)
        self._a2a("all_to_all_single(counts)", recv_counts_WC, counts_WC)
        step.started = True
        step.finish = None  # until the counts are read, what is owed is unknown
        # The one host read of the dynamic mode: variable splits need Python ints. The headers
        # (and the group's unread verdict, if any) come with it.
        pending = step.pending_tensor(device)
        parts = [counts_WC.view(-1), recv_counts_WC.view(-1)] + ([] if pending is None else [pending])
        host = torch.cat(parts).tolist()
        C = 2 + HEADER_LEN
        rows = [host[C * r: C * (r + 1)] for r in range(2 * W)]
        send_rows, recv_rows = rows[:W], rows[W:]
        step.check([row[2:] for row in recv_rows], pending=None if pending is None else int(host[-1]))
        send_tok = tuple(int(row[0]) for row in send_rows)
        send_pair = tuple(int(row[1]) for row in send_rows)
        recv_tok = tuple(int(row[0]) for row in recv_rows)
        recv_pair = tuple(int(row[1]) for row in recv_rows)
        row_bytes = H * x_TH.element_size() + 4 * (1 + 2 * K)

        def owed_dispatch(status: int, detail: int) -> bool:
            # This rank's rows do not count (the step fails), only their sizes.
            send = torch.zeros(sum(send_tok), row_bytes, dtype=torch.uint8, device=device)
            self._a2a("all_to_all_single(dispatch)", send.new_empty((sum(recv_tok), row_bytes)), send,
                      recv_tok, send_tok)
            return owed_combine(status, detail)

        def owed_combine(status: int, detail: int) -> bool:
            y = x_TH.new_zeros((sum(recv_pair), H))
            self._combine_exchange(step, y, step.header_tensor(device, status, detail), send_pair, recv_pair)
            return step.read_now(device)

        step.finish = owed_dispatch

        # One packed row per (token, destination), grouped by destination, tokens ascending
        # ([W, T] nonzero is row-major): [x_t bytes | t | K local expert ids (-1: slot not
        # for this destination) | K weights as int32 bits]. One all_to_all carries rows and
        # metadata together.
        nz = visit_TW.t().nonzero()
        d_U, t_U = nz[:, 0], nz[:, 1]
        x_bytes_UB = _as_bytes(x_TH.index_select(0, t_U))
        loc_UK = torch.where(dest_TK[t_U] == d_U.unsqueeze(1), plan.local_expert_TK[t_U], -1).to(torch.int32)
        w_UK = weights_TK[t_U].to(torch.float32).contiguous().view(torch.int32)
        meta_UM = torch.cat([t_U.to(torch.int32).unsqueeze(1), loc_UK, w_UK], dim=1)
        send_UB = torch.cat([x_bytes_UB, _as_bytes(meta_UM)], dim=1)
        recv_UB = send_UB.new_empty((sum(recv_tok), row_bytes))
        self._a2a("all_to_all_single(dispatch)", recv_UB, send_UB, recv_tok, send_tok)
        step.finish = owed_combine

        xb = H * x_TH.element_size()
        x_recv_UH = recv_UB[:, :xb].contiguous().view(x_TH.dtype)
        meta = recv_UB[:, xb:].contiguous().view(torch.int32)
        tok_U, loc_recv_UK = meta[:, 0].to(torch.int64), meta[:, 1 : 1 + K].to(torch.int64)
        w_recv_UK = meta[:, 1 + K :].contiguous().view(torch.float32)
        # Pairs in (source rank, token, slot) order: rows come by source then token, slots ascend.
        pair = (loc_recv_UK >= 0).nonzero()
        u_N, k_N = pair[:, 0], pair[:, 1]
        if int(u_N.shape[0]) != sum(recv_pair):
            raise RuntimeError(
                f"all_to_all dispatch: {int(u_N.shape[0])} pairs arrived, the counts promised {sum(recv_pair)}"
            )
        src_U = torch.repeat_interleave(
            torch.arange(W, device=device), torch.tensor(recv_tok, device=device), output_size=sum(recv_tok)
        )
        return A2AHandle(
            plan=plan,
            recv_x_NH=x_recv_UH.index_select(0, u_N),
            recv_expert_N=loc_recv_UK[u_N, k_N],
            recv_src_N=src_U[u_N],
            recv_token_N=tok_U[u_N],
            recv_slot_N=k_N,
            recv_weight_N=w_recv_UK[u_N, k_N],
            send_pair_splits=send_pair,
            recv_pair_splits=recv_pair,
            send_token_splits=send_tok,
            recv_token_splits=recv_tok,
            rank=me,
            num_tokens=int(T),
            hidden_size=int(H),
            row_bytes=row_bytes,
            step=step,
            header=hdr,
        )

    def _combine_exchange(self, step: EPStep, y_NH: torch.Tensor, hdr: torch.Tensor, send_pair, recv_pair
                          ) -> tuple[torch.Tensor, int]:
        """The dynamic combine all_to_all: hr header rows before each destination's rows.

        y_NH: [sum(recv_pair), H] rows computed here, in (source rank, token, slot) order.
        hdr:  int64 [HEADER_LEN] this rank's header. Returns (what came back: per source p,
        hr header rows then its send_pair[p] rows; hr).
        """
        W, H = self.world_size, int(y_NH.shape[1])
        row_bytes = H * y_NH.element_size()
        hr = _header_rows(row_bytes)
        # One copy builds the wire, in bytes: per destination its header (padded to hr rows by
        # cached zeros), then its rows.
        hdr_b, pad = hdr.view(torch.uint8), step.zero_pad(hdr.device, hr * row_bytes - HEADER_BYTES)
        y_b = y_NH.view(torch.uint8).view(-1)
        pieces, off = [], 0
        for n in recv_pair:
            pieces += [hdr_b, pad, y_b[off * row_bytes: (off + n) * row_bytes]]
            off += n
        wire = torch.cat(pieces).view(y_NH.dtype).view(-1, H)
        back = y_NH.new_empty((sum(send_pair) + W * hr, H))
        self._a2a("all_to_all_single(combine)", back, wire, [n + hr for n in send_pair],
                  [n + hr for n in recv_pair])
        return back, hr

    def _combine_dynamic(self, y_NH: torch.Tensor, h: A2AHandle) -> torch.Tensor:
        n_recv = sum(h.recv_pair_splits)
        if y_NH.dim() != 2 or y_NH.shape[0] != n_recv or y_NH.shape[1] != h.hidden_size:
            raise ValueError(f"y_NH: shape {tuple(y_NH.shape)}, expected [{n_recv}, {h.hidden_size}] (handle's rows)")
        step, W = h.step, self.world_size
        back, hr = self._combine_exchange(step, y_NH.contiguous(), h.header, h.send_pair_splits,
                                          h.recv_pair_splits)
        step.finish = owes_nothing
        T, K, H = h.num_tokens, h.plan.top_k, h.hidden_size
        # One scatter, as without headers: each pair's row to its (token, slot), the header
        # rows past the T*K pair rows.
        hdr_at = torch.arange(T * K, T * K + W * hr, device=y_NH.device)
        idx, off = [], 0
        for p, n in enumerate(h.send_pair_splits):
            idx += [hdr_at[p * hr: (p + 1) * hr], h.plan.send_order_P[off: off + n]]
            off += n
        y_ext = y_NH.new_zeros((T * K + W * hr, H))
        y_ext.index_copy_(0, torch.cat(idx), back)
        got_WB = y_ext[T * K:].reshape(W, -1).view(torch.uint8)[:, :HEADER_BYTES]
        y_PH = y_ext[: T * K]
        if step.read_now(y_NH.device):
            step.check(_read_header(got_WB).tolist())
        else:
            bad = step.device_verdict(h.header.view(torch.uint8), [got_WB])
            step.defer(bad)
            y_PH = y_PH.masked_fill(bad, float("nan"))
        return y_PH.view(T, K, H)

    # ------------------------------------------------------------------ static (decode)

    def _owed_static_dispatch(self, hdr: torch.Tensor, H: int, dtype: torch.dtype, K: int,
                              device: torch.device) -> None:
        W, Tm = self.world_size, self.static_tokens
        B = H * torch.empty((), dtype=dtype).element_size() + 8 * K + HEADER_BYTES
        send = torch.zeros(W, Tm, B, dtype=torch.uint8, device=device)
        send[:, :, B - HEADER_BYTES:] = hdr.view(torch.uint8)
        self._a2a("all_to_all_single(static dispatch)", torch.empty_like(send), send)

    def _owed_static_combine(self, step: EPStep, hdr: torch.Tensor, H: int, dtype: torch.dtype, K: int,
                             device: torch.device) -> bool:
        W, Tm = self.world_size, self.static_tokens
        c = _header_cols(torch.empty((), dtype=dtype).element_size())
        send = torch.zeros(W, Tm, K, H + c, dtype=dtype, device=device)
        send[:, 0, 0, H:].view(torch.uint8)[:, :HEADER_BYTES] = hdr.view(torch.uint8)
        self._a2a("all_to_all_single(static combine)", torch.empty_like(send), send)
        return step.read_now(device)

    def _dispatch_static(self, step: EPStep, x_TH, ids_TK, weights_TK) -> A2AStaticHandle:
        W, me, Tm = self.world_size, self.rank, self.static_tokens
        T, K = ids_TK.shape
        H = x_TH.shape[1]
        E = self.placement.num_experts
        device = x_TH.device
        pad = Tm - T
        ids_pad = ids_TK.to(torch.int64)
        w_pad = weights_TK.to(torch.float32).contiguous()
        x_pad = x_TH
        if pad:
            # Padding rows pick id E (a zero expert: never computed) and carry zero input.
            ids_pad = torch.cat([ids_pad, torch.full((pad, K), E, dtype=torch.int64, device=device)])
            w_pad = torch.cat([w_pad, torch.zeros(pad, K, dtype=torch.float32, device=device)])
            x_pad = torch.cat([x_TH, x_TH.new_zeros((pad, H))])
        plan = ep_plan(ids_pad, w_pad, self.placement, validate=False, copy_offset=me)
        hdr = step.header_tensor(device)
        # One packed row per token: [x bytes | K (physical id, weight bits) int32 pairs | step
        # header], to every rank. The source chose each pair's copy (-1: zero expert or padding);
        # the header rides in every row (C * 8 bytes each, no extra copy); the receiver reads the
        # first row's.
        picks_TK2 = torch.stack([plan.physical_TK.to(torch.int32), w_pad.view(torch.int32)], dim=2)
        row_TB = torch.cat([_as_bytes(x_pad.contiguous()), _as_bytes(picks_TK2.reshape(Tm, 2 * K)),
                            hdr.view(torch.uint8).expand(Tm, HEADER_BYTES)], dim=1)
        B = int(row_TB.shape[1])
        recv_WTB = row_TB.new_empty((W, Tm, B))
        self._a2a("all_to_all_single(static dispatch)", recv_WTB, row_TB.unsqueeze(0).expand(W, Tm, B).contiguous())
        step.started = True
        step.finish = lambda status, detail: self._owed_static_combine(
            step, step.header_tensor(device, status, detail), H, x_TH.dtype, K, device)
        recv_hdr_WB = recv_WTB[:, 0, B - HEADER_BYTES:]  # each source's header bytes (a view)
        if step.read_now(device):
            # Out of step: stop now, every rank alike. A refusal is remembered and raised after
            # the combine: the refusing rank runs the combine too (it may not read this).
            step.check(_read_header(recv_hdr_WB).tolist(), final=False)
        xb = H * x_TH.element_size()
        x_recv_WTH = recv_WTB[..., :xb].contiguous().view(x_TH.dtype)
        picks_recv = recv_WTB[..., xb: xb + 8 * K].contiguous().view(torch.int32).view(W, Tm, K, 2)
        N = W * Tm * K
        rank_of_Q, local_index_Q, _, _ = self.placement.physical_tensors(device)
        Q = self.placement.num_physical
        ids_N = picks_recv[..., 0].reshape(N).to(torch.int64)
        wts_N = picks_recv[..., 1].reshape(N).contiguous().view(torch.float32)
        routed = (ids_N >= 0) & (ids_N < Q)
        safe = ids_N.clamp(0, Q - 1)
        mine_N = routed & (rank_of_Q[safe] == me)
        L = self.num_local
        junk = max(L - 1, 0)
        local_N = torch.where(mine_N, local_index_Q[safe], torch.full_like(ids_N, junk))
        # Real rows first, grouped by expert in (source, token, slot) order; junk rows last.
        key_N = torch.where(mine_N, local_N, torch.full_like(local_N, L))
        order_N = torch.sort(key_N, stable=True).indices
        ar = torch.arange(N, device=device)
        src_N = ar // (Tm * K)
        tok_N = (ar // K) % Tm
        slot_N = ar % K
        x_rows = x_recv_WTH.reshape(W * Tm, H).index_select(0, (src_N * Tm + tok_N)[order_N])
        valid_sorted = mine_N[order_N]
        x_rows = torch.where(valid_sorted.unsqueeze(1), x_rows, torch.zeros((), dtype=x_rows.dtype, device=device))
        return A2AStaticHandle(
            plan=plan,
            recv_x_NH=x_rows,
            recv_expert_N=local_N[order_N],
            recv_src_N=src_N[order_N],
            recv_token_N=tok_N[order_N],
            recv_slot_N=slot_N[order_N],
            recv_weight_N=wts_N[order_N],
            recv_valid_N=valid_sorted,
            order_N=order_N,
            rank=me,
            world_size=W,
            num_tokens=int(T),
            static_tokens=int(Tm),
            hidden_size=int(H),
            step=step,
            header=hdr,
            recv_header_WB=recv_hdr_WB,
        )

    def _combine_static(self, y_NH: torch.Tensor, h: A2AStaticHandle) -> torch.Tensor:
        W, Tm, K, H = self.world_size, h.static_tokens, h.plan.top_k, h.hidden_size
        N = W * Tm * K
        if y_NH.dim() != 2 or tuple(y_NH.shape) != (N, H):
            raise ValueError(f"y_NH: shape {tuple(y_NH.shape)}, expected [{N}, {H}] (the static handle's rows)")
        step = h.step
        y_sorted = torch.where(h.recv_valid_N.unsqueeze(1), y_NH, torch.zeros((), dtype=y_NH.dtype, device=y_NH.device))
        # Rows of H + c: the header rides in the c spare columns of each destination's first row
        # (the other rows' spare columns are never read).
        c = _header_cols(y_NH.element_size())
        y_wire = y_NH.new_empty((N, H + c))
        y_wire[:, :H].index_copy_(0, h.order_N, y_sorted)
        y_wire.view(W, Tm * K, H + c)[:, 0, H:].view(torch.uint8)[:, :HEADER_BYTES] = h.header.view(torch.uint8)
        y_back = torch.empty_like(y_wire).view(W, Tm, K, H + c)
        self._a2a("all_to_all_single(static combine)", y_back, y_wire.view(W, Tm, K, H + c))
        step.finish = owes_nothing
        got_WB = y_back[:, 0, 0, H:].view(torch.uint8)[:, :HEADER_BYTES]
        dest_TK = h.plan.dest_rank_TK  # [Tm, K], -1 for zero experts and padding
        idx = dest_TK.clamp(min=0).view(1, Tm, K, 1).expand(1, Tm, K, H)
        y_TKH = y_back[..., :H].gather(0, idx).squeeze(0)
        y_TKH = torch.where((dest_TK >= 0).unsqueeze(2), y_TKH,
                            torch.zeros((), dtype=y_TKH.dtype, device=y_TKH.device))
        if step.read_now(y_NH.device):
            step.check(_read_header(got_WB).tolist())
        else:
            bad = step.device_verdict(h.header.view(torch.uint8), [h.recv_header_WB, got_WB])
            step.defer(bad)
            # A failed verdict makes every slot NaN (a zero-expert slot's y is never read).
            y_TKH = y_TKH.masked_fill(bad, float("nan"))
        return y_TKH[: h.num_tokens]
