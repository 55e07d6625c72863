"""Router rules: a Hugging Face config -> the RouterSpec of one MoE layer, one function per rule.

Each rule reads the HF config's own fields; the contract each encodes is in
docs/routing.md and was checked against the HF module of the pinned
transformers (tests/test_routing_hf.py). Which model types use which rule is the
family table's business (`moeflow.families`), not this module's.
"""

from __future__ import annotations

from typing import Any

from .spec import RouterSpec

__all__ = [
    "text_config", "mixtral", "qwen_olmoe", "deepseek_v3", "deepseek_v2", "deepseek_v4", "gpt_oss", "llama4",
    "longcat_flash", "gemma4",
]


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = getattr(config, name, default)
    return default if value is None else value


def _req(config: Any, name: str) -> int:
    """A required integer field of the HF config, or a ValueError naming it."""
    value = getattr(config, name, None)
    if value is None or isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"config.{name}={value!r}: expected an int (model_type={getattr(config, 'model_type', None)!r})"
        )
    return value


def text_config(config: Any) -> Any:
    """The config holding the MoE fields: multimodal wrappers (llama4, gemma4, kimi_k25) keep them in text_config."""
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        text = get_text()
        if text is not None:
            return text
    return getattr(config, "text_config", None) or config


def _softmax_family(config: Any, layer_idx: int, *, experts_field: str, always_renorm: bool = False) -> RouterSpec:
    return RouterSpec(
        score_fn="softmax",
        num_experts=_req(config, experts_field),
        top_k=_req(config, "num_experts_per_tok"),
        renorm=True if always_renorm else bool(_get(config, "norm_topk_prob", False)),
    )


def mixtral(config: Any, layer_idx: int) -> RouterSpec:
    return _softmax_family(config, layer_idx, experts_field="num_local_experts", always_renorm=True)


def qwen_olmoe(config: Any, layer_idx: int) -> RouterSpec:
    return _softmax_family(config, layer_idx, experts_field="num_experts")


def deepseek_v3(config: Any, layer_idx: int) -> RouterSpec:
    """DeepSeek-V3 / Kimi-K2 / GLM-4-MoE / dots1: sigmoid, bias, group-limited (top-2 sum)."""
    return RouterSpec(
        score_fn="sigmoid",
        num_experts=_req(config, "n_routed_experts"),
        top_k=_req(config, "num_experts_per_tok"),
        renorm=bool(_get(config, "norm_topk_prob", False)),
        renorm_eps=1e-20,
        scaling_factor=float(_get(config, "routed_scaling_factor", 1.0)),
        n_group=int(_get(config, "n_group", 1)),
        topk_group=int(_get(config, "topk_group", 1)),
        group_score="top2_sum",
        use_bias=True,
    )


def deepseek_v2(config: Any, layer_idx: int) -> RouterSpec:
    """Softmax; greedy or group_limited_greedy (group score = max). HF never renorms."""
    method = _get(config, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(
            f"config.topk_method={method!r}: deepseek_v2 supports 'greedy' and 'group_limited_greedy'"
        )
    grouped = method == "group_limited_greedy"
    return RouterSpec(
        score_fn="softmax",
        num_experts=_req(config, "n_routed_experts"),
        top_k=_req(config, "num_experts_per_tok"),
        scaling_factor=float(_get(config, "routed_scaling_factor", 1.0)),
        n_group=_req(config, "n_group") if grouped else 1,
        topk_group=_req(config, "topk_group") if grouped else 1,
        group_score="max",
    )


def deepseek_v4(config: Any, layer_idx: int) -> RouterSpec:
    """sqrt(softplus) scores, bias on the key, plain top-k; hash layers use tid2eid."""
    score = _get(config, "scoring_func", "sqrtsoftplus")
    if score not in ("sqrtsoftplus", "sigmoid", "softmax"):
        raise ValueError(f"config.scoring_func={score!r}: expected sqrtsoftplus, sigmoid or softmax")
    layer_types = list(_get(config, "mlp_layer_types", []))
    is_hash = layer_idx < len(layer_types) and layer_types[layer_idx] == "hash_moe"
    return RouterSpec(
        score_fn=score,
        num_experts=_req(config, "n_routed_experts"),
        top_k=_req(config, "num_experts_per_tok"),
        # HF's DeepseekV4 routers always renormalise (sum + 1e-20).
        renorm=True,
        renorm_eps=1e-20,
        scaling_factor=float(_get(config, "routed_scaling_factor", 1.0)),
        use_bias=not is_hash,
        hash_routing=is_hash,
    )


def gpt_oss(config: Any, layer_idx: int) -> RouterSpec:
    return RouterSpec(
        score_fn="topk_softmax", num_experts=_req(config, "num_local_experts"), top_k=_req(config, "num_experts_per_tok")
    )


def llama4(config: Any, layer_idx: int) -> RouterSpec:
    config = text_config(config)
    return RouterSpec(
        score_fn="topk_sigmoid",
        num_experts=_req(config, "num_local_experts"),
        top_k=_req(config, "num_experts_per_tok"),
        weight_on_input=True,
    )


def longcat_flash(config: Any, layer_idx: int) -> RouterSpec:
    """Softmax over E + Z, bias on the key, x routed_scaling_factor, no renorm."""
    return RouterSpec(
        score_fn="softmax",
        num_experts=_req(config, "n_routed_experts"),
        num_zero_experts=int(_get(config, "zero_expert_num", 0)),
        top_k=_req(config, "num_experts_per_tok"),
        scaling_factor=float(_get(config, "routed_scaling_factor", 1.0)),
        use_bias=True,
    )


def gemma4(config: Any, layer_idx: int) -> RouterSpec:
    config = text_config(config)
    if not _get(config, "enable_moe_block", False):
        raise ValueError("config.enable_moe_block=False: this gemma4 model has no MoE block")
    return RouterSpec(
        score_fn="softmax",
        num_experts=_req(config, "num_experts"),
        top_k=_req(config, "top_k_experts"),
        renorm=True,
        expert_scale=True,
        router_prenorm=True,
    )
