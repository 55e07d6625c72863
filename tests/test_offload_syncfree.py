"""Sync-free offloaded decode (OffloadConfig.sync_free, moeflow.offload.syncfree): bits, refill, ordering, capture.

Legend: L layers, E routed experts, K picks, Z cache slots, Q staging slots, N pairs, T tokens.

Tiers:
  * CPU, always: config refusals, the remap rule (torch version), the packed layout, the
    offloaded model against the resident one bit for bit (decode, a prefill on the
    synchronous path, decode again), the lagged refill (hit rate rises), the ordering rules
    (no lut entry points at a slot being overwritten; no key is published before its copy
    is done), the resident tile configuration on the pool.
  * CPU with Triton installed: the gather kernels under the Triton interpreter
    (TRITON_INTERPRET=1, in a subprocess) against the torch version, and a model run with them.
  * GPU (`-m gpu`): a patched tiny mixtral / deepseek_v3 at a 25% cache: eager decode equals
    the resident model bit for bit, zero synchronising calls per decode step, the decode step
    captured in a CUDA graph replays the eager tokens while the cache refills between replays,
    and the device hit rate rises.
Exactness: everything here is compared bit for bit (ids as integers, outputs with
assert_bitwise_equal / torch.equal); no tolerance is used.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from moeflow.hf.graphs import cache_kwarg
from moeflow.offload.attach import attach_offload
from moeflow.offload.config import OffloadConfig
from moeflow.offload.store import packed_layout, packed_views
from moeflow.offload.syncfree import GraphStats, admit_torch, remap_torch, stage_torch
from moeflow.testing import assert_bitwise_equal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_offload_model import E, L, _inputs, _model, _run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _attach(family: str, slots: int, *, seed: int = 0, policy: str = "lru", tokens: int = 1):
    ref = _model(family, seed=seed)
    off = copy.deepcopy(ref)
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=slots, policy=policy, device="cpu", sync_free=True,
                                                 sync_free_tokens=tokens, oldest_fraction=0.5), progress=False)
    return ref, off, rt


def _check_lut(rt) -> None:
    """Every lut entry names the slot the table holds the key in (a published key is really there).

    Under device admission (policy "lru") the device's slot_key is the table, and the lut is
    exactly its inverse.
    """
    g = rt.graph
    if g.device_lru:
        keys = g.slot_key.tolist()
        E_max = g.lut.shape[1]
        want = torch.full_like(g.lut, -1)
        for s, k in enumerate(keys):
            if k >= 0:
                want[k // E_max, k % E_max] = s
        assert torch.equal(g.lut.cpu(), want.cpu()), "lut is not the inverse of the device slot_key"
        return
    table = rt.cache.table
    for pos in range(L):
        for e in range(E):
            s = int(g.lut[pos, e])
            if s >= 0:
                assert table.slot_key[s] == (pos, e), f"lut ({pos}, {e}) -> {s}, the table holds {table.slot_key[s]}"
                assert s not in g.inflight, f"slot {s} published while its copy is in flight"


# ----------------------------------------------------------------------------- config


def test_config_refuses_what_sync_free_does_not_serve():
    with pytest.raises(TypeError, match="OffloadConfig.sync_free=1: expected a bool"):
        OffloadConfig(gpu_slots=4, sync_free=1)
    with pytest.raises(ValueError, match="OffloadConfig.sync_free_tokens=0"):
        OffloadConfig(gpu_slots=4, sync_free=True, sync_free_tokens=0)
    with pytest.raises(ValueError, match="OffloadConfig.prefetch_width=2: sync_free=True"):
        OffloadConfig(gpu_slots=4, sync_free=True, prefetch_width=2)
    for policy in ("predictive", "adaptive"):
        with pytest.raises(ValueError, match=f"OffloadConfig.policy='{policy}': sync_free=True"):
            OffloadConfig(gpu_slots=4, sync_free=True, policy=policy)
    with pytest.raises(ValueError, match="OffloadConfig.cpu_experts='always': sync_free=True"):
        OffloadConfig(gpu_slots=4, sync_free=True, cpu_experts="always", device="cpu")
    with pytest.raises(ValueError, match="OffloadConfig.store='mmap': sync_free=True"):
        OffloadConfig(gpu_slots=4, sync_free=True, store="mmap", checkpoint="x")
    with pytest.raises(ValueError, match="OffloadConfig.store='model': sync_free=True"):
        OffloadConfig(gpu_slots=4, sync_free=True, store="model")
    OffloadConfig(gpu_slots=4, sync_free=True, policy="random_oldest", sync_free_tokens=3)


def test_device_lru_refuses_fewer_slots_than_a_step_admits():
    with pytest.raises(ValueError, match="OffloadConfig.gpu_slots=4: sync_free=True with policy 'lru'"):
        _attach("mixtral", slots=4, tokens=3)  # 3 tokens x K=2: up to 6 experts in one step
    _attach("mixtral", slots=4, tokens=3, policy="random_oldest")  # staging serves it


def test_attach_refuses_zero_experts_and_leaves_the_layers():
    m = _model("longcat")
    with pytest.raises(ValueError, match=r"sync_free=True: layers\[0\] .* 2 zero experts"):
        attach_offload(list(m), OffloadConfig(gpu_slots=4, device="cpu", sync_free=True), progress=False)
    assert all(getattr(layer, "offload", None) is None for layer in m)


def test_refill_without_sync_free_is_refused():
    rt = attach_offload(list(_model("mixtral")), OffloadConfig(gpu_slots=4, device="cpu"), progress=False)
    assert rt.graph_stats() is None
    with pytest.raises(ValueError, match="refill\\(\\): OffloadConfig.sync_free=False"):
        rt.refill()


# ----------------------------------------------------------------------------- the rule


def test_remap_rule_owner_rank_and_log():
    # lut: expert 1 in cache slot 0; Z = 2 cache slots, NCAP = 6, P = 2 + 4
    lut = torch.tensor([-1, 0, -1, -1, -1, -1], dtype=torch.int32)
    ids = torch.tensor([3, 1, 3, 5, 1, 9])  # 9 is outside [0, E): the pool's end P (a NaN row, loud)
    log = torch.zeros(1 + 2 * 6, dtype=torch.int32)
    remap, experts = remap_torch(ids, lut, 2, 6, 6, log)
    # 3 is missing, owned by pair 0 -> rank 0 -> slot 2; 5 owned by pair 3 -> rank 1 -> slot 3
    assert remap.tolist() == [2, 0, 2, 3, 0, 6]
    assert experts.tolist() == [3, 5]
    assert log.tolist() == [1, 3, 1, 3, 5, 1, 9, 2, 0, 2, 3, 0, 6]
    remap_torch(ids[:2], lut, 2, 6, 6, log)
    assert log.tolist() == [2, 3, 1, -1, -1, -1, -1, 2, 0, -1, -1, -1, -1], "counter +1, the rest -1"
    host = torch.arange(6 * 16, dtype=torch.uint8).view(6, 16)
    pool = torch.zeros(6, 16, dtype=torch.uint8)
    stage_torch(experts, host, pool, 2)
    assert torch.equal(pool[2], host[3]) and torch.equal(pool[3], host[5]) and not pool[[0, 1, 4, 5]].any()


def test_admit_rule_lru_victims_lut_and_log():
    # L = 2 layers of E_max = 4, Z = 3 slots; layer 1's expert 2 in slot 0 (used at step 5), slot 1 empty,
    # layer 0's expert 3 in slot 2 (used at step 7)
    lut = torch.full((2, 4), -1, dtype=torch.int32)
    lut[1, 2], lut[0, 3] = 0, 2
    slot_key = torch.tensor([1 * 4 + 2, -1, 0 * 4 + 3], dtype=torch.int32)
    stamp = torch.tensor([5, 0, 7], dtype=torch.int64)
    clock = torch.tensor([9], dtype=torch.int64)
    log = torch.zeros(1 + 2 * 4, dtype=torch.int32)
    ids = torch.tensor([1, 3, 0, 1])  # layer 0: 3 hits slot 2; 1 and 0 miss (ranks 0, 1 by first pair)
    remap, experts, rows = admit_torch(ids, 0, lut, slot_key, stamp, clock, 4, 3, 4, log)
    # step 10: slot 2 stamped 10 (hit); 1 takes the empty slot 1 (stamp 0), 0 takes slot 0 (stamp 5)
    assert remap.tolist() == [1, 2, 0, 1] and experts.tolist() == [1, 0] and rows.tolist() == [1, 0]
    assert clock.tolist() == [10] and stamp.tolist() == [10, 10, 10]
    assert slot_key.tolist() == [0, 1, 3] and lut[1, 2] == -1, "layer 1's expert 2 evicted from slot 0"
    assert lut[0].tolist() == [0, 1, -1, 2]
    assert log.tolist() == [1, 1, 3, 0, 1, -3, 2, -2, -3], "copies logged as -2 - slot"
    # advance=0 keeps the clock: a slice of the same step never evicts what the step already holds
    lut2, sk2, st2, ck2 = lut.clone(), slot_key.clone(), stamp.clone(), clock.clone()
    remap, _, rows = admit_torch(torch.tensor([2]), 1, lut2, sk2, st2, ck2, 4, 3, 4, log, advance=0)
    assert ck2.tolist() == [10] and rows.tolist() == [0], "ties on stamp 10: the lowest slot"
    host = torch.arange(4 * 8, dtype=torch.uint8).view(4, 8)
    pool = torch.zeros(3, 8, dtype=torch.uint8)
    stage_torch(torch.tensor([1, 0]), host, pool, 3, torch.tensor([1, 0]))
    assert torch.equal(pool[1], host[1]) and torch.equal(pool[0], host[0]) and not pool[2].any()


def test_packed_layout_keeps_every_dtype_as_bytes():
    shapes = {"gate_up": (4, 3), "down": (3, 2), "gate_up_scale": ()}
    dtypes = {"gate_up": torch.uint8, "down": torch.float32, "gate_up_scale": torch.float16}
    offsets, B = packed_layout(shapes, dtypes)
    assert offsets == {"gate_up": 0, "down": 16, "gate_up_scale": 48} and B == 64
    buf = torch.zeros(5, B, dtype=torch.uint8)
    v = packed_views(buf, shapes, dtypes, offsets)
    assert v["gate_up"].shape == (5, 4, 3) and v["down"].shape == (5, 3, 2) and v["gate_up_scale"].shape == (5,)
    g = torch.Generator().manual_seed(0)
    want = {"gate_up": torch.randint(0, 255, (5, 4, 3), generator=g, dtype=torch.uint8),
            "down": torch.randn(5, 3, 2, generator=g), "gate_up_scale": torch.randn(5, generator=g).half()}
    for n, t in want.items():
        v[n].copy_(t)
    moved = torch.zeros_like(buf)
    moved[[4, 0]] = buf[[1, 3]]  # a row of bytes moves an expert, whatever its dtypes
    w = packed_views(moved, shapes, dtypes, offsets)
    for n, t in want.items():
        assert torch.equal(w[n][4], t[1]) and torch.equal(w[n][0], t[3]), n
    with pytest.raises(ValueError, match="expected uint8"):
        packed_views(buf.float(), shapes, dtypes, offsets)


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("family", ["mixtral", "deepseek", "gpt_oss", "llama4"])
@pytest.mark.parametrize("policy", ["lru", "random_oldest"])
def test_sync_free_is_bitwise_resident(family, policy):
    ref, off, rt = _attach(family, slots=8, policy=policy)  # 8 of 32 experts: a 25% cache
    assert rt.graph is not None and rt.store.packed is not None and rt.cache.num_slots == 8
    K = ref[0].config.top_k
    assert rt.graph.num_staging == (0 if policy == "lru" else min(E, K)) and rt.graph.P == 8 + rt.graph.num_staging
    seq, prefill = _inputs(1, n_decode=12)
    for x in seq:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} sync-free decode")
        _check_lut(rt)
    # 9 tokens: more pairs than a sync-free step serves -> the synchronous path, same slots
    assert_bitwise_equal(_run(off, prefill), _run(ref, prefill), what=f"{family} prefill (synchronous path)")
    _check_lut(rt)
    for x in seq[:4]:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} decode after the prefill")
        _check_lut(rt)
    st = rt.graph_stats()
    assert st.sync_steps == L and st.steps == 16 * L
    assert st.observed + st.dropped <= st.steps and st.staged > 0
    # device admission copies a miss once, into its slot; staging copies it again when the refill loads it
    assert (st.refill_copies == 0) if policy == "lru" else (st.refill_copies > 0)
    assert st.bytes_staged == st.staged * rt.store.expert_bytes
    assert st.refill_bytes == st.refill_copies * rt.store.expert_bytes
    rt.cache.table.check_invariants()


def test_batch_of_tokens_within_sync_free_tokens_stays_sync_free():
    ref, off, rt = _attach("mixtral", slots=6, tokens=3)  # device admission: a step's <= 6 experts fit
    assert rt.graph.ncap == 6 and rt.graph.num_staging == 0
    g = torch.Generator().manual_seed(4)
    for _ in range(6):
        x = torch.randn(3, 32, generator=g)
        assert_bitwise_equal(_run(off, x), _run(ref, x), what="3-token sync-free steps")
        _check_lut(rt)
    assert rt.graph_stats().sync_steps == 0 and rt.graph_stats().steps == 6 * L


def test_hit_rate_rises_as_the_cache_refills():
    # every expert fits (L*E slots): after the lag, every step hits on the device
    ref, off, rt = _attach("mixtral", slots=L * E, seed=3)
    seq = _inputs(2, n_decode=4)[0] * 4  # 4 tokens, 4 times: after the first pass only the lag misses
    per_token = []
    for x in seq:
        before = (rt.graph.stats.device_hits, rt.graph.stats.staged)
        assert_bitwise_equal(_run(off, x), _run(ref, x))
        rt.refill()  # observe this token's steps now (the next token's layer 0 would)
        per_token.append((rt.graph.stats.device_hits - before[0], rt.graph.stats.staged - before[1]))
    hits, staged = zip(*per_token)
    assert hits[0] == 0 and staged[0] > 0, f"cold cache: {per_token[:3]}"
    assert sum(staged[-8:]) == 0 and sum(hits[-8:]) > 0, f"a warm full cache still stages: {per_token}"
    st = rt.graph_stats()
    assert isinstance(st, GraphStats) and st.dropped == 0 and rt.stats().evictions == 0
    assert 0.5 < st.hit_rate < 1.0


def test_refill_never_overwrites_a_published_slot():
    ref, off, rt = _attach("mixtral", slots=4, policy="random_oldest")
    g = rt.graph
    g.journal = []
    seq, _ = _inputs(5, n_decode=12)
    for x in seq:
        assert_bitwise_equal(_run(off, x), _run(ref, x))
    ops = g.journal
    assert any(op[0] == "copy" for op in ops), "the refill issued no copy"
    lut_now = None
    marked = False
    for op in ops:
        if op[0] == "upload":
            lut_now, marked = op[1], False
        elif op[0] == "mark":
            marked = True
        elif op[0] == "copy":
            _, slot, key = op
            assert marked, "a copy without the mark that orders it after earlier kernels"
            assert lut_now is not None and not bool((lut_now == slot).any()), \
                f"slot {slot} overwritten while the lut still points at it"
            assert int(lut_now[key]) == -1, f"{key} published before its copy"


def test_no_key_is_published_before_its_copy_completes():
    # the lagged refill (random_oldest); nothing evicted: every load stays to be published
    ref, off, rt = _attach("deepseek", slots=L * E, policy="random_oldest")
    g = rt.graph
    done = {"ok": False}
    g._copy_done = lambda slot: done["ok"]  # the copy engine reports nothing finished yet
    seq, _ = _inputs(6, n_decode=8)
    for x in seq[:5]:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what="every expert served from staging")
    assert int((g.lut >= 0).sum()) == 0 and len(g.inflight) > 0
    assert g.stats.device_hits == 0 and rt.stats().misses > 0
    done["ok"] = True
    rt.refill()  # the copies are done now: published
    assert int((g.lut >= 0).sum()) > 0
    _check_lut(rt)
    for x in seq[5:]:
        assert_bitwise_equal(_run(off, x), _run(ref, x), what="after publication")


def test_pool_runs_with_the_resident_layers_tiles():
    from moeflow.config import ExpertWeights
    from moeflow.experts.base import tiled_as, tiling_experts
    from moeflow.experts.triton import TritonExperts
    from moeflow.tuning import GemmTile, MoETileConfig

    _, off, rt = _attach("mixtral", slots=4)
    g = rt.graph
    impl = TritonExperts(allow_cpu=True)
    K = off[0].config.top_k
    p = g.weights
    # weights shaped like the resident layer's (E experts): what its tiles are keyed by
    resident_w = ExpertWeights(**{n: getattr(p, n)[:1].expand(E, *getattr(p, n).shape[1:]) for n in p.TENSOR_FIELDS
                                  if getattr(p, n) is not None}, layout=p.layout, interleaved=p.interleaved)
    run = g._pool_impl(impl, 0, K, 1)
    assert p.num_experts == g.P != E and tiling_experts(run, p) == E
    assert run is not impl and run is tiled_as(impl, E), "one cached copy per (impl, E)"
    for T in (1, 2, 5, 8, 64):
        assert run.tile_config_for(p, K, T) == impl.tile_config_for(resident_w, K, T), f"T={T}"
        # the same kernels and tiles as the resident layer's plan (its E; the pool's own E sizes the buffers)
        pool, resident = run.plan(p, T, K), impl.plan(resident_w, T, K)
        assert pool.shape.tiling_experts == resident.shape.num_experts == E != pool.shape.num_experts, f"T={T}"
        assert (pool.path, pool.tiles) == (resident.path, resident.tiles), f"T={T}"
        assert [(s.stage, s.variant, s.tile, s.params) for s in pool.stages] == \
            [(s.stage, s.variant, s.tile, s.params) for s in resident.stages], f"T={T}"
    forced_cfg = MoETileConfig(block_m=16, gate_up=GemmTile(block_n=32, block_k=32, num_warps=4, num_stages=1),
                               down=GemmTile(block_n=32, block_k=32, num_warps=4, num_stages=1))
    forced = TritonExperts(tile_config=forced_cfg)
    assert g._pool_impl(forced, 0, K, 1).tile_config_for(p, K, 1) == forced_cfg, "a forced tile config is kept"
    assert tiled_as("not an impl", E) == "not an impl", "impls without tiles pass through"
    with pytest.raises(ValueError, match="num_experts=0"):
        tiled_as(impl, 0)


# ----------------------------------------------------------------------------- interpreter


def _run_interp(check: str) -> None:
    from moeflow.testing import run_interpreter_check

    run_interpreter_check(__file__, check)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (the interpreter comes with it)")
@pytest.mark.parametrize("check", ["kernels", "admit", "model"])
def test_interpreter(check):
    _run_interp(check)


def _interp_kernels() -> None:
    from moeflow.kernels.offload_gather import COPY_BLOCK_WORDS, gather_launch

    g = torch.Generator().manual_seed(0)
    for E_, Z, ncap, W, programs in ((8, 3, 6, 37, 2), (5, 2, 8, 2 * COPY_BLOCK_WORDS + 5, 3), (16, 1, 4, 8, 1)):
        Q = min(E_, ncap)
        P = Z + Q
        for trial in range(12):
            N = int(torch.randint(1, ncap + 1, (1,), generator=g))
            ids = torch.randint(0, E_, (N,), generator=g)
            if trial == 3:
                ids[0] = E_ + 1  # outside [0, E): remap P, never staged
            lut = torch.full((E_,), -1, dtype=torch.int32)
            resident = torch.randperm(E_, generator=g)[: int(torch.randint(0, Z + 1, (1,), generator=g))]
            for s, e in enumerate(resident.tolist()):
                lut[e] = s
            host = torch.randint(-2**31, 2**31 - 1, (E_, W), dtype=torch.int32, generator=g)
            pool_k, pool_t = torch.zeros(P, W, dtype=torch.int32), torch.zeros(P, W, dtype=torch.int32)
            log_k = torch.full((1 + 2 * ncap,), 7, dtype=torch.int32)
            log_t = log_k.clone()
            remap = torch.empty(N, dtype=torch.int32)
            jobs = torch.empty(1 + 2 * Q, dtype=torch.int32)
            ids_in = ids.to(torch.int32) if trial % 2 else ids
            gather_launch(ids_in, lut, host, pool_k, remap, jobs, log_k, num_cache_slots=Z, ncap=ncap,
                          programs=programs)
            want, experts = remap_torch(ids, lut, Z, P, ncap, log_t)
            stage_torch(experts, host, pool_t, Z)
            assert torch.equal(remap, want), (trial, remap.tolist(), want.tolist())
            assert torch.equal(log_k, log_t), (trial, log_k.tolist(), log_t.tolist())
            assert int(jobs[0]) == experts.numel() and jobs[1 : 1 + experts.numel()].tolist() == experts.tolist()
            assert torch.equal(pool_k, pool_t), f"trial {trial}: staged rows differ"


def _interp_admit() -> None:
    from moeflow.kernels.offload_gather import admit_launch

    g = torch.Generator().manual_seed(1)
    for L_, E_, Z, ncap, W in ((3, 8, 6, 6, 37), (2, 5, 5, 8, 20), (4, 16, 4, 4, 8)):
        Q = min(E_, ncap)
        lut_k = torch.full((L_, E_), -1, dtype=torch.int32)
        sk_k = torch.full((Z,), -1, dtype=torch.int32)
        st_k = torch.zeros(Z, dtype=torch.int64)
        ck_k = torch.zeros(1, dtype=torch.int64)
        lut_t, sk_t, st_t, ck_t = lut_k.clone(), sk_k.clone(), st_k.clone(), ck_k.clone()
        host = torch.randint(-2**31, 2**31 - 1, (L_, E_, W), dtype=torch.int32, generator=g)
        pool_k, pool_t = torch.zeros(Z, W, dtype=torch.int32), torch.zeros(Z, W, dtype=torch.int32)
        log_k = torch.zeros(1 + 2 * ncap, dtype=torch.int32)
        log_t = log_k.clone()
        for trial in range(16):  # a sequence of steps over the layers: the state carries over
            layer = trial % L_
            N = int(torch.randint(1, ncap + 1, (1,), generator=g))
            ids = torch.randint(0, E_, (N,), generator=g)
            if trial == 5:
                ids[0] = E_ + 2  # outside [0, E): remap Z (the pool's end), never admitted
            remap = torch.empty(N, dtype=torch.int32)
            jobs = torch.empty(1 + 2 * Q, dtype=torch.int32)
            admit_launch(ids, lut_k, sk_k, st_k, ck_k, host[layer], pool_k, remap, jobs, log_k, layer=layer,
                         ncap=ncap, programs=2)
            want, experts, rows = admit_torch(ids, layer, lut_t, sk_t, st_t, ck_t, E_, Z, ncap, log_t)
            stage_torch(experts, host[layer], pool_t, Z, rows)
            assert torch.equal(remap, want), (trial, remap.tolist(), want.tolist())
            for a, b, what in ((lut_k, lut_t, "lut"), (sk_k, sk_t, "slot_key"), (st_k, st_t, "stamp"),
                               (ck_k, ck_t, "clock"), (log_k, log_t, "log"), (pool_k, pool_t, "pool")):
                assert torch.equal(a, b), (trial, what, a.tolist() if a.numel() < 64 else "", b.tolist()
                                           if b.numel() < 64 else "")


def _interp_model() -> None:
    for family in ("mixtral", "gpt_oss"):
        ref, off, rt = _attach(family, slots=8)
        rt.graph.use_triton = True  # the kernels, run by the interpreter on the CPU tensors
        seq, prefill = _inputs(1, n_decode=6)
        for x in seq:
            assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} interpreter decode")
            _check_lut(rt)
        assert_bitwise_equal(_run(off, prefill), _run(ref, prefill), what=f"{family} interpreter prefill")
        for x in seq[:3]:
            assert_bitwise_equal(_run(off, x), _run(ref, x), what=f"{family} interpreter decode after prefill")
            _check_lut(rt)
        assert rt.graph_stats().staged > 0


# ----------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_CUDA or not HAS_TRITON, reason="needs CUDA and Triton")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
# tiny HF models grown to 32 / 24 routed experts so a 25% cache evicts: (family, overrides)
GPU_MODELS = {
    "mixtral": dict(num_hidden_layers=4, num_local_experts=8),
    "deepseek_v3": dict(num_hidden_layers=4, n_routed_experts=8),
}


def _sync_calls(fn) -> tuple[int, list[str]]:
    """Synchronising CUDA runtime calls made by fn() (torch profiler CPU events; as tests/test_e2e_gpu.py)."""
    from torch.profiler import ProfilerActivity, profile

    def count(f) -> list[str]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            f()
        return [e.name for e in prof.events() if any(e.name.startswith(s) for s in SYNC_EVENTS)
                and not e.name.startswith("cudaMemcpyAsync")]

    base = len(count(lambda: None))  # the profiler's own sync when it stops
    names = count(fn)
    return len(names) - base, names


def _hf_pair(family: str, full_cache: bool = False, policy: str = "lru"):
    """(resident patched model, offloaded sync-free patched model, runtime) in bf16 on the GPU.

    The cache holds 25% of the experts, or all of them with full_cache (so refills must reach a
    hit rate of 1).
    """
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_configs import tiny_model

    import moeflow
    from moeflow.layer import MoELayer

    res = tiny_model(family, **GPU_MODELS[family]).to("cuda", torch.bfloat16)
    res.config._attn_implementation = "sdpa"  # device-built masks (the eager path copies a CPU scalar)
    off = copy.deepcopy(res)
    moeflow.patch_model(res, experts="triton")
    moe = [m for m in res.modules() if isinstance(m, MoELayer)]
    keys = len(moe) * moe[0].config.num_experts
    slots = keys if full_cache else max(moe[0].config.top_k, keys // 4)
    moeflow.patch_model(off, experts="triton", offload=OffloadConfig(gpu_slots=slots, device="cuda", sync_free=True,
                                                                      policy=policy))
    rt = next(m.offload for m in off.modules() if isinstance(m, MoELayer))
    assert rt.graph is not None and rt.cache.num_slots == slots
    return res, off, rt


def _greedy(model, prompt: torch.Tensor, steps: int, between=None) -> torch.Tensor:
    from transformers import DynamicCache

    cache = {cache_kwarg(model): DynamicCache()}
    out = model(input_ids=prompt, **cache, use_cache=True)
    toks = [out.logits[:, -1].argmax(-1, keepdim=True)]
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        out = model(input_ids=toks[-1], **cache, use_cache=True)
        toks.append(out.logits[:, -1].argmax(-1, keepdim=True))
        logits.append(out.logits[:, -1])
        if between is not None:
            between()
    return torch.cat(toks, 1), torch.stack(logits)


@gpu
@needs_gpu
@pytest.mark.parametrize("policy", ["lru", "random_oldest"])
@pytest.mark.parametrize("family", list(GPU_MODELS))
def test_gpu_eager_decode_is_bitwise_resident(family, policy, hf_quiet):
    res, off, rt = _hf_pair(family, policy=policy)
    prompt = torch.randint(3, 97, (1, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    t_res, l_res = _greedy(res, prompt, 8)
    t_off, l_off = _greedy(off, prompt, 8)
    assert torch.equal(t_off, t_res), f"{family}: tokens {t_off.tolist()} != resident {t_res.tolist()}"
    assert_bitwise_equal(l_off, l_res, what=f"{family} sync-free decode logits over 8 steps")
    torch.cuda.synchronize()
    st = rt.graph_stats()
    assert st.steps >= 8 * len(rt.layers) and st.sync_steps == len(rt.layers)  # the prefill only
    # device admission (lru): a miss is copied once, by the step itself; staging: the refill copies again
    assert st.staged > 0 and (st.refill_copies == 0) == (policy == "lru")
    _check_lut_gpu(rt)


def _check_lut_gpu(rt) -> None:
    if rt.graph.device_lru:
        _check_lut(rt)  # the lut is the inverse of the device's slot_key
        return
    lut = rt.graph.lut.cpu()
    table = rt.cache.table
    for pos, e in (lut >= 0).nonzero().tolist():
        assert table.slot_key[int(lut[pos, e])] == (pos, e)


@gpu
@needs_gpu
def test_gpu_layer_stack_decode_step_makes_no_sync():
    """A stack of MoELayers offloaded sync-free: 0 synchronising calls per decode step, and sync-debug clean."""
    from moeflow.routing.monitor import RoutingMonitor

    ref = _model("mixtral").to("cuda", torch.bfloat16)
    off = copy.deepcopy(ref)
    monitor = RoutingMonitor()
    for m in list(ref) + list(off):
        m.experts_impl = "triton"
    for m in off:  # the routing status checked deferred (one flag per forward), as tests/test_e2e_gpu.py does
        m.check_routing, m.routing_monitor = "deferred", monitor
    attach_offload(list(off), OffloadConfig(gpu_slots=8, device="cuda", sync_free=True), progress=False)
    seq, _ = _inputs(1, n_decode=12)
    xs = [x.to("cuda", torch.bfloat16) for x in seq]

    def step(x):
        monitor.poll()
        y = _run(off, x)
        monitor.end_forward()
        return y

    for x in xs[:4]:  # warm-up: kernel compiles, tile configs, lazy buffers, the monitor's pinned flag
        assert_bitwise_equal(step(x), _run(ref, x), what="warm-up")
    for x in xs[4:8]:
        n, names = _sync_calls(lambda x=x: step(x))
        assert n == 0, f"a sync-free decode step synchronised: {names}"
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs[8:]:
            step(x)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    monitor.check(wait=True)
    for x in xs[8:]:
        assert_bitwise_equal(step(x), _run(ref, x), what="after the sync-debug steps")


@gpu
@needs_gpu
@pytest.mark.parametrize("family", list(GPU_MODELS))
def test_gpu_patched_decode_step_adds_no_sync(family, hf_quiet):
    """The HF model's decode step: sync-free offload adds no sync to what the resident patched model makes."""
    from transformers import DynamicCache

    res, off, rt = _hf_pair(family)
    prompt = torch.randint(3, 97, (1, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def stepper(model):
        cache = {cache_kwarg(model): DynamicCache()}  # the name once, not a signature lookup a step
        out = model(input_ids=prompt, **cache, use_cache=True)
        tok = [out.logits[:, -1].argmax(-1, keepdim=True)]

        def step():
            o = model(input_ids=tok[0], **cache, use_cache=True)
            tok[0] = o.logits[:, -1].argmax(-1, keepdim=True)

        return step

    s_res, s_off = stepper(res), stepper(off)
    for _ in range(3):  # warm-up
        s_res()
        s_off()
    base, base_names = _sync_calls(s_res)
    got, names = _sync_calls(s_off)
    assert got <= base, f"{family}: sync-free offloaded step {got} syncs {names} vs resident {base} {base_names}"


@gpu
@needs_gpu
@pytest.mark.parametrize("cache", ["quarter", "full"])
@pytest.mark.parametrize("family", list(GPU_MODELS))
def test_gpu_decode_step_captures_in_a_cuda_graph_and_refills_between_replays(family, cache, hf_quiet):
    """moeflow.hf.StaticDecoder (static cache + torch.cuda.graphs): replays give the eager (and the resident)
    tokens; the decoder calls refill() before each replay, which observes every replayed step (none dropped)
    and fills the cache: with a cache that holds every expert, a second replayed decode of the same prompt
    (the same experts) stages nothing."""
    from moeflow.hf.graphs import StaticDecoder

    res, off, rt = _hf_pair(family, full_cache=cache == "full")
    P, N = 6, 24
    prompt = torch.randint(3, 97, (1, P), device="cuda", generator=torch.Generator("cuda").manual_seed(2))

    def decode(model, graph):
        return StaticDecoder(model, batch_size=1, max_len=P + N + 2, graph=graph)

    def settle():  # wait for the read-backs and the refill copies, then publish them
        for _ in range(2):
            torch.cuda.synchronize()
            rt.refill()

    resident = decode(res, False).generate(prompt, N)
    resident_replayed = decode(res, True).generate(prompt, N)
    dec = decode(off, True)
    replayed = dec.generate(prompt, N)  # before the offloaded eager run: the replays meet a cold cache
    settle()
    st = rt.graph_stats()
    assert st.dropped == 0, f"{family}: the refill dropped {st.dropped} layer steps of {st.observed + st.dropped}"
    assert st.observed >= (N - 1) * len(rt.layers) and st.staged > 0 and st.refill_copies == 0, st
    staged = st.staged
    again = dec.generate(prompt, N)  # the same prompt: the same experts, now resident when the cache holds all
    settle()
    if cache == "full":
        assert rt.graph_stats().staged == staged, (f"{family}: a full cache staged "
                                                   f"{rt.graph_stats().staged - staged} experts on the second pass")
    eager = decode(off, False).generate(prompt, N)
    assert torch.equal(eager, resident), f"{family}: eager offloaded {eager.tolist()} != resident {resident.tolist()}"
    # the recipe itself first: the resident model's replay must equal its eager run
    assert torch.equal(resident_replayed, resident), (
        f"{family}: the RESIDENT model's graph replay {resident_replayed.tolist()} != its eager run "
        f"{resident.tolist()} (the capture recipe, not the offload path)")
    assert torch.equal(replayed, eager), f"{family}: graph replay {replayed.tolist()} != eager {eager.tolist()}"
    assert torch.equal(again, eager), f"{family}: second replay {again.tolist()} != eager {eager.tolist()}"
    _check_lut_gpu(rt)


@gpu
@needs_gpu
def test_gpu_hit_rate_rises_with_a_cache_that_holds_everything():
    ref = _model("deepseek").to("cuda", torch.bfloat16)
    off = copy.deepcopy(ref)
    rt = attach_offload(list(off), OffloadConfig(gpu_slots=L * E, device="cuda", sync_free=True), progress=False)
    seq, _ = _inputs(2, n_decode=24)
    staged = []
    for x in seq:
        x = x.to("cuda", torch.bfloat16)
        before = rt.graph.stats.staged
        assert_bitwise_equal(_run(off, x), _run(ref, x))
        torch.cuda.synchronize()  # the test waits so the lagged read-back is surely complete
        rt.refill()
        staged.append(rt.graph.stats.staged - before)
    assert staged[0] > 0 and sum(staged[-8:]) == 0, f"staged experts per token: {staged}"


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("kernels", "admit", "model"):
        raise SystemExit("usage: TRITON_INTERPRET=1 python tests/test_offload_syncfree.py {kernels|admit|model}")
    torch.set_grad_enabled(False)
    {"kernels": _interp_kernels, "admit": _interp_admit, "model": _interp_model}[sys.argv[1]]()
    print(f"PASS {sys.argv[1]}")
