"""Expert load balance on one process: redundant copies in the routing table, load counters, EPLB placement.

Legend: L layers, E logical experts, R redundant copies, Q = E + R physical experts, W ranks,
T tokens, K picks, G ranks per node.
"""

from __future__ import annotations

import pytest
import torch

from moeflow.config import ExpertWeights, MoEConfig
from moeflow.layer import MoELayer
from moeflow.parallel import (
    EPPlacementError,
    ModelPlacement,
    Placement,
    expert_load,
    physical_ids,
    plan_placement,
    track_load,
)
from moeflow.parallel.eplb import rank_load
from moeflow.parallel.plan import ep_plan
from moeflow.routing.spec import RouterSpec


def _zipf_load(L: int, E: int, seed: int = 0, s: float = 1.2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
    return torch.stack([(base[torch.randperm(E, generator=g)] * 1e5).round() for _ in range(L)]).to(torch.int64)


# ---------------------------------------------------------------------------- the routing table


def test_replicated_layout_and_named_error():
    p = Placement.replicated(8, 4, 4)
    assert p.num_physical == 12 and p.num_redundant == 4 and p.is_redundant
    assert p.experts_per_rank == ((0, 1, 2), (3, 4, 5), (6, 7, 0), (1, 2, 3))
    assert p.num_copies_E.tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    assert p.copies_EM[0].tolist() == [0, 8] and p.copies_EM[7].tolist() == [7, 7]
    with pytest.raises(EPPlacementError, match=r"redundant_experts=3: E \+ R = 8 \+ 3 = 11 .* world_size=4"):
        Placement.replicated(8, 4, 3)
    with pytest.raises(EPPlacementError, match="expert 2 has no physical copy"):
        Placement.from_physical([0, 1, 3, 0], [0, 0, 1, 1], world_size=2, num_experts=4)
    with pytest.raises(EPPlacementError, match=r"rank_of_Q\[1\]=2"):
        Placement.from_physical([0, 1], [0, 2], world_size=2)


def test_one_copy_placements_unchanged():
    """Without redundancy the physical id is the logical one and the fingerprint is the owner map's."""
    p = Placement.contiguous(8, 2)
    assert not p.is_redundant and p.num_physical == 8
    ids = torch.tensor([[0, 5], [7, 9]])
    assert physical_ids(ids, p).tolist() == [[0, 5], [7, -1]]
    assert p.fingerprint() == Placement.from_physical(list(range(8)), [0] * 4 + [1] * 4, world_size=2).fingerprint()


def test_one_copy_permuted_placement_routes_by_the_physical_map():
    """A one-copy placement numbered otherwise than the logical ids (plan_placement with R = 0) routes
    each pair to the rank and local index holding its expert."""
    p = Placement.from_physical([3, 0, 2, 1], [0, 0, 1, 1], world_size=2)
    assert not p.is_redundant and not p.is_identity
    assert p.experts_per_rank == ((3, 0), (2, 1))
    ids = torch.tensor([[0, 1], [3, 2], [4, 0]])
    plan = ep_plan(ids, torch.ones(3, 2), p, num_zero_experts=1)
    assert plan.physical_TK.tolist() == [[1, 3], [0, 2], [-1, 1]]
    assert plan.dest_rank_TK.tolist() == [[0, 1], [0, 1], [-1, 0]]
    assert plan.local_expert_TK.tolist() == [[1, 1], [0, 0], [-1, 1]]
    assert Placement.contiguous(4, 2).is_identity


@pytest.mark.parametrize("offset", [0, 1, 3])
def test_copies_share_rows_within_one(offset):
    """Every expert's pairs spread over its copies round robin: counts per copy differ by at most one,
    whatever the skew, and the choice is a pure function of the routing (same on every call)."""
    E, K, T, W = 6, 2, 37, 3
    p = Placement.from_physical([0, 1, 2, 3, 4, 5, 0, 0, 1], [0, 0, 0, 1, 1, 1, 2, 2, 2], world_size=W)
    g = torch.Generator().manual_seed(offset)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[::3, 0] = 0  # expert 0 hot
    ids[5, 1] = E  # a zero expert
    phys = physical_ids(ids, p, copy_offset=offset)
    assert torch.equal(phys, physical_ids(ids, p, copy_offset=offset))
    assert int(phys[5, 1]) == -1
    logical = p.logical_of_Q[phys.clamp(min=0)]
    assert torch.equal(torch.where(phys >= 0, logical, ids), ids), "a pair went to a copy of another expert"
    for e in range(E):
        copies = p.copies_EM[e, : int(p.num_copies_E[e])].tolist()
        n = [int((phys == q).sum()) for q in copies]
        assert max(n) - min(n) <= 1, f"expert {e}: rows per copy {n}"
    plan = ep_plan(ids, torch.ones(T, K), p, num_zero_experts=1, copy_offset=offset)
    assert torch.equal(plan.physical_TK, phys)
    assert torch.equal(plan.dest_rank_TK[phys >= 0], p.rank_of_Q[phys[phys >= 0]])
    assert int(plan.send_counts_R.sum()) == T * K - 1


def test_copy_offset_spreads_single_rows():
    """One row per source rank (decode): the offset (the source's rank) sends them to different copies."""
    p = Placement.replicated(2, 2, 2)  # experts 0, 1 each on both ranks
    got = {int(physical_ids(torch.tensor([[0]]), p, copy_offset=r)) for r in range(2)}
    assert got == {0, 2}


# ---------------------------------------------------------------------------- EPLB


def test_plan_placement_balances_and_is_deterministic():
    load = _zipf_load(3, 64)
    base = ModelPlacement.from_layers([Placement.contiguous(64, 8)] * 3)
    before = base.imbalance(load)
    prev = None
    for R in (0, 2, 4, 8):
        p = plan_placement(load, 8, redundant_experts=R)
        assert p.num_physical == 64 + R and p.num_layers == 3
        again = plan_placement(load.clone(), 8, redundant_experts=R)
        assert torch.equal(p.logical_of_LQ, again.logical_of_LQ) and torch.equal(p.rank_of_LQ, again.rank_of_LQ)
        for lp in p.layers:  # every expert at least once, every rank its share
            assert sorted(set(lp.logical_of_Q.tolist())) == list(range(64))
            assert [lp.num_local(r) for r in range(8)] == [(64 + R) // 8 + (r < (64 + R) % 8) for r in range(8)]
        imb = p.imbalance(load)
        assert imb >= 1.0 and imb < before
        if prev is not None:
            assert imb <= prev + 1e-9, f"R={R}: more copies balanced worse ({imb} > {prev})"
        prev = imb
    assert prev <= 1.10, f"R=W copies: imbalance {prev:.3f}"


def test_plan_placement_replicates_the_heaviest():
    load = torch.tensor([[100, 1, 1, 1, 1, 1, 1, 1]])
    p = plan_placement(load, 4, redundant_experts=4)
    lp = p.layers[0]
    assert int(lp.num_copies_E[0]) == 5 and int(lp.num_copies_E[1:].max()) == 1
    # the copies of expert 0 sit on different ranks where they can (4 ranks, 5 copies: one rank has 2)
    assert sorted(lp.rank_of_Q[lp.logical_of_Q == 0].tolist()) == [0, 0, 1, 2, 3]
    rl = rank_load(lp, load[0])
    assert float(rl.sum()) == pytest.approx(107.0)


def test_plan_placement_hierarchical():
    load = _zipf_load(2, 32, seed=4)
    p = plan_placement(load, 8, redundant_experts=8, ranks_per_node=4, expert_groups=8)
    for lp in p.layers:
        # each group of 4 experts (and its copies) stays within one node of 4 ranks
        for grp in range(8):
            nodes = {int(r) // 4 for e in range(4 * grp, 4 * grp + 4) for r in lp.rank_of_Q[lp.logical_of_Q == e]}
            assert len(nodes) == 1, f"group {grp} spans nodes {nodes}"
    assert p.imbalance(load) < ModelPlacement.from_layers([Placement.contiguous(32, 8)] * 2).imbalance(load)
    with pytest.raises(EPPlacementError, match="3 nodes do not split the 8 expert groups"):
        plan_placement(load, 6, redundant_experts=4, ranks_per_node=2, expert_groups=8)
    with pytest.raises(ValueError, match="ranks_per_node=3"):
        plan_placement(load, 8, ranks_per_node=3)


def test_plan_placement_refuses_bad_input():
    with pytest.raises(ValueError, match=r"load_LE\[0, 1\]=-1.0"):
        plan_placement(torch.tensor([[1, -1]]), 2)
    with pytest.raises(ValueError, match="expected a 2-D tensor"):
        plan_placement(torch.ones(4), 2)
    with pytest.raises(ValueError, match="redundant_experts=-1"):
        plan_placement(torch.ones(1, 4), 2, redundant_experts=-1)
    with pytest.raises(ValueError, match="world_size=0"):
        plan_placement(torch.ones(1, 4), 0)
    with pytest.raises(ValueError, match="expert_groups=2: only used with ranks_per_node"):
        plan_placement(torch.ones(1, 4), 2, expert_groups=2)


def test_imbalance_of_no_load_is_one():
    p = plan_placement(torch.zeros(2, 4), 2)
    assert p.imbalance(torch.zeros(2, 4)) == 1.0


# ---------------------------------------------------------------------------- load counters


def _layer(E=6, K=2, Z=0, seed=0) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=K, num_zero_experts=Z, renorm=True)
    cfg = MoEConfig(hidden_size=8, intermediate_size=4, router=spec, activation="silu")
    return MoELayer(cfg, router_weight_EH=torch.randn(E + Z, 8, generator=g),
                    experts=ExpertWeights(torch.randn(E, 8, 8, generator=g), torch.randn(E, 8, 4, generator=g)),
                    experts_impl="reference")


def test_expert_load_counts_routed_pairs_and_resets():
    layers = [_layer(seed=0), _layer(Z=2, seed=1)]
    with pytest.raises(ValueError, match="call moeflow.parallel.track_load"):
        expert_load(layers)
    track_load(layers)
    assert track_load(layers)[0] is layers[0].__dict__["_moeflow_load"], "track_load is idempotent"
    want = torch.zeros(2, 6, dtype=torch.int64)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for T in (5, 1, 0, 9):
            x = torch.randn(T, 8, generator=g)
            for i, m in enumerate(layers):
                m(x)
                ids = m.last_routing.ids_TK.reshape(-1)
                want[i] += torch.bincount(ids[ids < 6], minlength=6)
    got = expert_load(layers)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert torch.equal(expert_load(layers, reset=True), want)
    assert int(expert_load(layers).sum()) == 0
    with pytest.raises(ValueError, match="not expert-parallel; reduce=True"):
        expert_load(layers, reduce=True)
