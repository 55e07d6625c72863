"""moeflow.warmup: which token counts it runs, what it skips, and (on the GPU) that a fresh length
after it compiles nothing.

Legend: T tokens.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest
import torch

import moeflow
from moeflow.tuning import TUNING_DIR, nearest_key
from moeflow.warming import token_counts, warmup


def _tables():
    for path in sorted(glob.glob(os.path.join(TUNING_DIR, "*.json"))):
        with open(path) as f:
            d = json.load(f)
        for section in ("configs", "batch_invariant_by_T"):
            keys = [int(k) for k in (d.get(section) or {})]
            if keys:
                yield os.path.basename(path), section, keys


def test_token_counts_hit_every_tuned_bucket_in_both_specialisations():
    """Every bucket of every shipped table up to 8192 is met by a T that is not a multiple of 16 and
    (for buckets >= 16) by one that is: Triton compiles each (tile entry, T % 16 == 0) pair once."""
    Ts = token_counts(8192)
    assert Ts == tuple(sorted(set(Ts))) and Ts[0] == 1 and Ts[-1] == 8192
    missed = []
    n = 0
    for name, section, keys in _tables():
        for k in (k for k in keys if k <= 8192):
            hit = [T for T in Ts if nearest_key(keys, T) == k]
            n += 1
            if not any(T % 16 for T in hit) or (k >= 16 and not any(T % 16 == 0 for T in hit)):
                missed.append((name, section, k, hit))
    assert n > 0, "no tuned table found"
    assert not missed, missed[:5]


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "8192"])
def test_bad_max_tokens_is_named(bad):
    with pytest.raises(ValueError, match="max_tokens"):
        token_counts(bad)


def test_cpu_model_is_skipped_and_left_as_it_was(hf_quiet):
    from hf_configs import tiny_model

    model = tiny_model("qwen3_moe")
    moeflow.patch_model(model)
    layers = moeflow.moe_layers(model)
    before = [(layer.last_routing, layer.impl_name) for layer in layers]
    rep = warmup(model, max_tokens=64, progress=False)
    assert rep.layers == [] and len(rep.skipped) == len(layers)
    assert set(rep.skipped.values()) == {"not on CUDA"}
    assert [(layer.last_routing, layer.impl_name) for layer in layers] == before
    with pytest.raises(ValueError, match="no moeflow MoE layer"):
        warmup(torch.nn.Linear(2, 2), progress=False)
    with pytest.raises(TypeError, match="model"):
        warmup("qwen3", progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs CUDA and Triton")
def test_fresh_lengths_after_warmup_compile_nothing(hf_quiet):
    """After warmup(max_tokens=600), forwards at lengths never seen (odd, even, multiples of 16) run no
    Triton JIT compile; one layer of the model is warmed (all share a shape)."""
    from hf_configs import tiny_model
    from triton.runtime.jit import JITFunction

    model = tiny_model("qwen3_moe", hidden_size=256, num_attention_heads=2).to("cuda", torch.bfloat16)
    moeflow.patch_model(model, experts="triton", layer_graphs=False)
    rep = warmup(model, max_tokens=600, progress=False)
    assert len(rep.layers) == 1 and not rep.skipped
    compiled = []
    orig = JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiled.append(self.__name__)
        return orig(self, *args, **kwargs)

    JITFunction._do_compile = counting
    try:
        with torch.no_grad():
            for T in (7, 40, 100, 203, 318, 512, 599):
                model(torch.randint(3, 97, (1, T), device="cuda"), use_cache=False)
        torch.cuda.synchronize()
    finally:
        JITFunction._do_compile = orig
    moe = [n for n in compiled if "moe" in n or "route" in n or "router" in n]
    assert not moe, f"compiled at fresh lengths after warmup: {moe}"
