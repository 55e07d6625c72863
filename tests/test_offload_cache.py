"""Expert slot cache: invariants under random operation sequences, policies, copies, store, config errors.

Legend: S slots, L layers, E experts per layer, K picks per token, H hidden,
I intermediate per expert. A key is (layer, expert).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moeflow.config import ExpertWeights
from moeflow.offload.cache import ExpertCache, SlotTable
from moeflow.offload.config import OffloadConfig
from moeflow.offload.policy import LRU, Predictive, RandomOldest, make_policy
from moeflow.offload.store import ExpertStore
from moeflow.testing import assert_bitwise_equal

L, E = 3, 6

key_st = st.tuples(st.integers(0, L - 1), st.integers(0, E - 1))
op_st = st.one_of(
    st.tuples(st.just("step"), st.lists(key_st, min_size=1, max_size=4)),
    st.tuples(st.just("prefetch"), st.lists(key_st, max_size=4)),
    st.tuples(st.just("protect"), st.lists(key_st, max_size=3)),
)


def _run_ops(table: SlotTable, ops) -> None:
    """Apply ops, checking after each: invariants, pins respected, protection respected."""
    demand = 0
    pinned_now: dict = {}
    for kind, keys in ops:
        if kind == "step":
            keys = list(dict.fromkeys(keys))[: table.num_slots]
            table.begin_step()
            slots, loads = table.acquire(keys)
            demand += len(keys)
            assert set(slots) == set(keys)
            assert all(table.key_to_slot[k] == slots[k] for k in keys)
            assert all(table.is_pinned(s) for s in slots.values())
            assert len({s for s in slots.values()}) == len(keys), "two keys of a step share a slot"
            pinned_now = dict(slots)
        elif kind == "prefetch":
            before = {k: table.key_to_slot[k] for k in table.protected if k in table.key_to_slot}
            loads = table.prefetch(keys)
            # a prefetch never evicts a pinned key (this step's) nor a protected one
            for k, s in pinned_now.items():
                assert table.key_to_slot.get(k) == s, f"prefetch evicted pinned {k}"
            for k, s in before.items():
                assert table.key_to_slot.get(k) == s, f"prefetch evicted protected {k}"
            assert all(k in table.key_to_slot for k, _ in loads)
        else:
            table.protected = frozenset(keys)
        table.check_invariants()
        assert len(table.key_to_slot) <= table.num_slots
    st_ = table.stats
    assert st_.hits + st_.misses == demand


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.integers(1, 8), policy=st.sampled_from(["lru", "random_oldest", "predictive"]),
       ops=st.lists(op_st, max_size=40), seed=st.integers(0, 3))
def test_slot_table_invariants(slots, policy, ops, seed):
    table = SlotTable(slots, make_policy(policy, slots, fraction=0.3, seed=seed), expert_bytes=10)
    _run_ops(table, ops)


def test_step_pins_survive_its_own_misses():
    # S = 2, step needs (0,0) [resident, older] and (0,1) [missing]: the miss must evict
    # the other resident key (0,5), never (0,0) even though (0,0) is the LRU one.
    t = SlotTable(2, LRU(), 1)
    t.begin_step()
    t.acquire([(0, 0)])
    t.begin_step()
    t.acquire([(0, 5)])
    t.begin_step()
    slots, loads = t.acquire([(0, 0), (0, 1)])
    assert (0, 0) in t.key_to_slot and (0, 5) not in t.key_to_slot
    assert [k for k, _ in loads] == [(0, 1)]
    assert (t.stats.hits, t.stats.misses, t.stats.evictions) == (1, 3, 1)


def test_too_many_keys_for_slots_is_an_error():
    t = SlotTable(2, LRU(), 1)
    t.begin_step()
    with pytest.raises(ValueError, match="gpu_slots=2"):
        t.acquire([(0, 0), (0, 1), (0, 2)])


def test_lru_order_and_prefetch_accounting():
    t = SlotTable(3, LRU(), 100)
    for k in [(0, 0), (0, 1), (0, 2)]:
        t.begin_step()
        t.acquire([k])
    t.begin_step()
    t.acquire([(0, 0)])  # hit: order (oldest first) (0,1), (0,2), (0,0)
    t.prefetch([(1, 0)])  # evicts (0,1); the guess enters at the LRU end: (1,0), (0,2), (0,0)
    assert (0, 1) not in t.key_to_slot and (1, 0) in t.key_to_slot
    t.begin_step()
    t.acquire([(0, 3)])  # the unused guess is the first victim: a wasted prefetch
    assert (1, 0) not in t.key_to_slot and (0, 2) in t.key_to_slot
    t.begin_step()
    t.acquire([(0, 4)])  # evicts (0,2)
    t.begin_step()
    t.acquire([(0, 5)])  # evicts (0,0)
    assert set(t.key_to_slot) == {(0, 3), (0, 4), (0, 5)}
    s = t.stats
    assert (s.hits, s.misses, s.prefetch_issued, s.prefetch_used, s.prefetch_wasted) == (1, 6, 1, 0, 1)
    assert s.bytes_copied == 7 * 100
    t.check_invariants()


def test_a_used_guess_moves_up_like_any_hit():
    t = SlotTable(3, LRU(), 1)
    for k in [(0, 0), (0, 1)]:
        t.begin_step()
        t.acquire([k])
    t.prefetch([(1, 0)])  # free slot, at the LRU end: (1,0), (0,0), (0,1)
    t.begin_step()
    t.acquire([(1, 0)])  # used: now the most recent: (0,0), (0,1), (1,0)
    t.begin_step()
    t.acquire([(0, 9)])
    assert (0, 0) not in t.key_to_slot and (1, 0) in t.key_to_slot
    assert (t.stats.prefetch_used, t.stats.prefetch_wasted) == (1, 0)


def test_prefetch_respects_protection_and_can_skip():
    t = SlotTable(2, LRU(), 1)
    t.begin_step()
    t.acquire([(0, 0)])
    t.begin_step()
    t.acquire([(0, 1)])
    t.protected = frozenset({(0, 0)})
    # (0,1) pinned, (0,0) protected: no victim, the prefetch is skipped
    assert t.prefetch([(1, 3)]) == []
    assert t.stats.prefetch_issued == 0


def test_predictive_spares_protected_on_demand_and_falls_back():
    pol = Predictive(4, fraction=1.0, seed=0)
    t = SlotTable(2, pol, 1)
    t.begin_step()
    t.acquire([(0, 0)])
    t.begin_step()
    t.acquire([(0, 1)])
    t.protected = frozenset({(0, 0)})
    t.begin_step()
    t.acquire([(0, 2)])  # must evict (0,1): (0,0) is protected
    assert (0, 0) in t.key_to_slot and (0, 1) not in t.key_to_slot
    t.protected = frozenset({(0, 0), (0, 2)})
    t.begin_step()
    t.acquire([(0, 3)])  # all protected: falls back, still serves the miss
    assert (0, 3) in t.key_to_slot
    t.check_invariants()


def test_random_oldest_draws_from_the_oldest_pool_reproducibly():
    def run(seed):
        t = SlotTable(16, RandomOldest(16, fraction=0.25, seed=seed), 1)
        for e in range(16):
            t.begin_step()
            t.acquire([(0, e)])
        victims = []
        for e in range(16, 24):
            before = set(t.key_to_slot)
            t.begin_step()
            t.acquire([(1, e)])
            (gone,) = before - set(t.key_to_slot)
            victims.append(gone)
        return victims

    v = run(0)
    assert v == run(0)
    # the pool is the 4 oldest; the first victim is one of (0,0)..(0,3)
    assert v[0] in {(0, i) for i in range(4)}
    assert RandomOldest(16, fraction=0.0625).pool == 1 and RandomOldest(100, fraction=0.0625).pool == 7


# ---- tensors: store + cache on CPU --------------------------------------------------------------


def _weights(seed: int, E_: int = E, H: int = 8, I: int = 4, bias: bool = False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(E_, 2 * I, H, generator=g, dtype=dtype)
    dn = torch.randn(E_, H, I, generator=g, dtype=dtype)
    b1 = torch.randn(E_, 2 * I, generator=g, dtype=dtype) if bias else None
    b2 = torch.randn(E_, H, generator=g, dtype=dtype) if bias else None
    return ExpertWeights(gu, dn, b1, b2)


def _check_resident_contents(cache: ExpertCache, weights) -> None:
    for (layer, e), slot in cache.table.key_to_slot.items():
        w = weights[layer]
        assert_bitwise_equal(cache.buffers["gate_up"][slot], w.gate_up[e], what=f"gate_up {layer, e}")
        assert_bitwise_equal(cache.buffers["down"][slot], w.down[e], what=f"down {layer, e}")
        if w.gate_up_bias is not None:
            assert_bitwise_equal(cache.buffers["gate_up_bias"][slot], w.gate_up_bias[e], what="gate_up_bias")
            assert_bitwise_equal(cache.buffers["down_bias"][slot], w.down_bias[e], what="down_bias")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(slots=st.integers(1, 5), policy=st.sampled_from(["lru", "random_oldest", "predictive"]),
       ops=st.lists(op_st, max_size=25), bias=st.booleans())
def test_cache_slots_hold_the_right_experts(slots, policy, ops, bias):
    weights = [_weights(i, bias=bias) for i in range(L)]
    store = ExpertStore.from_weights(weights, mode="pinned", progress=False)
    cache = ExpertCache(store, slots, make_policy(policy, slots, fraction=0.5), "cpu")
    for kind, keys in ops:
        if kind == "step":
            cache.ensure(list(dict.fromkeys(keys))[:slots])
        elif kind == "prefetch":
            cache.prefetch(keys)
        else:
            cache.protect(keys)
        cache.table.check_invariants()
    _check_resident_contents(cache, weights)
    assert cache.weights.num_experts == slots


def test_store_pinned_copies_and_dedups_shared_tensors():
    w = _weights(0)
    store = ExpertStore.from_weights([w, w, _weights(1)], mode="pinned", progress=False)
    (_, _, a), = [p for p in store.pieces(0, 2) if p[0] == "down"]
    (_, _, b), = [p for p in store.pieces(1, 2) if p[0] == "down"]
    assert a.data_ptr() == b.data_ptr(), "a tensor shared by two layers is copied once"
    assert a.data_ptr() != w.down[2].data_ptr(), "pinned mode copies"
    assert store.pinned == torch.cuda.is_available()
    assert store.expert_bytes == (2 * 4 * 8 + 8 * 4) * 4
    model_store = ExpertStore.from_weights([w], mode="model", progress=False)
    assert model_store.pieces(0, 1)[0][2].data_ptr() == w.gate_up[1].data_ptr(), "model mode does not copy"
    with pytest.raises(ValueError, match="one slot pool needs one expert shape"):
        ExpertStore.from_weights([w, _weights(0, H=16)], progress=False)
    with pytest.raises(ValueError, match="expert=6"):
        store.pieces(0, 6)


@pytest.mark.parametrize("fmt", ["mixtral", "qwen", "fused"])
def test_store_mmap_from_safetensors_matches(tmp_path, fmt):
    from safetensors.torch import save_file

    weights = [_weights(10 + i, bias=(fmt == "fused")) for i in range(2)]
    tensors = {}
    I = 4
    for layer, w in enumerate(weights):
        p = f"model.layers.{layer}."
        if fmt == "fused":
            tensors[p + "mlp.experts.gate_up_proj"] = w.gate_up.contiguous()
            tensors[p + "mlp.experts.down_proj"] = w.down.contiguous()
            tensors[p + "mlp.experts.gate_up_proj_bias"] = w.gate_up_bias.contiguous()
            tensors[p + "mlp.experts.down_proj_bias"] = w.down_bias.contiguous()
            continue
        base, (g, u, d) = ((p + "block_sparse_moe.experts.", ("w1", "w3", "w2")) if fmt == "mixtral"
                           else (p + "mlp.experts.", ("gate_proj", "up_proj", "down_proj")))
        for e in range(E):
            tensors[f"{base}{e}.{g}.weight"] = w.gate_up[e, :I].contiguous()
            tensors[f"{base}{e}.{u}.weight"] = w.gate_up[e, I:].contiguous()
            tensors[f"{base}{e}.{d}.weight"] = w.down[e].contiguous()
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    store = ExpertStore.from_checkpoint(tmp_path, [0, 1], progress=False)
    assert store.mode == "mmap" and store.num_experts == [E, E]
    cache = ExpertCache(store, 4, LRU(), "cpu")
    cache.ensure([(0, 1), (1, 5), (0, 4)])
    cache.ensure([(1, 0)])
    _check_resident_contents(cache, weights)


# ---- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(gpu_slots=0), "gpu_slots"),
    (dict(gpu_slots=-3), "gpu_slots"),
    (dict(gpu_slots=True), "gpu_slots"),
    (dict(gpu_slots=4, policy="fifo"), "policy"),
    (dict(gpu_slots=4, prefetch_width=-1), "prefetch_width"),
    (dict(gpu_slots=4, store="disk"), "store"),
    (dict(gpu_slots=4, store="mmap"), "checkpoint"),
    (dict(gpu_slots=4, oldest_fraction=0.0), "oldest_fraction"),
    (dict(gpu_slots=4, predict_width=0), "predict_width"),
])
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"OffloadConfig.{field}"):
        OffloadConfig(**kwargs)


def test_config_slots_fewer_than_k_and_wide_prefetch():
    cfg = OffloadConfig(gpu_slots=3, prefetch_width=9)
    with pytest.raises(ValueError, match=r"OffloadConfig.gpu_slots=3: fewer slots than the K=4"):
        cfg.check_layers([2, 4], [8, 8])
    with pytest.raises(ValueError, match="OffloadConfig.prefetch_width=9"):
        OffloadConfig(gpu_slots=4, prefetch_width=9).check_layers([2], [8])
    OffloadConfig(gpu_slots=2, prefetch_width=8).check_layers([2], [8])  # fits: no error
    with pytest.raises(TypeError):
        OffloadConfig(4)  # kw_only
    with pytest.raises(AttributeError):
        cfg.gpu_slots = 5  # frozen


def test_prediction_width_rules():
    assert OffloadConfig(gpu_slots=4).prediction_width(2) == 0
    assert OffloadConfig(gpu_slots=4, policy="predictive").prediction_width(2) == 2
    assert OffloadConfig(gpu_slots=4, policy="predictive", predict_width=3).prediction_width(2) == 3
    assert OffloadConfig(gpu_slots=4, prefetch_width=5).prediction_width(2) == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_copies_on_side_stream_and_contents_match():
    weights = [_weights(i, H=64, I=32, dtype=torch.bfloat16) for i in range(L)]
    store = ExpertStore.from_weights(weights, mode="pinned", progress=False)
    assert store.pinned
    cache = ExpertCache(store, 4, make_policy("random_oldest", 4, fraction=0.5), "cuda")
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        keys = list({(int(torch.randint(L, (1,), generator=gen)), int(torch.randint(E, (1,), generator=gen)))
                     for _ in range(2)})
        slots = cache.ensure(keys)
        # a kernel on the compute stream reading the slots sees the copied values
        for k, s in slots.items():
            # stream-ordered reads after ensure(): exact bits of the host expert
            assert torch.equal(cache.buffers["down"][s], weights[k[0]].down[k[1]].cuda())
            assert torch.equal(cache.buffers["gate_up"][s], weights[k[0]].gate_up[k[1]].cuda())
        cache.prefetch([(0, 0), (1, 1)])
    torch.cuda.synchronize()
    st_ = cache.stats()
    assert st_.wait_s >= 0.0 and st_.hits + st_.misses > 0
    cache.table.check_invariants()
