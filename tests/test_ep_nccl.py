"""Expert parallelism on NCCL with what one GPU allows: world size 1, eager and under CUDA-graph replay.

The multi-GPU runs (world 2, 4, 8) need a machine kind that was not lent; these tests
exercise the NCCL code path and the static-buffer decode mode's graph capture.
"""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(scope="module")
def nccl_world1(tmp_path_factory):
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.group.WORLD
    dist.destroy_process_group()


def _layer(impl, E=16, H=256, I=128, K=4):
    from moeflow import ExpertWeights, MoEConfig, MoELayer, RouterSpec

    g = torch.Generator(device="cuda").manual_seed(0)
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, activation="silu",
                    router=RouterSpec(score_fn="softmax", num_experts=E, top_k=K, renorm=True))
    bf = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    w = ExpertWeights(gate_up=torch.randn(E, 2 * I, H, **bf) * 0.05, down=torch.randn(E, H, I, **bf) * 0.05)
    return MoELayer(cfg, router_weight_EH=torch.randn(E, H, **bf) * 0.1, experts=w, experts_impl=impl)


@pytest.mark.parametrize("mode", ["all_to_all", "all_reduce"])
def test_nccl_world1_equals_single_layer(nccl_world1, mode):
    from moeflow.parallel.ep import shard_layer
    from moeflow.testing import assert_close

    layer = _layer("reference")
    ep = shard_layer(layer, group=nccl_world1, mode=mode)
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
    ref = layer(x)
    got = ep(x)
    torch.cuda.synchronize()
    assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-3, what=f"NCCL world 1 {mode}")


def test_nccl_static_decode_graph_replay(nccl_world1):
    from moeflow.parallel.ep import shard_layer
    from moeflow.testing import assert_bitwise_equal, assert_close

    layer = _layer("triton")
    layer.check_routing = "never"  # no host sync inside the captured step
    ep = shard_layer(layer, group=nccl_world1, mode="all_to_all", static_tokens=8)
    x_static = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    eager = ep(x_static).clone()
    assert_close(eager.float(), layer(x_static).float(), rtol=2e-2, atol=2e-3, what="static decode vs layer")

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            ep(x_static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = ep(x_static)
    for seed in (1, 2, 3):
        x_new = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(device="cuda").manual_seed(seed))
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(y_static, ep(x_new), what=f"graph replay {seed} vs eager")
