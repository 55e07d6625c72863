"""ep_plan / Placement: the expert-parallel routing table's invariants (CPU, no distributed).

Legend: T tokens, K picks, P = T*K pairs, E routed experts, Z zero experts, W ranks.
Counts contract: `send_counts_R` sums to T*K minus the zero-expert pairs (ids >= E stay
on the source rank and are never sent).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeflow.parallel.plan import EPPlan, Placement, as_placement, contiguous_ranges, ep_plan

WORLDS = [1, 2, 3, 4, 8]


@st.composite
def plan_case(draw):
    W = draw(st.sampled_from(WORLDS))
    kind = draw(st.sampled_from(["contiguous", "map", "ranges_uneven", "rank_experts"]))
    if kind == "contiguous":
        E = W * draw(st.integers(1, 4))
        placement = contiguous_ranges(E, W)
    else:
        E = draw(st.integers(1, 20))
        if kind == "map":
            owner = draw(st.lists(st.integers(0, W - 1), min_size=E, max_size=E))
            placement = Placement.from_map(owner, world_size=W)
        elif kind == "ranges_uneven":
            cuts = sorted(draw(st.lists(st.integers(0, E), min_size=W - 1, max_size=W - 1)))
            bounds = [0, *cuts, E]
            placement = [(bounds[r], bounds[r + 1]) for r in range(W)]
        else:
            perm = draw(st.permutations(list(range(E))))
            owner = draw(st.lists(st.integers(0, W - 1), min_size=E, max_size=E))
            lists = [[e for e, r in zip(perm, owner) if r == rr] for rr in range(W)]
            placement = Placement.from_rank_experts(lists)
    Z = draw(st.integers(0, 3))
    K = draw(st.integers(1, min(E + Z, 6)))
    T = draw(st.integers(0, 24))
    mode = draw(st.sampled_from(["random", "one_rank", "skip_rank"]))
    p = as_placement(placement)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    pool = list(range(E + Z))
    if mode == "one_rank":
        # one rank takes every pair (plus zero experts): the most skewed routing
        r = draw(st.integers(0, W - 1))
        pool = list(p.experts_of(r)) + list(range(E, E + Z))
    elif mode == "skip_rank" and W > 1:
        r = draw(st.integers(0, W - 1))
        pool = [e for e in pool if e >= E or p.rank_of_E[e] != r]
    if len(pool) < K:
        pool = list(range(E + Z))
    rows = []
    for _ in range(T):
        pick = torch.randperm(len(pool), generator=g)[:K]
        rows.append([pool[i] for i in pick.tolist()])
    ids = torch.tensor(rows, dtype=torch.int32).reshape(T, K)
    weights = torch.rand(T, K, generator=g)
    return ids, weights, placement, p, E, Z, W


def _check_plan(plan: EPPlan, ids: torch.Tensor, p: Placement, E: int, W: int) -> None:
    T, K = ids.shape
    seen = torch.zeros(T, K, dtype=torch.int64)
    counts = plan.counts()
    assert len(counts) == W
    for r in range(W):
        pairs = plan.pairs_for(r)
        assert pairs.shape == (counts[r], 2)
        # (token, slot) order within a destination
        flat = pairs[:, 0] * K + pairs[:, 1]
        assert torch.equal(flat, torch.sort(flat).values)
        for t, k in pairs.tolist():
            e = int(ids[t, k])
            assert e < E, f"zero expert {e} sent to rank {r}"
            assert int(p.rank_of_E[e]) == r
            assert int(plan.local_expert_TK[t, k]) == p.experts_of(r).index(e)
            seen[t, k] += 1
    routed = ids.long() < E
    # every routed (token, expert) pair on exactly one rank, zero-expert pairs on none
    assert torch.equal(seen, routed.long())
    assert sum(counts) == T * K - int((~routed).sum())
    assert plan.num_zero_pairs() == int((~routed).sum())
    # inverse permutation
    P = T * K
    assert torch.equal(torch.sort(plan.send_order_P).values, torch.arange(P))
    assert torch.equal(plan.send_order_P[plan.inverse_P], torch.arange(P))
    # zero pairs are the tail of the order
    tail = plan.send_order_P[sum(counts):]
    assert bool(plan.is_zero_TK.reshape(-1)[tail].all())
    assert torch.equal(plan.dest_rank_TK[~routed], torch.full((int((~routed).sum()),), -1))
    offs = plan.send_offsets_R.tolist()
    assert offs == [sum(counts[:r]) for r in range(W)]


@settings(max_examples=300, deadline=None)
@given(plan_case())
def test_ep_plan_invariants(case):
    ids, weights, placement, p, E, Z, W = case
    plan = ep_plan(ids, weights, placement, num_experts=E, num_zero_experts=Z)
    assert plan.world_size == W and plan.num_experts == E
    _check_plan(plan, ids, p, E, W)
    # int64 ids give the same plan
    plan64 = ep_plan(ids.long(), weights, p)
    assert torch.equal(plan64.send_order_P, plan.send_order_P)
    assert torch.equal(plan64.send_counts_R, plan.send_counts_R)


@pytest.mark.parametrize("W", WORLDS)
def test_one_rank_takes_everything_and_zero_token_ranks(W):
    E, K, T = 8 * W, 4, 13
    ranges = contiguous_ranges(E, W)
    last = W - 1
    ids = torch.stack([torch.randperm(8)[:K] + ranges[last][0] for _ in range(T)]).int()
    plan = ep_plan(ids, torch.rand(T, K), ranges)
    c = plan.counts()
    assert c[last] == T * K
    assert all(c[r] == 0 for r in range(W - 1))
    assert plan.local_count(last) == T * K and plan.remote_count(last) == 0
    if W > 1:
        assert plan.remote_count(0) == T * K and plan.local_count(0) == 0


def test_zero_tokens():
    plan = ep_plan(torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2), contiguous_ranges(4, 2))
    assert plan.counts() == [0, 0]
    assert plan.send_order_P.numel() == 0
    assert plan.pairs_for(1).shape == (0, 2)


def test_zero_experts_stay_home():
    # E = 4 routed + Z = 2 zero experts (ids 4, 5), W = 2
    ids = torch.tensor([[0, 4], [5, 3], [2, 1]], dtype=torch.int32)
    plan = ep_plan(ids, torch.rand(3, 2), [(0, 2), (2, 4)], num_zero_experts=2)
    assert plan.counts() == [2, 2]
    assert plan.is_zero_TK.tolist() == [[False, True], [True, False], [False, False]]
    assert plan.dest_rank_TK.tolist() == [[0, -1], [-1, 1], [1, 0]]
    assert plan.pairs_for(0).tolist() == [[0, 0], [2, 1]]
    assert plan.pairs_for(1).tolist() == [[1, 1], [2, 0]]
    assert plan.send_order_P.tolist()[-2:] == [1, 2]
    with pytest.raises(ValueError, match=r"ids_TK\[1, 0\]=6"):
        ep_plan(torch.tensor([[0, 4], [6, 3]], dtype=torch.int32), torch.rand(2, 2), [(0, 2), (2, 4)],
                num_zero_experts=2)


def test_explicit_map_and_local_index():
    p = Placement.from_map([1, 0, 1, 0, 2], world_size=4)
    assert p.experts_per_rank == ((1, 3), (0, 2), (4,), ())
    assert p.local_index_E.tolist() == [0, 0, 1, 1, 0]
    assert not p.is_contiguous
    assert p.range_of(2) == (4, 5) and p.range_of(3) == (0, 0)
    ids = torch.tensor([[4, 0], [3, 2]], dtype=torch.int32)
    plan = ep_plan(ids, torch.rand(2, 2), p)
    assert plan.counts() == [1, 2, 1, 0]
    assert plan.local_expert_TK.tolist() == [[0, 0], [1, 1]]
    # tensor and dict maps are the same placement
    assert as_placement(torch.tensor([1, 0, 1, 0, 2])).experts_per_rank == ((1, 3), (0, 2), (4,))
    assert as_placement({0: 1, 1: 0, 2: 1, 3: 0, 4: 2}).experts_per_rank == ((1, 3), (0, 2), (4,))


def test_bad_placements_name_the_expert():
    with pytest.raises(ValueError, match="world_size=3 does not divide num_experts=8"):
        contiguous_ranges(8, 3)
    with pytest.raises(ValueError, match="expert 3 is not placed"):
        as_placement([(0, 3), (4, 6)])
    with pytest.raises(ValueError, match="expert 2 is in the ranges of rank 0 and rank 1"):
        as_placement([(0, 3), (2, 6)])
    with pytest.raises(ValueError, match="expert 2 is not placed"):
        as_placement({0: 0, 1: 1, 3: 0})
    with pytest.raises(ValueError, match="expert 1 is not placed"):
        as_placement([0, -1, 1])
    with pytest.raises(ValueError, match="expert 1 is placed twice"):
        Placement.from_rank_experts([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="expert 2 is not placed"):
        Placement.from_rank_experts([[0, 1], [3]])
    with pytest.raises(ValueError, match="expert 2 is on rank 5, outside world_size=2"):
        Placement.from_map([0, 1, 5], world_size=2)
    with pytest.raises(ValueError, match="expert 6 is not placed"):
        ep_plan(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), [(0, 3), (3, 6)], num_experts=8)
    with pytest.raises(ValueError, match=r"expert_ranges\[1\]"):
        as_placement([(0, 3), (5, 4)])


def test_bad_routing_inputs():
    ranges = contiguous_ranges(4, 2)
    with pytest.raises(TypeError, match="ids_TK.dtype=torch.float32"):
        ep_plan(torch.zeros(2, 2), torch.zeros(2, 2), ranges)
    with pytest.raises(ValueError, match="weights_TK: shape"):
        ep_plan(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, 3), ranges)
    with pytest.raises(ValueError, match=r"ids_TK\[1, 1\]=-1"):
        ep_plan(torch.tensor([[0, 1], [2, -1]], dtype=torch.int32), torch.zeros(2, 2), ranges)
    with pytest.raises(ValueError, match="ids_TK: expected a 2-D"):
        ep_plan(torch.zeros(4, dtype=torch.int32), torch.zeros(4), ranges)


def test_dispatcher_options_are_checked_by_name():
    """all_reduce-only options given to all_to_all are refused, not ignored; reduce_dtype takes a dtype or its
    name and refuses anything else by name. One gloo rank (a HashStore group: no ports, no processes)."""
    import torch.distributed as dist

    from moeflow.config import MoEConfig
    from moeflow.parallel.ep_parts import make_dispatcher
    from moeflow.routing.spec import RouterSpec

    cfg = MoEConfig(hidden_size=8, intermediate_size=8, activation="silu",
                    router=RouterSpec(score_fn="softmax", num_experts=4, top_k=2))
    made_here = not dist.is_initialized()
    if made_here:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = dist.group.WORLD
        for opt in ({"reduce_dtype": "float32"}, {"check_inputs": False}):
            with pytest.raises(ValueError, match=f"{next(iter(opt))}=.*an all_reduce option"):
                make_dispatcher(cfg, group=g, mode="all_to_all", **opt)
        assert make_dispatcher(cfg, group=g, mode="all_reduce", reduce_dtype="bfloat16").reduce_dtype == torch.bfloat16
        assert make_dispatcher(cfg, group=g, mode="all_reduce").reduce_dtype == torch.float32
        with pytest.raises(TypeError, match="reduce_dtype='int8'"):
            make_dispatcher(cfg, group=g, mode="all_reduce", reduce_dtype="int8")
        with pytest.raises(TypeError, match="check_inputs='yes'"):
            make_dispatcher(cfg, group=g, mode="all_reduce", check_inputs="yes")
    finally:
        if made_here:
            dist.destroy_process_group()
