"""The config.json readers of the families that are small deltas on the Llama layout (OLMo 2
and 3, GLM and GLM-4, StarCoder2, Cohere, ERNIE 4.5, Seed-OSS, EXAONE 4, Arcee; the attention
and scalings of OLMoE, Granite MoE and ERNIE 4.5 MoE, whose experts ``moe_families`` reads):
each returns the config with the family's defaults written into the keys the common reader
(``ArchConfig.from_dict``) takes, and the ``ArchConfig`` fields the family sets; what the
family allows but this engine does not implement is refused (ConfigError) rather than served
wrong."""

from __future__ import annotations

from typing import Any

from services.config import ConfigError
from services.engine.deepseek_config import read_deepseek, read_glm4_moe

Fields = dict[str, Any]

# families whose transformers model pairs rotary dims (0, 1), (2, 3), ... rather than the
# first half with the second; the loader reorders their q and k rows (ArchConfig's
# rotary_interleaved)
INTERLEAVED_ROTARY_TYPES = ("glm", "glm4", "cohere", "ernie4_5", "ernie4_5_moe")


# What a config.json leaves out reads as transformers' config class of its model_type defaults
# it (a field's default; rope_theta: the class's default_theta; the Qwen-VL types: their text
# config's, and the outer config's image token), with no transformers at run time: these are
# those classes' defaults for the keys the readers take, applied (``with_class_defaults``)
# before the family readers. An entry is here only where the class's default differs from what
# the readers read without one: the common reader (ArchConfig.from_dict) falls back to
# rms_norm_eps 1e-6, rope_theta 10000, max_position_embeddings 4096, untied embeddings, as many
# KV heads as heads, head_dim hidden_size / heads; the family readers set some of their own (the
# eps of OLMo 2, OLMoE, StarCoder2, Cohere and ERNIE MoE, head_dim of GLM, ERNIE, Seed-OSS and
# Gemma, the rope base of gpt-oss, OLMo 3, Gemma 3, Cohere and ERNIE MoE, tied embeddings of
# StarCoder2, Cohere and the ERNIEs, DeepSeek's MLA and MoE keys). hidden_size,
# num_hidden_layers and num_attention_heads have none: a checkpoint gives them. Gemma 3's and
# Mistral 3's multimodal configs take theirs from transformers' readers (model_config).
# tests/services/engine/test_config_defaults.py holds each entry to transformers'.
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "mistral": {"vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072},
    "qwen2": {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768},
    "qwen3": {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "head_dim": 128, "max_position_embeddings": 32768},
    "qwen3_moe": {"vocab_size": 151936, "intermediate_size": 6144, "moe_intermediate_size": 768,
                  "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "num_experts": 128, "num_experts_per_tok": 8},
    "qwen2_moe": {"vocab_size": 151936, "intermediate_size": 5632, "moe_intermediate_size": 1408,
                  "num_key_value_heads": 16, "max_position_embeddings": 32768,
                  "num_experts": 60, "num_experts_per_tok": 4},
    "mixtral": {"vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
                "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 131072,
                "num_local_experts": 8, "num_experts_per_tok": 2},
    # the Qwen-VL models' text configs (Qwen2VLTextConfig, ...) and their image token
    "qwen2_vl": {"vocab_size": 152064, "intermediate_size": 29568, "num_key_value_heads": 8,
                 "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 32768,
                 "image_token_id": 151655},
    "qwen2_5_vl": {"vocab_size": 152064, "intermediate_size": 29568, "num_key_value_heads": 8,
                   "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 32768,
                   "image_token_id": 151655},
    "qwen3_vl": {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
                 "head_dim": 128, "rope_theta": 5e5, "max_position_embeddings": 128000,
                 "image_token_id": 151655},
    "gemma": {"vocab_size": 256000, "intermediate_size": 24576, "num_key_value_heads": 16,
              "max_position_embeddings": 8192, "tie_word_embeddings": True},
    "gemma2": {"vocab_size": 256000, "intermediate_size": 9216, "num_key_value_heads": 4,
               "head_dim": 256, "max_position_embeddings": 8192, "tie_word_embeddings": True},
    "gemma3_text": {"vocab_size": 262208, "intermediate_size": 9216, "num_key_value_heads": 4,
                    "head_dim": 256, "max_position_embeddings": 131072,
                    "tie_word_embeddings": True},
    "phi3": {"vocab_size": 32064, "intermediate_size": 8192, "rms_norm_eps": 1e-5,
             "original_max_position_embeddings": 4096},
    "smollm3": {"vocab_size": 128256, "intermediate_size": 11008, "num_key_value_heads": 4,
                "rope_theta": 2e6, "max_position_embeddings": 32768, "tie_word_embeddings": True},
    "granite": {"vocab_size": 32000, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "gpt_oss": {"vocab_size": 201088, "intermediate_size": 2880, "num_key_value_heads": 8,
                "head_dim": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                "num_local_experts": 128, "num_experts_per_tok": 4},
    "olmo2": {"vocab_size": 50304, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "olmo3": {"vocab_size": 50304, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "glm": {"vocab_size": 151552, "intermediate_size": 13696, "num_key_value_heads": 2,
            "rms_norm_eps": 1.5625e-7, "max_position_embeddings": 131072},
    "glm4": {"vocab_size": 151552, "intermediate_size": 13696, "num_key_value_heads": 2,
             "rms_norm_eps": 1.5625e-7, "max_position_embeddings": 131072},
    "starcoder2": {"vocab_size": 49152, "intermediate_size": 12288, "num_key_value_heads": 2},
    "cohere": {"vocab_size": 256000, "intermediate_size": 22528, "max_position_embeddings": 8192},
    "ernie4_5": {"vocab_size": 103424, "intermediate_size": 3072, "num_key_value_heads": 2,
                 "rms_norm_eps": 1e-5, "rope_theta": 5e5, "max_position_embeddings": 131072},
    "seed_oss": {"vocab_size": 155136, "intermediate_size": 27648, "num_key_value_heads": 8,
                 "max_position_embeddings": 524288},
    "exaone4": {"vocab_size": 102400, "intermediate_size": 16384, "num_key_value_heads": 32,
                "rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
    "arcee": {"vocab_size": 32000, "intermediate_size": 18432, "rms_norm_eps": 1e-5},
    "deepseek_v2": {"vocab_size": 102400, "intermediate_size": 11008,
                    "max_position_embeddings": 2048},
    "deepseek_v3": {"vocab_size": 129280, "intermediate_size": 18432},
    "glm4_moe": {"vocab_size": 151552, "intermediate_size": 10944, "num_key_value_heads": 8,
                 "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
    "olmoe": {"vocab_size": 50304, "intermediate_size": 2048},
    "granitemoe": {"vocab_size": 32000, "intermediate_size": 11008,
                   "max_position_embeddings": 2048},
    "granitemoeshared": {"vocab_size": 32000, "intermediate_size": 11008,
                         "max_position_embeddings": 2048},
    "ernie4_5_moe": {"vocab_size": 103424, "intermediate_size": 12288, "num_key_value_heads": 4,
                     "max_position_embeddings": 131072},
}  # fmt: skip
# the families whose transformers config reads num_experts and num_local_experts as one key (its
# attribute_map): a default for it stands only where the file gives neither
_EXPERTS_KEYS = ("num_experts", "num_local_experts")
_ONE_EXPERTS_KEY = ("qwen3_moe", "mixtral", "gpt_oss")


def with_class_defaults(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with ``CLASS_DEFAULTS`` for the keys it leaves out; what it says stands (a
    rope_theta default under its rope_parameters' or rope_scaling's too, which the readers
    take first)."""
    given = set(cfg)
    if model_type in _ONE_EXPERTS_KEY and given & set(_EXPERTS_KEYS):
        given |= set(_EXPERTS_KEYS)
    defaults = CLASS_DEFAULTS.get(model_type, {})
    return {**{k: v for k, v in defaults.items() if k not in given}, **cfg}


def read_family(model_type: str, cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """(the config for the common reader, the family's own ArchConfig fields); the config as
    it was and no fields for a family read by the common reader alone."""
    reader = _READERS.get(model_type)
    return reader(cfg) if reader is not None else (cfg, {})


def _olmo2(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """OLMo 2: norms after attention and after the MLP (none before), q and k RMSNorms over
    the whole projection (every head at once); transformers' rms_norm_eps default 1e-5."""
    _check_act(str(cfg.get("model_type")), cfg, "silu")
    return {**cfg, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5)}, {"qk_norm_whole": True}


def _olmo3(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """OLMo 3: OLMo 2 with sliding layers (``layer_types``, else every fourth layer full), a
    4096-key window by default, and a rotary table per layer type as transformers 5 reads
    them: ``rope_parameters`` per type, or the older ``rope_theta`` (default 500000) with
    ``rope_scaling`` for the full layers alone; the sliding layers' must be default
    frequencies."""
    read, fields = _olmo2(cfg)
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)
    ]
    params = dict(cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta", 500_000.0)
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # the older keys (the published configs'), or one set of parameters for both
        full = {**(cfg.get("rope_scaling") or {}), **params}
        local = {"rope_type": "default", "rope_theta": params.get("rope_theta", theta)}
    full.setdefault("rope_theta", theta)
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        raise ConfigError(f"olmo3: rope scaling {kind!r} on the sliding layers is not supported")
    local_theta = float(local.get("rope_theta", theta))
    read = {**read, "rope_parameters": full, "rope_scaling": None, "layer_types": types,
            "sliding_window": cfg.get("sliding_window", 4096)}  # fmt: skip
    # one table serves both kinds of layer where their frequencies are the same
    same = (
        full.get("rope_type", full.get("type", "default")) == "default"
        and float(full["rope_theta"]) == local_theta
    )
    return read, {**fields, "local_rope_theta": 0.0 if same else local_theta}


def _glm(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """GLM (glm-4-9b-hf) and GLM-4 (GLM-4-0414): Llama's layers with biased q/k/v (not o),
    half of each head rotating (``partial_rotary_factor``, 0.5 unless given) with its dims
    paired (0, 1), (2, 3), ..., gate and up stored as one ``gate_up_proj``; head_dim 128 unless
    given. GLM-4 adds a norm after attention and after the MLP (four a layer)."""
    model_type = str(cfg.get("model_type"))
    _check_act(model_type, cfg, "silu")
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "longrope":
        raise ConfigError(f"{model_type}: rope scaling 'longrope' is not supported")
    read = {**cfg, "head_dim": cfg.get("head_dim") or 128, "partial_rotary_factor": partial,
            "attention_bias": cfg.get("attention_bias", True)}  # fmt: skip
    return read, {"rotary_interleaved": True}


def _starcoder2(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """StarCoder2: LayerNorms with a bias (``norm_epsilon``), a GELU-tanh MLP of two biased
    projections (c_fc, c_proj), biases on every attention projection (``use_bias``), tied
    embeddings by default, every layer through ``sliding_window`` when one is given."""
    _check_act("starcoder2", cfg, "gelu_pytorch_tanh")
    bias = bool(cfg.get("use_bias", True))
    read = {**cfg, "rms_norm_eps": cfg.get("norm_epsilon", 1e-5), "attention_bias": bias,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}  # fmt: skip
    return read, {"mlp_bias": bias}


def _cohere(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """Cohere (Command-R): attention and MLP side by side from one bias-free LayerNorm
    (``layer_norm_eps``), rotary dims paired (0, 1), (2, 3), ..., logits times ``logit_scale``
    (0.0625 unless given), a rotary base of 500000 unless given, tied embeddings, and with ``use_qk_norm`` a LayerNorm of each q and
    k head (its own weight per head)."""
    _check_act("cohere", cfg, "silu")
    scale = cfg.get("logit_scale", 0.0625)
    if not isinstance(scale, int | float) or isinstance(scale, bool) or not scale > 0:
        raise ConfigError(f"cohere: logit_scale must be a positive number, got {scale!r}")
    read = {**cfg, "rms_norm_eps": cfg.get("layer_norm_eps", 1e-5),
            "rope_theta": cfg.get("rope_theta", 500_000.0),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}  # fmt: skip
    fields = {"rotary_interleaved": True, "logit_scale": float(scale),
              "qk_norm": bool(cfg.get("use_qk_norm", False))}  # fmt: skip
    return read, fields


def _ernie4_5(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """ERNIE 4.5 (dense): rotary dims paired (0, 1), (2, 3), ... (whole heads), ``use_bias`` on
    every projection, head_dim 128 and tied embeddings unless given."""
    _check_act("ernie4_5", cfg, "silu")
    bias = bool(cfg.get("use_bias", False))
    read = {**cfg, "head_dim": cfg.get("head_dim") or 128, "attention_bias": bias,
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}  # fmt: skip
    return read, {"mlp_bias": bias, "o_proj_bias": bias}


def _seed_oss(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """Seed-OSS: Llama's layers with q/k/v biased by ``attention_bias`` (True unless given),
    o_proj by ``attention_out_bias``, the MLP by ``mlp_bias``; head_dim 128 unless given."""
    _check_act("seed_oss", cfg, "silu")
    read = {**cfg, "head_dim": cfg.get("head_dim") or 128,
            "attention_bias": cfg.get("attention_bias", True)}  # fmt: skip
    return read, {"o_proj_bias": bool(cfg.get("attention_out_bias", False)),
                  "mlp_bias": bool(cfg.get("mlp_bias", False))}  # fmt: skip


def _exaone4(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """EXAONE 4: OLMo 2's layers (norms after each branch) with Qwen3's per-head q/k norms; with
    a ``sliding_window`` its sliding layers (``layer_types``, else those off every
    ``sliding_window_pattern``-th: an int, or a string of L (local) and G (global) repeated)
    attend through it and rotate, the others attend to everything without rotary embedding;
    without one, every layer is global and rotates."""
    _check_act("exaone4", cfg, "silu")
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window", 4096)  # transformers' default when the key is absent
    if window is None:
        return {**cfg, "sliding_window": None, "layer_types": None}, {}
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern", 4)
    if types is None and isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        types = ["sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
                 for i in range(layers)]  # fmt: skip
    elif types is None and isinstance(pattern, int) and pattern > 0:
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]  # fmt: skip
    elif types is None:
        raise ConfigError(f"exaone4: sliding_window_pattern {pattern!r} is not supported")
    if len(types) != layers:
        raise ConfigError(f"exaone4: layer_types names {len(types)} of {layers} layers")
    nope = tuple(i for i, t in enumerate(types) if t != "sliding_attention")
    return {**cfg, "sliding_window": window, "layer_types": types}, {"nope_layers": nope}


def _arcee(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """Arcee (AFM): Llama's layers with an ungated MLP, ``down(relu(up(x)) ** 2)``."""
    _check_act("arcee", cfg, "relu2")
    return cfg, {"mlp_bias": bool(cfg.get("mlp_bias", False))}


def _olmoe(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """OLMoE: OLMo 2's q and k RMSNorms over the whole projection, but Llama's norms before
    each branch; ``attention_bias`` biases o_proj too; q, k (after their norms) and v clipped
    to +-``clip_qkv`` when given. Its norms' widths are the hidden size: a head_dim other than
    hidden_size / heads is refused (transformers' model cannot be built with one either)."""
    _check_act("olmoe", cfg, "silu")
    heads, hidden = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ConfigError(f"olmoe: head_dim {head_dim} must be hidden_size / num_attention_heads")
    clip = cfg.get("clip_qkv")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int | float)
                             or not clip > 0):  # fmt: skip
        raise ConfigError(f"olmoe: clip_qkv must be a positive number or null, got {clip!r}")
    read = {**cfg, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5), "head_dim": None}
    fields = {"qk_norm": True, "qk_norm_whole": True, "clip_qkv": float(clip or 0.0),
              "o_proj_bias": bool(cfg.get("attention_bias"))}  # fmt: skip
    return read, fields


def _granitemoe(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """Granite MoE (and with its shared MLP): the dense Granite's layers and scalings
    (``model_config`` reads them for the three), a SiLU-gated MLP in each expert."""
    _check_act(str(cfg.get("model_type")), cfg, "silu")
    return cfg, {}


def _ernie4_5_moe(cfg: dict[str, Any]) -> tuple[dict[str, Any], Fields]:
    """ERNIE 4.5 MoE's attention and dense layers: the dense ERNIE 4.5's rotary pairing, head_dim
    hidden_size / heads unless given, a rotary base of 500000, tied embeddings and
    rms_norm_eps 1e-5 unless given; ``use_bias`` (every projection and the lm_head biased) is
    refused."""
    _check_act("ernie4_5_moe", cfg, "silu")
    if cfg.get("use_bias"):
        raise ConfigError(
            "ernie4_5_moe: use_bias (biased projections and lm_head) is not supported"
        )
    read = {**cfg, "rope_theta": cfg.get("rope_theta", 500_000.0), "attention_bias": False,
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5),
            "tie_word_embeddings": cfg.get("tie_word_embeddings", True)}  # fmt: skip
    return read, {}


def _check_act(model_type: str, cfg: dict[str, Any], want: str) -> None:
    act = cfg.get("hidden_act") or want
    if act != want:
        raise ConfigError(f"{model_type}: hidden_act {act!r}; only {want} is supported")


_READERS = {
    "deepseek_v2": read_deepseek,
    "deepseek_v3": read_deepseek,
    "glm4_moe": read_glm4_moe,
    "olmo2": _olmo2,
    "olmo3": _olmo3,
    "glm": _glm,
    "glm4": _glm,
    "starcoder2": _starcoder2,
    "cohere": _cohere,
    "ernie4_5": _ernie4_5,
    "seed_oss": _seed_oss,
    "exaone4": _exaone4,
    "arcee": _arcee,
    "olmoe": _olmoe,
    "granitemoe": _granitemoe,
    "granitemoeshared": _granitemoe,
    "ernie4_5_moe": _ernie4_5_moe,
}
