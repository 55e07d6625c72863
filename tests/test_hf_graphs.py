"""moeflow.hf.StaticDecoder: the static-cache greedy decode recipe that a CUDA graph replays.

CPU: the eager recipe (static cache, static mask, rewound counters) gives transformers' own
greedy tokens, patched and unpatched; bad arguments are refused by name. GPU (tests/test_e2e_gpu.py):
replays equal eager at batch 1 and 16.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_configs import tiny_model  # noqa: E402

import moeflow  # noqa: E402
from moeflow.hf.graphs import StaticDecoder  # noqa: E402


def _hf_greedy(model, prompt, n):
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out


@pytest.mark.parametrize("family,patch", [("mixtral", False), ("mixtral", True), ("qwen3_moe", True),
                                          ("deepseek_v3", True)])
@pytest.mark.parametrize("batch", [1, 3])
def test_eager_recipe_gives_transformers_greedy_tokens(family, patch, batch, hf_quiet):
    model = tiny_model(family)
    model.config._attn_implementation = "sdpa"
    if patch:
        moeflow.patch_model(model, experts="reference")
    prompt = torch.randint(3, 97, (batch, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = _hf_greedy(model, prompt, 7)
    dec = StaticDecoder(model, batch_size=batch, max_len=16, graph=False)
    got = dec.generate(prompt, 7)
    assert torch.equal(got, want), f"{family} patch={patch} b{batch}: {got.tolist()} != transformers {want.tolist()}"
    # a second call on the same decoder (shorter prompt) rewinds the cache and gives the same again
    got2 = dec.generate(prompt[:, 1:], 7)
    with torch.no_grad():
        want2 = _hf_greedy(model, prompt[:, 1:], 7)
    assert torch.equal(got2, want2)


def test_logits_are_returned_per_decode_step(hf_quiet):
    model = tiny_model("mixtral")
    dec = StaticDecoder(model, batch_size=2, max_len=12, graph=False)
    ids, logits = dec.generate(torch.randint(3, 97, (2, 4)), 5, return_logits=True)
    assert ids.shape == (2, 9) and logits.shape == (4, 2, model.config.vocab_size)
    assert torch.equal(logits.argmax(-1).T, ids[:, 5:])


def test_bad_arguments_are_refused_by_name(hf_quiet):
    model = tiny_model("mixtral")
    with pytest.raises(ValueError, match="graph=True"):
        StaticDecoder(model, batch_size=1, max_len=8)  # a CPU model cannot be captured
    with pytest.raises(ValueError, match="batch_size=0"):
        StaticDecoder(model, batch_size=0, max_len=8, graph=False)
    with pytest.raises(ValueError, match="max_len"):
        StaticDecoder(model, batch_size=1, max_len=True, graph=False)
    with pytest.raises(TypeError, match="model"):
        StaticDecoder(object(), batch_size=1, max_len=8, graph=False)
    dec = StaticDecoder(model, batch_size=2, max_len=8, graph=False)
    with pytest.raises(ValueError, match="batch 1, expected batch_size=2"):
        dec.generate(torch.ones(1, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="max_len=8"):
        dec.generate(torch.ones(2, 5, dtype=torch.long), 4)
    with pytest.raises(TypeError, match="int64"):
        dec.generate(torch.ones(2, 3), 2)


def test_sliding_window_caches_are_refused_for_graphs(hf_quiet):
    model = tiny_model("gpt_oss")  # layer_types: sliding_attention, full_attention
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match=r"sliding-window layers \['StaticSlidingWindowLayer'\]"):
        StaticDecoder(model, batch_size=1, max_len=8)
    StaticDecoder(model, batch_size=1, max_len=8, graph=False)  # eager is fine


def test_offloaded_model_with_host_refills_is_refused_for_graphs(hf_quiet):
    """A replay skips the host refills of OffloadConfig(sync_free=False): refused by name, before any capture."""
    model = tiny_model("mixtral")
    model.config._attn_implementation = "sdpa"
    moeflow.patch_model(model, offload=moeflow.OffloadConfig(gpu_slots=4, device="cpu"))
    with pytest.raises(ValueError, match=r"MoE layer 0 is offloaded with OffloadConfig\(sync_free=False\)"):
        StaticDecoder(model, batch_size=1, max_len=8)
    StaticDecoder(model, batch_size=1, max_len=8, graph=False)  # eager is fine
