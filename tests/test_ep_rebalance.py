"""rebalance over 2 and 4 spawned gloo ranks: mid-run moves, all-or-nothing on failure, offload, FP8, models.

Legend: W ranks, T_r tokens on rank r, E logical experts, R redundant copies, L layers.

Outputs are compared BIT FOR BIT with the single-process layers (a batch-invariant experts
impl, `RowwiseExperts`: copies split an expert's rows, see test_ep_redundant) before and after
each rebalance; whole models: greedy tokens equal to the unsharded model's, logits within
rtol = atol/max|logits| = 1e-5 (reference experts).

Failures: a rank that raises while gathering its send data or building its new experts makes
every rank raise (its own error there, EPRebalanceAborted elsewhere) and keep its old
placement; the group stays usable. A rank that stalls mid-move past `timeout_s` surfaces as
EPCollectiveError on every rank (the last case: it breaks the group).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from ep_spawn import check_case
from test_ep_dist import _build, _generate, _hf_quiet, _tokens
from test_ep_redundant import HOT, RowwiseExperts

from moeflow.layer import MoELayer
from moeflow.parallel import (
    EPRebalanceAborted,
    ModelPlacement,
    Placement,
    expert_load,
    plan_placement,
    rebalance,
)
from moeflow.parallel import rebalancing as rebalance_mod
from moeflow.parallel.dist_utils import EPCollectiveError
from moeflow.parallel.ep import shard_layer
from moeflow.testing import assert_bitwise_equal, assert_close

TIMEOUT_S = 10.0
STALL_TIMEOUT_S = 2.0


def _chain(W: int, seed: int, *, R: int | None = None, mode: str = "all_to_all", static: int | None = None):
    refs = [_build(E=8, K=2, shared="rowwise", skew_experts=HOT if i != 1 else (), seed=seed + i,
                   impl=RowwiseExperts()) for i in range(3)]
    for i, m in enumerate(refs):
        m.layer_idx = i
    eps = [shard_layer(m, group=dist.group.WORLD, mode=mode, redundant_experts=R, static_tokens=static,
                       timeout_s=TIMEOUT_S) for m in refs]
    return refs, eps


def _step(refs, eps, rank, W, step, Ts, *, same_tokens=False):
    xs = [_tokens(100 + step, 0 if same_tokens else r, Ts[r], 24) for r in range(W)]
    with torch.no_grad():
        if same_tokens:
            x_all = x_me = xs[0]
        else:
            x_all, x_me = torch.cat(xs), xs[rank]
        for ref, ep in zip(refs, eps):
            x_all = x_all + ref(x_all)
            x_me = x_me + ep(x_me)
    if same_tokens:
        assert_close(x_me, x_all, rtol=1e-6, atol=1e-6 * float(x_all.abs().max()), what=f"step {step} all_reduce")
    else:
        off = sum(Ts[:rank])
        assert_bitwise_equal(x_me, x_all[off: off + Ts[rank]], what=f"rank {rank} step {step}")


def _case_mid_run(rank, W):
    """Serve, measure, rebalance (R: 0 -> W), serve; the static decode and all_reduce modes too; then
    (dynamic) R: W -> 2W -> 0 (packed by load) -> contiguous; the same bits throughout."""
    for mode, static in (("all_to_all", None), ("all_to_all", 8), ("all_reduce", None)):
        refs, eps = _chain(W, 200, mode=mode, static=static)
        Ts = [3, 6, 0, 5][:W] if mode == "all_to_all" else [6] * W
        same = mode == "all_reduce"
        n = 2 if mode == "all_to_all" and static is None else 1  # steps before and after the move
        for step in range(n):
            _step(refs, eps, rank, W, step, Ts, same_tokens=same)
        load = expert_load(eps, reduce=True, reset=True)
        assert int(load.sum()) == n * 2 * 3 * (Ts[0] if same else sum(Ts)), load.tolist()  # steps * K * layers
        before = ModelPlacement.from_layers([m.dispatcher.placement for m in eps]).imbalance(load)
        p = plan_placement(load, W, redundant_experts=W)
        assert p.imbalance(load) <= before
        old = [m.dispatcher for m in eps]
        rep = rebalance(eps, p)
        assert all(m.dispatcher is not d for m, d in zip(eps, old))
        assert [m.dispatcher.placement.fingerprint() for m in eps] == [lp.fingerprint() for lp in p.layers]
        assert all(m.source.num_experts == lp.num_local(rank) for m, lp in zip(eps, p.layers))
        assert rep.experts_received + rep.experts_copied == sum(lp.num_local(rank) for lp in p.layers)
        moved = torch.tensor([rep.bytes_sent, rep.bytes_received])
        dist.all_reduce(moved)
        assert int(moved[0]) == int(moved[1]), "bytes sent and received over the group differ"
        for step in range(2, 2 + n):
            _step(refs, eps, rank, W, step, Ts, same_tokens=same)
        if mode != "all_to_all" or static is not None:
            continue
        p2 = plan_placement(expert_load(eps, reduce=True), W, redundant_experts=2 * W)
        rebalance(eps, p2)
        _step(refs, eps, rank, W, 4, Ts, same_tokens=same)
        # one copy each, packed by load (physical ids no longer the logical ones)
        p0 = plan_placement(expert_load(eps, reduce=True), W, redundant_experts=0)
        assert not all(lp.is_identity for lp in p0.layers)
        rebalance(eps, p0)
        _step(refs, eps, rank, W, 6, Ts, same_tokens=same)
        # back to one copy each, contiguous
        rebalance(eps, [Placement.contiguous(8, W)] * 3)
        _step(refs, eps, rank, W, 5, Ts, same_tokens=same)


def _fail_on(rank_to_fail: int, rank: int, where: str):
    """Make `where` (a rebalance stage) raise on one rank; returns the undo."""
    orig = getattr(rebalance_mod, where)

    def boom(*args, **kwargs):
        if rank == rank_to_fail:
            raise RuntimeError(f"injected failure in {where}")
        return orig(*args, **kwargs)

    setattr(rebalance_mod, where, boom)
    return lambda: setattr(rebalance_mod, where, orig)


def _case_failing_rank(rank, W):
    """A rank failing in each stage: every rank raises (its own error / EPRebalanceAborted naming it), keeps
    its old placement and serves the same bits; a rebalance afterwards succeeds."""
    refs, eps = _chain(W, 300, R=W)
    Ts = [4, 2, 5, 1][:W]
    _step(refs, eps, rank, W, 0, Ts)
    p = plan_placement(expert_load(eps, reduce=True), W, redundant_experts=2 * W)
    for step, where in enumerate(("_check", "_send_buffers", "_build")):
        old = [(m.dispatcher, m.source) for m in eps]
        undo = _fail_on(1, rank, where)
        try:
            if rank == 1:
                with pytest.raises(RuntimeError, match=f"injected failure in {where}"):
                    rebalance(eps, p)
            else:
                with pytest.raises(EPRebalanceAborted, match=r"rank\(s\) \[1\] refused or failed") as info:
                    rebalance(eps, p)
                assert info.value.ranks == (1,)
        finally:
            undo()
        assert all(m.dispatcher is d and m.source is s for m, (d, s) in zip(eps, old)), "a failed rebalance changed"
        _step(refs, eps, rank, W, 1 + step, Ts)
    # ranks that disagree on the placement: every rank refuses
    mine = p if rank else plan_placement(expert_load(eps, reduce=False) + 1, W, redundant_experts=W)
    with pytest.raises(EPRebalanceAborted, match="passed another placement"):
        rebalance(eps, mine)
    rebalance(eps, p)
    _step(refs, eps, rank, W, 9, Ts)
    with pytest.raises(TypeError, match="expected a ModelPlacement or a list of Placement"):
        rebalance(eps, "placement")  # refused by every rank alike, after the check vote
    _step(refs, eps, rank, W, 10, Ts)


def _case_offload(rank, W):
    """Offloaded layers: the new store holds the new local experts, read from the old store's host copies."""
    from moeflow.offload.attach import attach_offload
    from moeflow.offload.config import OffloadConfig

    refs, eps = _chain(W, 400)
    rt = attach_offload(eps, OffloadConfig(gpu_slots=2, policy="lru", prefetch_width=2, device="cpu"), progress=False)
    Ts = [5, 1, 3, 2][:W]
    _step(refs, eps, rank, W, 0, Ts)
    p = plan_placement(expert_load(eps, reduce=True), W, redundant_experts=W)
    rebalance(eps, p)
    new_rt = eps[0].offload
    assert new_rt is not rt and all(m.offload is new_rt for m in eps)
    assert new_rt.store.num_experts == [lp.num_local(rank) for lp in p.layers]
    for step in range(1, 3):
        _step(refs, eps, rank, W, step, Ts)
    new_rt.cache.table.check_invariants()


def _case_quantized(rank, W):
    """FP8 experts: the stored bytes and block scales move; the same bits after."""
    from moeflow.quant.experts import quantize_experts
    from moeflow.quant.spec import fp8_block_spec

    base = _build(E=8, K=2, skew_experts=HOT, seed=24)
    qw = quantize_experts(base.expert_weights, fp8_block_spec((8, 8)))
    layer = MoELayer(base.config, router=base.router_weights, experts=qw, experts_impl=RowwiseExperts())
    ep = shard_layer(layer, group=dist.group.WORLD, timeout_s=TIMEOUT_S)
    Ts = [2, 5, 3, 1][:W]
    for step in range(2):
        xs = [_tokens(500 + step, r, Ts[r], 24) for r in range(W)]
        with torch.no_grad():
            out, ref = ep(xs[rank]), layer(torch.cat(xs))[sum(Ts[:rank]): sum(Ts[: rank + 1])]
        assert_bitwise_equal(out, ref, what=f"rank {rank} FP8 step {step}")
        if step == 0:
            p = plan_placement(expert_load([ep], reduce=True), W, redundant_experts=W)
            rebalance([ep], p)
            w = ep.source.weights
            assert w.gate_up.dtype == torch.float8_e4m3fn
            mine = list(p.layers[0].experts_of(rank))
            assert torch.equal(w.gate_up.view(torch.uint8), qw.gate_up[mine].view(torch.uint8))
            assert torch.equal(w.gate_up_scale, qw.gate_up_scale[mine])


def _case_whole_model(rank, W):
    """A patched model generates, rebalances on its measured load, and generates the same greedy tokens."""
    import moeflow
    from moeflow import hf as mhf

    _hf_quiet()
    from hf_configs import tiny_model

    model = tiny_model("deepseek_v3", seed=7)
    ids = torch.randint(3, 97, (2, 5 + rank), generator=torch.Generator().manual_seed(40 + rank))
    with torch.no_grad():
        want, want_logits = _generate(model, ids), model(ids).logits
    moeflow.patch_model(model, experts="reference", ep_group=dist.group.WORLD,
                        ep_options={"redundant_experts": W, "timeout_s": TIMEOUT_S})
    with torch.no_grad():
        model(ids)  # the load the placement is planned from
    p = plan_placement(expert_load(model, reduce=True), W, redundant_experts=2 * W)
    rebalance(model, p)
    assert all(m.dispatcher.placement.num_physical == 8 + 2 * W for m in mhf.moe_layers(model))
    with torch.no_grad():
        got, got_logits = _generate(model, ids), model(ids).logits
    assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5 * float(want_logits.abs().max()),
                 what="logits after rebalance")
    assert torch.equal(got, want), f"after rebalance: {got.tolist()} != {want.tolist()}"


def _case_stalled_rank(rank, W):
    """Rank 1 stalls mid-move past the timeout: every rank raises EPCollectiveError naming the exchange
    and keeps its old placement (the group is broken afterwards: the last case)."""
    refs, eps = _chain(W, 600)
    for m in eps:
        m.dispatcher.timeout_s = STALL_TIMEOUT_S
    Ts = [3, 3, 3, 3][:W]
    _step(refs, eps, rank, W, 0, Ts)
    p = plan_placement(expert_load(eps, reduce=True), W, redundant_experts=W)
    old = [m.dispatcher for m in eps]
    orig = rebalance_mod._send_buffers

    def stall(*args, **kwargs):
        if rank == 1:
            time.sleep(2 * STALL_TIMEOUT_S + 0.5)
        return orig(*args, **kwargs)

    rebalance_mod._send_buffers = stall
    try:
        with pytest.raises(EPCollectiveError, match="send/recv|rebalance"):
            rebalance(eps, p)
    finally:
        rebalance_mod._send_buffers = orig
    assert all(m.dispatcher is d for m, d in zip(eps, old))


CASES = [
    ("mid_run", _case_mid_run),
    ("failing_rank", _case_failing_rank),
    ("offload", _case_offload),
    ("quantized", _case_quantized),
    ("whole_model_greedy", _case_whole_model),
    ("stalled_rank", _case_stalled_rank),  # last: it breaks the group
]


@pytest.mark.parametrize(("W", "case"), [(W, name) for W in (2, 4) for name, _ in CASES])
def test_ep_rebalance_gloo(W, case):
    check_case("test_ep_rebalance", W, case)
