"""Host (Python) time of a MoELayer step on the CUDA code path, run on the CPU with no-op kernels.

The GPU machine's host is ~3x slower than this development machine in Python, and a patched
layer step there is host-bound (benchmarks/RESULTS.md, third session of 2026-12-03). This harness
takes the CUDA router step (router_step_cuda, allowed on CPU tensors) and the Triton experts'
Python with every Triton kernel replaced by a no-op, so what it times is moeflow's own Python and
torch allocations per step (qwen3-30b-a3b shape, bf16). Nothing launches; nothing is checked.

    python benchmarks/profile_layer_python.py          # best-of-3 us per step at T = 1 and 2048
    python benchmarks/profile_layer_python.py 1        # plus a cProfile of 2000 steps at T = 1
"""
import cProfile, inspect, io, pstats, sys, time
sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
import torch
import moeflow.routing.gpu as g
g._ALLOW_CPU = True
import moeflow.routing.router as R
src = inspect.getsource(R.run_router).replace("if r_TH.is_cuda and triton_available():", "if True:")
exec(compile(src, R.__file__, "exec"), R.__dict__)
import moeflow.layer as L
L.run_router = R.run_router
class Noop:
    def __getitem__(self, grid): return lambda *a, **k: None
import moeflow.kernels.router_fused as rf, moeflow.kernels.router_logits as rl, moeflow.kernels.router_select as rs
import moeflow.experts.triton as tmod, moeflow.kernels.moe_align as amod, moeflow.kernels.moe_gemm as gmod
for m in (rf, rl, rs, tmod, amod, gmod):
    for n in dir(m):
        if n.endswith("_kernel"):
            setattr(m, n, Noop())
from moeflow.config import MoEConfig, ExpertWeights
from moeflow.routing.spec import RouterSpec
from moeflow.experts.triton import TritonExperts
E, H, I, K = 128, 2048, 768, 8
spec = RouterSpec(score_fn="softmax", num_experts=E, top_k=K)
cfg = MoEConfig(hidden_size=H, intermediate_size=I, router=spec, activation="silu")
w = ExpertWeights(torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16))
layer = L.MoELayer(cfg, router_weight_EH=torch.randn(E, H, dtype=torch.bfloat16) * 0.01, experts=w,
                   experts_impl=TritonExperts(allow_cpu=True))
layer.check_routing = "never"
for T in (1, 2048):
    x = torch.randn(T, H, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(20):
            layer(x)
        n = 2000
        best = 1e9
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                layer(x)
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
    print(f"T={T}: layer step python {best:.1f} us")
if len(sys.argv) > 1:
    x = torch.randn(int(sys.argv[1]), H, dtype=torch.bfloat16)
    pr = cProfile.Profile(); pr.enable()
    with torch.no_grad():
        for _ in range(2000):
            layer(x)
    pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[-7000:])
