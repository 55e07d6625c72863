"""Expert load balance on CUDA: the copy rule and the load counter read nothing back; redundant copies and
rebalance on NCCL (world size 1: what one GPU allows), eager and under CUDA-graph replay.

Bounds: the batch-invariant Triton experts (`triton_bi`) give a row the same bits whatever rows share its
GEMM, so copies splitting an expert's rows change nothing: compared bit for bit with the single layer.
"""

import pytest
import torch
from test_ep_nccl import _layer, nccl_world1  # noqa: F401 - the fixture is used by name

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_physical_ids_on_device_no_sync():
    from moeflow.parallel import physical_ids
    from moeflow.parallel.plan import Placement

    p = Placement.replicated(16, 4, 8)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(18, generator=g)[:4] for _ in range(257)])  # ids 16, 17: zero experts
    want = physical_ids(ids, p, copy_offset=3)
    ids_d = ids.cuda()
    physical_ids(ids_d, p, copy_offset=3)  # the placement's device tables are copied once, here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = physical_ids(ids_d, p, copy_offset=3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), want)


def test_load_counter_no_sync():
    from moeflow.parallel import expert_load, track_load

    layer = _layer("reference")
    (counter,) = track_load([layer])
    ids = torch.randint(0, 16, (64, 4), device="cuda")
    counter.add(ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counter.add(ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = expert_load([layer])
    assert got.device.type == "cuda"
    assert torch.equal(got[0].cpu(), 2 * torch.bincount(ids.reshape(-1).cpu(), minlength=16))


def test_nccl_copies_and_rebalance_bitwise(nccl_world1):  # noqa: F811
    from moeflow.parallel import expert_load, plan_placement, rebalance
    from moeflow.parallel.ep import shard_layer
    from moeflow.testing import assert_bitwise_equal

    layer = _layer("triton_bi")
    ep = shard_layer(layer, group=nccl_world1, redundant_experts=4)
    x = torch.randn(97, 256, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(1))
    want = layer(x)
    assert_bitwise_equal(ep(x), want, what="NCCL copies vs single layer (triton_bi)")
    load = expert_load([ep], reduce=True)
    assert int(load.sum()) == 97 * 4
    p = plan_placement(load, 1, redundant_experts=8)
    rebalance([ep], p)
    w = ep.source.weights
    mine = list(p.layers[0].experts_of(0))
    assert torch.equal(w.gate_up.view(torch.int16), layer.expert_weights.gate_up[mine].view(torch.int16))
    assert_bitwise_equal(ep(x), want, what="after rebalance")


def test_nccl_static_decode_graph_with_copies(nccl_world1):  # noqa: F811
    from moeflow.parallel.ep import shard_layer
    from moeflow.testing import assert_bitwise_equal, capture_cuda_graph

    layer = _layer("triton_bi")
    layer.check_routing = "never"  # no host sync inside the captured step
    ep = shard_layer(layer, group=nccl_world1, mode="all_to_all", static_tokens=8, redundant_experts=8)
    x_static = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    assert_bitwise_equal(ep(x_static), layer(x_static), what="static decode with copies vs layer")
    ep(x_static)  # the placement's device tables and the step's first allocations, outside the capture
    graph, y_static = capture_cuda_graph(lambda: ep(x_static))
    for seed in (1, 2):
        x_new = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator(device="cuda").manual_seed(seed))
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(y_static, ep(x_new), what=f"graph replay {seed} vs eager, copies")
