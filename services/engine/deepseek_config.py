"""The config.json readers of DeepSeek-V2 and V3 (``deepseek_v2``, ``deepseek_v3``; Moonlight
and Kimi-K2 are V3): multi-head latent attention (``ArchConfig.mla``) and DeepSeek's MoE
(``MoeConfig.grouped``: the group-limited router, shared experts), as transformers 5 builds the
models; and of GLM-4.5/4.6 (``glm4_moe``): V3's MoE beside the Llama attention (partial rotary,
optional per-head q/k norms, q/k/v biases). What the configuration allows but transformers and vLLM would serve differently, or this
engine does not implement, is refused (ConfigError) rather than served wrong."""

from __future__ import annotations

import math
from typing import Any

from services.config import ConfigError

Fields = dict[str, Any]

# transformers' defaults where config.json leaves a key out (DeepseekV2Config, DeepseekV3Config,
# Glm4MoeConfig) for the MLA and MoE keys; the common reader's keys (vocab_size, eps, ...) in
# arch_families.CLASS_DEFAULTS
_MLA_DIMS = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
             "v_head_dim": 128}  # fmt: skip
_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v2": {"n_routed_experts": 64, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
                    "first_k_dense_replace": 0, "q_lora_rank": 1536, "moe_intermediate_size": 1407,
                    "n_group": None, "topk_group": None, **_MLA_DIMS},
    "deepseek_v3": {"n_routed_experts": 256, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                    "first_k_dense_replace": 3, "q_lora_rank": 1536, "moe_intermediate_size": 2048,
                    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, **_MLA_DIMS},
    "glm4_moe": {"n_routed_experts": 128, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
                 "first_k_dense_replace": 1, "moe_intermediate_size": 1408, "n_group": 1,
                 "topk_group": 1, "num_experts_per_tok": 8},
}  # fmt: skip
# the families routed as DeepSeek-V3 (sigmoid scores, the correction bias, noaux_tc)
_V3_ROUTING = ("deepseek_v3", "glm4_moe")
# the widest latent (kv_lora_rank + qk_rope_head_dim) a cache head may hold: the attention
# kernels' widest head (``kernels.triton_common.MAX_HEAD_DIM``); DeepSeek's own is 576
MAX_LATENT_WIDTH = 1024


def read_deepseek(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """(the config for the common reader, the ArchConfig fields of MLA and DeepSeek's MoE)."""
    model_type = str(cfg.get("model_type"))
    cfg = {**_DEFAULTS[model_type], **cfg}
    act = cfg.get("hidden_act") or "silu"
    if act != "silu":
        raise ConfigError(f"{model_type}: hidden_act {act!r}; only silu is supported")
    if cfg.get("mlp_bias"):  # V2's config allows biases on its MLPs (no checkpoint has them)
        raise ConfigError(f"{model_type}: mlp_bias is not supported")
    mla = _mla(model_type, cfg)
    # the paged cache holds the latent: one KV head a token, [rotary key | normed latent]
    # (``models.deepseek``); every query head attends over it (vLLM ignores
    # num_key_value_heads too; transformers needs it equal to the heads)
    width = mla.kv_lora_rank + mla.qk_rope_head_dim
    if width > MAX_LATENT_WIDTH:
        raise ConfigError(
            f"{model_type}: a latent of {mla.kv_lora_rank} + {mla.qk_rope_head_dim} rotary dims "
            f"is wider than the attention kernels' {MAX_LATENT_WIDTH}"
        )
    read = {**cfg, "head_dim": width, "num_key_value_heads": 1, "sliding_window": None}
    bias = bool(cfg.get("attention_bias", False))
    fields = {"mla": mla, "moe": _moe(model_type, cfg), "head_dim": width,
              "num_kv_heads": 1, "attention_bias": bias, "o_proj_bias": bias,
              "mlp_bias": False}  # fmt: skip
    return read, fields


def read_glm4_moe(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """GLM-4.5/4.6 as transformers' ``Glm4MoeForCausalLM``: the Llama attention with q/k/v
    biased by ``attention_bias`` (o_proj never), per-head q/k RMSNorms before the rotation with
    ``use_qk_norm``, the first ``partial_rotary_factor`` (0.5 unless given) of each head rotating
    by halves; DeepSeek-V3's MoE from ``first_k_dense_replace`` on."""
    cfg = {**_DEFAULTS["glm4_moe"], **cfg}
    act = cfg.get("hidden_act") or "silu"
    if act != "silu":
        raise ConfigError(f"glm4_moe: hidden_act {act!r}; only silu is supported")
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    partial = rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 0.5
    dim = int(head_dim * float(partial))
    if not 0.0 < float(partial) <= 1.0 or dim < 2 or dim % 2:
        raise ConfigError(
            f"glm4_moe: partial_rotary_factor {partial} gives {dim} rotary dims of head_dim "
            f"{head_dim}; it must give an even number between 2 and head_dim"
        )
    if rope.get("rope_type", rope.get("type")) == "longrope":
        raise ConfigError("glm4_moe: rope scaling 'longrope' is not supported")
    # the common reader takes the rope without the partial factor (this reader's field)
    read = {**cfg, "head_dim": head_dim, "rope_parameters": rope, "rope_scaling": None,
            "partial_rotary_factor": None, "sliding_window": None}  # fmt: skip
    fields = {"moe": _moe("glm4_moe", cfg), "partial_rotary_factor": float(partial),
              "qk_norm": bool(cfg.get("use_qk_norm", False)),
              "attention_bias": bool(cfg.get("attention_bias", False)), "o_proj_bias": False,
              "mlp_bias": False}  # fmt: skip
    return read, fields


def _positive(model_type: str, cfg: dict[str, Any], key: str, allow_zero: bool = False) -> int:
    value = cfg.get(key)
    least = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        want = "a whole number >= 0" if allow_zero else "a positive whole number"
        raise ConfigError(f"{model_type}: {key} must be {want}, got {value!r}")
    return value


def _mla(model_type: str, cfg: dict[str, Any]) -> Any:
    from services.engine.model_config import MlaConfig, scaling_kind

    dims = {key: _positive(model_type, cfg, key) for key in
            ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}  # fmt: skip
    if dims["qk_rope_head_dim"] % 2:
        raise ConfigError(f"{model_type}: qk_rope_head_dim {dims['qk_rope_head_dim']} is odd")
    q_lora = cfg.get("q_lora_rank")
    if q_lora is not None:
        q_lora = _positive(model_type, cfg, "q_lora_rank")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{model_type}: partial_rotary_factor is not supported")
    scale = (dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]) ** -0.5
    # transformers' yarn_apply_mscale: any scaled rope with mscale_all_dim scales the softmax
    m_all = rope.get("mscale_all_dim") or 0
    if scaling_kind(rope) != "default" and m_all:
        factor = float(rope["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= mscale * mscale
    # V2 rotates by complex products (dims paired); V3 pairs them where rope_interleave says
    pairs = model_type == "deepseek_v2" or bool(cfg.get("rope_interleave", True))
    return MlaConfig(q_lora_rank=q_lora or 0, rope_pairs=pairs, softmax_scale=scale, **dims)


def _moe(model_type: str, cfg: dict[str, Any]) -> Any:
    """DeepSeek's MoE as transformers builds it: every layer from ``first_k_dense_replace`` on
    sparse (``moe_layer_freq`` other than 1 refused: transformers ignores it, vLLM does not),
    ``n_shared_experts`` experts' worth of one always-on MLP beside the routed ones."""
    from services.engine.model_config import GroupedRouting, MoeConfig

    layers = _positive(model_type, cfg, "num_hidden_layers")
    experts = _positive(model_type, cfg, "n_routed_experts")
    top_k = _positive(model_type, cfg, "num_experts_per_tok")
    size = _positive(model_type, cfg, "moe_intermediate_size")
    first = _positive(model_type, cfg, "first_k_dense_replace", allow_zero=True)
    shared = _positive(model_type, cfg, "n_shared_experts", allow_zero=True)
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ConfigError(f"{model_type}: moe_layer_freq {cfg['moe_layer_freq']} is not supported")
    if top_k > experts:
        raise ConfigError(f"{model_type}: num_experts_per_tok {top_k} of {experts} experts")
    scaling = cfg.get("routed_scaling_factor")
    if isinstance(scaling, bool) or not isinstance(scaling, int | float) or not scaling > 0:
        raise ConfigError(f"{model_type}: routed_scaling_factor must be > 0, got {scaling!r}")
    v3 = model_type in _V3_ROUTING
    groups, kept, renormalize = _routing(model_type, cfg, experts, top_k)
    sparse = tuple(range(first, layers))
    if not sparse:
        return None  # every layer dense
    return MoeConfig(
        num_experts=experts, top_k=top_k, intermediate_size=size, renormalize=renormalize,
        layers=sparse, weights_in_model_dtype=False, shared_intermediate_size=shared * size,
        grouped=GroupedRouting(sigmoid=v3, num_groups=groups, topk_groups=kept,
                               scaling=float(scaling)),
    )  # fmt: skip


def _routing(
    model_type: str, cfg: dict[str, Any], experts: int, top_k: int
) -> tuple[int, int, bool]:
    """(groups, groups kept, renormalize) of the router; V2: ``topk_method`` greedy (one
    group) or group_limited_greedy; V3: noaux_tc (sigmoid scores, the correction bias)."""
    method, scoring = cfg.get("topk_method"), cfg.get("scoring_func")
    if model_type == "deepseek_v2":
        method = method or "greedy"
        if method not in ("greedy", "group_limited_greedy") or scoring not in (None, "softmax"):
            raise ConfigError(
                f"deepseek_v2: topk_method {method!r} with scoring_func {scoring!r} is not "
                "supported (greedy or group_limited_greedy over softmax scores are)"
            )
        if cfg.get("norm_topk_prob"):  # transformers ignores it, DeepSeek's code and vLLM not
            raise ConfigError("deepseek_v2: norm_topk_prob true is not supported")
        if method == "greedy":
            return 1, 1, False
    elif method not in (None, "noaux_tc") or scoring not in (None, "sigmoid"):
        raise ConfigError(
            f"{model_type}: topk_method {method!r} with scoring_func {scoring!r} is not "
            "supported (noaux_tc over sigmoid scores is)"
        )
    groups, kept = cfg.get("n_group"), cfg.get("topk_group")
    if not isinstance(groups, int) or not isinstance(kept, int) or not 1 <= kept <= groups:
        raise ConfigError(
            f"{model_type}: n_group {groups!r} and topk_group {kept!r} must be whole numbers "
            "with 1 <= topk_group <= n_group"
        )
    per_group = experts // groups
    v3 = model_type in _V3_ROUTING  # its groups rank by their two best experts
    if experts % groups or (v3 and per_group < 2):
        raise ConfigError(
            f"{model_type}: {experts} experts do not make {groups} equal groups"
            + (" of two or more" if v3 else "")
        )
    if top_k > kept * per_group:
        raise ConfigError(
            f"{model_type}: num_experts_per_tok {top_k} exceeds the {kept * per_group} experts "
            f"of the {kept} groups kept"
        )
    return groups, kept, v3 and bool(cfg.get("norm_topk_prob", True))
