"""The prefetch cost rule (moeflow.offload.gate.PrefetchGate): its arithmetic, its estimates, and
its replay on a skewed trace against plain LRU and prefetch of every prediction.

Legend: L layers, E experts per layer, K picks per token, S slots, W prediction width, B bytes
of one expert. A key is (layer, expert); a step is one layer of one token.
"""

from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from moeflow.offload.attach import attach_offload
from moeflow.offload.config import OffloadConfig
from moeflow.offload.gate import PrefetchGate
from moeflow.offload.trace import Step, Trace, record_trace, replay
from moeflow.testing import assert_bitwise_equal


def test_overlap_zero_never_copies():
    g = PrefetchGate(overlap=0.0, width=2)
    for _ in range(50):  # every prediction of layer 1 rank 0 comes true: p -> 1, still <= 1
        g.observe([(0, 0)])
        g.predicted([(1, 3)])
        assert not g.admit((1, 3), evicts=False)
        g.observe([(1, 3)])
    assert g.precision(1, 0) == pytest.approx(51 / 52)
    assert (g.admitted, g.declined) == (0, 50)


def test_admission_arithmetic_and_the_step_budget():
    g = PrefetchGate(overlap=1.5, width=2)
    # 8 predictions of layer 1 at rank 0, 6 used; at rank 1, 2 used: p = 7/10 and 3/10
    for i in range(8):
        g.observe([(0, 0)])
        g.predicted([(1, 1), (1, 2)])
        g._pending[1] = [(1, 0), (2, 1)]
        g.observe([(1, 1 if i < 6 else 5), (1, 2 if i < 2 else 6)])
    assert g.precision(1, 0) == pytest.approx(7 / 10) and g.precision(1, 1) == pytest.approx(3 / 10)
    q = g.regret
    assert q == pytest.approx(0.25)  # the prior: no victims yet
    g.observe([(0, 0)])
    g.predicted([(1, 1), (1, 2)])
    # rank 0 into a free slot, a whole copy hidden: 0.7 > 0 -> admitted, budget 1.5 -> 0.5
    assert g.admit((1, 1), evicts=False)
    # rank 1 evicting: half hidden: 0.3 > 0.5 + 0.7 * q? no
    assert not g.admit((1, 2), evicts=True)
    assert 0.3 < 0.5 + (1 - 0.3) * q
    # the next step opens a new budget
    g.observe([(1, 1)])
    g.predicted([(2, 0)])
    assert g.admit((2, 0), evicts=True)  # no history of layer 2: p = 1/2 > 0 + 1/2 * q


def test_regret_counts_victims_demanded_within_one_token():
    g = PrefetchGate(overlap=1.0, width=1)
    g.observe([(0, 0)])
    g.observe([(1, 0)])  # L = 2 layers seen
    g.evicted((0, 5))
    g.evicted((1, 6))
    g.observe([(0, 5)])  # (0, 5) demanded again: regret
    g.observe([(1, 1)])
    g.observe([(0, 1)])  # (1, 6) older than L steps: no regret
    assert (g.regret_used, g.regret_seen) == (0.5 + 1, 2.0 + 2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prefetch_rule="sometimes"), "OffloadConfig.prefetch_rule='sometimes'"),
    (dict(prefetch_overlap=-0.5), "OffloadConfig.prefetch_overlap=-0.5"),
    (dict(prefetch_overlap=math.nan), "OffloadConfig.prefetch_overlap=nan"),
    (dict(prefetch_overlap=math.inf), "OffloadConfig.prefetch_overlap=inf"),
    (dict(prefetch_overlap=True), "OffloadConfig.prefetch_overlap=True"),
])
def test_config_refuses_bad_rules(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadConfig(gpu_slots=4, **kwargs)


def test_default_is_plain_lru_without_prefetch():
    c = OffloadConfig(gpu_slots=4)
    assert (c.policy, c.prefetch_width, c.prefetch_rule, c.prefetch_overlap) == ("lru", 0, "cost", 0.0)


def skewed_trace(tokens: int = 1500, L: int = 4, E: int = 8, K: int = 2, W: int = 2, seed: int = 0) -> Trace:
    """Zipf(1.2)-skewed routing with token-to-token reuse, and a next-layer prediction that names
    the true picks first with probability 0.75 each (else a random other expert)."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) ** 1.2 for r in range(E)]
    perms = [rng.sample(range(E), E) for _ in range(L)]
    t = Trace(num_layers=L, num_experts=[E] * L, top_k=[K] * L, pred_width=W, expert_bytes=1000)
    prev = [None] * L
    for p in range(tokens):
        picks = []
        for j in range(L):
            ids: list[int] = []
            if prev[j] is not None and rng.random() < 0.5:
                ids.append(rng.choice(prev[j]))
            while len(ids) < K:
                e = perms[j][rng.choices(range(E), weights)[0]]
                if e not in ids:
                    ids.append(e)
            picks.append(ids)
            prev[j] = ids
        for j in range(L):
            pred = None
            if j + 1 < L:
                row: list[int] = []
                for e in picks[j + 1]:
                    c = e if rng.random() < 0.75 else rng.randrange(E)
                    if c not in row:
                        row.append(c)
                while len(row) < W:
                    c = rng.randrange(E)
                    if c not in row:
                        row.append(c)
                pred = [row[:W]]
            t.steps.append(Step(p, j, [picks[j]], pred))
    return t


def test_replay_cost_rule_against_lru_and_prefetch_everything():
    t = skewed_trace()
    S = 8  # 25% of L * E
    lru = replay(t, S, "lru")
    # overlap 0: no guess pays, the cost rule is plain LRU (same copies, same hits)
    r0 = replay(t, S, "lru", 2)
    assert (r0.bytes_copied, r0.hits, r0.prefetch_issued) == (lru.bytes_copied, lru.hits, 0)
    for ov in (0.5, 1.0):
        always = replay(t, S, "lru", 2, prefetch_rule="always", prefetch_overlap=ov)
        cost = replay(t, S, "lru", 2, prefetch_rule="cost", prefetch_overlap=ov)
        print(f"overlap {ov}: bytes lru {lru.bytes_copied} always {always.bytes_copied} cost {cost.bytes_copied}; "
              f"hits {lru.hits} / {always.hits} / {cost.hits}; exposed {lru.bytes_copied} / "
              f"{always.exposed_bytes} / {cost.exposed_bytes}")
        assert always.bytes_copied > lru.bytes_copied  # prefetching every guess copies more
        assert cost.bytes_copied < always.bytes_copied  # the rule copies fewer bytes
        assert cost.hits > lru.hits  # and keeps some of prefetch's hits
        assert cost.exposed_bytes < min(lru.bytes_copied, always.exposed_bytes)  # least on the critical path


@pytest.mark.parametrize("overlap", [0.0, 1.0])
def test_replay_of_the_cost_rule_matches_the_live_cache(overlap):
    """The live runtime's gate and the replay's see the same steps: the same copies."""
    from tests.test_offload_model import _inputs, _model, _run

    with torch.no_grad():
        ref = _model("deepseek", seed=7)
        off = copy.deepcopy(ref)
        cfg = OffloadConfig(gpu_slots=5, policy="lru", prefetch_width=3, prefetch_overlap=overlap, device="cpu")
        rt = attach_offload(list(off), cfg, progress=False)
        seq, _ = _inputs(4, n_decode=16)
        with record_trace(off, width=4) as rec:
            for x in seq:
                assert_bitwise_equal(_run(off, x), _run(ref, x))
    r = replay(rec.trace, 5, "lru", 3, prefetch_overlap=overlap)
    s = rt.stats()
    assert (r.hits, r.misses, r.prefetch_issued, r.prefetch_used, r.prefetch_wasted) == \
           (s.hits, s.misses, s.prefetch_issued, s.prefetch_used, s.prefetch_wasted)
    assert r.bytes_copied == s.bytes_copied
    if overlap == 0.0:
        assert s.prefetch_issued == 0
    else:
        assert 0 < rt.prefetcher.gate.admitted and rt.prefetcher.gate.declined > 0
