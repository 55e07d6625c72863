"""transformers' compiled decode path on a patched model (CPU, inductor, default mode).

What transformers documents for fast decode: a static KV cache and the model's forward
compiled (`model.forward = torch.compile(model.forward, fullgraph=True)`), then
`generate(..., cache_implementation="static")`. On the tiny qwen3_moe (fp32, 2 layers) the
compiled generate must give the eager patched model's greedy tokens, and its per-step logits
within rtol 1e-5 (atol 1e-5 x max|logit|; max-abs and RMS error printed): the MoE ops give
the eager bits, the rest is inductor's code. A second prompt length reuses the compiled decode
graph and adds one dynamic prefill graph. (mode="reduce-overhead" on CUDA:
tests/test_compile_gpu.py.)
"""

from __future__ import annotations

import pytest
import torch
from hf_configs import tiny_model

import moeflow
from moeflow.testing import assert_close, error_stats

pytestmark = pytest.mark.usefixtures("one_thread", "hf_quiet")

GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static",
           return_dict_in_generate=True, output_logits=True)


def test_static_cache_generate_with_compiled_forward_gives_the_eager_tokens():
    torch._dynamo.reset()
    model = tiny_model("qwen3_moe", seed=9)
    moeflow.patch_model(model, experts="reference")
    prompts = [torch.randint(3, 97, (2, P), generator=torch.Generator().manual_seed(P)) for P in (7, 5)]
    with torch.no_grad():
        want = [model.generate(p, **GEN) for p in prompts]
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, fullgraph=True)
    try:
        with torch.no_grad():
            got = [model.generate(p, **GEN) for p in prompts]
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
    for p, g, w in zip(prompts, got, want):
        assert torch.equal(g.sequences, w.sequences), f"P={p.shape[1]}: {g.sequences.tolist()} != {w.sequences.tolist()}"
        lg, lw = torch.stack(g.logits), torch.stack(w.logits)
        max_abs, rms, _ = error_stats(lg, lw)
        print(f"P={p.shape[1]}: compiled vs eager logits max_abs={max_abs:.3e} rms={rms:.3e}")
        assert_close(lg, lw, rtol=1e-5, atol=1e-5 * float(lw.abs().max()), what=f"P={p.shape[1]} logits")
