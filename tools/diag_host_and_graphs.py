"""Diagnostics (GPU): Triton launch overhead, host time of one patched MoE layer, CUDA-graph decode at batch 1 / 16.

What benchmarks/RESULTS.md's "Host time of a patched layer" quotes. Prints only; asserts nothing. The layer
section times one layer with its Triton experts launched through Triton's JIT binder and through the cached
launchers (KernelOptions(fast_launch=False / True)).

    PYTHONPATH=. python3 tools/diag_host_and_graphs.py
"""

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
import traceback

import torch

try:  # optional: only the "launch" section needs it, and the module must import without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only machines
    triton = None
    tl = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("launch", "layer", "ops", "graphs")


def section(s):
    print(f"\n===== {s}", flush=True)


def host_us(fn, n=3000):
    """Host time of one call of ``fn`` in microseconds (the GPU is synchronized before and after)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _build_k20():
    """A Triton kernel with 20 runtime arguments and 4 constexprs that does nothing."""

    @triton.jit
    def k20(a, b, c, d, e, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, s1, s2, s3, s4, s5,
            A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr):
        pid = tl.program_id(0)
        if pid < 0:
            tl.store(a + pid, 1.0)

    return k20


# ---------------------------------------------------------------- (2) launch overhead
def launch_overhead():
    """Host time of a Triton launch (JIT path and CompiledKernel.run) next to small torch ops."""
    if triton is None:
        raise ImportError("the 'launch' section needs triton")
    k20 = _build_k20()
    ts = [torch.empty(16, device="cuda") for _ in range(5)]
    ints = [7, 4096, 2048, 128, 8, 3, 5, 9, 11, 13]
    strides = [2048, 1, 768, 1, 2]

    def jit_launch():
        k20[(64,)](*ts, *ints, *strides, A=16, B=64, C=64, D=8, num_warps=4, num_stages=3)

    for _ in range(20):
        jit_launch()
    torch.cuda.synchronize()
    print(f"jit launch (20 args): {host_us(jit_launch):.2f} us/launch (host)")
    ck = k20[(64,)](*ts, *ints, *strides, A=16, B=64, C=64, D=8, num_warps=4, num_stages=3)
    print("compiled kernel type", type(ck))
    torch.cuda.current_device()

    def direct():
        stream = torch.cuda.current_stream().cuda_stream
        ck.run(64, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None,
               *ts, *ints, *strides, 16, 64, 64, 8)

    try:
        direct()
        torch.cuda.synchronize()
        print(f"direct CompiledKernel.run: {host_us(direct):.2f} us/launch (host)")
    except Exception as ex:
        print("direct run failed:", repr(ex)[:500])

    from moeflow.kernels.launch import FastKernel

    fk = FastKernel(k20)

    def fast_launch():
        fk[(64,)](*ts, *ints, *strides, A=16, B=64, C=64, D=8, num_warps=4, num_stages=3)

    fast_launch()
    print(f"FastKernel launch (20 args, cached): {host_us(fast_launch):.2f} us/launch (host)")

    def empty_torch():
        torch.empty(16, device="cuda")

    print(f"torch.empty: {host_us(empty_torch):.2f} us")
    x = torch.randn(16, device="cuda")
    print(f"torch add: {host_us(lambda: x + 1):.2f} us")


# ---------------------------------------------------------------- (3) host time of MoELayer pieces
def layer_host_time(profile: bool = True):
    """Host, wall and CUDA-graph GPU time of one patched Qwen3-MoE layer at T=1/16/2048, plus cProfile."""
    import transformers

    import moeflow
    from moeflow.layer import MoELayer

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=4096, num_hidden_layers=1, hidden_size=2048, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, norm_topk_prob=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    moeflow.patch_model(model, experts="triton")

    from moeflow.experts.options import KernelOptions
    from moeflow.experts.triton import TritonExperts

    layer = [m for m in model.modules() if isinstance(m, MoELayer)][0]
    print("layer", type(layer).__name__)
    # A/B in one process: every launch through Triton's JIT, then through FastKernel's cache
    for fast in (False, True):
        layer.experts_impl = TritonExperts(options=KernelOptions(fast_launch=fast))
        print(f"-- launches {'through FastKernel (cached compiled kernels)' if fast else 'through the Triton JIT'}")
        _layer_host_rows(layer, profile=fast and profile)


def _layer_host_rows(layer, *, profile: bool) -> None:
    for T in (1, 16, 2048):
        x = torch.randn(T, 2048, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            for _ in range(5):
                layer(x)
            torch.cuda.synchronize()
            n = 200 if T < 2048 else 30
            t0 = time.perf_counter()
            for _ in range(n):
                layer(x)
            th = (time.perf_counter() - t0) / n * 1e6
            torch.cuda.synchronize()
            tw = (time.perf_counter() - t0) / n * 1e6
            # GPU time via events
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                layer(x)
            g.replay()
            torch.cuda.synchronize()
            s.record()
            for _ in range(20):
                g.replay()
            e.record()
            torch.cuda.synchronize()
            print(f"T={T}: host {th:.1f} us/call, wall {tw:.1f} us/call, graph GPU {s.elapsed_time(e)/20*1e3:.1f} us")
        if profile and T in (1, 2048):
            pr = cProfile.Profile()
            with torch.no_grad():
                pr.enable()
                for _ in range(50):
                    layer(x)
                pr.disable()
            torch.cuda.synchronize()
            sio = io.StringIO()
            pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(25)
            print(sio.getvalue()[-6000:])


def layer_ops():
    """Every aten op and Triton launch one patched layer step issues (qwen3 / deepseek-v3 shapes, T=1, 2048).

    Host time per layer is ~15 us per torch op and ~29 us per Triton launch on the GPU machine's
    host, so the list says where a host-bound layer's time goes.
    """
    from collections import Counter

    import transformers
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.jit import JITFunction

    import moeflow
    from moeflow.hf.patch import MoEBlock

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    launches = []
    orig_run = JITFunction.run

    def run(self, *a, **k):
        launches.append(self.fn.__name__)
        return orig_run(self, *a, **k)

    cfgs = {
        "qwen3": transformers.Qwen3MoeConfig(
            vocab_size=4096, num_hidden_layers=1, hidden_size=2048, moe_intermediate_size=768, num_experts=128,
            num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            intermediate_size=6144, norm_topk_prob=True),
        "deepseek_v3": transformers.DeepseekV3Config(
            vocab_size=4096, num_hidden_layers=1, first_k_dense_replace=0, hidden_size=7168,
            moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
            n_group=8, topk_group=4, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128,
            kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, intermediate_size=4096),
    }
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        moeflow.patch_model(model, experts="triton")
        hf_block = next(m for m in model.modules() if isinstance(m, MoEBlock))
        for T in (1, 2048):
            x = torch.randn(1, T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
            for who, mod in (("MoELayer", hf_block.moe_layer), ("HF block", hf_block)):
                with torch.no_grad():
                    for _ in range(3):
                        mod(x if who == "HF block" else x[0])
                    torch.cuda.synchronize()
                    launches.clear()
                    JITFunction.run = run
                    try:
                        with Ops() as ops:
                            mod(x if who == "HF block" else x[0])
                    finally:
                        JITFunction.run = orig_run
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(30):
                        mod(x if who == "HF block" else x[0])
                    host = (time.perf_counter() - t0) / 30 * 1e6
                    torch.cuda.synchronize()
                c = Counter(ops.ops)
                print(f"{name} {who} T={T}: host {host:.0f} us, {len(ops.ops)} aten ops, {len(launches)} triton "
                      f"launches {launches}")
                print("   aten:", dict(c.most_common()))
        del model
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- (1) CUDA graph batch 16
def _make_model(tiny_model, patch, experts="triton", **kw):
    import moeflow

    torch.manual_seed(0)
    m = tiny_model("mixtral").to("cuda", torch.bfloat16)
    m.config._attn_implementation = "sdpa"
    if patch:
        moeflow.patch_model(m, experts=experts, **kw)
    return m


def _decode(model, batch, graph, P=6, N=8):
    """Greedy decode of N tokens after a P-token prompt (moeflow.hf.StaticDecoder), eager or replayed."""
    from moeflow.hf.graphs import StaticDecoder

    prompt = torch.randint(3, 97, (batch, P), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    return StaticDecoder(model, batch_size=batch, max_len=P + N + 2, graph=graph).generate(prompt, N,
                                                                                        return_logits=True)


def graph_decode(batch):
    """Eager vs CUDA-graph decode of the tiny Mixtral, unpatched and patched (triton / reference experts)."""
    tests_dir = os.path.join(ROOT, "tests")
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    from hf_configs import tiny_model

    for patch, experts in ((False, None), (True, "triton"), (True, "reference")):
        try:
            m = _make_model(tiny_model, patch, experts)
            e1, l1 = _decode(m, batch, False)
            e2, l2 = _decode(m, batch, False)
            g1, lg = _decode(m, batch, True)
            d = (lg - l1).abs().amax(dim=(1, 2)).tolist()
            print(f"b{batch} patch={patch} {experts}: eager==eager {torch.equal(e1, e2)} "
                  f"(maxdiff {(l1-l2).abs().max().item():.3g}); graph==eager {torch.equal(g1, e1)}; "
                  f"per-step logits maxdiff {[f'{v:.3g}' for v in d]}", flush=True)
        except Exception as ex:
            traceback.print_exc(limit=3)
            print(f"b{batch} patch={patch} {experts}: ERROR {ex!r}"[:800], flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-profile", action="store_true", help="layer section: no cProfile tables")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="which diagnostics to run (default: all, in the order launch, layer, graphs)")
    args = ap.parse_args(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    if "launch" in args.sections:
        section("triton launch overhead")
        launch_overhead()
    if "layer" in args.sections:
        section("MoE layer host time, qwen3 shape, T=1 and T=2048")
        layer_host_time(profile=not args.no_profile)
    if "ops" in args.sections:
        section("aten ops and Triton launches of one patched layer step")
        layer_ops()
    if "graphs" in args.sections:
        section("cuda graph decode batch 16")
        for batch in (1, 16):
            graph_decode(batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
