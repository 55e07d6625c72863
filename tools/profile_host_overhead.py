"""Where the host time of a patched model's forward goes (cProfile), next to its GPU time.

A forward is host-bound when launching its kernels takes longer than running them: the
GPU idles between kernels and the wall time exceeds the kernel time. This script builds
an L-layer transformers model at a real layer shape (random weights, bf16, CUDA),
patches it with moeflow, times one prefill forward (wall, CUDA events) and the GPU
kernel time (torch profiler), and prints the top host functions by cumulative time
(cProfile) of the same forward. Nothing is asserted: it is a diagnosis tool.

    python3 tools/profile_host_overhead.py --shape qwen3-30b-a3b --layers 4 --T 2048
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                             num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4,
                                             head_dim=128, intermediate_size=6144, norm_topk_prob=True)),
    "mixtral-8x7b": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                           num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8)),
}


def main(argv=None) -> int:
    import transformers

    import moeflow

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--experts", default="auto")
    ap.add_argument("--top", type=int, default=30, help="cProfile rows to print (0: no cProfile)")
    ap.add_argument("--floor", action="store_true",
                    help="also time the model with every MoE block replaced by an identity: the wall time no "
                         "MoE implementation can beat in eager mode (the rest of the model's host and GPU time)")
    args = ap.parse_args(argv)
    cls, kw = SHAPES[args.shape]
    cfg = getattr(transformers, cls)(vocab_size=4096, num_hidden_layers=args.layers, **kw)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 4096, (1, args.T), device="cuda")

    def fwd():
        with torch.no_grad():
            return model(ids, use_cache=False, logits_to_keep=1).logits

    def wall_ms(n=5):
        fwd()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fwd()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3

    def gpu_ms():
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fwd()
            torch.cuda.synchronize()
        return sum(e.device_time_total for e in prof.key_averages()) / 1e3

    print(f"{args.shape} L={args.layers} T={args.T}")
    print(f"  hf       wall {wall_ms():8.2f} ms   gpu {gpu_ms():8.2f} ms")
    moeflow.patch_model(model, experts=args.experts)
    print(f"  moeflow  wall {wall_ms():8.2f} ms   gpu {gpu_ms():8.2f} ms")
    if args.floor:
        from benchmarks.bench_e2e import NO_MOE, apply_variant, remove_variant

        moeflow.unpatch_model(model)
        apply_variant(model, NO_MOE)  # bench_e2e's "no_moe": every MoE block hands its input back
        print(f"  no-MoE   wall {wall_ms():8.2f} ms   gpu {gpu_ms():8.2f} ms   (every MoE block an identity)")
        remove_variant(model)
        moeflow.patch_model(model, experts=args.experts)
    if args.top <= 0:
        return 0
    fwd()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        fwd()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(args.top)
    print(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
    print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
