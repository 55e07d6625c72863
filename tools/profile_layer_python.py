"""Host (Python) time of a MoELayer step on the CUDA code path, run on the CPU with no-op kernels.

The GPU machine's host is ~3x slower than this development machine in Python, and a patched
layer step there is host-bound at small T (benchmarks/RESULTS.md, "Host time of a patched layer"). This harness
takes the CUDA router step (router_step_cuda, allowed on CPU tensors) and the Triton experts'
Python with every Triton kernel replaced by a no-op, so what it times is moeflow's own Python and
torch allocations per step (qwen3-30b-a3b shape, bf16). Nothing launches; nothing is checked.

    python tools/profile_layer_python.py          # best-of-3 us per step at T = 1 and 2048
    python tools/profile_layer_python.py 1        # plus a cProfile of 2000 steps at T = 1
"""

from __future__ import annotations

import cProfile
import inspect
import io
import os
import pstats
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class _Noop:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def _cuda_path_on_cpu():
    """Route with router_step_cuda on CPU tensors and make every moeflow Triton kernel a no-op."""
    import moeflow.experts.triton as tmod
    import moeflow.kernels.moe_align as amod
    import moeflow.kernels.moe_gemm as gmod
    import moeflow.kernels.router_fused as rf
    import moeflow.kernels.router_logits as rl
    import moeflow.kernels.router_select as rs
    import moeflow.layer as L
    import moeflow.routing.gpu as g
    import moeflow.routing.router as R

    # the router step's CUDA-tensor check passes CPU tensors (as the no-op kernels pass everything)
    g._check_device = lambda name, t: None
    src = inspect.getsource(R.run_router).replace("if r_TH.is_cuda and triton_available():", "if True:")
    exec(compile(src, R.__file__, "exec"), R.__dict__)
    L.run_router = R.run_router
    for m in (rf, rl, rs, tmod, amod, gmod):
        for n in dir(m):
            if n.endswith("_kernel"):
                setattr(m, n, _Noop())
    return L


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    L = _cuda_path_on_cpu()
    from moeflow.config import ExpertWeights, MoEConfig
    from moeflow.experts.triton import TritonExperts
    from moeflow.routing.spec import RouterSpec

    E, H, I, K = 128, 2048, 768, 8
    cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=RouterSpec(score_fn="softmax", num_experts=E, top_k=K),
                    activation="silu")
    w = ExpertWeights(torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16))
    layer = L.MoELayer(cfg, router_weight_EH=torch.randn(E, H, dtype=torch.bfloat16) * 0.01, experts=w,
                       experts_impl=TritonExperts(allow_cpu=True))
    layer.check_routing = "never"
    with torch.no_grad():
        for T in (1, 2048):
            x = torch.randn(T, H, dtype=torch.bfloat16)
            for _ in range(20):
                layer(x)
            n, best = 2000, float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(n):
                    layer(x)
                best = min(best, (time.perf_counter() - t0) / n * 1e6)
            print(f"T={T}: layer step python {best:.1f} us")
        if argv:
            x = torch.randn(int(argv[0]), H, dtype=torch.bfloat16)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(2000):
                layer(x)
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
            print(s.getvalue()[-7000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
