"""Expert parallelism over gloo: 2 and 4 spawned CPU ranks, checked against one process.

Legend: W ranks, T_r tokens on rank r, K picks, E routed experts, Z zero experts,
H hidden, I intermediate per expert.

One spawn per world size runs every check (spawning costs seconds; a check is
milliseconds); each check's result per rank comes back through a queue and becomes
one pytest test. Payloads are self-describing: token row x[t] carries its source rank
in column 0 and t/64 in column 1 (both exact in fp32), so what arrives and what the
experts compute can be decoded and counted.

Tolerances: all_to_all with the reference experts is compared BIT FOR BIT with the
single-process MoELayer run on all ranks' tokens concatenated in rank order (dynamic
and static modes), with a batch-invariant shared expert (RowwiseSharedMLP). With an
nn.Linear shared expert (not batch-invariant on CPU BLAS: a row's bits depend on the
GEMM's row count, in one process too), all_reduce (cross-rank sum order) and the
`grouped` experts (the single process and the ranks pick different grouped paths for
different row counts) outputs are compared with rtol = atol = 1e-5 in fp32.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ep_spawn import free_port, gather_ranks, report_and_exit
from torch import nn

from moeflow.config import ExpertWeights, MoEConfig
from moeflow.experts.select import get_impl
from moeflow.layer import MoELayer
from moeflow.parallel.dist_utils import EPCollectiveError, EPConfigMismatch, collective
from moeflow.parallel.ep import shard_layer
from moeflow.parallel.plan import as_placement, contiguous_ranges
from moeflow.routing.spec import RouterSpec
from moeflow.testing import assert_bitwise_equal, assert_close

TOL = dict(rtol=1e-5, atol=1e-5)
TIMEOUT_S = 4.0  # the short user timeout of the hung-rank check
CASE_TIMEOUT_S = 10.0  # any other collective: fail (not hang) if a peer is lost


def _all_reduce(t: torch.Tensor) -> None:
    collective("test all_reduce(counts)", dist.all_reduce, t, group=dist.group.WORLD, timeout_s=CASE_TIMEOUT_S)


class SharedMLP(nn.Module):
    """A SwiGLU shared expert (the HF MLP shape)."""

    def __init__(self, H: int, I: int, g: torch.Generator, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = nn.Linear(H, I, bias=False, dtype=dtype)
        self.up = nn.Linear(H, I, bias=False, dtype=dtype)
        self.down = nn.Linear(I, H, bias=False, dtype=dtype)
        with torch.no_grad():
            for lin in (self.gate, self.up, self.down):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.3)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class RowwiseSharedMLP(SharedMLP):
    """The same SwiGLU run one row at a time (batch-invariant).

    A row's bits from nn.Linear depend on the GEMM's row count on CPU BLAS, and even
    silu's do (vectorised body vs scalar tail); so the single-process layer's shared
    expert is itself not batch-invariant. This one is, so the bitwise checks can
    include a shared expert.
    """

    def forward(self, x):
        if x.shape[0] == 0:
            return super().forward(x)
        return torch.cat([super(RowwiseSharedMLP, self).forward(x[t : t + 1]) for t in range(x.shape[0])])


class CountingImpl:
    """Wraps an experts impl and records every (x_NH, expert_N) it is asked to compute."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = f"counting({inner.name})"
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def supports(self, config):
        return self.inner.supports(config)

    def forward_pairs(self, x_NH, expert_N, w, config):
        self.calls.append((x_NH.clone(), expert_N.clone()))
        return self.inner.forward_pairs(x_NH, expert_N, w, config)


def _build(*, E=8, K=2, Z=0, H=24, I=12, shared=False, impl="reference", score_fn="softmax",
           weight_on_input=False, skew_experts=(), seed=0, dtype=torch.float32) -> MoELayer:
    g = torch.Generator().manual_seed(seed)
    spec = RouterSpec(score_fn=score_fn, num_experts=E, top_k=K, num_zero_experts=Z,
                      renorm=score_fn == "softmax", weight_on_input=weight_on_input)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu")
    router_w = (torch.randn(E + Z, H, generator=g) * 0.5).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * 0.3).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.3).to(dtype)
    bias = None
    if skew_experts:
        # a large router bias on some experts: every token picks among them
        bias = torch.zeros(E + Z)
        bias[list(skew_experts)] = 40.0
        bias = bias.to(dtype)
    shared_mod = None
    if shared:
        shared_mod = (RowwiseSharedMLP if shared == "rowwise" else SharedMLP)(H, 10, g, dtype)
    return MoELayer(cfg, router_weight_EH=router_w, experts=ExpertWeights(gate_up, down), router_bias_E=bias,
                    shared_expert=shared_mod, experts_impl=impl)


def _tokens(seed: int, rank: int, T: int, H: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(T, H, generator=g)
    x[:, 0] = float(rank)
    x[:, 1] = torch.arange(T, dtype=torch.float32) / 64.0
    return x.to(dtype)


def _decode_rows(x_NH: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Global row (in the concatenated batch) of each payload row."""
    src = x_NH[:, 0].round().long()
    tok = (x_NH[:, 1].to(torch.float32) * 64).round().long()
    return offs[src] + tok


def _count_computed(calls, valid_N, local_ids, offs, ids_all, K, shift=0) -> torch.Tensor:
    """[T_all, K] how many times each pair was computed here, from what the experts saw."""
    counts = torch.zeros(ids_all.shape[0], K, dtype=torch.int64)
    assert len(calls) <= 1, f"experts called {len(calls)} times in one forward"
    for x_NH, e_N in calls:
        if valid_N is not None:
            x_NH, e_N = x_NH[valid_N], e_N[valid_N]
        rows = _decode_rows(x_NH, offs)
        gid = local_ids[e_N - shift]
        match = ids_all[rows].long() == gid[:, None]
        assert bool(match.any(1).all()), "a computed row's expert is not among its token's picks"
        slot = match.int().argmax(1)
        counts.index_put_((rows, slot), torch.ones_like(rows), accumulate=True)
    return counts


def _check_payload(h, rank, placement, offs, routing_all, E):
    valid = getattr(h, "recv_valid_N", None)
    sel = slice(None) if valid is None else valid
    x = h.recv_x_NH[sel]
    src, tok, slot = h.recv_src_N[sel], h.recv_token_N[sel], h.recv_slot_N[sel]
    assert torch.equal(x[:, 0].round().long(), src), "token row does not carry its source rank"
    assert torch.equal((x[:, 1] * 64).round().long(), tok), "token row does not carry its token index"
    rows = offs[src] + tok
    local_ids = torch.tensor(placement.experts_of(rank), dtype=torch.long)
    gid = routing_all.ids_TK[rows, slot].long()
    assert bool((gid < E).all()), "a zero-expert pair was sent"
    assert torch.equal(local_ids[h.recv_expert_N[sel]], gid), "pair arrived with the wrong expert"
    assert_bitwise_equal(h.recv_weight_N[sel], routing_all.weights_TK[rows, slot].float(), what="weights")
    # arrival order: (source rank, token, slot) within each expert, grouped stably
    key = (h.recv_expert_N[sel] * 10**6 + rows * 16 + slot) if valid is not None else (src * 10**6 + tok * 16 + slot)
    assert torch.equal(key, torch.sort(key).values), "rows not in (source, token, slot) order"
    return rows


class _Soft:
    """Collects failed checks so a rank keeps joining the collectives that follow (one rank
    stopping early would leave its peers waiting and misalign every later check)."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def check(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except AssertionError as exc:
            self.errors.append(str(exc) or traceback.format_exc())
            return None

    def done(self) -> None:
        if self.errors:
            raise AssertionError("\n".join(self.errors))


def _exactly_once(soft, counter, ep, p, rank, offs, routing_all, E, K):
    """Count the pairs each rank's experts computed (decoded from the payload) and all-reduce."""
    counts = soft.check(_count_computed, counter.calls, getattr(ep.last_handle, "recv_valid_N", None),
                        torch.tensor(p.experts_of(rank), dtype=torch.long), offs, routing_all.ids_TK, K,
                        ep.source.expert_shift)
    if counts is None:  # still join the collective
        counts = torch.full(routing_all.ids_TK.shape, -(10**6), dtype=torch.int64)
    _all_reduce(counts)
    want = (routing_all.ids_TK.long() < E).long()
    soft.check(lambda: None if torch.equal(counts, want) else (_ for _ in ()).throw(
        AssertionError(f"pairs not computed exactly once: {int((counts != want).sum())} pairs off")))


def _run_a2a(rank, W, *, Ts, E=8, K=2, Z=0, shared=False, impl="reference", placement=None, static=None,
             skew_rank=None, score_fn="softmax", weight_on_input=False, bitwise=True, seed=0):
    soft = _Soft()
    p = as_placement(placement if placement is not None else contiguous_ranges(E, W))
    skew = p.experts_of(skew_rank) if skew_rank is not None else ()
    layer = _build(E=E, K=K, Z=Z, shared=shared, impl=impl, score_fn=score_fn, weight_on_input=weight_on_input,
                   skew_experts=skew, seed=seed)
    H = layer.config.hidden_size
    xs = [_tokens(seed, r, Ts[r], H) for r in range(W)]
    x_all = torch.cat(xs)
    offs = torch.tensor([sum(Ts[:r]) for r in range(W)])
    with torch.no_grad():
        ref_all = layer(x_all)
        routing_all = layer.route(x_all)
    counter = CountingImpl(get_impl(impl))
    ep = shard_layer(layer, group=dist.group.WORLD, mode="all_to_all", placement=placement,
                     static_tokens=static, timeout_s=CASE_TIMEOUT_S, experts_impl=counter)
    with torch.no_grad():
        out = ep(xs[rank])
    ref = ref_all[offs[rank]: offs[rank] + Ts[rank]]
    if bitwise:
        soft.check(assert_bitwise_equal, out, ref, what=f"rank {rank} EP output vs single process")
    else:
        soft.check(assert_close, out, ref, **TOL, what=f"rank {rank} EP output vs single process")
    h = ep.last_handle
    soft.check(_check_payload, h, rank, p, offs, routing_all, E)
    # every (token, expert) pair computed exactly once across ranks
    if not weight_on_input:  # (scaled inputs cannot be decoded)
        _exactly_once(soft, counter, ep, p, rank, offs, routing_all, E, K)
    # counts exchange: pairs from each source equal what the global routing says
    if static is None:
        dest_all = p.rank_of_E[routing_all.ids_TK.long().clamp(max=E - 1)]
        dest_all[routing_all.ids_TK.long() >= E] = -1
        want = [int((dest_all[offs[s]: offs[s] + Ts[s]] == rank).sum()) for s in range(W)]
        if list(h.recv_pair_splits) != want:
            soft.errors.append(f"recv splits {h.recv_pair_splits} != {want}")
    soft.done()
    return ep, routing_all


def _run_ar(rank, W, *, T, E=8, K=2, Z=0, shared=False, impl="reference", placement=None, static=None, seed=0):
    soft = _Soft()
    p = as_placement(placement if placement is not None else contiguous_ranges(E, W))
    layer = _build(E=E, K=K, Z=Z, shared=shared, impl=impl, seed=seed)
    H = layer.config.hidden_size
    Ts = [T // W + (1 if r < T % W else 0) for r in range(W)]
    x_all = torch.cat([_tokens(seed, r, Ts[r], H) for r in range(W)])
    offs = torch.tensor([sum(Ts[:r]) for r in range(W)])
    with torch.no_grad():
        ref_all = layer(x_all)
        routing_all = layer.route(x_all)
    counter = CountingImpl(get_impl(impl))
    ep = shard_layer(layer, group=dist.group.WORLD, mode="all_reduce", placement=placement,
                     static_tokens=static, timeout_s=CASE_TIMEOUT_S, experts_impl=counter)
    with torch.no_grad():
        out = ep(x_all)
    soft.check(assert_close, out, ref_all, **TOL, what=f"rank {rank} all_reduce EP output vs single process")
    _exactly_once(soft, counter, ep, p, rank, offs, routing_all, E, K)
    soft.done()


# ---------------------------------------------------------------------------- the checks


def _case_basic(rank, W):
    _run_a2a(rank, W, Ts=[5, 7, 3, 6][:W])


def _case_skew(rank, W):
    ep, _ = _run_a2a(rank, W, Ts=[6] * W, skew_rank=W - 1, seed=1)
    st = ep.token_stats()
    if rank == W - 1:
        assert st["received"] == 6 * 2 * (W - 1) and st["local"] == 12, st
    else:
        assert st["received"] == 0 and st["local"] == 0 and st["sent"] == 12, st


def _case_zero_tokens(rank, W):
    _run_a2a(rank, W, Ts=[0, 3] if W == 2 else [0, 4, 1, 0], seed=2)


def _case_t1(rank, W):
    _run_a2a(rank, W, Ts=[1] * W, seed=3)


def _case_map(rank, W):
    # E = 6 does not split over 4; rank 2 of 4 owns no expert at all
    owner = [1, 0, 1, 0, 0, 1] if W == 2 else [0, 1, 3, 0, 1, 3]
    _run_a2a(rank, W, Ts=[4, 6, 5, 2][:W], E=6, K=2, placement=owner, seed=4)


def _case_ranges_uneven(rank, W):
    ranges = [(0, 5), (5, 7)] if W == 2 else [(0, 1), (1, 4), (4, 4), (4, 7)]
    _run_a2a(rank, W, Ts=[5, 4, 3, 6][:W], E=7, K=3, placement=ranges, seed=5)


def _case_shared_zero(rank, W):
    _run_a2a(rank, W, Ts=[5, 7, 2, 4][:W], Z=2, K=3, shared="rowwise", seed=6)


def _case_shared_linear(rank, W):
    _run_a2a(rank, W, Ts=[5, 7, 2, 4][:W], Z=1, K=2, shared="linear", bitwise=False, seed=14)


def _case_static(rank, W):
    _run_a2a(rank, W, Ts=[5, 8, 0, 3][:W], Z=2, K=3, shared="rowwise", static=8, seed=7)


def _case_static_skew(rank, W):
    _run_a2a(rank, W, Ts=[4, 1, 3, 4][:W], static=4, skew_rank=0, seed=8)


def _case_grouped(rank, W):
    _run_a2a(rank, W, Ts=[9, 4, 6, 5][:W], impl="grouped", bitwise=False, seed=9)


def _case_weight_on_input(rank, W):
    _run_a2a(rank, W, Ts=[5, 3, 4, 2][:W], K=1, score_fn="topk_sigmoid", weight_on_input=True, shared="rowwise",
             seed=10)


def _case_ar(rank, W):
    _run_ar(rank, W, T=11, Z=2, K=3, shared="linear", seed=11)


def _case_ar_static_map(rank, W):
    owner = [1, 0, 1, 0, 0, 1] if W == 2 else [0, 1, 3, 0, 1, 3]
    _run_ar(rank, W, T=6, E=6, placement=owner, static=6, seed=12)


def _case_mismatch(rank, W):
    if W == 2:
        kw = dict(K=3 if rank == 1 else 2, dtype=torch.float64 if rank == 1 else torch.float32)
        want = ["top_k(K) per rank = [2, 3]", "dtype per rank = ['torch.float32', 'torch.float64']"]
    else:
        kw = dict(H=32 if rank == 2 else 24, E=12 if rank == 3 else 8)
        want = ["num_experts(E) per rank = [8, 8, 8, 12]", "hidden_size(H) per rank = [24, 24, 32, 24]"]
    layer = _build(**kw)
    with pytest.raises(EPConfigMismatch) as info:
        shard_layer(layer, group=dist.group.WORLD, mode="all_to_all", timeout_s=CASE_TIMEOUT_S)
    for w in want:
        assert w in str(info.value), str(info.value)


def _case_bad_placement(rank, W):
    layer = _build(E=6)
    if W == 4:
        with pytest.raises(ValueError, match="world_size=4 does not divide num_experts=6"):
            shard_layer(layer, group=dist.group.WORLD, mode="all_to_all")
    with pytest.raises(ValueError, match="expert 5 is not placed"):
        shard_layer(layer, group=dist.group.WORLD, placement=[(0, 3), (3, 5)] + [(5, 5)] * (W - 2))
    with pytest.raises(ValueError, match="built for world_size=3"):
        shard_layer(layer, group=dist.group.WORLD, placement=[(0, 2), (2, 4), (4, 6)])
    with pytest.raises(ValueError, match="mode='tensor'"):
        shard_layer(layer, group=dist.group.WORLD, mode="tensor")
    with pytest.raises(ValueError, match="group=None"):
        shard_layer(layer, group=None)


def _case_world_of_one(rank, W):
    """EP over a one-rank subgroup: the rank owns every expert (static: a zero spare expert)."""
    groups = [dist.new_group([r]) for r in range(W)]  # collective: every rank creates every group
    layer = _build(Z=1, K=3, shared="rowwise", seed=15)
    x = _tokens(15, rank, 5, layer.config.hidden_size)
    with torch.no_grad():
        ref = layer(x)
        for static in (None, 5, 8):
            for mode in ("all_to_all", "all_reduce"):
                ep = shard_layer(layer, group=groups[rank], mode=mode, static_tokens=static,
                                 timeout_s=CASE_TIMEOUT_S, experts_impl="reference")
                assert ep.dispatcher.world_size == 1 and len(ep.dispatcher.local_ids) == 8
                out = ep(x)
                if mode == "all_to_all":
                    assert_bitwise_equal(out, ref, what=f"W=1 {mode} static={static}")
                else:
                    assert_close(out, ref, **TOL, what=f"W=1 {mode} static={static}")


def _hf_quiet() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _generate(model, ids_BS: torch.Tensor, n: int = 6) -> torch.Tensor:
    # min = max new tokens: every rank runs the same number of forwards (collectives per step)
    return model.generate(ids_BS, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)


def _whole_model(rank, W, family, mode):
    """A tiny transformers model patched with ep_group generates the unsharded model's tokens."""
    import moeflow
    from moeflow import hf as mhf

    _hf_quiet()
    from hf_configs import tiny_model

    model = tiny_model(family, seed=3)
    # all_to_all: each rank its own prompts (different lengths: uneven T); all_reduce: the same.
    r = rank if mode == "all_to_all" else 0
    ids = torch.randint(3, 97, (2, 5 + r), generator=torch.Generator().manual_seed(20 + r))
    with torch.no_grad():
        want = _generate(model, ids)
        want_logits = model(ids).logits
    report = moeflow.patch_model(model, experts="reference", ep_group=dist.group.WORLD, ep_mode=mode)
    assert report.ep_mode == mode and all(b.dispatcher == mode for b in report.blocks), report
    with torch.no_grad():
        got = _generate(model, ids)
        got_logits = model(ids).logits
    assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5 * float(want_logits.abs().max()),
                 what=f"{family} {mode} logits")
    assert torch.equal(got, want), f"{family} {mode}: generated {got.tolist()} != unsharded {want.tolist()}"
    mhf.unpatch_model(model)


def _whole_model_offload(rank, W, family, mode, policy):
    """EP and offload together through patch_model: each rank caches only its local experts."""
    import moeflow
    from moeflow import hf as mhf
    from moeflow.offload.config import OffloadConfig

    _hf_quiet()
    from hf_configs import tiny_model

    model = tiny_model(family, seed=4)
    r = rank if mode == "all_to_all" else 0
    ids = torch.randint(3, 97, (2, 4 + r), generator=torch.Generator().manual_seed(30 + r))
    with torch.no_grad():
        want = _generate(model, ids)
        want_logits = model(ids).logits
    off = OffloadConfig(gpu_slots=2, policy=policy, prefetch_width=2, prefetch_rule="always", device="cpu")
    report = moeflow.patch_model(model, experts="reference", ep_group=dist.group.WORLD, ep_mode=mode, offload=off,
                                 ep_options={"timeout_s": CASE_TIMEOUT_S})
    assert report.offload and all(b.dispatcher == mode for b in report.blocks), report
    layers = mhf.moe_layers(model)
    rt = layers[0].offload
    assert rt is not None and rt.store.num_experts == [len(m.dispatcher.local_ids) for m in layers], \
        "the rank's cache must hold only its local experts"
    with torch.no_grad():
        got = _generate(model, ids)
        got_logits = model(ids).logits
    assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5 * float(want_logits.abs().max()),
                 what=f"{family} {mode} {policy} EP+offload logits")
    assert torch.equal(got, want), f"{family} {mode} {policy}: EP+offload generated {got.tolist()} != {want.tolist()}"
    s = rt.stats()
    rt.cache.table.check_invariants()
    # A rank may own no expert its group-limited routing picks; across ranks the caches served.
    served = torch.tensor([s.hits + s.misses], dtype=torch.int64)
    _all_reduce(served)
    assert int(served) > 0, "no rank's cache served a lookup"


def _layer_chain_offload(rank, W, policy, Ts):
    """Three sharded + offloaded layers (reference experts, all_to_all) run a residual chain over
    several steps: each rank's output is BIT-identical to the single-process resident layers."""
    from moeflow.offload.attach import attach_offload
    from moeflow.offload.config import OffloadConfig

    E = 16
    ref_layers = [_build(E=E, K=2, shared="rowwise", seed=40 + i) for i in range(3)]
    for i, m in enumerate(ref_layers):
        m.layer_idx = i
    sharded = [shard_layer(m, group=dist.group.WORLD, mode="all_to_all", timeout_s=CASE_TIMEOUT_S)
               for m in ref_layers]
    rt = attach_offload(sharded, OffloadConfig(gpu_slots=2, policy=policy, prefetch_width=2,
                                               prefetch_rule="always", device="cpu"),
                        release=False, progress=False)
    assert rt.store.num_experts == [E // W] * 3
    H = ref_layers[0].config.hidden_size
    offs = [sum(Ts[:r]) for r in range(W)]
    with torch.no_grad():
        for step in range(4):
            xs = [_tokens(50 + step, r, Ts[r], H) for r in range(W)]
            x_all = torch.cat(xs)
            x_me = xs[rank]
            for ref, ep in zip(ref_layers, sharded):
                x_all = x_all + ref(x_all)
                x_me = x_me + ep(x_me)
            assert_bitwise_equal(x_me, x_all[offs[rank]: offs[rank] + Ts[rank]],
                                 what=f"rank {rank} step {step} {policy} EP+offload chain")
    s = rt.stats()
    rt.cache.table.check_invariants()
    assert s.misses > 0, "2 slots for 16/W local experts: the cache must miss"


def _case_ep_offload(rank, W):
    _layer_chain_offload(rank, W, "lru", [5, 2, 7, 1][:W])
    _layer_chain_offload(rank, W, "predictive", [3, 6, 0, 4][:W])
    _whole_model_offload(rank, W, "mixtral", "all_to_all", "predictive")
    _whole_model_offload(rank, W, "deepseek_v3", "all_to_all", "lru")
    _whole_model_offload(rank, W, "deepseek_v3", "all_reduce", "predictive")


def _case_all_reduce_misuse(rank, W):
    """all_reduce needs the same tokens on every rank: a named error on every rank, never a wrong sum
    or a backend abort."""
    from moeflow.parallel.dist_utils import EPInputMismatch

    layer = _build(seed=16)
    ep = shard_layer(layer, group=dist.group.WORLD, mode="all_reduce", timeout_s=CASE_TIMEOUT_S)
    H = layer.config.hidden_size
    with torch.no_grad():
        same = _tokens(16, 0, 4, H)
        ep(same)  # the same tokens: fine
        with pytest.raises(EPInputMismatch, match="same T but different tokens"):
            ep(_tokens(16, rank, 4, H))  # same T, different tokens
        with pytest.raises(EPInputMismatch, match=r"T per rank = \["):
            ep(_tokens(16, 0, 3 + rank, H))  # different T
        out = ep(same)  # the group is still in step after a refused call
    with torch.no_grad():
        assert_close(out, layer(same), **TOL, what="all_reduce after refused calls")


def _case_load_ds_v4(rank, W, ckpt_dir):
    """DeepSeek-V4 EP layer from a checkpoint keeps the shared expert's SwiGLU clamp."""
    import moeflow
    from moeflow import hf as mhf
    from moeflow.parallel.ep import load_ep_layer

    _hf_quiet()
    from hf_configs import tiny_model

    model = tiny_model("deepseek_v4", seed=6)
    sub = os.path.join(ckpt_dir, "dsv4")
    if rank == 0:
        model.save_pretrained(sub)
    _all_reduce(torch.zeros(1))
    moeflow.patch_model(model, experts="reference")
    layer = mhf.moe_layers(model)[1]  # layer 1: learned routing (layer 0 is hash-routed)
    placement = None if W == 2 else [(0, 2), (2, 3), (3, 5), (5, 6)]
    ep = load_ep_layer(sub, "deepseek_v4", 1, config=layer.config, group=dist.group.WORLD, placement=placement,
                       experts_impl="reference", timeout_s=CASE_TIMEOUT_S)
    assert ep.shared_expert.swiglu_limit == layer.config.swiglu_limit, "the shared expert lost its clamp"
    Ts = [4, 2, 5, 3][:W]
    H = layer.config.hidden_size
    xs = [_tokens(6, r, Ts[r], H) * 8.0 for r in range(W)]  # large inputs: the clamp is active
    with torch.no_grad():
        ref = layer(torch.cat(xs))[sum(Ts[:rank]): sum(Ts[: rank + 1])]
        out = ep(xs[rank])
    assert_close(out, ref, **TOL, what="DS-V4 load_ep_layer output vs single process")


def _case_quantized_experts(rank, W):
    """A rank holds its experts' FP8 bytes (data + block scales) and computes bit-identically."""
    from moeflow.quant.experts import quantize_experts
    from moeflow.quant.spec import fp8_block_spec

    base = _build(seed=17)
    qw = quantize_experts(base.expert_weights, fp8_block_spec((8, 8)))  # 12 = 8 + a partial block
    layer = MoELayer(base.config, router=base.router_weights, experts=qw, experts_impl="reference")
    Ts = [4, 6, 1, 3][:W]
    xs = [_tokens(17, r, Ts[r], base.config.hidden_size) for r in range(W)]
    with torch.no_grad():
        ref = layer(torch.cat(xs))[sum(Ts[:rank]): sum(Ts[: rank + 1])]
        ep = shard_layer(layer, group=dist.group.WORLD, mode="all_to_all", timeout_s=CASE_TIMEOUT_S)
        out = ep(xs[rank])
    w = ep.source.weights
    assert w.quant is not None and w.gate_up.dtype == torch.float8_e4m3fn and w.gate_up.shape[0] == 8 // W
    assert w.gate_up_scale is not None and w.gate_up_scale.shape[0] == 8 // W
    assert_bitwise_equal(out, ref, what=f"rank {rank} FP8 EP vs single process")


def _case_whole_model(rank, W):
    _whole_model(rank, W, "mixtral", "all_to_all")
    _whole_model(rank, W, "deepseek_v3", "all_to_all")  # shared expert, grouped routing
    _whole_model(rank, W, "deepseek_v3", "all_reduce")
    if W == 2:
        _whole_model(rank, W, "longcat_flash", "all_to_all")  # zero experts (E = 6: 2 ranks only)


def _case_load_local(rank, W, ckpt_dir):
    """load_ep_layer reads only this rank's experts; output matches the single-process layer."""
    import moeflow
    from moeflow import hf as mhf
    from moeflow.parallel.ep import load_ep_layer

    _hf_quiet()
    from hf_configs import tiny_model

    model = tiny_model("deepseek_v3", seed=5)
    if rank == 0:
        model.save_pretrained(ckpt_dir)
    _all_reduce(torch.zeros(1))  # the checkpoint is on disk before anyone reads it
    moeflow.patch_model(model, experts="reference")
    layer = mhf.moe_layers(model)[0]  # deepseek_v3 tiny: layer 1 is the MoE one
    ep = load_ep_layer(ckpt_dir, "deepseek_v3", layer.layer_idx, config=layer.config, group=dist.group.WORLD,
                       experts_impl="reference", timeout_s=CASE_TIMEOUT_S)
    L = len(ep.dispatcher.local_ids)
    assert ep.source.weights.gate_up.shape[0] == L == 8 // W, "more than the local experts were loaded"
    held = [t for t in [*ep.parameters(), *ep.buffers()] if t.dim() == 3]
    assert held and all(t.shape[0] == L for t in held), "full expert tensors were materialised"
    Ts = [3, 6, 1, 4][:W]
    xs = [_tokens(5, r, Ts[r], layer.config.hidden_size) for r in range(W)]
    with torch.no_grad():
        ref = layer(torch.cat(xs))[sum(Ts[:rank]): sum(Ts[: rank + 1])]
        out = ep(xs[rank])
    # the loaded shared expert is moeflow's SwiGLU module, not the HF MLP object: within rounding
    assert_close(out, ref, **TOL, what="load_ep_layer output vs single process")


CASES = [
    ("basic_uneven_T", _case_basic),
    ("skewed_one_rank_gets_all", _case_skew),
    ("rank_with_zero_tokens", _case_zero_tokens),
    ("T1", _case_t1),
    ("explicit_map", _case_map),
    ("uneven_ranges", _case_ranges_uneven),
    ("shared_and_zero_experts", _case_shared_zero),
    ("shared_linear_tolerance", _case_shared_linear),
    ("static_decode", _case_static),
    ("static_decode_skewed", _case_static_skew),
    ("grouped_impl", _case_grouped),
    ("weight_on_input", _case_weight_on_input),
    ("all_reduce", _case_ar),
    ("all_reduce_static_map", _case_ar_static_map),
    ("config_mismatch", _case_mismatch),
    ("bad_placement", _case_bad_placement),
    ("world_of_one_subgroup", _case_world_of_one),
    ("whole_model_generate", _case_whole_model),
    ("ep_with_offload", _case_ep_offload),
    ("quantized_experts", _case_quantized_experts),
    ("all_reduce_misuse_named_error", _case_all_reduce_misuse),
    ("load_local_experts", None),  # needs the checkpoint directory: see _worker
    ("load_deepseek_v4_clamp", None),
]


def _timeout_case(rank, done) -> str:
    """Rank 1 stalls; rank 0 must fail within the timeout, naming the collective, and then refuse
    every later call (EPGroupBroken) instead of pairing with a stale collective. When rank 1
    resumes, it too gets a named error within its timeout and then EPGroupBroken: no abort."""
    from moeflow.parallel.dist_utils import EPGroupBroken

    layer = _build(seed=13)
    ep = shard_layer(layer, group=dist.group.WORLD, mode="all_to_all", timeout_s=TIMEOUT_S)
    x = _tokens(13, rank, 3, 24)
    if rank == 1:
        done.wait(60)  # rank 0 has timed out and been refused
        t0 = time.monotonic()
        try:
            with torch.no_grad():
                ep(x)
        except EPCollectiveError as exc:
            if time.monotonic() - t0 > TIMEOUT_S + 6:
                return f"resumed rank: error after {time.monotonic() - t0:.1f}s"
            if isinstance(exc, EPGroupBroken):
                return f"resumed rank: refused before any collective failed here: {exc}"
        else:
            return "resumed rank: no error although rank 0 left the group"
        try:
            with torch.no_grad():
                ep(x)
        except EPGroupBroken:
            return "ok"
        return "resumed rank: a second call after a failed collective was not refused"
    t0 = time.monotonic()
    try:
        try:
            with torch.no_grad():
                ep(x)
        except EPCollectiveError as exc:
            dt = time.monotonic() - t0
            msg = str(exc)
            if "all_to_all_single(counts)" not in msg or "timeout 4s" not in msg:
                return f"error does not name the collective/timeout: {msg}"
            if not TIMEOUT_S - 0.5 <= dt <= TIMEOUT_S + 6:
                return f"timed out after {dt:.1f}s, expected ~{TIMEOUT_S}s"
        else:
            return "no error raised although rank 1 never joined"
        t1 = time.monotonic()
        try:
            with torch.no_grad():
                ep(x)
        except EPGroupBroken as exc:
            if time.monotonic() - t1 > 1.0 or "failed earlier" not in str(exc):
                return f"the refusal was slow or unnamed: {exc}"
            return "ok"
        return "a call after the timeout was not refused"
    finally:
        done.set()


def _worker(rank, W, port, q, done, names, ckpt_dir):
    torch.set_num_threads(1)
    results = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=W,
                                timeout=datetime.timedelta(seconds=60))
        for name, fn in CASES:
            if names is not None and name not in names:
                continue
            try:
                if name == "load_local_experts":
                    _case_load_local(rank, W, ckpt_dir)
                elif name == "load_deepseek_v4_clamp":
                    _case_load_ds_v4(rank, W, ckpt_dir)
                else:
                    fn(rank, W)
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc()
        if W == 2 and (names is None or "hung_rank_timeout" in names):
            try:
                results["hung_rank_timeout"] = _timeout_case(rank, done)
            except Exception:
                results["hung_rank_timeout"] = traceback.format_exc()
    except Exception:
        results["_setup"] = traceback.format_exc()
    report_and_exit(q, rank, results)


_RESULTS: dict[int, dict[int, dict[str, str]]] = {}


def _spawn(W: int, names: tuple[str, ...] | None = None) -> dict[int, dict[str, str]]:
    """Run the checks (all, or `names`) on W gloo ranks; {rank: {check: "ok" | traceback}}."""
    if names is None and W in _RESULTS:
        return _RESULTS[W]
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    port = free_port()
    ckpt_dir = tempfile.mkdtemp(prefix=f"moeflow_ep{W}_")
    procs = [ctx.Process(target=_worker, args=(r, W, port, q, done, names, ckpt_dir), daemon=True)
             for r in range(W)]
    out = gather_ranks(procs, q, 150.0)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    if names is None:
        _RESULTS[W] = out
    return out


# The hung-rank check runs once, with 2 ranks (it costs a timeout).
_PARAMS = [(W, name) for W in (2, 4) for name, _ in CASES] + [(2, "hung_rank_timeout")]


@pytest.mark.parametrize(("W", "case"), _PARAMS)
def test_ep_gloo(W, case):
    res = _spawn(W)
    assert len(res) == W, f"only ranks {sorted(res)} of {W} reported (a worker crashed or hung)"
    for rank in range(W):
        assert "_setup" not in res[rank], res[rank]["_setup"]
        got = res[rank].get(case, "missing")
        assert got == "ok", f"rank {rank}:\n{got}"
