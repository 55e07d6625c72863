"""Expert placement and the expert-parallel routing table.

Legend: T tokens on this (source) rank, K picks per token, P = T*K (token, slot) pairs
(flattened row-major: pair p = t*K + k), E routed (logical) experts, Z zero experts, W ranks
(world size of the expert-parallel group), L experts on one rank, Q physical experts (E + R
with R redundant copies), M the most copies one logical expert has.

Redundant experts: a placement may hold Q = E + R physical experts, each a copy of one
logical expert; a logical expert then has 1 or more copies, on any ranks. The routing table
maps each (token, logical expert) pair to one copy by `physical_ids`: the j-th pair of
expert e in (token, slot) order goes to copy (j + copy_offset) % copies(e), so every copy
gets the same number of rows within one; the all-to-all dispatcher offsets by its rank (the
remainders land on different copies across ranks), the all-reduce plan by 0 (every rank
holds the same tokens and must pick the same copy). The rule reads only this rank's routing:
no collective, no host read.

Nothing here talks to torch.distributed: `ep_plan` is a pure function of one rank's
routing, and the same code serves the all-to-all dispatcher (`all_to_all.py`), the
all-reduce plan (`all_reduce.py`) and the tests.

Zero experts (LongCat): an id >= E is an identity expert. It costs no compute and is
never sent anywhere: the pair stays on the source rank, which adds w*x itself when it
combines. So `send_counts_R` sums to T*K minus the number of zero-expert pairs, and
the zero-expert pairs sit at the end of `send_order_P` (after every rank's block).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["EPPlacementError", "Placement", "contiguous_ranges", "as_placement", "EPPlan", "ep_plan", "physical_ids"]


class EPPlacementError(ValueError):
    """A placement of physical (redundant) experts that cannot serve: E + R not a multiple of W for
    the default layout, a logical expert without a copy, a rank outside the group, a count that
    does not match the layer."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def contiguous_ranges(num_experts: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's expert range: rank r owns [r*E/W, (r+1)*E/W).

    Raises ValueError when W does not divide E: an uneven split is a placement choice
    the caller must make explicitly (pass ranges or an expert->rank map).
    """
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"contiguous_ranges: num_experts={num_experts!r}, expected an int >= 1")
    if not _is_int(world_size) or world_size < 1:
        raise ValueError(f"contiguous_ranges: world_size={world_size!r}, expected an int >= 1")
    if num_experts % world_size:
        raise ValueError(
            f"contiguous_ranges: world_size={world_size} does not divide num_experts={num_experts}; "
            f"pass explicit ranges or an expert->rank map (Placement.from_map) instead"
        )
    per = num_experts // world_size
    return [(r * per, (r + 1) * per) for r in range(world_size)]


@dataclass(frozen=True, eq=False)
class Placement:
    """Which rank holds each routed expert, and (with redundancy) each expert's copies.

    num_experts:      E (logical experts, the ids the router picks).
    world_size:       W (ranks may hold no expert at all).
    experts_per_rank: rank -> the logical ids of its physical experts, in local order. Local
                      expert j on rank r is a copy of `experts_per_rank[r][j]`: the order of
                      `ExpertWeights.subset(experts_per_rank[r])`. Without redundancy the ids
                      ascend and each expert is on one rank.
    rank_of_E:        int64 [E] (CPU), the rank of each expert's first copy.
    local_index_E:    int64 [E] (CPU), that copy's index among its rank's experts.
    logical_of_Q:     int64 [Q] (CPU), the logical expert of each physical one (Q = E: identity).
    rank_of_Q:        int64 [Q] (CPU), the rank holding each physical expert.
    local_index_Q:    int64 [Q] (CPU), its index among that rank's experts.
    copies_EM:        int64 [E, M] (CPU), the physical ids of each expert's copies, ascending,
                      padded with the first copy.
    num_copies_E:     int64 [E] (CPU), copies of each expert (>= 1).

    Build it with `contiguous`, `from_ranges`, `from_map`, `from_rank_experts` (one copy
    each), `replicated` (the default layout of R redundant copies) or `from_physical` (any
    physical map); each validates (every expert at least once; without redundancy exactly
    once). `as_placement` picks among the one-copy forms.
    """

    num_experts: int
    world_size: int
    experts_per_rank: tuple[tuple[int, ...], ...]
    rank_of_E: torch.Tensor = field(repr=False)
    local_index_E: torch.Tensor = field(repr=False)
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)
    logical_of_Q: torch.Tensor | None = field(default=None, repr=False)
    rank_of_Q: torch.Tensor | None = field(default=None, repr=False)
    local_index_Q: torch.Tensor | None = field(default=None, repr=False)
    copies_EM: torch.Tensor | None = field(default=None, repr=False)
    num_copies_E: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.logical_of_Q is None:  # built field by field: one copy per expert, physical id = logical id
            E = self.num_experts
            set_ = object.__setattr__
            set_(self, "logical_of_Q", torch.arange(E, dtype=torch.int64))
            set_(self, "rank_of_Q", self.rank_of_E.clone())
            set_(self, "local_index_Q", self.local_index_E.clone())
            set_(self, "copies_EM", torch.arange(E, dtype=torch.int64).view(E, 1))
            set_(self, "num_copies_E", torch.ones(E, dtype=torch.int64))

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def _build(cls, num_experts: int, owner: list[int], world_size: int) -> Placement:
        """One copy of each expert e, on rank owner[e] (physical id = logical id)."""
        return cls._build_physical(num_experts, list(range(num_experts)), owner, world_size)

    @classmethod
    def _build_physical(cls, num_experts: int, logical: list[int], ranks: list[int], world_size: int
                        ) -> Placement:
        """Physical expert q is a copy of logical[q] on rank ranks[q]; a rank's local order is physical order."""
        per_rank: list[list[int]] = [[] for _ in range(world_size)]
        local_q = [0] * len(logical)
        for q, r in enumerate(ranks):
            local_q[q] = len(per_rank[r])
            per_rank[r].append(logical[q])
        copies: list[list[int]] = [[] for _ in range(num_experts)]
        for q, e in enumerate(logical):
            copies[e].append(q)
        M = max(len(c) for c in copies)
        first = [c[0] for c in copies]
        return cls(
            num_experts=num_experts,
            world_size=world_size,
            experts_per_rank=tuple(tuple(x) for x in per_rank),
            rank_of_E=torch.tensor([ranks[q] for q in first], dtype=torch.int64),
            local_index_E=torch.tensor([local_q[q] for q in first], dtype=torch.int64),
            logical_of_Q=torch.tensor(logical, dtype=torch.int64),
            rank_of_Q=torch.tensor(ranks, dtype=torch.int64),
            local_index_Q=torch.tensor(local_q, dtype=torch.int64),
            copies_EM=torch.tensor([c + [c[0]] * (M - len(c)) for c in copies], dtype=torch.int64),
            num_copies_E=torch.tensor([len(c) for c in copies], dtype=torch.int64),
        )

    @classmethod
    def from_physical(cls, logical_of_Q: Sequence[int] | torch.Tensor, rank_of_Q: Sequence[int] | torch.Tensor, *,
                      world_size: int, num_experts: int | None = None) -> Placement:
        """Q physical experts: physical q is a copy of logical expert `logical_of_Q[q]`, held by rank
        `rank_of_Q[q]` (local order on a rank: physical order). E = max logical id + 1 unless given.

        Raises EPPlacementError naming the entry: a logical expert with no copy, an id or a rank
        out of range, lists of different lengths.
        """
        logical = _int_list(logical_of_Q, "logical_of_Q")
        ranks = _int_list(rank_of_Q, "rank_of_Q")
        if len(logical) != len(ranks) or not logical:
            raise EPPlacementError(f"logical_of_Q has {len(logical)} entries and rank_of_Q {len(ranks)}: expected "
                                   f"the same number (>= 1), one per physical expert")
        if not _is_int(world_size) or world_size < 1:
            raise EPPlacementError(f"world_size={world_size!r}: expected an int >= 1")
        E = max(logical) + 1 if num_experts is None else num_experts
        if not _is_int(E) or E < 1:
            raise EPPlacementError(f"num_experts={num_experts!r}: expected an int >= 1")
        for q, (e, r) in enumerate(zip(logical, ranks)):
            if not 0 <= e < E:
                raise EPPlacementError(f"logical_of_Q[{q}]={e}: expected a logical expert in [0, {E})")
            if not 0 <= r < world_size:
                raise EPPlacementError(f"rank_of_Q[{q}]={r}: expected a rank in [0, world_size={world_size})")
        missing = sorted(set(range(E)) - set(logical))
        if missing:
            raise EPPlacementError(f"logical_of_Q: expert {missing[0]} has no physical copy (every logical expert "
                                   f"needs at least one; {len(missing)} missing)")
        return cls._build_physical(E, logical, ranks, world_size)

    @classmethod
    def replicated(cls, num_experts: int, world_size: int, redundant_experts: int) -> Placement:
        """The default layout of R redundant copies: Q = E + R physical experts, physical q a copy of
        logical q % E, Q / W consecutive physical experts per rank (q on rank q // (Q / W)).

        Raises EPPlacementError when W does not divide E + R (every rank holds the same count).
        """
        for name, v, lo in (("num_experts", num_experts, 1), ("world_size", world_size, 1),
                            ("redundant_experts", redundant_experts, 0)):
            if not _is_int(v) or v < lo:
                raise EPPlacementError(f"{name}={v!r}: expected an int >= {lo}")
        Q = num_experts + redundant_experts
        if Q % world_size:
            raise EPPlacementError(
                f"redundant_experts={redundant_experts}: E + R = {num_experts} + {redundant_experts} = {Q} physical "
                f"experts do not split evenly over world_size={world_size} ranks; expected E + R a multiple of W "
                f"(e.g. R = {-num_experts % world_size or world_size}), or pass an explicit placement")
        per = Q // world_size
        return cls._build_physical(num_experts, [q % num_experts for q in range(Q)],
                                   [q // per for q in range(Q)], world_size)

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int) -> Placement:
        """Equal contiguous ranges (ValueError when W does not divide E)."""
        return cls.from_ranges(contiguous_ranges(num_experts, world_size))

    @classmethod
    def from_ranges(cls, ranges: Sequence[Sequence[int]], *, num_experts: int | None = None) -> Placement:
        """`ranges[r] = (start, end)`: rank r owns experts [start, end). E = max end unless given.

        The ranges must cover [0, E) exactly once: a gap or an overlap is a ValueError
        naming the expert. An empty range (start == end) is a rank with no experts.
        """
        if isinstance(ranges, (str, bytes)) or not isinstance(ranges, Sequence) or len(ranges) == 0:
            raise ValueError(f"expert_ranges={ranges!r}: expected a non-empty list of (start, end) per rank")
        parsed: list[tuple[int, int]] = []
        for r, rng in enumerate(ranges):
            if (
                isinstance(rng, (str, bytes))
                or not isinstance(rng, Sequence)
                or len(rng) != 2
                or not all(_is_int(v) for v in rng)
            ):
                raise ValueError(f"expert_ranges[{r}]={rng!r}: expected (start, end) ints")
            start, end = rng
            if start < 0 or end < start:
                raise ValueError(f"expert_ranges[{r}]=({start}, {end}): expected 0 <= start <= end")
            parsed.append((start, end))
        e_total = max(end for _, end in parsed)
        if num_experts is not None:
            if e_total > num_experts:
                raise ValueError(
                    f"expert_ranges reach expert {e_total - 1} but num_experts={num_experts}"
                )
            e_total = num_experts
        if e_total < 1:
            raise ValueError(f"expert_ranges={ranges!r}: no rank owns any expert")
        owner = [-1] * e_total
        for r, (start, end) in enumerate(parsed):
            for e in range(start, end):
                if owner[e] != -1:
                    raise ValueError(
                        f"expert_ranges: expert {e} is in the ranges of rank {owner[e]} and rank {r}"
                    )
                owner[e] = r
        _check_all_owned(owner, "expert_ranges")
        return cls._build(e_total, owner, len(parsed))

    @classmethod
    def from_map(
        cls,
        expert_to_rank: Sequence[int] | torch.Tensor | Mapping[int, int],
        *,
        world_size: int | None = None,
        num_experts: int | None = None,
    ) -> Placement:
        """`expert_to_rank[e]` = the rank owning expert e (list, 1-D int tensor or {expert: rank}).

        W = max rank + 1 unless given. An expert with no rank (missing from a dict, or a
        negative entry) or a rank outside [0, W) is a ValueError naming the expert.
        """
        if isinstance(expert_to_rank, torch.Tensor):
            if expert_to_rank.dim() != 1 or expert_to_rank.dtype.is_floating_point or expert_to_rank.dtype == torch.bool:
                raise ValueError(
                    f"expert_to_rank: tensor {expert_to_rank.dtype}{tuple(expert_to_rank.shape)}, "
                    f"expected a 1-D integer tensor of length E"
                )
            owner = [int(v) for v in expert_to_rank.tolist()]
        elif isinstance(expert_to_rank, Mapping):
            keys = list(expert_to_rank)
            if not all(_is_int(k) for k in keys) or not all(_is_int(v) for v in expert_to_rank.values()):
                raise ValueError(f"expert_to_rank={dict(expert_to_rank)!r}: expected {{expert: rank}} ints")
            bad = [k for k in keys if k < 0]
            if bad:
                raise ValueError(f"expert_to_rank: expert id {bad[0]} is negative")
            n = num_experts if num_experts is not None else (max(keys) + 1 if keys else 0)
            extra = [k for k in keys if k >= n]
            if extra:
                raise ValueError(f"expert_to_rank: expert {extra[0]} >= num_experts={n}")
            owner = [expert_to_rank.get(e, -1) for e in range(n)]
        elif isinstance(expert_to_rank, Sequence) and not isinstance(expert_to_rank, (str, bytes)):
            if not all(_is_int(v) for v in expert_to_rank):
                raise ValueError(f"expert_to_rank={list(expert_to_rank)!r}: expected ints (one rank per expert)")
            owner = list(expert_to_rank)
        else:
            raise ValueError(f"expert_to_rank={expert_to_rank!r}: expected a list, 1-D tensor or dict")
        if num_experts is not None and len(owner) != num_experts:
            raise ValueError(f"expert_to_rank has {len(owner)} entries, expected num_experts={num_experts}")
        if len(owner) == 0:
            raise ValueError("expert_to_rank is empty: expected one rank per expert")
        _check_all_owned(owner, "expert_to_rank")
        w = max(owner) + 1 if world_size is None else world_size
        if not _is_int(w) or w < 1:
            raise ValueError(f"world_size={world_size!r}: expected an int >= 1")
        for e, r in enumerate(owner):
            if r >= w:
                raise ValueError(f"expert_to_rank: expert {e} is on rank {r}, outside world_size={w}")
        return cls._build(len(owner), owner, w)

    @classmethod
    def from_rank_experts(
        cls, rank_experts: Sequence[Sequence[int]], *, num_experts: int | None = None
    ) -> Placement:
        """`rank_experts[r]` = the experts rank r owns (any order). Each expert exactly once:
        a missing or repeated expert is a ValueError naming it."""
        if isinstance(rank_experts, (str, bytes)) or not isinstance(rank_experts, Sequence) or not rank_experts:
            raise ValueError(f"rank_experts={rank_experts!r}: expected a non-empty list of expert lists")
        all_ids = []
        for r, experts in enumerate(rank_experts):
            if isinstance(experts, torch.Tensor):
                experts = experts.tolist()
            if not all(_is_int(e) for e in experts):
                raise ValueError(f"rank_experts[{r}]={experts!r}: expected expert ids (ints)")
            all_ids.extend((e, r) for e in experts)
        n = num_experts if num_experts is not None else (max(e for e, _ in all_ids) + 1 if all_ids else 0)
        if n < 1:
            raise ValueError("rank_experts: no rank owns any expert")
        owner = [-1] * n
        for e, r in all_ids:
            if e < 0 or e >= n:
                raise ValueError(f"rank_experts[{r}]: expert {e} outside [0, {n})")
            if owner[e] != -1:
                raise ValueError(f"rank_experts: expert {e} is placed twice (rank {owner[e]} and rank {r})")
            owner[e] = r
        _check_all_owned(owner, "rank_experts")
        return cls._build(n, owner, len(rank_experts))

    # ---- queries ------------------------------------------------------------------

    def experts_of(self, rank: int) -> tuple[int, ...]:
        """Global ids of rank `rank`'s experts, ascending."""
        self._check_rank(rank)
        return self.experts_per_rank[rank]

    def num_local(self, rank: int) -> int:
        return len(self.experts_of(rank))

    def range_of(self, rank: int) -> tuple[int, int] | None:
        """(start, end) if rank's experts are one contiguous range, else None."""
        ex = self.experts_of(rank)
        if not ex:
            return (0, 0)
        return (ex[0], ex[0] + len(ex)) if ex == tuple(range(ex[0], ex[0] + len(ex))) else None

    @property
    def is_contiguous(self) -> bool:
        """Every rank holds one contiguous range."""
        return all(self.range_of(r) is not None for r in range(self.world_size))

    def tensors(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank_of_E, local_index_E) on `device`, cached (one copy per device)."""
        key = str(torch.device(device))
        hit = self._device_cache.get(key)
        if hit is None:
            hit = (self.rank_of_E.to(device), self.local_index_E.to(device))
            self._device_cache[key] = hit
        return hit

    @property
    def num_physical(self) -> int:
        """Q: physical experts over all ranks (E + R)."""
        return int(self.logical_of_Q.numel())

    @property
    def num_redundant(self) -> int:
        """R = Q - E: copies beyond one per logical expert."""
        return self.num_physical - self.num_experts

    @property
    def is_redundant(self) -> bool:
        return self.num_physical != self.num_experts

    @property
    def is_identity(self) -> bool:
        """One copy each and physical id = logical id (every one-copy constructor but from_physical)."""
        hit = self._device_cache.get("identity")
        if hit is None:
            hit = self._device_cache["identity"] = not self.is_redundant and bool(
                torch.equal(self.logical_of_Q, torch.arange(self.num_experts, dtype=torch.int64)))
        return hit

    def physical_of(self, rank: int) -> tuple[int, ...]:
        """Physical ids of rank `rank`'s experts, in local order."""
        self._check_rank(rank)
        return tuple(int(q) for q in (self.rank_of_Q == rank).nonzero().view(-1).tolist())

    def physical_tensors(self, device: torch.device | str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rank_of_Q, local_index_Q, copies_EM, num_copies_E) on `device`, cached (one copy per device)."""
        key = ("physical", str(torch.device(device)))
        hit = self._device_cache.get(key)
        if hit is None:
            hit = tuple(t.to(device) for t in (self.rank_of_Q, self.local_index_Q, self.copies_EM, self.num_copies_E))
            self._device_cache[key] = hit
        return hit

    def fingerprint(self) -> tuple[int, ...]:
        """A short integer summary (E, W, a hash of the physical map) for cross-rank checks.
        Without redundancy the hash is the one of the owner map alone."""
        h = 0
        for r in self.rank_of_E.tolist():
            h = (h * 1000003 + r + 1) % (1 << 61)
        if self.is_redundant:
            for e, r in zip(self.logical_of_Q.tolist(), self.rank_of_Q.tolist()):
                h = (h * 1000003 + e * 65536 + r + 7) % (1 << 61)
        return (self.num_experts, self.world_size, h)

    def _check_rank(self, rank: int) -> None:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r}: expected 0 <= rank < world_size={self.world_size}")


def _int_list(v: Sequence[int] | torch.Tensor, name: str) -> list[int]:
    if isinstance(v, torch.Tensor):
        if v.dim() != 1 or v.dtype.is_floating_point or v.dtype == torch.bool:
            raise EPPlacementError(f"{name}: tensor {v.dtype}{tuple(v.shape)}, expected a 1-D integer tensor")
        return [int(x) for x in v.tolist()]
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or not all(_is_int(x) for x in v):
        raise EPPlacementError(f"{name}={v!r}: expected a list (or 1-D tensor) of ints")
    return list(v)


def _check_all_owned(owner: list[int], what: str) -> None:
    for e, r in enumerate(owner):
        if r < 0:
            raise ValueError(f"{what}: expert {e} is not placed on any rank (every expert needs exactly one)")


def as_placement(
    expert_ranges: Placement | Sequence | torch.Tensor | Mapping, *, num_experts: int | None = None
) -> Placement:
    """Interpret the forms `ep_plan` accepts.

    - a `Placement`;
    - a list of (start, end) pairs, one per rank (contiguous ranges);
    - a flat list / 1-D int tensor of length E, or a {expert: rank} dict (expert->rank map).
    A rank->experts list of lists is ambiguous with ranges: use `Placement.from_rank_experts`.
    `num_experts`, when given, must match the placement's E.
    """
    if isinstance(expert_ranges, Placement):
        p = expert_ranges
    elif isinstance(expert_ranges, (torch.Tensor, Mapping)):
        p = Placement.from_map(expert_ranges, num_experts=num_experts)
    elif isinstance(expert_ranges, Sequence) and not isinstance(expert_ranges, (str, bytes)):
        if len(expert_ranges) and all(_is_int(v) for v in expert_ranges):
            p = Placement.from_map(list(expert_ranges), num_experts=num_experts)
        else:
            p = Placement.from_ranges(expert_ranges, num_experts=num_experts)
    else:
        raise ValueError(
            f"expert_ranges={expert_ranges!r}: expected a Placement, (start, end) per rank, "
            f"or an expert->rank map"
        )
    if num_experts is not None and p.num_experts != num_experts:
        raise ValueError(f"expert placement covers {p.num_experts} experts, expected num_experts={num_experts}")
    return p


@dataclass(frozen=True, eq=False)
class EPPlan:
    """One source rank's routing table: where each (token, slot) pair is computed.

    All tensors live on the routing's device; building the plan reads nothing back to
    the host (when `ep_plan(validate=False)`), so it can sit inside a CUDA graph.

    dest_rank_TK:   int64 [T, K]; rank computing pair (t, k); -1 for a zero expert.
    local_expert_TK:int64 [T, K]; the expert's index among its rank's experts; -1 for zero.
    is_zero_TK:     bool [T, K]; id >= E: identity expert, stays on the source rank.
    send_order_P:   int64 [P]; flat pair ids t*K+k sorted stably by destination rank, so
                    rank r's pairs are send_order_P[send_offsets_R[r] : +send_counts_R[r]]
                    in (token, slot) order; zero-expert pairs last.
    inverse_P:      int64 [P]; inverse_P[p] = position of pair p in send_order_P (combine:
                    y_P = y_sent[inverse_P]).
    send_counts_R:  int64 [W]; pairs per destination (sum = P - zero pairs).
    send_offsets_R: int64 [W]; exclusive prefix sum of send_counts_R.
    world_size, num_experts, top_k: W, E, K.
    physical_TK:    int64 [T, K]; the physical expert (copy) computing pair (t, k); -1 for
                    a zero expert. Equals ids_TK where the placement has no redundancy.
    """

    dest_rank_TK: torch.Tensor
    local_expert_TK: torch.Tensor
    is_zero_TK: torch.Tensor
    send_order_P: torch.Tensor
    inverse_P: torch.Tensor
    send_counts_R: torch.Tensor
    send_offsets_R: torch.Tensor
    world_size: int
    num_experts: int
    top_k: int
    physical_TK: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.dest_rank_TK.shape[0])

    @property
    def num_pairs(self) -> int:
        """P = T*K, including zero-expert pairs."""
        return int(self.dest_rank_TK.numel())

    # Host-side views (each reads the counts back: not for the static decode path).

    def counts(self) -> list[int]:
        """Pairs per destination rank (host read)."""
        return [int(c) for c in self.send_counts_R.tolist()]

    def num_zero_pairs(self) -> int:
        return int(self.is_zero_TK.sum())

    def local_count(self, rank: int) -> int:
        """Pairs that stay on `rank` (zero experts excluded)."""
        return self.counts()[rank]

    def remote_count(self, rank: int) -> int:
        """Pairs `rank` sends to other ranks."""
        c = self.counts()
        return sum(c) - c[rank]

    def pairs_for(self, rank: int) -> torch.Tensor:
        """int64 [n, 2] (token, slot) of the pairs going to `rank`, in (token, slot) order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank!r}: expected 0 <= rank < world_size={self.world_size}")
        c = self.counts()
        start = sum(c[:rank])
        flat = self.send_order_P[start : start + c[rank]]
        return torch.stack([flat // self.top_k, flat % self.top_k], dim=1)


def ep_plan(
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    expert_ranges: Placement | Sequence | torch.Tensor | Mapping,
    *,
    num_experts: int | None = None,
    num_zero_experts: int | None = None,
    validate: bool = True,
    copy_offset: int = 0,
) -> EPPlan:
    """Split one rank's T tokens' picks by destination rank.

    ids_TK:        int32/int64 [T, K]; ids in [0, E) are routed experts, ids >= E are zero
                   experts (identity; kept on the source rank, never sent).
    weights_TK:    float [T, K]; only its shape is checked here (the weights travel with
                   the rows in the dispatcher; the combine uses them on the source rank).
    expert_ranges: see `as_placement`: (start, end) per rank, an expert->rank map, or a
                   `Placement`.
    num_experts:   E, checked against the placement when given (without it, an id just
                   past a too-short placement would silently count as a zero expert).
    num_zero_experts: Z; when given, ids >= E + Z are a ValueError.
    validate:      check ids on the host (one device->host read). The static decode path
                   passes False and must feed valid ids.
    copy_offset:   with redundant copies, where each expert's round robin over its copies
                   starts (see `physical_ids`); the all-to-all dispatcher passes its rank.
    """
    placement = as_placement(expert_ranges, num_experts=num_experts)
    if not isinstance(ids_TK, torch.Tensor) or ids_TK.dim() != 2:
        raise ValueError(f"ids_TK: expected a 2-D tensor [T, K], got {type(ids_TK).__name__} "
                         f"{tuple(getattr(ids_TK, 'shape', ()))}")
    if ids_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"ids_TK.dtype={ids_TK.dtype}: expected torch.int32 or torch.int64")
    if not isinstance(weights_TK, torch.Tensor) or weights_TK.shape != ids_TK.shape:
        raise ValueError(
            f"weights_TK: shape {tuple(getattr(weights_TK, 'shape', ()))}, expected {tuple(ids_TK.shape)} like ids_TK"
        )
    if not weights_TK.dtype.is_floating_point:
        raise TypeError(f"weights_TK.dtype={weights_TK.dtype}: expected a floating dtype")
    T, K = ids_TK.shape
    E, W = placement.num_experts, placement.world_size
    device = ids_TK.device
    ids = ids_TK.to(torch.int64)
    if validate and ids.numel():
        neg = ids < 0
        if bool(neg.any()):
            t, k = (int(v) for v in neg.nonzero()[0])
            raise ValueError(f"ids_TK[{t}, {k}]={int(ids[t, k])}: expert ids must be >= 0")
        if num_zero_experts is not None:
            over = ids >= E + num_zero_experts
            if bool(over.any()):
                t, k = (int(v) for v in over.nonzero()[0])
                raise ValueError(
                    f"ids_TK[{t}, {k}]={int(ids[t, k])}: expected < E + Z = {E} + {num_zero_experts}"
                )
    rank_of_Q, local_index_Q, _, _ = placement.physical_tensors(device)
    is_zero = ids >= E
    phys = physical_ids(ids, placement, copy_offset=copy_offset)
    safe = phys.clamp(min=0)  # index only; zero pairs are overwritten just below
    dest = torch.where(is_zero, torch.full_like(ids, -1), rank_of_Q[safe])
    local = torch.where(is_zero, torch.full_like(ids, -1), local_index_Q[safe])
    # Zero-expert pairs sort after every rank (key W); stable sort keeps (token, slot) order
    # inside each destination, which is what makes the receiver's rows come in
    # (source rank, token, slot) order.
    key_P = torch.where(is_zero, torch.full_like(dest, W), dest).reshape(-1)
    send_order = torch.sort(key_P, stable=True).indices
    inverse = torch.empty_like(send_order)
    inverse[send_order] = torch.arange(send_order.numel(), device=device, dtype=send_order.dtype)
    # scatter_add rather than bincount: bincount sizes its output from the data (a host sync).
    counts = torch.zeros(W + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key_P, torch.ones_like(key_P))
    counts = counts[:W]
    offsets = torch.cumsum(counts, 0) - counts
    return EPPlan(
        dest_rank_TK=dest,
        local_expert_TK=local,
        is_zero_TK=is_zero,
        send_order_P=send_order,
        inverse_P=inverse,
        send_counts_R=counts,
        send_offsets_R=offsets,
        world_size=W,
        num_experts=E,
        top_k=int(K),
        physical_TK=phys,
    )


def physical_ids(ids_TK: torch.Tensor, placement: Placement, *, copy_offset: int = 0) -> torch.Tensor:
    """The copy that computes each pair: int64 [T, K] physical ids, -1 for a zero expert (id >= E).

    ids_TK: int [T, K] logical ids on any device (valid ids; ids >= E are zero experts).
    The j-th pair of expert e, counting pairs in (token, slot) order, goes to copy
    (j + copy_offset) % copies(e) of e (its copies in ascending physical order): each copy
    gets the same number of this call's rows within one. Device-side (a stable sort and a
    scatter), no host read; with one copy each a lookup (the logical id itself when the placement
    numbers physical experts as the logical ones).
    """
    E = placement.num_experts
    ids = ids_TK.to(torch.int64)
    is_zero = ids >= E
    if placement.is_identity:
        return torch.where(is_zero, torch.full_like(ids, -1), ids)
    _, _, copies_EM, num_copies_E = placement.physical_tensors(ids.device)
    if not placement.is_redundant:
        return torch.where(is_zero, torch.full_like(ids, -1), copies_EM[ids.clamp(max=E - 1), 0])
    key_P = torch.where(is_zero, torch.full_like(ids, E), ids).reshape(-1)
    n = int(key_P.numel())
    order = torch.sort(key_P, stable=True).indices
    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, key_P, torch.ones_like(key_P))
    starts = torch.cumsum(counts, 0) - counts
    occ = torch.empty_like(key_P)
    occ[order] = torch.arange(n, device=ids.device, dtype=torch.int64) - starts[key_P[order]]
    safe = key_P.clamp(max=E - 1)
    j = (occ + int(copy_offset)) % num_copies_E[safe]
    phys = copies_EM[safe, j]
    return torch.where(is_zero, torch.full_like(ids, -1), phys.view_as(ids))
