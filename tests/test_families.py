"""`router_spec_from_hf` for each supported family's Hugging Face config class.

Legend: E routed experts, Z zero experts, K picks per token.

Every config is built with explicit values (not the class defaults, which move
between transformers versions) and its RouterSpec compared field by field with
the one the family's HF router implies (docs/routing.md; the routers
themselves are compared on logits in tests/test_routing_hf.py). A family the
installed transformers lacks is skipped there and fails here from 5.24 on.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import moeflow
from moeflow import RouterSpec
from moeflow.routing.families import SUPPORTED_FAMILIES

transformers = pytest.importorskip("transformers")
ALL_FAMILIES_SINCE = (5, 24)
_VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2])


def _config(family: str, cls: str, **kwargs):
    """transformers.models.<family>.configuration_<family>.<cls>(**kwargs), or a clean skip on older versions."""
    try:
        module = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
        return getattr(module, cls)(**kwargs)
    except (ImportError, AttributeError) as e:
        if _VERSION >= ALL_FAMILIES_SINCE:
            raise
        pytest.skip(f"transformers {transformers.__version__} lacks {family}.{cls}: {e}")


def _spec(**kw) -> RouterSpec:
    return RouterSpec(**kw)


DS3 = dict(score_fn="sigmoid", renorm=True, renorm_eps=1e-20, use_bias=True, group_score="top2_sum")

# name -> (family module, config class, kwargs, layer_idx, expected RouterSpec)
CASES: dict[str, tuple[str, str, dict, int, RouterSpec]] = {
    "mixtral": ("mixtral", "MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2), 0,
                _spec(score_fn="softmax", num_experts=8, top_k=2, renorm=True)),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeConfig", dict(num_experts=60, num_experts_per_tok=4, norm_topk_prob=False), 0,
                  _spec(score_fn="softmax", num_experts=60, top_k=4)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeConfig", dict(num_experts=128, num_experts_per_tok=8, norm_topk_prob=True), 0,
                  _spec(score_fn="softmax", num_experts=128, top_k=8, renorm=True)),
    "olmoe": ("olmoe", "OlmoeConfig", dict(num_experts=64, num_experts_per_tok=8, norm_topk_prob=False), 0,
              _spec(score_fn="softmax", num_experts=64, top_k=8)),
    # DeepSeek-V2: HF never renormalises, even with norm_topk_prob=True (the original code does).
    "deepseek_v2/group_limited_greedy": (
        "deepseek_v2", "DeepseekV2Config",
        dict(n_routed_experts=160, num_experts_per_tok=6, topk_method="group_limited_greedy", n_group=8,
             topk_group=3, routed_scaling_factor=16.0, norm_topk_prob=True), 0,
        _spec(score_fn="softmax", num_experts=160, top_k=6, n_group=8, topk_group=3, group_score="max",
              scaling_factor=16.0)),
    "deepseek_v2/greedy": (
        "deepseek_v2", "DeepseekV2Config",
        dict(n_routed_experts=64, num_experts_per_tok=6, topk_method="greedy", n_group=1, topk_group=1,
             routed_scaling_factor=1.0), 0,
        _spec(score_fn="softmax", num_experts=64, top_k=6, group_score="max")),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3Config",
                    dict(n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True,
                         routed_scaling_factor=2.5), 0,
                    _spec(num_experts=256, top_k=8, n_group=8, topk_group=4, scaling_factor=2.5, **DS3)),
    "deepseek_v3/no_renorm": ("deepseek_v3", "DeepseekV3Config",
                              dict(n_routed_experts=64, num_experts_per_tok=6, n_group=1, topk_group=1,
                                   norm_topk_prob=False, routed_scaling_factor=1.0), 0,
                              _spec(num_experts=64, top_k=6, **{**DS3, "renorm": False})),
    "glm4_moe": ("glm4_moe", "Glm4MoeConfig",
                 dict(n_routed_experts=160, num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True,
                      routed_scaling_factor=2.5), 0,
                 _spec(num_experts=160, top_k=8, scaling_factor=2.5, **DS3)),
    "dots1": ("dots1", "Dots1Config",
              dict(n_routed_experts=128, num_experts_per_tok=6, n_group=1, topk_group=1, norm_topk_prob=True,
                   routed_scaling_factor=2.5), 0,
              _spec(num_experts=128, top_k=6, scaling_factor=2.5, **DS3)),
    # DeepSeek-V4: HF renormalises always (norm_topk_prob is not read), K = 1 included.
    "deepseek_v4/moe": ("deepseek_v4", "DeepseekV4Config",
                        dict(n_routed_experts=256, num_experts_per_tok=6, routed_scaling_factor=1.5,
                             num_hidden_layers=6), 3,
                        _spec(score_fn="sqrtsoftplus", num_experts=256, top_k=6, renorm=True, renorm_eps=1e-20,
                              scaling_factor=1.5, use_bias=True)),
    "deepseek_v4/hash_moe": ("deepseek_v4", "DeepseekV4Config",
                             dict(n_routed_experts=256, num_experts_per_tok=6, routed_scaling_factor=1.5,
                                  num_hidden_layers=6), 0,
                             _spec(score_fn="sqrtsoftplus", num_experts=256, top_k=6, renorm=True, renorm_eps=1e-20,
                                   scaling_factor=1.5, hash_routing=True)),
    "gpt_oss": ("gpt_oss", "GptOssConfig", dict(num_local_experts=32, num_experts_per_tok=4), 0,
                _spec(score_fn="topk_softmax", num_experts=32, top_k=4)),
    "llama4_text": ("llama4", "Llama4TextConfig", dict(num_local_experts=16, num_experts_per_tok=1), 0,
                    _spec(score_fn="topk_sigmoid", num_experts=16, top_k=1, weight_on_input=True)),
    "llama4": ("llama4", "Llama4Config", dict(text_config=dict(num_local_experts=128, num_experts_per_tok=1)), 0,
               _spec(score_fn="topk_sigmoid", num_experts=128, top_k=1, weight_on_input=True)),
    "longcat_flash": ("longcat_flash", "LongcatFlashConfig",
                      dict(n_routed_experts=512, zero_expert_num=256, moe_topk=12, routed_scaling_factor=6.0), 0,
                      _spec(score_fn="softmax", num_experts=512, num_zero_experts=256, top_k=12, scaling_factor=6.0,
                            use_bias=True)),
    "gemma4_text": ("gemma4", "Gemma4TextConfig", dict(enable_moe_block=True, num_experts=128, top_k_experts=8), 0,
                    _spec(score_fn="softmax", num_experts=128, top_k=8, renorm=True, expert_scale=True,
                          router_prenorm=True)),
    "gemma4": ("gemma4", "Gemma4Config",
               dict(text_config=dict(enable_moe_block=True, num_experts=64, top_k_experts=4)), 0,
               _spec(score_fn="softmax", num_experts=64, top_k=4, renorm=True, expert_scale=True,
                     router_prenorm=True)),
    # Kimi-K2.5 wraps a DeepSeek-V3 text model (its "kimi_k2" text model_type is mapped to deepseek_v3).
    "kimi_k25": ("kimi_k25", "Kimi_K25Config",
                 dict(text_config=dict(model_type="kimi_k2", n_routed_experts=384, num_experts_per_tok=8, n_group=1,
                                       topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827)), 0,
                 _spec(num_experts=384, top_k=8, scaling_factor=2.827, **DS3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_router_spec_from_hf_config_class(name: str) -> None:
    family, cls, kwargs, layer_idx, expected = CASES[name]
    cfg = _config(family, cls, **kwargs)
    spec = moeflow.router_spec_from_hf(cfg, layer_idx)
    assert isinstance(spec, RouterSpec)
    assert spec == expected, f"{name}: {spec}\n  expected {expected}"
    assert "RouterSpec(" in repr(spec)


def test_kimi_k2_remote_config() -> None:
    """Kimi-K2 checkpoints ship their own config class (model_type 'kimi_k2', DeepSeek-V3 fields)."""
    cfg = types.SimpleNamespace(model_type="kimi_k2", n_routed_experts=384, num_experts_per_tok=8, n_group=1,
                                topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827, num_hidden_layers=61)
    assert moeflow.router_spec_from_hf(cfg) == _spec(num_experts=384, top_k=8, scaling_factor=2.827, **DS3)


def test_print_spec_in_a_fresh_interpreter() -> None:
    """`python -c "import moeflow; print(moeflow.router_spec_from_hf(cfg))"` in a fresh interpreter, per config class."""
    lines = []
    for name, (family, cls, kwargs, layer_idx, _) in CASES.items():
        mod = f"transformers.models.{family}.configuration_{family}"
        lines.append(f"print({name!r}, moeflow.router_spec_from_hf(importlib.import_module({mod!r}).{cls}(**{kwargs!r}),"
                     f" {layer_idx}))")
    script = "import importlib\nimport moeflow\n" + "\n".join(lines)
    if _VERSION < ALL_FAMILIES_SINCE:
        pytest.skip(f"transformers {transformers.__version__}: some config classes may be missing")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [line for line in proc.stdout.splitlines() if "RouterSpec(" in line]
    assert len(out) == len(CASES), proc.stdout
    for line, (name, (*_, expected)) in zip(out, CASES.items()):
        assert line == f"{name} {expected!r}"


def test_unsupported_family_lists_the_supported_ones() -> None:
    llama = transformers.LlamaConfig()
    with pytest.raises(ValueError, match=r"config.model_type='llama' is not a supported MoE family; supported: ") as e:
        moeflow.router_spec_from_hf(llama)
    for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe",
                   "dots1", "deepseek_v4", "gpt_oss", "llama4", "longcat_flash", "gemma4"):
        assert family in str(e.value)
        assert family in SUPPORTED_FAMILIES
    assert tuple(moeflow.SUPPORTED_FAMILIES) == SUPPORTED_FAMILIES
    with pytest.raises(ValueError, match=r"config.model_type=None is not a supported MoE family"):
        moeflow.router_spec_from_hf(types.SimpleNamespace())


def test_deepseek_v4_hash_layers_by_index() -> None:
    kw = dict(n_routed_experts=64, num_experts_per_tok=4, num_hidden_layers=6)
    cfg = _config("deepseek_v4", "DeepseekV4Config", **kw)
    hashed = [moeflow.router_spec_from_hf(cfg, i).hash_routing for i in range(6)]
    assert hashed == [t == "hash_moe" for t in cfg.mlp_layer_types] == [True, True, True, False, False, False]
    for i in range(6):
        s = moeflow.router_spec_from_hf(cfg, i)
        assert s.use_bias == (not s.hash_routing)  # hash layers have no e_score_correction_bias
    legacy = _config("deepseek_v4", "DeepseekV4Config", num_hash_layers=1, **kw)
    assert [moeflow.router_spec_from_hf(legacy, i).hash_routing for i in range(3)] == [True, False, False]
    explicit = _config("deepseek_v4", "DeepseekV4Config", mlp_layer_types=["moe", "hash_moe"] * 3, **kw)
    assert [moeflow.router_spec_from_hf(explicit, i).hash_routing for i in range(6)] == [False, True] * 3
    with pytest.raises(ValueError, match=r"layer_idx=6: expected < config.num_hidden_layers=6 \(deepseek_v4\)"):
        moeflow.router_spec_from_hf(cfg, 6)
    with pytest.raises(ValueError, match=r"layer_idx=-1: expected an int >= 0"):
        moeflow.router_spec_from_hf(cfg, -1)
    with pytest.raises(ValueError, match=r"layer_idx=True: expected an int >= 0"):
        moeflow.router_spec_from_hf(cfg, True)


def test_bad_family_fields_are_named() -> None:
    dots = _config("dots1", "Dots1Config")  # n_routed_experts defaults to None
    with pytest.raises(ValueError, match=r"config.n_routed_experts=None: expected an int \(model_type='dots1'\)"):
        moeflow.router_spec_from_hf(dots)
    ds2 = _config("deepseek_v2", "DeepseekV2Config", n_routed_experts=16, num_experts_per_tok=2)
    ds2.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match=r"config.topk_method='noaux_tc': deepseek_v2 supports 'greedy' and"):
        moeflow.router_spec_from_hf(ds2)
    ds2_groups = _config("deepseek_v2", "DeepseekV2Config", n_routed_experts=16, num_experts_per_tok=2,
                         topk_method="group_limited_greedy", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match=r"RouterSpec.n_group=3 does not divide the 16 experts"):
        moeflow.router_spec_from_hf(ds2_groups)
    gemma = _config("gemma4", "Gemma4TextConfig", enable_moe_block=False)
    with pytest.raises(ValueError, match=r"config.enable_moe_block=False: this gemma4 model has no MoE block"):
        moeflow.router_spec_from_hf(gemma)
    with pytest.raises(ValueError, match=r"config.text_config=None: a kimi_k25 config wraps its MoE text model"):
        moeflow.router_spec_from_hf(types.SimpleNamespace(model_type="kimi_k25"))
    v4 = _config("deepseek_v4", "DeepseekV4Config", n_routed_experts=16, num_experts_per_tok=2, num_hidden_layers=4)
    v4.scoring_func = "relu"
    with pytest.raises(ValueError, match=r"config.scoring_func='relu': expected sqrtsoftplus, sigmoid or softmax"):
        moeflow.router_spec_from_hf(v4, 3)


@pytest.mark.parametrize("name", list(CASES))
def test_specs_route(name: str) -> None:
    """Each family's spec is accepted by `route` with the inputs that family needs."""
    family, cls, kwargs, layer_idx, _ = CASES[name]
    spec = moeflow.router_spec_from_hf(_config(family, cls, **kwargs), layer_idx)
    S, K = spec.num_slots, spec.top_k
    kw = {}
    if spec.use_bias:
        kw["bias"] = torch.zeros(S)
    if spec.expert_scale:
        kw["expert_scale"] = torch.ones(S)
    if spec.hash_routing:
        kw["hash_table"] = torch.arange(10 * K).reshape(10, K) % spec.num_experts
        kw["input_ids"] = torch.arange(3)
    logits = torch.randn(3, S, generator=torch.Generator().manual_seed(0))
    r = moeflow.route(logits, spec, **kw)
    assert r.ids_TK.shape == (3, K) and r.weights_TK.shape == (3, K)
    assert bool((r.ids_TK >= 0).all()) and bool((r.ids_TK < S).all())
    assert not torch.isnan(r.weights_TK).any()
