"""rebalance: move expert weights between ranks to a new placement, between steps, all ranks or none.

Legend: L expert-parallel layers (model order), E logical experts, Q physical experts per
layer, W ranks, j a rank's local expert index, B bytes.

    p = plan_placement(expert_load(model, reduce=True), W, redundant_experts=R)   # moeflow.parallel.eplb
    report = rebalance(model, p)          # collective: every rank, between forwards

For every layer and every physical expert of the new placement, the rank that will hold it
takes its tensors (weights, biases, quantization scales: the stored bytes, whatever their
dtype) from its own old experts when it holds that logical expert already, else from an
old holder (spread over the holders: rank r's j-th new expert reads holder (r + j) % n).
One message per pair of ranks carries all of them, point to point.

The protocol (every rank reaches the same outcome):
    1. check: this rank checks the new placement against its layers (E, W, mode, the
       source it can read), then one all_gather of (status, placement fingerprint,
       generation) tells every rank whether all ranks agree and are ready;
    2. move: every rank posts its sends and receives; a rank whose send data failed to
       gather still sends (zeros of the agreed sizes), so that no peer waits for it;
    3. build: each rank builds its new experts, dispatchers and sources aside (the old
       ones keep serving);
    4. commit vote: a second all_gather of the statuses; all OK: every rank swaps its
       layers' dispatcher and source (assignments only, nothing that can fail); else every
       rank raises EPRebalanceAborted naming the failed ranks and keeps the old placement
       (the group stays usable: every rank ran the same collectives).
A rank that dies or hangs mid-move surfaces on the others as EPCollectiveError (with
`timeout_s`, naming the exchange); they keep the old placement and the group is marked
broken, as for a failed step.

Memory: until the commit a rank holds its old and its new experts (and, offloaded, both stores
and slot caches), plus the bytes it sends and receives.

No EP step may be in flight (a ValueError otherwise): call it between forwards. Offloaded
layers (moeflow.offload) get a new store and slot cache holding their new experts (the host
copies of the old store are the source of the moves); the old cache is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import ExpertWeights
from .dist_utils import (
    STEP_MAGIC,
    EPCollectiveError,
    collective,
    current_step,
    group_device,
    group_rank,
    group_size,
    point_to_point,
)
from .ep_parts import local_source, make_dispatcher
from .eplb import ModelPlacement
from .load import load_layers
from .plan import EPPlacementError, Placement

__all__ = ["EPRebalanceAborted", "RebalanceReport", "rebalance"]

_FIELDS = ExpertWeights.TENSOR_FIELDS
_OK, _FAILED = 0, 1


class EPRebalanceAborted(EPCollectiveError):
    """A rank could not take part in a rebalance (bad placement, a failed copy): every rank stays on
    its old placement. Attributes: ranks (the ranks that failed)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass(frozen=True)
class RebalanceReport:
    """What a rebalance did on this rank: experts received from other ranks and copied locally, bytes
    sent and received (all layers)."""

    experts_received: int
    experts_copied: int
    bytes_sent: int
    bytes_received: int


@dataclass(frozen=True)
class _Layer:
    layer: Any
    old: Placement
    new: Placement
    fields: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # per-expert (name, shape, dtype)
    device: torch.device

    def row_bytes(self) -> int:
        return sum(_numel(s) * torch.empty((), dtype=d).element_size() for _, s, d in self.fields)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_GENERATION: dict[int, int] = {}


def rebalance(model_or_layers, placement: ModelPlacement | list[Placement], *,
              timeout_s: float | None = None) -> RebalanceReport:
    """Move every expert-parallel layer of `model_or_layers` (model order) to `placement`.

    placement: a ModelPlacement (moeflow.parallel.eplb.plan_placement) or one Placement per layer.
    timeout_s: each exchange's limit (None: the first layer's dispatcher's).
    Collective over the layers' group; between steps. Returns this rank's RebalanceReport.
    Raises EPRebalanceAborted on every rank when any rank refused or failed (all keep the
    old placement), EPCollectiveError when a rank died or hung (the group is then broken).
    """
    layers = load_layers(model_or_layers)
    d0 = getattr(layers[0], "dispatcher", None)
    group = getattr(d0, "group", None)
    if group is None:
        raise ValueError(f"layers[0] (layer_idx={layers[0].layer_idx}): not expert-parallel; rebalance moves the "
                         f"experts of layers sharded with shard_layer / patch_model(ep_group=...)")
    timeout_s = d0.timeout_s if timeout_s is None else timeout_s
    me, W = group_rank(group), group_size(group)
    gen = _GENERATION.get(id(group), 0) + 1
    # 1. check (a local refusal still votes, so that no peer waits for this rank)
    plan, err, fp = None, None, 0
    try:
        plan = _check(layers, placement, group, me, W)
        fp = _fingerprint(plan)
    except Exception as exc:  # noqa: BLE001 - any refusal is voted, then re-raised
        err = exc
    _vote(group, timeout_s, me, W, gen, err, fp, "check")
    _GENERATION[id(group)] = gen
    # 2. move
    moves = _moves(plan)
    sends, recvs, send_err = {}, {}, None
    try:
        sends = _send_buffers(plan, moves, me, group_device(group))
    except Exception as exc:  # noqa: BLE001
        send_err = exc
        sends = {peer: torch.zeros(n, dtype=torch.uint8, device=group_device(group))
                 for peer, n in _message_sizes(plan, moves, me, outgoing=True).items()}
    recvs = {peer: torch.empty(n, dtype=torch.uint8, device=group_device(group))
             for peer, n in _message_sizes(plan, moves, me, outgoing=False).items()}
    point_to_point("send/recv(expert weights)", sends, recvs, group=group, timeout_s=timeout_s)
    # 3. build aside
    built, build_err = None, send_err
    if build_err is None:
        try:
            built = _build(plan, moves, recvs, me, group)
        except Exception as exc:  # noqa: BLE001
            build_err = exc
    # 4. commit vote
    _vote(group, timeout_s, me, W, gen, build_err, fp, "commit")
    received = sum(1 for lay in moves for it in lay if it[0] == me and it[2] != me)
    copied = sum(1 for lay in moves for it in lay if it[0] == me and it[2] == me)
    _commit(plan, built)
    return RebalanceReport(experts_received=received, experts_copied=copied,
                           bytes_sent=sum(int(b.numel()) for b in sends.values()),
                           bytes_received=sum(int(b.numel()) for b in recvs.values()))


def _check(layers: list, placement, group, me: int, W: int) -> list[_Layer]:
    if isinstance(placement, ModelPlacement):
        new = list(placement.layers)
    elif isinstance(placement, (list, tuple)) and all(isinstance(p, Placement) for p in placement):
        new = list(placement)
    else:
        raise TypeError(f"placement: expected a ModelPlacement or a list of Placement, got {type(placement).__name__}")
    if len(new) != len(layers):
        raise EPPlacementError(f"placement: {len(new)} layers, but the model has {len(layers)} expert-parallel layers")
    if current_step(group) is not None:
        raise ValueError("rebalance: an expert-parallel step is in flight on this group; call it between forwards")
    out = []
    for i, (layer, p) in enumerate(zip(layers, new)):
        d = layer.dispatcher
        if getattr(d, "group", None) is not group:
            raise ValueError(f"layers[{i}] (layer_idx={layer.layer_idx}): not sharded over the first layer's group")
        if p.num_experts != layer.config.num_experts or p.world_size != W:
            raise EPPlacementError(f"placement.layers[{i}]: E={p.num_experts}, W={p.world_size}; layer "
                                   f"{layer.layer_idx} has E={layer.config.num_experts} over W={W} ranks")
        w = _old_weights(layer)
        fields = tuple((n, tuple(t.shape[1:]), t.dtype) for n in _FIELDS if (t := getattr(w, n)) is not None)
        out.append(_Layer(layer, d.placement, p, fields, w.gate_up.device))
    return out


def _old_weights(layer) -> ExpertWeights:
    """This rank's experts as held now (index j + the source's expert_shift is local expert j)."""
    runtime = getattr(layer, "offload", None)
    if runtime is not None:
        store = runtime.store
        if store.layer_tensors is None or store.packed is not None:
            raise ValueError(f"layer {layer.layer_idx}: offloaded with store mode {store.mode!r}"
                             f"{' (packed)' if store.packed is not None else ''}; rebalance reads the host copies of "
                             f"an unpacked pinned / model store")
        t = store.layer_tensors[runtime.layers.index(layer)]
        return ExpertWeights(**{n: t.get(n) for n in _FIELDS}, layout=store.layout, interleaved=store.interleaved,
                             quant=store.quant)
    w = getattr(layer.source, "weights", None)
    if not isinstance(w, ExpertWeights):
        raise ValueError(f"layer {layer.layer_idx}: its source {type(layer.source).__name__} holds no expert tensors "
                         f"to move")
    return w


def _shift(layer) -> int:
    return 0 if getattr(layer, "offload", None) is not None else int(getattr(layer.source, "expert_shift", 0))


def _moves(plan: list[_Layer] | None) -> list[list[tuple[int, int, int, int]]]:
    """Per layer: (dest rank, new local j, source rank, old local index there), in (dest, j) order."""
    if plan is None:
        return []
    out = []
    for lay in plan:
        old_local: list[dict[int, int]] = []
        for r in range(lay.old.world_size):
            first: dict[int, int] = {}
            for j, e in enumerate(lay.old.experts_of(r)):
                first.setdefault(e, j)
            old_local.append(first)
        holders = {e: [r for r in range(lay.old.world_size) if e in old_local[r]] for e in range(lay.old.num_experts)}
        items = []
        for r in range(lay.new.world_size):
            for j, e in enumerate(lay.new.experts_of(r)):
                if e in old_local[r]:
                    items.append((r, j, r, old_local[r][e]))
                else:
                    hs = holders[e]
                    s = hs[(r + j) % len(hs)]
                    items.append((r, j, s, old_local[s][e]))
        out.append(items)
    return out


def _message_sizes(plan, moves, me: int, *, outgoing: bool) -> dict[int, int]:
    sizes: dict[int, int] = {}
    for lay, items in zip(plan or [], moves):
        rb = lay.row_bytes()
        for dst, _, src, _ in items:
            if src == dst:
                continue
            if outgoing and src == me:
                sizes[dst] = sizes.get(dst, 0) + rb
            elif not outgoing and dst == me:
                sizes[src] = sizes.get(src, 0) + rb
    return sizes


def _row_bytes_of(w: ExpertWeights, lay: _Layer, idx: int) -> list[torch.Tensor]:
    return [getattr(w, n)[idx].contiguous().view(torch.uint8).reshape(-1) for n, _, _ in lay.fields]


def _send_buffers(plan, moves, me: int, device: torch.device) -> dict[int, torch.Tensor]:
    parts: dict[int, list[torch.Tensor]] = {}
    for lay, items in zip(plan or [], moves):
        w, shift = _old_weights(lay.layer), _shift(lay.layer)
        for dst, _, src, old_j in items:
            if src == me and dst != me:
                parts.setdefault(dst, []).extend(_row_bytes_of(w, lay, old_j + shift))
    return {peer: torch.cat([p.to(device) for p in ps]) for peer, ps in parts.items()}


def _build(plan, moves, recvs: dict[int, torch.Tensor], me: int, group) -> list[tuple[Any, ExpertWeights, Any, Any]]:
    """Per layer (layer, new local experts, new dispatcher, new source), built aside."""
    offsets = {peer: 0 for peer in recvs}
    built = []
    for lay, items in zip(plan, moves):
        mine = [it for it in items if it[0] == me]
        w, shift = _old_weights(lay.layer), _shift(lay.layer)
        new = {n: torch.empty((len(mine), *s), dtype=dt, device=lay.device) for n, s, dt in lay.fields}
        for _, j, src, old_j in mine:
            if src == me:
                for n, _, _ in lay.fields:
                    new[n][j].copy_(getattr(w, n)[old_j + shift])
                continue
            off = offsets[src]
            for n, s, dt in lay.fields:
                nb = _numel(s) * torch.empty((), dtype=dt).element_size()
                piece = recvs[src][off: off + nb]
                new[n][j].view(-1).view(torch.uint8).copy_(piece.to(lay.device))
                off += nb
            offsets[src] = off
        d_old = lay.layer.dispatcher
        nw = ExpertWeights(**{n: new.get(n) for n in _FIELDS}, layout=w.layout, interleaved=w.interleaved,
                           quant=w.quant) if mine else None
        d = make_dispatcher(lay.layer.config, group=d_old.group, mode=d_old.name, placement=lay.new,
                            static_tokens=getattr(d_old, "static_tokens", None), timeout_s=d_old.timeout_s,
                            reduce_dtype=getattr(d_old, "reduce_dtype", None) if d_old.name == "all_reduce" else None,
                            check_inputs=getattr(d_old, "check_inputs", None) if d_old.name == "all_reduce" else None)
        static = getattr(d_old, "static_tokens", None) is not None
        # no expert here after the move (nw None): an empty source
        built.append((lay.layer, nw, d, local_source(lay.new, me, static=static, local=nw)))
    return _with_offload(built)


def _with_offload(built: list) -> list:
    """Offloaded layers: a new store and runtime per old runtime, built now (the dispatchers swapped in
    for the construction only: the prefetcher reads the layers' local ids), installed at commit."""
    runtimes: dict[int, Any] = {}
    for layer, *_ in built:
        rt = getattr(layer, "offload", None)
        if rt is not None:
            runtimes.setdefault(id(rt), rt)
    if not runtimes:
        return [(*b, None) for b in built]
    from ..offload.attach import OffloadRuntime
    from ..offload.store import ExpertStore

    by_layer = {id(b[0]): b for b in built}
    new_rt: dict[int, Any] = {}
    for key, rt in runtimes.items():
        entries = [by_layer.get(id(layer)) for layer in rt.layers]
        if any(e is None or e[1] is None for e in entries):
            raise ValueError("rebalance: an offloaded layer must keep at least one expert on every rank, and every "
                             "layer of its offload runtime must be rebalanced together")
        saved = [layer.dispatcher for layer in rt.layers]
        try:
            for layer, e in zip(rt.layers, entries):
                layer.dispatcher = e[2]
            store = ExpertStore.from_weights([e[1] for e in entries], mode="pinned", progress=False)
            new_rt[key] = OffloadRuntime(rt.layers, store, rt.config)
        finally:
            for layer, d in zip(rt.layers, saved):
                layer.dispatcher = d
    return [(*b, new_rt.get(id(getattr(b[0], "offload", None)))) for b in built]


def _commit(plan, built) -> None:
    """Swap every layer's dispatcher and source (offloaded layers: the new runtime installed over new
    resident sources, released once its store holds their copy, as attach_offload does; the old
    runtime is dropped, not detached: its resident tensors were released)."""
    for layer, _, d, src, _ in built:
        layer.dispatcher = d
        layer.set_source(src)
    installed: set[int] = set()
    for *_, rt in built:
        if rt is not None and id(rt) not in installed:
            installed.add(id(rt))
            resident = [m.source for m in rt.layers]
            rt.install()
            for s in resident:
                s.release()


def _fingerprint(plan: list[_Layer]) -> int:
    h = len(plan)
    for lay in plan:
        h = (h * 1000003 + lay.new.fingerprint()[2] + lay.new.num_physical) % (1 << 61)
    return h


def _vote(group, timeout_s, me: int, W: int, gen: int, err: BaseException | None, fp: int, what: str) -> None:
    """All-gather [magic, generation, status, fingerprint] per rank; raise EPRebalanceAborted on every rank
    when a rank failed or the ranks disagree (the failing rank re-raises its own error)."""
    dev = group_device(group)
    mine = torch.tensor([STEP_MAGIC, gen, _OK if err is None else _FAILED, fp], dtype=torch.int64, device=dev)
    got = [torch.empty_like(mine) for _ in range(W)]
    collective(f"all_gather(rebalance {what})", dist.all_gather, got, mine, group=group, timeout_s=timeout_s)
    rows = torch.stack(got).cpu().tolist()
    failed = tuple(r for r, row in enumerate(rows) if row[2] != _OK)
    if err is not None:
        if hasattr(err, "add_note"):
            err.add_note(f"expert parallelism: this rank (rank {me}) refused the rebalance at its {what} step; "
                         f"every rank keeps its old placement")
        raise err
    if failed:
        raise EPRebalanceAborted(
            f"rebalance ({what}) on rank {me}/{W}: rank(s) {list(failed)} refused or failed; every rank keeps its "
            f"old placement (the group stays usable)", failed)
    odd = [r for r, row in enumerate(rows) if row[0] != STEP_MAGIC or row[1] != gen or row[3] != fp]
    if odd:
        raise EPRebalanceAborted(
            f"rebalance ({what}) on rank {me}/{W}: rank(s) {odd} passed another placement or are at another "
            f"rebalance (fingerprints {[row[3] for row in rows]}, generations {[row[1] for row in rows]}); every "
            f"rank keeps its old placement", tuple(odd))
