"""A patched model under torch.compile on the GPU: CUDA graphs through mode="reduce-overhead",
batch invariance of the op, the deferred routing check, steps a recorded graph cannot replay.

Everything here needs CUDA and Triton (`-m gpu`); without them the module is skipped.
Tiny models (tests/hf_configs.py) in fp32 on CUDA with the fused Triton experts, so that
inductor's code for the rest of the model rounds like eager's closely enough for greedy
tokens to be compared exactly.

Legend: B batch, P prompt, T tokens, H hidden.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                       reason="needs CUDA and Triton"),
]


def _tiny(family: str, dtype=torch.float32, **kw):
    from hf_configs import tiny_model

    model = tiny_model(family, **kw).to("cuda", dtype)
    model.config._attn_implementation = "sdpa"  # masks built on the device (capturable)
    return model


def _patched(family: str, experts: str):
    """A fresh tiny CUDA model of `family`, patched with `experts`, after a dynamo reset; skips a
    family this transformers does not have."""
    from hf_configs import available_families

    import moeflow

    if family not in available_families():
        pytest.skip(f"this transformers has no {family}")
    torch._dynamo.reset()
    model = _tiny(family)
    moeflow.patch_model(model, experts=experts)
    return model


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "gemma4", "deepseek_v4"])
def test_fullgraph_on_cuda(family, hf_quiet):
    model = _patched(family, "auto")
    ids = torch.randint(3, 97, (2, 9), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(ids)
        want = model(ids).logits
        got = torch.compile(model, fullgraph=True, backend="aot_eager")(ids).logits  # inductor: tests below
    assert explained.graph_break_count == 0, [str(b.reason)[:300] for b in explained.break_reasons]
    err = float((got - want).abs().max())
    assert err <= 1e-4 * float(want.abs().max()), f"{family}: compiled vs eager max-abs {err:.3g}"
    torch._dynamo.reset()


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_reduce_overhead_static_generate_gives_the_eager_tokens(family, batch, hf_quiet):
    """transformers' compiled decode path (static cache, compile_config mode="reduce-overhead",
    fullgraph) on a patched model: the eager patched model's greedy tokens."""
    from transformers import CompileConfig

    from moeflow import hf as mhf

    model = _patched(family, "triton")
    P, N = 6, 12
    prompt = torch.randint(3, 97, (batch, P), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    kw = dict(max_new_tokens=N, min_new_tokens=N, do_sample=False, pad_token_id=0, cache_implementation="static",
              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        want = model.generate(prompt, disable_compile=True, **kw)
        cc = CompileConfig(fullgraph=True, mode="reduce-overhead")
        got = [model.generate(prompt, compile_config=cc, **kw) for _ in range(3)]  # warm-up, record, replay
    mhf.check_routing(model)
    for i, g in enumerate(got):
        d = (torch.stack(g.logits) - torch.stack(want.logits)).abs().amax().item()
        assert torch.equal(g.sequences, want.sequences), (f"call {i}: {g.sequences.tolist()} != eager "
                                                          f"{want.sequences.tolist()}; logits max diff {d:.3g}")
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma4", "deepseek_v4"])
def test_reduce_overhead_forward_from_a_fresh_model(family, hf_quiet):
    """The first call a patched model ever gets is torch.compile's cudagraph warm-up (mode=
    "reduce-overhead"): nothing the step keeps may come from the graph's pool; warm-up, recording
    and replays give the eager logits."""
    from moeflow import hf as mhf

    model = _patched(family, "triton")
    ids = torch.randint(3, 97, (2, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
    with torch.no_grad():
        got = [compiled(ids).logits.clone() for _ in range(4)]  # warm-up, record, replay, replay
        mhf.check_routing(model)
        want = model(ids).logits
    for i, g in enumerate(got):
        err = float((g - want).abs().max())
        assert err <= 1e-4 * float(want.abs().max()), f"{family} call {i}: compiled vs eager max-abs {err:.3g}"
    torch._dynamo.reset()


def test_triton_bi_op_is_batch_invariant_under_compile(hf_quiet):
    """A row's output does not depend on the other rows of the batch: the compiled block runs the
    batch-invariant op, whose bits equal the eager block's."""
    import moeflow

    torch._dynamo.reset()
    model = _tiny("qwen2_moe", dtype=torch.bfloat16, hidden_size=256, num_attention_heads=2)
    moeflow.patch_model(model, experts="triton_bi")
    block = model.model.layers[0].mlp
    compiled = torch.compile(block, fullgraph=True)
    gen = torch.Generator("cuda").manual_seed(7)
    probes = torch.randn(3, 256, device="cuda", generator=gen).bfloat16()
    bad = []
    with torch.no_grad():
        alone = torch.cat([block(probes[i : i + 1]) for i in range(3)])
        for T in (1, 2, 5, 16, 33, 257, 1000):
            x = torch.randn(T, 256, device="cuda", generator=gen).bfloat16()
            pos = sorted({0, T // 2, T - 1})
            for i, p in enumerate(pos):
                x[p] = probes[i]
            out = compiled(x)
            if not torch.equal(out, block(x)):
                bad.append(f"T={T}: compiled != eager")
            for i, p in enumerate(pos):
                if not torch.equal(out[p], alone[i]):
                    bad.append(f"T={T} pos={p}: max diff {float((out[p].float() - alone[i].float()).abs().max()):.3g}")
    assert not bad, bad[:8]
    torch._dynamo.reset()


def test_nan_is_named_after_a_compiled_forward(hf_quiet):
    """A NaN logit inside the compiled model is named as the eager model names it (layer, first row,
    count), at check_routing, and at the next compiled forward once its flag has landed."""
    import moeflow
    from moeflow import hf as mhf

    torch._dynamo.reset()
    model = _tiny("mixtral")
    moeflow.patch_model(model, experts="triton")
    compiled = torch.compile(model, fullgraph=True)
    ids = torch.tensor([[3, 4, 5, 6]], device="cuda")
    with torch.no_grad():
        compiled(ids)
        mhf.check_routing(model)
        model.get_input_embeddings().weight[5] = float("nan")
        model(ids)  # eager: the message to expect (attention spreads the NaN to other rows)
        with pytest.raises(ValueError, match=r"NaN logit in token row \d+ of layer \d+") as eager:
            mhf.check_routing(model)
        compiled(ids)  # deferred: no raise inside the forward
        with pytest.raises(ValueError) as got:
            mhf.check_routing(model)
        assert str(got.value) == str(eager.value)
        compiled(ids)
        torch.cuda.synchronize()  # the flag has landed: the next compiled forward's first op raises
        with pytest.raises(ValueError, match="NaN logit in token row"):
            compiled(torch.tensor([[3, 4]], device="cuda"))
    torch._dynamo.reset()


def test_reduce_overhead_refuses_an_offloaded_model(hf_quiet):
    import moeflow
    from moeflow.hf.op import CompiledStepError
    from moeflow.offload.config import OffloadConfig

    torch._dynamo.reset()
    model = _tiny("qwen3_moe")
    moeflow.patch_model(model, experts="triton", offload=OffloadConfig(gpu_slots=4))
    ids = torch.randint(3, 97, (1, 5), device="cuda")
    with torch.no_grad():
        fine = torch.compile(model, fullgraph=True)  # default mode: the offloaded step runs in the op
        fine(ids)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, mode="reduce-overhead")
        with pytest.raises(CompiledStepError, match=r"\(layer 0\).*offloaded"):
            for _ in range(3):  # cudagraph trees: warm-up, then the recording
                compiled(ids)
    torch._dynamo.reset()
