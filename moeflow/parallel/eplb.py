"""Expert placement from measured load (EPLB): replicate the heaviest experts, pack the copies onto ranks.

Legend: L MoE layers, E logical experts per layer, R redundant copies, Q = E + R physical
experts, W ranks, G ranks per node, N = W / G nodes, X expert groups (of E / X experts).

    load_LE = expert_load(model, reduce=True)                 # moeflow.parallel.load
    p = plan_placement(load_LE, world_size=W, redundant_experts=R)
    p.imbalance(load_LE)                                      # max rank load / mean rank load
    rebalance(model, p)                                       # moeflow.parallel.rebalancing

The algorithm is DeepSeek's EPLB, per layer:
    1. replicate: R times, give one more copy to the expert whose load per copy is the
       largest (ties: the lower id), so the heaviest load a single copy carries is minimal;
    2. pack: the Q copies (each carrying load / copies of its expert) in descending load
       (ties: lower expert, then lower copy) go one by one to the least loaded rank that has
       room (ties: the lower rank), preferring a rank that does not hold the expert yet (a
       second copy on the same rank balances nothing);
    with `ranks_per_node` (hierarchical): first the expert groups are packed onto nodes the
    same way (equal groups per node), then steps 1 and 2 run inside each node with Q / N
    copies over its G ranks, so a token's experts stay on few nodes when the router limits
    the groups it picks (DeepSeek-V3's group-limited routing).
Everything is host arithmetic in float64 on the given table: deterministic, the same on
every rank that passes the same load.

A rank's room is Q / W copies; when W does not divide Q the first Q % W ranks hold one more
(the hierarchical form needs W | Q). The runtime takes such a placement as given;
`shard_layer(redundant_experts=R)` without one needs W | Q (its default layout).

Imbalance of a placement on a load: each expert's load splits evenly over its copies (the
routing rule, moeflow.parallel.plan.physical_ids, gives each copy the same rows within one);
a rank's load is the sum over its copies; per layer max / mean over ranks; over layers
sum of maxima / sum of means (a step waits for the slowest rank at every layer).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .plan import EPPlacementError, Placement

__all__ = ["ModelPlacement", "plan_placement", "rank_load", "imbalance"]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, eq=False)
class ModelPlacement:
    """Every layer's physical experts: which logical expert each copy is and which rank holds it.

    logical_of_LQ: int64 [L, Q] (CPU), the logical expert of physical q in layer l.
    rank_of_LQ:    int64 [L, Q] (CPU), the rank holding it (non-decreasing along q).
    world_size:    W. num_experts: E.
    layers:        per layer the `Placement` the routing table uses (built from the rows).
    """

    logical_of_LQ: torch.Tensor = field(repr=False)
    rank_of_LQ: torch.Tensor = field(repr=False)
    world_size: int
    num_experts: int
    layers: tuple[Placement, ...] = field(repr=False, default=())

    def __post_init__(self) -> None:
        if self.logical_of_LQ.dim() != 2 or self.logical_of_LQ.shape != self.rank_of_LQ.shape:
            raise EPPlacementError(f"logical_of_LQ {tuple(self.logical_of_LQ.shape)} / rank_of_LQ "
                                   f"{tuple(self.rank_of_LQ.shape)}: expected two [L, Q] tables of one shape")
        if not self.layers:
            object.__setattr__(self, "layers", tuple(
                Placement.from_physical(lq, rq, world_size=self.world_size, num_experts=self.num_experts)
                for lq, rq in zip(self.logical_of_LQ, self.rank_of_LQ)))

    @classmethod
    def from_layers(cls, layers: Sequence[Placement]) -> ModelPlacement:
        """From per-layer placements (one E, W and Q for all)."""
        layers = list(layers)
        if not layers or not all(isinstance(p, Placement) for p in layers):
            raise TypeError("layers: expected a non-empty list of moeflow.parallel.Placement")
        E, W, Q = layers[0].num_experts, layers[0].world_size, layers[0].num_physical
        for i, p in enumerate(layers):
            if (p.num_experts, p.world_size, p.num_physical) != (E, W, Q):
                raise EPPlacementError(f"layers[{i}]: E={p.num_experts}, W={p.world_size}, Q={p.num_physical}; "
                                       f"expected layers[0]'s E={E}, W={W}, Q={Q}")
        return cls(torch.stack([p.logical_of_Q for p in layers]), torch.stack([p.rank_of_Q for p in layers]),
                   world_size=W, num_experts=E, layers=tuple(layers))

    @property
    def num_layers(self) -> int:
        return int(self.logical_of_LQ.shape[0])

    @property
    def num_physical(self) -> int:
        return int(self.logical_of_LQ.shape[1])

    @property
    def num_redundant(self) -> int:
        return self.num_physical - self.num_experts

    def rank_load(self, load_LE: torch.Tensor) -> torch.Tensor:
        """float64 [L, W]: each rank's share of the load (see the module doc)."""
        load = _check_load(load_LE, self.num_experts, L=self.num_layers)
        return torch.stack([rank_load(p, load[i]) for i, p in enumerate(self.layers)])

    def imbalance(self, load_LE: torch.Tensor) -> float:
        """Sum over layers of the busiest rank's load / sum over layers of the mean rank load (>= 1;
        1.0 for no load at all)."""
        return imbalance(self.rank_load(load_LE))

    def imbalance_per_layer(self, load_LE: torch.Tensor) -> torch.Tensor:
        """float64 [L]: max / mean rank load per layer (1.0 where the layer has no load)."""
        rl = self.rank_load(load_LE)
        mean = rl.mean(1)
        return torch.where(mean > 0, rl.max(1).values / mean.clamp_min(1e-300), torch.ones_like(mean))


def rank_load(placement: Placement, load_E: torch.Tensor) -> torch.Tensor:
    """float64 [W]: each rank's load under `placement` for logical load_E [E] (copies split it evenly)."""
    load = torch.as_tensor(load_E).to(torch.float64).reshape(-1)
    if load.numel() != placement.num_experts:
        raise ValueError(f"load_E: {load.numel()} entries, expected E={placement.num_experts}")
    per_copy_Q = load[placement.logical_of_Q] / placement.num_copies_E[placement.logical_of_Q].to(torch.float64)
    out = torch.zeros(placement.world_size, dtype=torch.float64)
    return out.index_add_(0, placement.rank_of_Q, per_copy_Q)


def imbalance(rank_load_LW: torch.Tensor) -> float:
    """Sum over layers of max rank load / sum of mean rank load, from a [L, W] (or [W]) table."""
    rl = rank_load_LW.to(torch.float64)
    if rl.dim() == 1:
        rl = rl.unsqueeze(0)
    mean = float(rl.mean(1).sum())
    return float(rl.max(1).values.sum()) / mean if mean > 0 else 1.0


def _check_load(load_LE: object, E: int | None = None, L: int | None = None) -> torch.Tensor:
    if not isinstance(load_LE, torch.Tensor) or load_LE.dim() != 2:
        raise ValueError(f"load_LE: expected a 2-D tensor [L, E], got {type(load_LE).__name__} "
                         f"{tuple(getattr(load_LE, 'shape', ()))}")
    if load_LE.dtype == torch.bool or load_LE.dtype.is_complex:
        raise TypeError(f"load_LE.dtype={load_LE.dtype}: expected integer or floating counts")
    load = load_LE.detach().to("cpu", torch.float64)
    if E is not None and load.shape[1] != E:
        raise ValueError(f"load_LE: {load.shape[1]} experts per layer, expected E={E}")
    if L is not None and load.shape[0] != L:
        raise ValueError(f"load_LE: {load.shape[0]} layers, expected L={L}")
    if load.numel() and (not bool(torch.isfinite(load).all()) or bool((load < 0).any())):
        bad = (~torch.isfinite(load) | (load < 0)).nonzero()[0].tolist()
        raise ValueError(f"load_LE[{bad[0]}, {bad[1]}]={float(load[bad[0], bad[1]])}: expected finite counts >= 0")
    return load


def plan_placement(load_LE: torch.Tensor, world_size: int, *, redundant_experts: int = 0,
                   ranks_per_node: int | None = None, expert_groups: int | None = None) -> ModelPlacement:
    """Place E + R physical experts per layer on W ranks from the measured load (DeepSeek's EPLB).

    load_LE: [L, E] load per layer and logical expert (counts, any real dtype, any device;
        read once to the host).
    world_size: W. redundant_experts: R >= 0 extra copies per layer (Q = E + R).
    ranks_per_node: G: hierarchical placement over W / G nodes (W % G == 0, the expert groups
        split evenly over the nodes, W | Q); None: one level.
    expert_groups: X, the router's expert groups (E % X == 0) the hierarchical form packs onto
        nodes whole; None: every expert its own group.
    Returns a ModelPlacement (deterministic for a given load). Raises ValueError / TypeError /
    EPPlacementError naming the argument.
    """
    load = _check_load(load_LE)
    L, E = load.shape
    if E < 1 or L < 1:
        raise ValueError(f"load_LE: shape {tuple(load.shape)}, expected at least one layer and one expert")
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected an int >= 1")
    if not _is_int(redundant_experts) or redundant_experts < 0:
        raise ValueError(f"redundant_experts={redundant_experts!r}: expected an int >= 0")
    W, Q = world_size, E + redundant_experts
    rows = []
    if ranks_per_node is None:
        if expert_groups is not None:
            raise ValueError(f"expert_groups={expert_groups!r}: only used with ranks_per_node (hierarchical)")
        caps = [Q // W + (1 if r < Q % W else 0) for r in range(W)]
        for l in range(L):
            rows.append(_place_layer(load[l].tolist(), list(range(E)), Q - E, caps, list(range(W))))
    else:
        if not _is_int(ranks_per_node) or ranks_per_node < 1 or W % ranks_per_node:
            raise ValueError(f"ranks_per_node={ranks_per_node!r}: expected an int >= 1 dividing world_size={W}")
        X = E if expert_groups is None else expert_groups
        if not _is_int(X) or X < 1 or E % X:
            raise ValueError(f"expert_groups={expert_groups!r}: expected an int >= 1 dividing E={E}")
        N = W // ranks_per_node
        if X % N:
            raise EPPlacementError(f"ranks_per_node={ranks_per_node}: {N} nodes do not split the {X} expert groups "
                                   f"evenly; expected the groups a multiple of the nodes (or ranks_per_node=None)")
        if Q % W:
            raise EPPlacementError(f"redundant_experts={redundant_experts}: the hierarchical placement needs W | E + R "
                                   f"(E + R = {Q}, W = {W})")
        for l in range(L):
            rows.append(_place_layer_hierarchical(load[l].tolist(), X, N, ranks_per_node, Q))
    logical = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    ranks = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    return ModelPlacement(logical, ranks, world_size=W, num_experts=E)


def _replicate(load: list[float], experts: list[int], extra: int) -> dict[int, int]:
    """Copies per expert: one each, then `extra` more, each to the largest load per copy (ties: lower id)."""
    copies = {e: 1 for e in experts}
    heap = [(-load[e], e) for e in experts]
    heapq.heapify(heap)
    for _ in range(extra):
        _, e = heapq.heappop(heap)
        copies[e] += 1
        heapq.heappush(heap, (-load[e] / copies[e], e))
    return copies


def _pack(items: list[tuple[float, int, int]], caps: list[int], ranks: list[int]) -> dict[int, list[int]]:
    """Greedy balanced packing: items (weight, expert, copy) heaviest first onto the least loaded rank with room,
    preferring one without that expert. Returns rank -> experts."""
    items = sorted(items, key=lambda it: (-it[0], it[1], it[2]))
    held: dict[int, list[int]] = {r: [] for r in ranks}
    heap = [(0.0, r) for r, c in zip(ranks, caps) if c > 0]
    heapq.heapify(heap)
    room = dict(zip(ranks, caps))
    for w, e, _ in items:
        skipped = []
        pick = None
        while heap:
            cand = heapq.heappop(heap)
            if e not in held[cand[1]]:
                pick = cand
                break
            skipped.append(cand)
        if pick is None:  # every rank with room holds e already: the least loaded of them
            pick = skipped.pop(0)
        for s in skipped:
            heapq.heappush(heap, s)
        load_r, r = pick
        held[r].append(e)
        room[r] -= 1
        if room[r] > 0:
            heapq.heappush(heap, (load_r + w, r))
    return held


def _place_layer(load: list[float], experts: list[int], extra: int, caps: list[int], ranks: list[int]
                 ) -> tuple[list[int], list[int]]:
    """One layer (or one node): replicate, pack; (logical of each physical, its rank), rank-major, logical ascending."""
    copies = _replicate(load, experts, extra)
    items = [(load[e] / copies[e], e, c) for e in experts for c in range(copies[e])]
    held = _pack(items, caps, ranks)
    logical, rank_of = [], []
    for r in ranks:
        for e in sorted(held[r]):
            logical.append(e)
            rank_of.append(r)
    return logical, rank_of


def _place_layer_hierarchical(load: list[float], X: int, N: int, G: int, Q: int) -> tuple[list[int], list[int]]:
    E = len(load)
    size = E // X
    group_load = [sum(load[g * size:(g + 1) * size]) for g in range(X)]
    nodes = _pack([(group_load[g], g, 0) for g in range(X)], [X // N] * N, list(range(N)))
    logical, rank_of = [], []
    for n in range(N):
        experts = [g * size + i for g in sorted(nodes[n]) for i in range(size)]
        ranks = list(range(n * G, (n + 1) * G))
        lq, rq = _place_layer(load, experts, Q // N - len(experts), [Q // (N * G)] * G, ranks)
        logical += lq
        rank_of += rq
    return logical, rank_of
