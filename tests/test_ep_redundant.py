"""Redundant expert copies under expert parallelism: 2 and 4 spawned gloo ranks against one process.

Legend: W ranks, T_r tokens on rank r, E logical experts, R redundant copies, Q = E + R physical
experts, K picks, H hidden.

Replicas are exact copies, so a pair computed on any copy gives the same row as long as the
experts impl gives a row the same bits whatever other rows share its GEMM (batch invariance).
Copies split an expert's rows into smaller GEMMs, so: all_to_all (dynamic and static) with a
batch-invariant experts impl (`RowwiseExperts`: the reference experts one row at a time) is
compared BIT FOR BIT with the single-process layer run on all ranks' tokens in rank order; with
the `reference` experts themselves (CPU BLAS picks kernels by row count) and in all_reduce mode
(cross-rank sum order): rtol = 1e-6, atol = 1e-6 * max |expected| in fp32. Whole models: greedy
tokens equal, logits within rtol = atol/max|logits| = 1e-5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ep_spawn import check_case
from test_ep_dist import _build, _generate, _hf_quiet, _tokens

from moeflow.experts.select import get_impl
from moeflow.layer import MoELayer
from moeflow.parallel import EPPlacementError, expert_load, plan_placement
from moeflow.parallel.ep import shard_layer
from moeflow.parallel.plan import Placement
from moeflow.testing import assert_bitwise_equal, assert_close

TIMEOUT_S = 10.0
HOT = (1, 2)  # experts a large router bias makes every token pick


class RowwiseExperts:
    """The reference experts computing one row per call: a row's bits never depend on its batch."""

    name = "rowwise_reference"

    def __init__(self) -> None:
        self.inner = get_impl("reference")

    def supports(self, config):
        return self.inner.supports(config)

    def forward_pairs(self, x_NH, expert_N, w, config):
        if x_NH.shape[0] == 0:
            return self.inner.forward_pairs(x_NH, expert_N, w, config)
        return torch.cat([self.inner.forward_pairs(x_NH[n: n + 1], expert_N[n: n + 1], w, config)
                          for n in range(x_NH.shape[0])])


def _hot_placement(E: int, W: int) -> Placement:
    """EPLB's placement for a load on the HOT experts only: they get every redundant copy (R = W)."""
    load = torch.ones(1, E, dtype=torch.int64)
    load[0, list(HOT)] = 1000
    return plan_placement(load, W, redundant_experts=W).layers[0]


def _ref_rows(layer, xs, rank):
    Ts = [int(x.shape[0]) for x in xs]
    with torch.no_grad():
        return layer(torch.cat(xs))[sum(Ts[:rank]): sum(Ts[: rank + 1])]


def _rel_tol(ref: torch.Tensor) -> dict:
    return dict(rtol=1e-6, atol=1e-6 * max(1.0, float(ref.abs().max())) if ref.numel() else 1e-6)


def _case_a2a_copies_bitwise(rank, W):
    """Hot experts with a copy on every rank, uneven T (one rank with none): the same bits as one
    process (batch-invariant experts; the reference ones within 1e-6), and each hot expert's rows
    spread over its copies (per copy within W of each other)."""
    for Ts, skew in (([3, 0, 7, 1][:W], HOT), ([5, 2, 0, 4][:W], ())):
        layer = _build(E=8, K=2, shared="rowwise", skew_experts=skew, seed=21, impl=RowwiseExperts())
        p = _hot_placement(8, W)
        ep = shard_layer(layer, group=dist.group.WORLD, mode="all_to_all", placement=p, redundant_experts=W,
                         timeout_s=TIMEOUT_S)
        assert ep.dispatcher.local_ids == p.experts_of(rank)
        assert ep.source.weights.gate_up.shape[0] == p.num_local(rank)
        xs = [_tokens(21, r, Ts[r], 24) for r in range(W)]
        with torch.no_grad():
            out = ep(xs[rank])
        ref = _ref_rows(layer, xs, rank)
        assert_bitwise_equal(out, ref, what=f"rank {rank} a2a with copies, T={Ts}")
        ep_ref = shard_layer(layer, group=dist.group.WORLD, placement=p, experts_impl="reference", timeout_s=TIMEOUT_S)
        with torch.no_grad():
            out_ref = ep_ref(xs[rank])
        assert_close(out_ref, ref, **_rel_tol(ref), what=f"rank {rank} a2a with copies, reference experts")
        if skew:
            rows = torch.zeros(p.num_physical, dtype=torch.int64)
            mine = torch.tensor(p.physical_of(rank), dtype=torch.int64)
            rows[mine] = torch.bincount(ep.last_handle.recv_expert_N, minlength=len(mine))[: len(mine)]
            dist.all_reduce(rows)
            for e in HOT:
                per_copy = rows[p.copies_EM[e, : int(p.num_copies_E[e])]]
                assert int(per_copy.sum()) == sum(Ts)
                assert int(per_copy.max() - per_copy.min()) <= W, f"expert {e}: rows per copy {per_copy.tolist()}"
                assert bool((per_copy > 0).all()) or sum(Ts) < len(per_copy), per_copy.tolist()


def _case_static_and_all_reduce(rank, W):
    layer = _build(E=8, K=2, shared="rowwise", skew_experts=HOT, seed=22, impl=RowwiseExperts())
    Ts = [4, 1, 6, 0][:W]
    xs = [_tokens(22, r, Ts[r], 24) for r in range(W)]
    ep = shard_layer(layer, group=dist.group.WORLD, mode="all_to_all", static_tokens=8, redundant_experts=W,
                     timeout_s=TIMEOUT_S)
    with torch.no_grad():
        out = ep(xs[rank])
    assert_bitwise_equal(out, _ref_rows(layer, xs, rank), what=f"rank {rank} static decode with copies")
    ar = shard_layer(layer, group=dist.group.WORLD, mode="all_reduce", placement=_hot_placement(8, W),
                     timeout_s=TIMEOUT_S)
    x = _tokens(22, 0, 9, 24)
    for static in (None, 4):
        ar_s = ar if static is None else shard_layer(layer, group=dist.group.WORLD, mode="all_reduce",
                                                     placement=_hot_placement(8, W), static_tokens=static,
                                                     timeout_s=TIMEOUT_S)
        with torch.no_grad():
            got, ref = ar_s(x), layer(x)
        assert_close(got, ref, **_rel_tol(ref), what=f"all_reduce with copies (static={static})")


def _case_named_errors(rank, W):
    layer = _build(E=8, K=2, seed=23)
    with pytest.raises(EPPlacementError, match=r"E \+ R = 8 \+ 3 = 11 physical experts do not split evenly"):
        shard_layer(layer, group=dist.group.WORLD, redundant_experts=3)
    with pytest.raises(EPPlacementError, match="R=0; expected them to agree"):
        shard_layer(layer, group=dist.group.WORLD, placement=Placement.contiguous(8, W), redundant_experts=W)
    with pytest.raises(EPPlacementError, match="redundant_experts=-1"):
        shard_layer(layer, group=dist.group.WORLD, redundant_experts=-1)


def _case_quantized_copies(rank, W):
    """FP8 experts (data + block scales) with copies: each rank holds its copies' stored bytes."""
    from moeflow.quant.experts import quantize_experts
    from moeflow.quant.spec import fp8_block_spec

    base = _build(E=8, K=2, skew_experts=HOT, seed=24)
    qw = quantize_experts(base.expert_weights, fp8_block_spec((8, 8)))
    layer = MoELayer(base.config, router=base.router_weights, experts=qw, experts_impl=RowwiseExperts())
    Ts = [2, 5, 3, 1][:W]
    xs = [_tokens(24, r, Ts[r], 24) for r in range(W)]
    p = _hot_placement(8, W)
    ep = shard_layer(layer, group=dist.group.WORLD, placement=p, timeout_s=TIMEOUT_S)
    w = ep.source.weights
    assert w.gate_up.dtype == torch.float8_e4m3fn and w.gate_up.shape[0] == p.num_local(rank)
    assert torch.equal(w.gate_up_scale, qw.gate_up_scale[list(p.experts_of(rank))])
    with torch.no_grad():
        out = ep(xs[rank])
    assert_bitwise_equal(out, _ref_rows(layer, xs, rank), what=f"rank {rank} FP8 with copies")


def _case_offload_copies(rank, W):
    """Three layers with copies, offloaded: each rank's store holds its physical experts; bitwise."""
    from moeflow.offload.attach import attach_offload
    from moeflow.offload.config import OffloadConfig

    refs = [_build(E=8, K=2, shared="rowwise", skew_experts=HOT if i == 1 else (), seed=30 + i,
                   impl=RowwiseExperts()) for i in range(3)]
    for i, m in enumerate(refs):
        m.layer_idx = i
    eps = [shard_layer(m, group=dist.group.WORLD, redundant_experts=W, timeout_s=TIMEOUT_S) for m in refs]
    rt = attach_offload(eps, OffloadConfig(gpu_slots=2, policy="lru", prefetch_width=2, device="cpu"),
                        release=False, progress=False)
    assert rt.store.num_experts == [(8 + W) // W] * 3
    Ts = [3, 5, 0, 2][:W]
    offs = sum(Ts[:rank])
    with torch.no_grad():
        for step in range(3):
            xs = [_tokens(60 + step, r, Ts[r], 24) for r in range(W)]
            x_all, x_me = torch.cat(xs), xs[rank]
            for ref, ep in zip(refs, eps):
                x_all = x_all + ref(x_all)
                x_me = x_me + ep(x_me)
            assert_bitwise_equal(x_me, x_all[offs: offs + Ts[rank]], what=f"rank {rank} step {step} offload+copies")


def _case_load_counts(rank, W):
    """expert_load counts on the device per rank; reduce=True sums the group (all_reduce mode once)."""
    a2a = [shard_layer(_build(E=8, K=2, seed=40 + i), group=dist.group.WORLD, redundant_experts=W,
                       timeout_s=TIMEOUT_S) for i in range(2)]
    ar = shard_layer(_build(E=8, K=2, seed=42), group=dist.group.WORLD, mode="all_reduce", timeout_s=TIMEOUT_S)
    layers = [*a2a, ar]
    want = torch.zeros(3, 8, dtype=torch.int64)
    Ts = [4, 0, 3, 6][:W]
    with torch.no_grad():
        for step in range(2):
            xs = [_tokens(70 + step, r, Ts[r], 24) for r in range(W)]
            x_ar = _tokens(80 + step, 0, 5, 24)
            for i, m in enumerate(a2a):
                m(xs[rank])
                ref = _build(E=8, K=2, seed=40 + i)
                ref(torch.cat(xs))
                want[i] += torch.bincount(ref.last_routing.ids_TK.reshape(-1), minlength=8)
            ar(x_ar)
            ref = _build(E=8, K=2, seed=42)
            ref(x_ar)
            want[2] += torch.bincount(ref.last_routing.ids_TK.reshape(-1), minlength=8)
    got = expert_load(layers, reduce=True, reset=True)
    assert torch.equal(got, want), f"{got.tolist()} != {want.tolist()}"
    assert int(expert_load(layers).sum()) == 0, "reset=True left counts"


def _whole_model(rank, W, family, mode, R):
    from hf_configs import tiny_model

    import moeflow
    from moeflow import hf as mhf

    _hf_quiet()
    model = tiny_model(family, seed=3)
    r = rank if mode == "all_to_all" else 0
    ids = torch.randint(3, 97, (2, 5 + r), generator=torch.Generator().manual_seed(20 + r))
    with torch.no_grad():
        want, want_logits = _generate(model, ids), model(ids).logits
    moeflow.patch_model(model, experts="reference", ep_group=dist.group.WORLD, ep_mode=mode,
                        ep_options={"redundant_experts": R, "timeout_s": TIMEOUT_S})
    layers = mhf.moe_layers(model)
    assert all(m.dispatcher.placement.num_redundant == R for m in layers)
    with torch.no_grad():
        got, got_logits = _generate(model, ids), model(ids).logits
    assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5 * float(want_logits.abs().max()),
                 what=f"{family} {mode} R={R} logits")
    assert torch.equal(got, want), f"{family} {mode} R={R}: {got.tolist()} != {want.tolist()}"
    mhf.unpatch_model(model)


def _case_whole_model(rank, W):
    _whole_model(rank, W, "mixtral", "all_to_all", W)  # E = 4
    _whole_model(rank, W, "deepseek_v3", "all_reduce", 2 * W)  # E = 8, shared expert, grouped routing


CASES = [
    ("a2a_copies_bitwise", _case_a2a_copies_bitwise),
    ("static_and_all_reduce", _case_static_and_all_reduce),
    ("named_errors", _case_named_errors),
    ("quantized_copies", _case_quantized_copies),
    ("offload_copies", _case_offload_copies),
    ("load_counts", _case_load_counts),
    ("whole_model_greedy", _case_whole_model),
]


@pytest.mark.parametrize(("W", "case"), [(W, name) for W in (2, 4) for name, _ in CASES])
def test_ep_redundant_gloo(W, case):
    check_case("test_ep_redundant", W, case)
