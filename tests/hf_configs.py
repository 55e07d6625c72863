"""Tiny Hugging Face configs, one per MoE family, shared by moeflow's tests.

`tiny_config(family)` returns a fresh transformers config (fp32, 2 decoder layers,
a few experts, small hidden size) for a family name of `HF_FAMILIES`;
`tiny_model(family, seed=...)` builds the CausalLM with fixed-seed random weights.
Families the installed transformers lacks are left out of `available_families()`,
never faked. Sizes are chosen so that each family exercises what makes it special
(groups, shared experts, zero experts, hash layers, biases) at the smallest shape
that keeps routing non-trivial.

Legend: H hidden size, E routed experts, K experts per token, I intermediate per expert.
"""

from __future__ import annotations

import importlib

import torch

# family -> (config class path, kwargs). Every kwarg is a plain value so that a test can
# print and reproduce it. Hidden size 32 with 2 heads of 16 keeps RoPE happy everywhere.
_COMMON = dict(vocab_size=97, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
               max_position_embeddings=128, tie_word_embeddings=False)

_TABLE: dict[str, tuple[str, dict]] = {
    "mixtral": ("transformers.MixtralConfig", dict(
        _COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("transformers.Qwen2MoeConfig", dict(
        _COMMON, num_hidden_layers=2, intermediate_size=40, moe_intermediate_size=24, num_experts=6,
        num_experts_per_tok=2, shared_expert_intermediate_size=20, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen3_moe": ("transformers.Qwen3MoeConfig", dict(
        _COMMON, num_hidden_layers=2, head_dim=16, intermediate_size=40, moe_intermediate_size=24,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "olmoe": ("transformers.OlmoeConfig", dict(
        _COMMON, num_hidden_layers=2, intermediate_size=24, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=False)),
    # group_limited_greedy with 2 groups of 4: the group mask matters.
    "deepseek_v2": ("transformers.DeepseekV2Config", dict(
        _COMMON, num_hidden_layers=2, intermediate_size=40, moe_intermediate_size=24, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=2)),
    "deepseek_v3": ("transformers.DeepseekV3Config", dict(
        _COMMON, num_hidden_layers=2, intermediate_size=40, moe_intermediate_size=24, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8, num_key_value_heads=2)),
    "glm4_moe": ("transformers.Glm4MoeConfig", dict(
        _COMMON, num_hidden_layers=2, head_dim=16, intermediate_size=40, moe_intermediate_size=24,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=0, n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5)),
    "gpt_oss": ("transformers.GptOssConfig", dict(
        _COMMON, num_hidden_layers=2, head_dim=16, intermediate_size=24, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    # moe_layers=[1]: layer 0 dense, layer 1 MoE (the 128E model interleaves).
    "llama4": ("transformers.Llama4TextConfig", dict(
        _COMMON, num_hidden_layers=2, head_dim=16, intermediate_size=24, intermediate_size_mlp=40,
        num_local_experts=4, num_experts_per_tok=1, moe_layers=[0, 1], attention_chunk_size=64,
        no_rope_layers=[1, 1])),
    # 6 routed + 2 zero experts: some picks are identities.
    "longcat_flash": ("transformers.LongcatFlashConfig", dict(
        {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}, num_layers=2,
        num_key_value_heads=2, ffn_hidden_size=40, expert_ffn_hidden_size=24, n_routed_experts=6,
        zero_expert_num=2, moe_topk=2, routed_scaling_factor=2.0, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8)),
    # layer 0 hash-routed (tid2eid), layer 1 learned sqrt-softplus routing.
    "deepseek_v4": ("transformers.DeepseekV4Config", dict(
        _COMMON, num_hidden_layers=2, head_dim=16, moe_intermediate_size=24, n_routed_experts=6,
        num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=24, o_groups=2, o_lora_rank=16,
        index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=8, hc_mult=2, hc_sinkhorn_iters=3,
        layer_types=["sliding_attention", "sliding_attention"], mlp_layer_types=["hash_moe", "moe"],
        swiglu_limit=0.05, routed_scaling_factor=1.5, num_nextn_predict_layers=0)),
    "gemma4": ("transformers.Gemma4TextConfig", dict(
        _COMMON, num_hidden_layers=2, head_dim=16, intermediate_size=40, enable_moe_block=True,
        num_experts=6, top_k_experts=2, moe_intermediate_size=24, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=97, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        global_head_dim=16, num_global_key_value_heads=1)),
}

HF_FAMILIES: tuple[str, ...] = tuple(_TABLE)


def _config_class(family: str):
    if family not in _TABLE:
        raise ValueError(f"tiny_config: family={family!r} is not one of {HF_FAMILIES}")
    path, _ = _TABLE[family]
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name, None)


def available_families() -> list[str]:
    """The families of `HF_FAMILIES` whose config class the installed transformers has."""
    return [f for f in HF_FAMILIES if _config_class(f) is not None]


def tiny_config(family: str, **overrides):
    """A fresh tiny fp32 config for `family` (kwargs in `overrides` win)."""
    cls = _config_class(family)
    if cls is None:
        raise ValueError(f"tiny_config: the installed transformers has no config class for {family!r}")
    kwargs = dict(_TABLE[family][1])
    kwargs.update(overrides)
    # Every kwarg above is accepted by both transformers 5.17 and 5.24 (checked).
    cfg = cls(**kwargs)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_model(family: str, *, seed: int = 0, **overrides):
    """`AutoModelForCausalLM.from_config(tiny_config(family))` in fp32 eval mode, fixed-seed weights.

    Biases that HF initialises to zero (e_score_correction_bias, gpt-oss expert biases,
    gemma4 per-expert scales) are filled with random values too, so that a loader or a
    patch that drops them changes the output.
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("e_score_correction_bias", "gate_up_proj_bias", "down_proj_bias"):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
            elif leaf == "per_expert_scale":
                t.copy_(1.0 + 0.5 * torch.rand(t.shape, generator=gen))
            elif leaf == "tid2eid":
                # Distinct ids per row, like a real hash table.
                num_experts = int(model.config.n_routed_experts)
                rows = [torch.randperm(num_experts, generator=gen)[: t.shape[1]] for _ in range(t.shape[0])]
                t.copy_(torch.stack(rows).to(t.dtype))
            elif name.endswith("router.bias") and family == "gpt_oss":
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    return model.eval()
