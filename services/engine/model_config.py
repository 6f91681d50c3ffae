"""The architecture facts the engine needs, read from a Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.config import ConfigError
from services.engine.arch_families import (
    INTERLEAVED_ROTARY_TYPES,
    read_family,
    with_class_defaults,
)
from services.engine.moe_families import MOE_FAMILY_TYPES, moe_fields

SUPPORTED = {
    "llama": "Llama 2/3, SmolLM",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "qwen2_moe": "Qwen1.5-MoE, Qwen2-MoE (with their shared expert)",
    "mixtral": "Mixtral",
    "qwen2_vl": "Qwen2-VL (images)",
    "qwen2_5_vl": "Qwen2.5-VL (images)",
    "qwen3_vl": "Qwen3-VL (images)",
    "gemma": "Gemma (the first; CodeGemma)",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
    "gemma3": "Gemma 3 4B-27B (images)",
    "mistral3": "Mistral Small 3.1/3.2, Magistral Small (images)",
    "phi3": "Phi-3, Phi-3.5, Phi-4, Phi-4-mini",
    "smollm3": "SmolLM3 (its layers without rotary embedding)",
    "granite": "Granite 3.x (dense)",
    "gpt_oss": "gpt-oss (its MXFP4 experts dequantized at load)",
    "olmo2": "OLMo 2",
    "olmo3": "OLMo 3",
    "glm": "GLM-4 (glm-4-9b-hf and its chat)",
    "glm4": "GLM-4-0414",
    "starcoder2": "StarCoder2",
    "cohere": "Command-R (Cohere)",
    "ernie4_5": "ERNIE 4.5 (dense)",
    "seed_oss": "Seed-OSS",
    "exaone4": "EXAONE 4.0",
    "arcee": "Arcee (AFM)",
    "deepseek_v2": "DeepSeek-V2, V2-Lite, V2.5 (MLA, DeepSeek MoE)",
    "deepseek_v3": "DeepSeek-V3, R1, Moonlight, Kimi-K2 (MLA, DeepSeek MoE; bf16 weights)",
    "glm4_moe": "GLM-4.5, GLM-4.6 (DeepSeek's MoE; bf16 weights)",
    "olmoe": "OLMoE",
    "granitemoe": "Granite 3.x MoE",
    "granitemoeshared": "Granite MoE with a shared expert",
    "ernie4_5_moe": "ERNIE 4.5 MoE (text)",
}
# checkpoints that store q/k/v as one qkv_proj and gate/up as one gate_up_proj (as our layers)
FUSED_CHECKPOINT_TYPES = ("phi3",)
VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # Qwen-VL's (M-RoPE); mistral3 has images too
SUPPORTED_SCALING = (
    "default",
    "linear",
    "llama3",
    "yarn",
    "longrope",
)  # rope scaling (services.engine.rope)
# families whose config turns sliding-window attention on with use_sliding_window
# (_sliding_layers says for which layers)
_QWEN_TYPES = ("qwen2", "qwen3", "qwen3_moe", "qwen2_vl", "qwen2_5_vl")
MOE_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss", *MOE_FAMILY_TYPES)
_O_BIAS_TYPES = (
    "llama",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "granite",
    "gpt_oss",
    "olmo2",
    "olmo3",
    "starcoder2",
    "cohere",
    "arcee",
    "granitemoe",
    "granitemoeshared",
)  # attention_bias biases o_proj too
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl", "gemma3_text", "olmo2", "olmo3", "exaone4")
# keys of MoE variants this engine does not implement: refused rather than served wrong
_SHARED_EXPERT_KEYS = ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")


# a Gemma 3 checkpoint with vision (served as its language model), or a Mistral 3 one: its
# language model's tensors under the names of the text-only model (as uploaded with
# transformers 4, and as transformers 5 saves them); the vision tower's and the projector's,
# skipped (Gemma 3) or read by mistral3_name
_LANGUAGE_NAMES = (
    ("language_model.model.", "model."), ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)  # fmt: skip
# a vision-language model's vision tower and projector, by the names our models hold them
VISION_TOWERS = ("visual.", "model.visual.", "vision_tower.", "multi_modal_projector.")
_OTHER_TOWERS = (
    "vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.",
)  # fmt: skip


def language_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text-only model names it; None for a tensor
    of another tower."""
    if name.startswith(_OTHER_TOWERS):
        return None
    for prefix, plain in _LANGUAGE_NAMES:
        if name.startswith(prefix):
            return plain + name[len(prefix) :]
    return name


def mistral3_name(name: str) -> str:
    """A Mistral 3 checkpoint's tensor name as our model holds it: the language model's as the
    text-only model names it, the vision tower's and the projector's at the top (without
    transformers 5's ``model.``)."""
    if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        return name[len("model.") :]
    return language_model_name(name) or name


def gemma3_name(name: str) -> str:
    """A Gemma 3 checkpoint's tensor name as our model holds it: the language model's as the
    text-only model names it, the SigLIP tower's and the projector's at the top, without
    transformers 5's ``model.`` or the Hub's ``vision_model.`` inside the tower."""
    if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
        name = name[len("model.") :]
    if name.startswith("vision_tower.vision_model."):
        return "vision_tower." + name[len("vision_tower.vision_model.") :]
    return language_model_name(name) or name


def multimodal_names(name: str) -> tuple[str, ...]:
    """The names a text-only model's tensor or module ``name`` has in the multimodal
    checkpoints of the families served as their language model (the inverse of
    :func:`language_model_name`), for matching what such a checkpoint's config lists."""
    return tuple(prefix + name[len(plain) :] for prefix, plain in _LANGUAGE_NAMES
                 if name.startswith(plain))  # fmt: skip


def scaling_kind(scaling: dict[str, Any] | None) -> str:
    """The rope scaling's kind as transformers names it (``mrope``, Qwen2-VL's published name
    for its default frequencies, reads as default)."""
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    return "default" if kind == "mrope" else str(kind)


# the variables that let --max-model-len exceed the model's own maximum (vLLM's, then ours)
ALLOW_LONG_MAX_MODEL_LEN_ENV = ("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "TANDEM_ALLOW_LONG_MAX_MODEL_LEN")


def derived_max_model_len(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The longest context the model's config says it handles, as vLLM derives it: the config's
    max_position_embeddings, times the rope scaling's factor where the scaling stretches the
    trained length (linear, dynamic; YaRN stretches its original_max_position_embeddings).
    Llama 3's and LongRoPE's configs already give the stretched length."""
    scaling = scaling or {}
    kind = scaling_kind(scaling)
    factor = scaling.get("factor")
    if kind in ("default", "llama3", "longrope", "su") or not factor:
        return max_position_embeddings
    base = max_position_embeddings
    if kind == "yarn":
        base = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    return int(base * float(factor))


def allow_long_max_model_len(environ: Mapping[str, str]) -> str | None:
    """The variable that allows a --max-model-len beyond the model's maximum, if one is set."""
    for name in ALLOW_LONG_MAX_MODEL_LEN_ENV:
        if environ.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return name
    return None


@dataclass(frozen=True)
class GemmaConfig:
    """What Gemma 2 and 3 add to the Llama layout: RMSNorms whose weight applies as
    ``1 + weight`` (the product in fp32), a norm after attention and around the MLP (four a
    layer), a GELU (tanh) MLP, token embeddings scaled by ``sqrt(hidden_size)``, the softmax
    scale from ``query_pre_attn_scalar``, and the sliding layers' own rotary base (default
    frequencies). Gemma 2's attention scores and final logits are soft-capped (``cap *
    tanh(x / cap)``); Gemma 3 norms q and k instead (``ArchConfig.qk_norm``)."""

    embed_scale: float
    query_scale: float
    local_rope_theta: float
    attn_softcap: float = 0.0  # Gemma 2's attn_logit_softcapping; 0: none
    final_softcap: float = 0.0  # Gemma 2's final_logit_softcapping; 0: none
    sandwich_norms: bool = True  # four norms a layer; the first Gemma: two, as Llama's


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's router (``kernels.moe.ref_grouped_topk``): V2's softmax scores (its greedy
    method: one group), V3's sigmoid scores with a learned correction bias that only chooses;
    the ``topk_groups`` best of ``num_groups`` expert groups kept, the weights times
    ``scaling`` (``routed_scaling_factor``). Its shared experts (``MoeConfig``'s
    ``shared_intermediate_size``) are one ungated-sum MLP, not Qwen2-MoE's gated one."""

    sigmoid: bool
    num_groups: int
    topk_groups: int
    scaling: float


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention: q through ``q_proj``, or ``q_a_proj`` ->
    ``q_a_layernorm`` -> ``q_b_proj`` (``q_lora_rank`` > 0); ``kv_a_proj_with_mqa`` gives a
    latent of ``kv_lora_rank`` (normed, then ``kv_b_proj`` into each head's nope key and value)
    and one rotary key part of ``qk_rope_head_dim`` shared by every head. The engine caches the
    latent (``models.deepseek``): ``ArchConfig.head_dim`` is ``qk_rope_head_dim +
    kv_lora_rank``, one KV head, one plane (``ArchConfig.kv_planes``)."""

    q_lora_rank: int  # 0: q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # the checkpoint pairs rotary dims (0, 1), (2, 3), ... (V2's complex rotation, V3's
    # rope_interleave): the loader reorders the rotary rows into halves, as GLM's
    rope_pairs: bool
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of a Mixture-of-Experts model: ``top_k`` of ``num_experts`` SiLU-gated
    experts per token, routed by a softmax over the router's logits."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k weights divided by their sum (Mixtral; Qwen3 norm_topk_prob)
    layers: tuple[int, ...]  # the decoder layers with a sparse block; the others are dense
    weights_in_model_dtype: bool  # Qwen3-MoE rounds the router weights to it, Mixtral keeps fp32
    # Qwen2-MoE's shared expert: a SiLU-gated MLP of this width every token goes through, its
    # output times sigmoid(shared_expert_gate(x)) added to the experts'; 0: none
    shared_intermediate_size: int = 0
    # False: the shared expert's output added as it is, no gate (Granite MoE's shared MLP)
    shared_gate: bool = True
    # ERNIE 4.5: a learned bias per expert added to the softmax probabilities to choose the
    # top-k (their weights are the probabilities without it), and the router kept in float32
    correction_bias: bool = False
    router_fp32: bool = False
    # gpt-oss: a bias on the router and on each expert's projections, and its clamped SwiGLU
    # (gate clamped above at swiglu_limit, up to +-swiglu_limit, (up + 1) * gate *
    # sigmoid(swiglu_alpha * gate)) instead of silu(gate) * up; swiglu_limit 0: SiLU gating
    biases: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    # the checkpoint stores the experts as MXFP4 blocks and scales (gpt-oss's published
    # weights), dequantized to the model's dtype as they load
    mxfp4: bool = False
    grouped: GroupedRouting | None = None  # DeepSeek's router; None: moe_routing's softmax


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower of a Qwen2-VL model (``vision_config``) and how its output meets the
    language model: the image placeholder token and the M-RoPE split of the rotary frequencies."""

    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int  # the language model's width
    image_token_id: int
    mrope_section: tuple[int, ...]  # frequencies rotated by t, h, w positions
    # Qwen2.5-VL: RMSNorm and a gated SiLU MLP of this width, attention within windows of
    # window_size pixels except in the full-attention blocks; 0 / () for Qwen2-VL
    intermediate_size: int = 0
    window_size: int = 0
    full_attention_blocks: tuple[int, ...] = ()
    model_type: str = "qwen2_vl"  # or qwen2_5_vl, qwen3_vl
    # Qwen3-VL: learned patch positions (a square table of this many, resampled to each grid),
    # the rotary frequencies' axes interleaved (t, h, w, t, h, w, ...) rather than in sections,
    # and DeepStack: the outputs of these vision blocks, each through its own merger, added to
    # the image tokens' hidden states after decoder layers 0, 1, ...
    num_position_embeddings: int = 0
    mrope_interleaved: bool = False
    deepstack_blocks: tuple[int, ...] = ()
    vision_rope_theta: float = 10000.0
    # Mistral 3 (Pixtral's tower, model_type mistral3): the activation of its gated MLP and of
    # the projector's, the projector's biases and RMSNorm eps, and the tower's outputs it reads
    # (its hidden states by index, 0: the normed patch embeddings, i: block i's output)
    hidden_act: str = ""
    projector_act: str = ""
    projector_bias: bool = False
    projector_eps: float = 1e-5
    feature_layer: int = -1
    # Gemma 3 (a SigLIP tower, model_type gemma3): LayerNorms of projector_eps, learned patch
    # positions (num_position_embeddings, a square image), hidden_act its MLP's; the projector
    # average-pools spatial_merge_size x spatial_merge_size squares of patches. Its language
    # model attends both ways among one image's tokens (``bidirectional``)

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens attend to each other both ways in the language model
        (Gemma 3): each image's tokens are then computed in one prefill chunk."""
        return self.model_type == "gemma3"

    @property
    def windowed(self) -> bool:
        return self.window_size > 0

    @property
    def mrope(self) -> bool:
        """Whether the image tokens take 3-D rotary positions (Qwen-VL's M-RoPE); Mistral 3's
        are plain positions."""
        return self.model_type not in ("mistral3", "gemma3")

    @property
    def qwen3(self) -> bool:
        return self.model_type == "qwen3_vl"


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k and v projections
    o_proj_bias: bool = False  # Llama's and Qwen3's attention_bias biases o_proj too
    mlp_bias: bool = False  # Llama's mlp_bias: the gate, up and down projections
    qk_norm: bool = False
    torch_dtype: str = "float32"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    quantization_config: dict[str, Any] = field(default_factory=dict)  # HF's, as written
    moe: MoeConfig | None = None
    vision: VisionConfig | None = None  # a vision-language model's tower
    gemma: GemmaConfig | None = None  # Gemma 3's differences from the Llama layout
    # keys a query sees (itself included) in the layers of sliding_layers, as transformers'
    # sliding-window mask; None (and no layers): every layer attends to the whole context
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # the model_type of a multimodal checkpoint of which only the language model is served
    # ("gemma3"; "mistral3" without its preprocessor_config.json beside it, or quantized):
    # its other towers' weights are skipped, and no request may carry images
    language_of: str = ""
    # layers whose queries and keys are not rotated (SmolLM3's NoPE layers, no_rope_layers 0)
    nope_layers: tuple[int, ...] = ()
    # the share of each head's dims that rotate (Phi-4-mini: 0.75); the rest pass unrotated
    partial_rotary_factor: float = 1.0
    # Granite's scalings: token embeddings times embedding_multiplier, each attention and MLP
    # output times residual_multiplier before it joins the residual stream, the softmax scale
    # attention_multiplier (0: head_dim ** -0.5), the logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 0.0
    logits_scaling: float = 1.0
    # gpt-oss: one learned logit per query head joins each softmax (its value vector zero)
    attention_sinks: bool = False
    # OLMo 2's q and k RMSNorms: over the whole projection (every head at once), not per head
    qk_norm_whole: bool = False
    # GLM's and Cohere's rotary pairs dims (0, 1), (2, 3), ... of each head (the rotated
    # ones): the loader reorders the rows of q_proj and k_proj (and Cohere's per-head q/k
    # norm weights) to (0, 2, 4, ..., 1, 3, 5, ...) so that the engine's rotation of the
    # first half with the second computes it; q . k is unchanged by the common reordering
    rotary_interleaved: bool = False
    # OLMo 3's sliding layers' own rotary base (default frequencies) where their table differs
    # from the full layers' (which take rope_scaling); 0: every layer rotates by cos_sin
    local_rope_theta: float = 0.0
    # Cohere's: the logits times this
    logit_scale: float = 1.0
    # DeepSeek's multi-head latent attention (the cache holds its latent: one KV head of
    # kv_lora_rank + qk_rope_head_dim dims, one plane)
    mla: MlaConfig | None = None
    # OLMoE's clip_qkv: q, k (after their norms) and v clamped to +-clip_qkv; 0: not clipped
    clip_qkv: float = 0.0

    @property
    def language_only(self) -> str:
        """Why a multimodal checkpoint's images are refused (``language_of`` set); ""."""
        if self.language_of in ("mistral3", "gemma3"):
            return (
                f"{self.language_of}'s vision tower is served only from a checkpoint with its "
                "image processor's preprocessor_config.json, unquantized"
            )
        return f"{self.language_of}'s vision tower is not supported yet" if self.language_of else ""

    @property
    def rotary_dim(self) -> int:
        """The dims of each query and key head that rotary embedding turns (the first ones)."""
        if self.mla is not None:  # its cache rows and queries laid out [rope | latent]
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def window(self, layer: int) -> int:
        """The keys a query of ``layer`` sees, itself included; 0: the whole context."""
        if self.sliding_window is None or layer not in self.sliding_layers:
            return 0
        return self.sliding_window

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ArchConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED:
            known = ", ".join(f"{k} ({v})" for k, v in SUPPORTED.items())
            raise ConfigError(f"model_type {model_type!r} is not supported; supported: {known}")
        _check_head(cfg.get("architectures"))
        vision, gemma, language_of = None, None, ""
        if model_type == "gemma3":
            vision = _siglip_config(cfg)
            cfg, model_type = _gemma3_language(cfg), "gemma3_text"
        elif model_type == "mistral3":
            vision = _pixtral_config(cfg)
            cfg, model_type = _mistral3_language(cfg), "mistral"
        elif model_type in VL_TYPES:  # the language model's keys: text_config's over the top's
            cfg = {**cfg, **(cfg.get("text_config") or {}), "model_type": model_type}
        # transformers' defaults for what the file leaves out (Gemma 3's and Mistral 3's
        # language models already have theirs, from transformers' readers above)
        cfg = with_class_defaults(model_type, cfg)
        if model_type == "gemma3_text":
            cfg, gemma = _gemma3(cfg)
        elif model_type == "gemma2":
            cfg, gemma = _gemma2(cfg)
        elif model_type == "gemma":
            cfg, gemma = _gemma1(cfg)
        elif model_type == "gpt_oss":
            cfg = _gpt_oss(cfg)
        cfg, family = read_family(model_type, cfg)
        if model_type in VL_TYPES:
            vision = _vision_config(model_type, cfg)
        heads = int(cfg["num_attention_heads"])
        window, windowed = _sliding_layers(model_type, cfg)
        # as transformers builds each family: Qwen2's q/k/v always have biases, Mistral's and
        # Mixtral's never, the others' as attention_bias says
        if model_type in ("qwen2", "qwen2_vl", "qwen2_5_vl"):
            qkv_bias = True
        elif model_type == "qwen2_moe":
            qkv_bias = bool(cfg.get("qkv_bias", True))
        else:
            qkv_bias = model_type not in ("mistral", "mixtral") and bool(cfg.get("attention_bias"))
        silu = model_type not in MOE_TYPES and gemma is None and not family
        if silu and cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(
                f"{model_type}: hidden_act {cfg['hidden_act']!r}; only silu is supported"
            )
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = scaling_kind(rope)
        if kind not in SUPPORTED_SCALING:
            raise ConfigError(
                f"{model_type}: rope scaling {kind!r} is not supported "
                f"({', '.join(SUPPORTED_SCALING)} are)"
            )
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        partial = _partial_rotary(model_type, cfg, rope, head_dim)
        if kind == "longrope":
            if model_type in (*VL_TYPES, "gemma", "gemma2", "gemma3_text"):
                raise ConfigError(f"{model_type}: rope scaling 'longrope' is not supported")
            rope = _longrope_config(model_type, cfg, rope, int(head_dim * partial))
        elif kind != "default" and not isinstance(rope.get("factor"), int | float):
            raise ConfigError(f"{model_type}: rope scaling {kind!r} needs a factor")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        fields: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=qkv_bias and model_type in _O_BIAS_TYPES,
            mlp_bias=model_type in ("llama", "granite") and bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in _QK_NORM_TYPES,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            quantization_config=_checkpoint_quantization(model_type, cfg),
            moe=_moe_config(model_type, cfg) if model_type in MOE_TYPES else None,
            vision=vision,
            gemma=gemma,
            sliding_window=window,
            sliding_layers=windowed,
            language_of=language_of,
            nope_layers=_nope_layers(model_type, cfg),
            partial_rotary_factor=partial,
            **_granite_scalings(model_type, cfg),
            attention_sinks=model_type == "gpt_oss",
            qk_norm_whole=False,
            rotary_interleaved=model_type in INTERLEAVED_ROTARY_TYPES,
        )
        return cls(**{**fields, **family})  # the family's fields over the common reader's

    @classmethod
    def from_file(cls, path: Path) -> ArchConfig:
        """A checkpoint's config.json; ConfigError (naming the file) if it is not valid JSON,
        not an object, or lacks a field the architecture needs or holds one of the wrong type."""
        try:
            cfg = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path} is not a readable JSON model config: {e}") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
        try:
            arch = cls.from_dict(cfg)
        except KeyError as e:
            raise ConfigError(f"{path} lacks {e.args[0]!r}, which the model needs") from None
        except ConfigError as e:  # says what is wrong already (an unsupported model_type)
            raise ConfigError(f"{path}: {e}") from None
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise ConfigError(f"{path} has a field of the wrong type or value: {e}") from None
        # Mistral3Config ties by default, but the published checkpoints hold their own lm_head:
        # transformers then leaves the two apart (its tie_weights), as here
        if (
            arch.vision is not None
            and arch.vision.model_type in ("mistral3", "gemma3")
            and not (Path(path).parent / "preprocessor_config.json").is_file()
        ):  # no image processor to serve images with: the language model alone, images refused
            arch = dataclasses.replace(arch, vision=None, language_of=arch.vision.model_type)
        if (
            arch.model_type == "mistral"
            and (arch.vision is not None or arch.language_of == "mistral3")
            and arch.tie_word_embeddings
            and _MISTRAL3_LM_HEADS & tensor_names(Path(path).parent)
        ):
            arch = dataclasses.replace(arch, tie_word_embeddings=False)
        if arch.tie_word_embeddings and lm_head_stored_apart(Path(path).parent):
            # transformers 5 ties the two only where the checkpoint holds no lm_head of its own
            # or one equal to the embedding: one with other values is the output layer it uses
            arch = dataclasses.replace(arch, tie_word_embeddings=False)
        eos = tuple(dict.fromkeys((*arch.eos_token_ids, *generation_eos(Path(path).parent))))
        if eos != arch.eos_token_ids:
            arch = dataclasses.replace(arch, eos_token_ids=eos)
        return arch

    @property
    def kv_planes(self) -> int:
        """Planes of each layer's paged cache ``[planes, blocks, bs, Hkv, D]``: keys and values
        (2); DeepSeek's latent, the keys that are also the values (1)."""
        return 1 if self.mla is not None else 2

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.kv_planes * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


# families whose transformers model rotates part of each head (Phi3's q_rot and q_pass)
_PARTIAL_ROTARY_TYPES = ("phi3", "glm", "glm4")


def _partial_rotary(
    model_type: str, cfg: dict[str, Any], rope: dict[str, Any], head_dim: int
) -> float:
    """``partial_rotary_factor`` (1.0 if absent), refused for a family whose model rotates
    whole heads or where it leaves an odd or empty rotary dim."""
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is None or float(partial) == 1.0:
        return 1.0
    dim = int(head_dim * float(partial))
    if model_type not in _PARTIAL_ROTARY_TYPES:
        raise ConfigError(f"{model_type}: partial_rotary_factor {partial} is not supported")
    if not 0.0 < float(partial) < 1.0 or dim < 2 or dim % 2:
        raise ConfigError(
            f"{model_type}: partial_rotary_factor {partial} gives {dim} rotary dims of "
            f"head_dim {head_dim}; it must give an even number between 2 and head_dim"
        )
    return float(partial)


def _longrope_config(
    model_type: str, cfg: dict[str, Any], rope: dict[str, Any], rotary_dim: int
) -> dict[str, Any]:
    """LongRoPE's parameters with ``original_max_position_embeddings`` in them (Phi-3 configs
    keep it beside rope_scaling); its two factor lists must have one entry per rotated pair."""
    old_len = rope.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings"
    )
    if not isinstance(old_len, int) or old_len < 1:
        raise ConfigError(f"{model_type}: longrope needs original_max_position_embeddings")
    for name in ("short_factor", "long_factor"):
        factors = rope.get(name)
        if (
            not isinstance(factors, list)
            or len(factors) != rotary_dim // 2
            or not all(isinstance(f, int | float) and f > 0 for f in factors)
        ):
            raise ConfigError(
                f"{model_type}: longrope's {name} must be {rotary_dim // 2} positive numbers "
                f"(one per pair of the {rotary_dim} rotary dims)"
            )
    return {**rope, "original_max_position_embeddings": old_len}


def _gemma3_language(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a Gemma 3 checkpoint with vision (model_type ``gemma3``):
    its ``text_config`` with the defaults transformers' ``Gemma3TextConfig`` gives the keys it
    leaves out (the published 4B-27B configs name only a few), and the checkpoint's dtype and
    tied embeddings."""
    from transformers import Gemma3TextConfig

    given = {k: v for k, v in (cfg.get("text_config") or {}).items() if k != "model_type"}
    text = Gemma3TextConfig(**given).to_dict()
    text["tie_word_embeddings"] = cfg.get(
        "tie_word_embeddings", given.get("tie_word_embeddings", True)
    )
    for key in ("torch_dtype", "dtype", "quantization_config", "eos_token_id", "bos_token_id"):
        if cfg.get(key) is not None and given.get(key) is None:
            text[key] = cfg[key]
    return {**text, "model_type": "gemma3_text"}


_SIGLIP_ACTS = ("gelu_pytorch_tanh", "gelu")  # the SigLIP MLP's activations we implement


def _siglip_config(cfg: dict[str, Any]) -> VisionConfig:
    """A Gemma 3 checkpoint's SigLIP vision tower and projector, as transformers'
    ``Gemma3Config`` reads them (its defaults: the 4B-27B tower); what the engine does not
    implement is refused rather than served wrong."""
    from transformers import Gemma3Config, PreTrainedConfig

    given = {k: v for k, v in cfg.items() if k not in ("model_type", "text_config")}
    full = Gemma3Config(**given, text_config=cfg.get("text_config"))
    vis, text = full.vision_config, full.text_config
    assert isinstance(vis, PreTrainedConfig) and isinstance(text, PreTrainedConfig)
    if vis.hidden_act not in _SIGLIP_ACTS:
        raise ConfigError(
            f"gemma3: vision hidden_act {vis.hidden_act!r} is not supported ({_SIGLIP_ACTS})"
        )
    heads, width = int(vis.num_attention_heads), int(vis.hidden_size)
    if width % heads:
        raise ConfigError(
            f"gemma3: vision hidden_size {width} must divide by num_attention_heads {heads}"
        )
    patches = int(vis.image_size) // int(vis.patch_size)  # a side
    tokens = int(full.mm_tokens_per_image or 256)
    side = math.isqrt(tokens)
    if side * side != tokens or patches % side:
        raise ConfigError(
            f"gemma3: mm_tokens_per_image {tokens} must be a square whose "
            f"side divides the {patches} patches a side"
        )
    return VisionConfig(
        model_type="gemma3",
        depth=int(vis.num_hidden_layers),
        embed_dim=width,
        num_heads=heads,
        mlp_ratio=0,
        in_channels=int(vis.num_channels),
        patch_size=int(vis.patch_size),
        temporal_patch_size=1,
        spatial_merge_size=patches // side,
        out_hidden_size=int(text.hidden_size),
        image_token_id=int(full.image_token_id),
        mrope_section=(),
        intermediate_size=int(vis.intermediate_size),
        num_position_embeddings=patches * patches,
        hidden_act=str(vis.hidden_act),
        projector_eps=float(vis.layer_norm_eps),
    )


# a Mistral 3 checkpoint's own lm_head: by the Hub's names (transformers 4's and 5's saves) or by
# transformers 5's module tree
_MISTRAL3_LM_HEADS = frozenset(("language_model.lm_head.weight", "lm_head.weight"))


def generation_eos(directory: Path) -> tuple[int, ...]:
    """The end-of-sequence ids of ``directory``'s generation_config.json (none without one).
    Chat models list their end-of-turn token there rather than in config.json (Gemma 2 and 3
    instruct: ``<end_of_turn>``; Llama 3 instruct: ``<|eot_id|>``), and transformers'
    ``generate`` and vLLM both stop at these too."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        values = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a readable JSON generation config: {e}") from None
    eos = values.get("eos_token_id") if isinstance(values, dict) else None
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return tuple(ids)


def tensor_names(directory: Path) -> set[str]:
    """The names of the tensors in a directory's safetensors files, from their index or their
    headers (no tensor is read); empty where there are none (a named config)."""
    return set(_tensor_files(directory))


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Each tensor of a directory's safetensors files by name, and the file that holds it."""
    index = directory / "model.safetensors.index.json"
    try:
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            return {name: directory / str(file) for name, file in weight_map.items()}
        files: dict[str, Path] = {}
        for file in sorted(directory.glob("*.safetensors")):
            with file.open("rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                files.update((k, file) for k in json.loads(fh.read(size)) if k != "__metadata__")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise ConfigError(
            f"{directory}: the safetensors files' tensor names are unreadable: {e}"
        ) from None
    return files


_EMBEDDING, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
_ROWS_COMPARED = 1 << 26  # elements of each tensor read at a time by lm_head_stored_apart


def lm_head_stored_apart(directory: Path) -> bool:
    """Whether a checkpoint of a tied config holds an lm_head of its own beside its token
    embedding, with other values (or another shape): transformers 5 then leaves the two
    untied (its ``tie_weights`` ties only tensors it did not read, or read equal), and the
    model's logits come from that lm_head. Read in slices, stopping at the first difference;
    False where either is not stored."""
    stored = {language_model_name(name): (name, file)
              for name, file in _tensor_files(directory).items()}  # fmt: skip
    if _EMBEDDING not in stored or _LM_HEAD not in stored:
        return False
    (name_a, file_a), (name_b, file_b) = stored[_EMBEDDING], stored[_LM_HEAD]
    try:
        stamp = tuple((f.stat().st_mtime_ns, f.stat().st_size) for f in (file_a, file_b))
    except OSError as e:
        raise ConfigError(f"{directory}: the safetensors files are unreadable: {e}") from None
    return _differ(name_a, file_a, name_b, file_b, stamp)


@functools.cache
def _differ(name_a: str, file_a: Path, name_b: str, file_b: Path, stamp: tuple[Any, ...]) -> bool:
    """Whether two stored tensors differ in shape or in any value; each pair compared once a
    process (whose start reads config.json more than once) while its files (``stamp``) stay."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file_a), "pt") as fa, safe_open(str(file_b), "pt") as fb:
            a, b = fa.get_slice(name_a), fb.get_slice(name_b)
            shape = list(a.get_shape())
            if shape != list(b.get_shape()):
                return True
            step = max(1, _ROWS_COMPARED // max(1, math.prod(shape[1:])))
            for start in range(0, shape[0] if shape else 1, step):
                x, y = (a[start : start + step], b[start : start + step]) if shape else (a[:], b[:])
                if x.dtype != y.dtype:
                    x, y = x.float(), y.float()
                if not torch.equal(x, y):
                    return True
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{file_a.parent}: {name_a} and {name_b} are unreadable: {e}") from None
    return False


_PIXTRAL_ACTS = ("silu", "gelu")  # the vision MLP's and the projector's we implement


def _pixtral_config(cfg: dict[str, Any]) -> VisionConfig:
    """A Mistral 3 checkpoint's Pixtral vision tower and projector, as transformers'
    ``Mistral3Config`` reads them (its defaults: Mistral Small 3.1's); what its configuration
    allows but this engine does not implement is refused rather than served wrong."""
    from transformers import Mistral3Config, PreTrainedConfig

    given = {k: v for k, v in cfg.items() if k not in ("model_type", "text_config")}
    full = Mistral3Config(**given, text_config=cfg.get("text_config"))
    vis, text = full.vision_config, full.text_config
    assert isinstance(vis, PreTrainedConfig) and isinstance(text, PreTrainedConfig)
    for what, act in (
        ("vision hidden_act", vis.hidden_act),
        ("projector_hidden_act", full.projector_hidden_act),
    ):
        if act not in _PIXTRAL_ACTS:
            raise ConfigError(f"mistral3: {what} {act!r} is not supported ({_PIXTRAL_ACTS})")
    heads, width = int(vis.num_attention_heads), int(vis.hidden_size)
    if width % heads or int(vis.head_dim or width // heads) != width // heads:
        raise ConfigError(
            f"mistral3: vision head_dim {vis.head_dim} must be hidden_size / num_attention_heads"
        )
    rope = dict(vis.rope_parameters or {})
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"mistral3: vision rope_type {rope['rope_type']!r} is not supported")
    layer, depth = full.vision_feature_layer, int(vis.num_hidden_layers)
    if isinstance(layer, list) and len(layer) == 1:
        layer = layer[0]
    if not isinstance(layer, int):  # several: transformers' projector norms one tower's width
        raise ConfigError(
            f"mistral3: vision_feature_layer {layer} (several layers) is not supported"
        )
    if not -depth - 1 <= layer <= depth:
        raise ConfigError(f"mistral3: vision_feature_layer {layer} outside the vision tower")
    return VisionConfig(
        model_type="mistral3",
        depth=depth,
        embed_dim=width,
        num_heads=heads,
        mlp_ratio=0,
        in_channels=int(vis.num_channels),
        patch_size=int(vis.patch_size),
        temporal_patch_size=1,
        spatial_merge_size=int(full.spatial_merge_size),
        out_hidden_size=int(text.hidden_size),
        image_token_id=int(full.image_token_id),
        mrope_section=(),
        intermediate_size=int(vis.intermediate_size),
        vision_rope_theta=float(rope.get("rope_theta", 10000.0)),
        hidden_act=str(vis.hidden_act),
        projector_act=str(full.projector_hidden_act),
        projector_bias=bool(full.multimodal_projector_bias),
        projector_eps=float(text.rms_norm_eps),
        feature_layer=layer % (depth + 1),
    )


def _mistral3_language(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a Mistral 3 checkpoint (model_type ``mistral3``: Mistral
    Small 3.1/3.2, Magistral Small; a Pixtral vision tower beside a Mistral decoder) as
    transformers' ``Mistral3Config`` reads it: its ``text_config`` with ``MistralConfig``'s
    defaults filled in (and Mistral Small's where the text config is absent), the checkpoint's
    dtype and tied embeddings (``Mistral3Config``'s default: tied; ``ArchConfig.from_file``
    unties them where the checkpoint holds an lm_head of its own, as transformers does)."""
    from transformers import Mistral3Config, PreTrainedConfig

    given = cfg.get("text_config")
    kind = (given or {}).get("model_type", "mistral")
    if kind != "mistral":
        raise ConfigError(
            f"mistral3: a {kind!r} language model is not supported (only Mistral's: Mistral "
            "Small 3.1/3.2, Magistral Small; Ministral 3's position-scaled queries are not)"
        )
    reader = Mistral3Config(text_config=given).text_config
    assert isinstance(reader, PreTrainedConfig)  # a dict given is read into MistralConfig
    text = reader.to_dict()
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    for key in ("torch_dtype", "dtype", "quantization_config", "eos_token_id", "bos_token_id"):
        if cfg.get(key) is not None and (given or {}).get(key) is None:
            text[key] = cfg[key]
    return {**text, "model_type": "mistral"}


def _gemma3(cfg: dict[str, Any]) -> tuple[dict[str, Any], GemmaConfig]:
    """Gemma 3's config read as transformers 5 reads it (``rope_parameters`` per layer type, or
    the older ``rope_theta``, ``rope_local_base_freq`` and ``rope_scaling`` for the global
    layers; ``layer_types``, or every ``sliding_window_pattern``-th layer global), with its
    rope and window in the keys the common reader takes; what it does not implement refused."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ConfigError(f"gemma3_text: {key} {cfg[key]} (soft-capping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("gemma3_text: bidirectional attention (EmbeddingGemma) is not supported")
    _check_gemma_activation("gemma3_text", cfg)
    params = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # the older keys: rope_scaling applies to the global layers
        full = {**(cfg.get("rope_scaling") or {}), **params}
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    if scaling_kind(local) != "default":
        raise ConfigError(f"gemma3_text: rope scaling {scaling_kind(local)!r} on the sliding "
                          "layers is not supported")  # fmt: skip
    layers = int(cfg["num_hidden_layers"])
    types = _layer_types(cfg, layers, int(cfg.get("sliding_window_pattern") or 6))
    gemma = GemmaConfig(
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        local_rope_theta=float(local.get("rope_theta", 10_000.0)),
    )
    read = {**cfg, "rope_parameters": full, "rope_scaling": None, "layer_types": types,
            "sliding_window": cfg.get("sliding_window", 4096)}  # fmt: skip
    return read, gemma


def _check_gemma_activation(
    model_type: str, cfg: dict[str, Any], legacy_gelu: bool = False
) -> None:
    """Gemma's MLP is GELU-tanh; ``legacy_gelu``: the first Gemma's published ``gelu``, which
    transformers takes as it."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh" and not (legacy_gelu and act == "gelu"):
        raise ConfigError(f"{model_type}: hidden_activation {act!r}; only gelu_pytorch_tanh is")


def _default_rope_theta(model_type: str, cfg: dict[str, Any]) -> float:
    """The rotary base of a family that takes one base and no rope scaling (Gemma 1 and 2)."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if scaling_kind(rope) != "default":
        raise ConfigError(f"{model_type}: rope scaling {scaling_kind(rope)!r} is not supported")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0)))


def _gemma1(cfg: dict[str, Any]) -> tuple[dict[str, Any], GemmaConfig]:
    """The first Gemma as transformers reads it: Llama's two norms a layer (Gemma's, as
    ``1 + weight``), a GELU-tanh MLP (``hidden_act: gelu``, the published configs' value,
    meaning it, as transformers takes it), scaled embeddings, the softmax scale from head_dim,
    one rotary base, no window."""
    _check_gemma_activation("gemma", cfg, legacy_gelu=True)
    theta = _default_rope_theta("gemma", cfg)
    head_dim = int(cfg.get("head_dim") or 256)  # transformers' default for the first Gemma
    gemma = GemmaConfig(
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        query_scale=head_dim**-0.5,
        local_rope_theta=theta,
        sandwich_norms=False,
    )
    read = {**cfg, "head_dim": head_dim, "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}}  # fmt: skip
    return read, gemma


def _gemma2(cfg: dict[str, Any]) -> tuple[dict[str, Any], GemmaConfig]:
    """Gemma 2's config as transformers reads it: every other layer (the even ones) sliding
    unless ``layer_types`` says otherwise, a 4096-key window, one rotary base for every layer,
    attention scores capped at ``attn_logit_softcapping`` (50) and final logits at
    ``final_logit_softcapping`` (30) when given (None: not capped)."""
    _check_gemma_activation("gemma2", cfg)
    theta = _default_rope_theta("gemma2", cfg)
    caps = {}
    for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
        cap = cfg.get(key, default)
        if cap is not None and not (isinstance(cap, int | float) and cap > 0):
            raise ConfigError(f"gemma2: {key} must be a positive number or null, got {cap!r}")
        caps[key] = float(cap or 0.0)
    layers = int(cfg["num_hidden_layers"])
    types = _layer_types(cfg, layers, 2)
    gemma = GemmaConfig(
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        local_rope_theta=theta,
        attn_softcap=caps["attn_logit_softcapping"],
        final_softcap=caps["final_logit_softcapping"],
    )
    read = {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "rope_scaling": None, "layer_types": types,
            "sliding_window": cfg.get("sliding_window", 4096)}  # fmt: skip
    return read, gemma


def _sliding_layers(model_type: str, cfg: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """The window and the layers that attend through it, as transformers 5's modelling code
    decides for each family: Mistral (``sliding_window``, 4096 when the key is absent), Phi-3
    (``sliding_window``, none when absent) and Mixtral window every layer (``layer_types``
    ignored for Mistral and Mixtral), Qwen3-MoE every layer with
    ``use_sliding_window``; Qwen2, Qwen3 and Qwen2(.5)-VL with ``use_sliding_window`` the layers
    ``layer_types`` names, else those from ``max_window_layers`` on (its default: 28, 80 for the
    VL models); Gemma 3, OLMo 3 and EXAONE 4 (their readers fill in ``layer_types``) the
    ``layer_types`` ones; StarCoder2 every layer when ``sliding_window`` is given; Llama,
    Qwen3-VL, OLMo 2, GLM, Cohere, ERNIE 4.5 (and its MoE), Seed-OSS, Arcee, OLMoE and Granite
    MoE never. (None, ()) when no layer does."""
    layers = range(int(cfg["num_hidden_layers"]))
    if model_type in ("llama", "qwen3_vl", "granite", "gemma", "olmo2", "glm", "glm4", "cohere",
                      "ernie4_5", "seed_oss", "arcee", "olmoe", "granitemoe",
                      "granitemoeshared", "ernie4_5_moe"):  # fmt: skip
        return None, ()
    if model_type == "qwen2_moe":  # its windows alternate below max_window_layers: not served
        if cfg.get("use_sliding_window"):
            raise ConfigError("qwen2_moe: use_sliding_window is not supported")
        return None, ()
    if model_type == "smollm3":  # use_sliding_window: the layer_types ones (its NoPE layers)
        if not cfg.get("use_sliding_window") or cfg.get("sliding_window") is None:
            return None, ()
        nope = set(_nope_layers(model_type, cfg))
        types = cfg.get("layer_types") or [
            "sliding_attention" if i in nope else "full_attention" for i in layers
        ]
        windowed = tuple(i for i in layers if types[i] == "sliding_attention")
        return (int(cfg["sliding_window"]), windowed) if windowed else (None, ())
    if model_type in _QWEN_TYPES and not cfg.get("use_sliding_window"):
        return None, ()
    no_window = ("mixtral", "phi3", "starcoder2")  # none when the key is absent
    window = cfg.get("sliding_window", 4096 if model_type not in no_window else None)
    if window is None:
        return None, ()
    types = cfg.get("layer_types")
    if model_type in ("mistral", "mixtral", "qwen3_moe", "starcoder2"):
        windowed = tuple(layers)
    elif types is not None:
        if len(types) != len(layers):
            raise ConfigError(
                f"{model_type}: layer_types names {len(types)} of {len(layers)} layers"
            )
        windowed = tuple(i for i in layers if types[i] == "sliding_attention")
    elif model_type in _QWEN_TYPES:
        first = int(cfg.get("max_window_layers", 80 if model_type in VL_TYPES else 28))
        windowed = tuple(i for i in layers if i >= first)
    else:
        windowed = tuple(layers)
    if not windowed:
        return None, ()
    if int(window) < 1:
        raise ConfigError(f"{model_type}: sliding_window {window} must be at least 1")
    return int(window), windowed


def _granite_scalings(model_type: str, cfg: dict[str, Any]) -> dict[str, float]:
    """Granite's four multipliers (transformers' defaults: 1.0 each), each a positive number;
    none for the other families."""
    if model_type not in ("granite", "granitemoe", "granitemoeshared"):
        return {}
    out = {}
    for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling"):  # fmt: skip
        value = cfg.get(key, 1.0)
        if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
            raise ConfigError(f"{model_type}: {key} must be a positive number, got {value!r}")
        out[key] = float(value)
    return out


def _nope_layers(model_type: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without rotary embedding: ``no_rope_layers`` (1: rotated, 0: not), or
    every ``no_rope_layer_interval``-th layer (default 4), as transformers derives them."""
    if model_type != "smollm3":
        return ()
    layers = int(cfg["num_hidden_layers"])
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ConfigError(f"smollm3: no_rope_layers names {len(flags)} of {layers} layers")
    return tuple(i for i, rotated in enumerate(flags) if not rotated)


def _layer_types(cfg: dict[str, Any], layers: int, every: int) -> list[str]:
    """``layer_types``, or transformers' default for the families that alternate: every
    ``every``-th layer global, the others sliding (Gemma 2 and gpt-oss: 2, Gemma 3: its
    ``sliding_window_pattern``)."""
    return cfg.get("layer_types") or [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)
    ]


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's config with transformers' defaults for what it leaves out: every other layer
    (the even ones) through a 128-key window, YaRN (factor 32 over 4096 positions, untruncated),
    biased attention projections."""
    layers = int(cfg["num_hidden_layers"])
    types = _layer_types(cfg, layers, 2)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096,
    }  # fmt: skip
    return {**cfg, "layer_types": types, "sliding_window": cfg.get("sliding_window", 128),
            "rope_parameters": {"rope_theta": cfg.get("rope_theta", 150000.0), **rope},
            "attention_bias": cfg.get("attention_bias", True)}  # fmt: skip


def _checkpoint_quantization(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``quantization_config``, but for gpt-oss's MXFP4 experts: those are
    dequantized as they load (``MoeConfig.mxfp4``), the model then served unquantized."""
    q = dict(cfg.get("quantization_config") or {})
    return {} if model_type == "gpt_oss" and _is_mxfp4(q) else q


def _is_mxfp4(q: dict[str, Any]) -> bool:
    return str(q.get("quant_method", "")).lower() == "mxfp4"


def _moe_config(model_type: str, cfg: dict[str, Any]) -> MoeConfig | None:
    """Qwen3-MoE (``num_experts``, saved by transformers as ``num_local_experts``; a layer is
    sparse unless in ``mlp_only_layers`` or off the ``decoder_sparse_step``) or Mixtral (every
    layer sparse, ``intermediate_size`` per expert, always renormalized); refuses what differs.
    The families of ``moe_families`` as it reads them."""
    if model_type in MOE_FAMILY_TYPES:
        read = moe_fields(model_type, cfg)
        return None if read is None else MoeConfig(**read)
    shared = 0
    if model_type == "qwen2_moe":  # transformers builds its shared expert whatever its width
        shared = int(cfg.get("shared_expert_intermediate_size", 5632))
        if shared < 1:
            raise ConfigError(f"qwen2_moe: shared_expert_intermediate_size {shared} must be >= 1")
    for key in _SHARED_EXPERT_KEYS:
        if cfg.get(key) and not (model_type == "qwen2_moe" and key == _SHARED_EXPERT_KEYS[0]):
            raise ConfigError(f"{model_type}: shared experts ({key}={cfg[key]}) are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{model_type}: hidden_act {cfg['hidden_act']!r}; only silu is supported")
    layers = int(cfg["num_hidden_layers"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if model_type in ("mixtral", "gpt_oss"):  # gpt-oss: a softmax over the top-k logits
        size, renormalize, sparse = int(cfg["intermediate_size"]), True, list(range(layers))
    else:
        step = int(cfg.get("decoder_sparse_step", 1))
        if step < 1:
            raise ConfigError(f"{model_type}: decoder_sparse_step {step} must be at least 1")
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        size, renormalize = int(cfg["moe_intermediate_size"]), bool(cfg.get("norm_topk_prob"))
    if experts == 0 or not sparse:
        return None  # no sparse layer: a dense model
    if not 1 <= top_k <= experts:
        raise ConfigError(f"{model_type}: num_experts_per_tok {top_k} of {experts} experts")
    oss = model_type == "gpt_oss"
    limit, alpha = float(cfg.get("swiglu_limit", 7.0)), float(cfg.get("swiglu_alpha", 1.702))
    if oss and not (limit > 0 and alpha > 0):
        raise ConfigError(f"gpt_oss: swiglu_limit {limit} and swiglu_alpha {alpha} must be > 0")
    return MoeConfig(
        experts,
        top_k,
        size,
        renormalize,
        tuple(sparse),
        model_type in ("qwen3_moe", "qwen2_moe", "gpt_oss"),
        shared,
        biases=oss,
        swiglu_limit=limit if oss else 0.0,
        swiglu_alpha=alpha,
        mxfp4=oss and _is_mxfp4(dict(cfg.get("quantization_config") or {})),
    )


def _vision_config(model_type: str, cfg: dict[str, Any]) -> VisionConfig:
    """The vision tower of ``cfg``, the config with its language model's keys at the top
    (``text_config``'s over the top level's, as ``ArchConfig.from_dict`` merges them)."""
    vis = cfg.get("vision_config") or {}
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    section = tuple(int(n) for n in rope.get("mrope_section") or ())
    head_dim = int(
        cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    )
    if sum(section) * 2 != head_dim:
        raise ConfigError(f"{model_type}: mrope_section {list(section)} must sum to head_dim / 2")
    v25, v3 = model_type == "qwen2_5_vl", model_type == "qwen3_vl"
    want_act = "gelu_pytorch_tanh" if v3 else "silu" if v25 else "quick_gelu"
    act = vis.get("hidden_act", want_act)
    if act != want_act:
        raise ConfigError(f"{model_type}: vision hidden_act {act!r} is not supported")
    mlp_width = int(vis.get("intermediate_size", 4304 if v3 else 3420)) if v25 or v3 else 0
    windows = tuple(int(i) for i in vis.get("fullatt_block_indexes") or ()) if v25 else ()
    return VisionConfig(
        model_type=model_type,
        depth=int(vis.get("depth", 27 if v3 else 32)),
        embed_dim=int(vis.get("embed_dim" if model_type == "qwen2_vl" else "hidden_size", 1280)),
        num_heads=int(vis.get("num_heads", 16)),
        mlp_ratio=int(vis.get("mlp_ratio", 4)),
        in_channels=int(vis.get("in_channels", 3)),
        patch_size=int(vis.get("patch_size", 16 if v3 else 14)),
        temporal_patch_size=int(vis.get("temporal_patch_size", 2)),
        spatial_merge_size=int(vis.get("spatial_merge_size", 2)),
        out_hidden_size=int(
            vis.get("hidden_size" if model_type == "qwen2_vl" else "out_hidden_size")
            or cfg["hidden_size"]
        ),
        image_token_id=int(cfg["image_token_id"]),
        mrope_section=section,
        intermediate_size=mlp_width,
        window_size=int(vis.get("window_size", 112)) if v25 else 0,
        full_attention_blocks=windows,
        **(_qwen3_vl_fields(cfg, vis) if v3 else {}),
    )


def _qwen3_vl_fields(text: dict[str, Any], vis: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-VL's own VisionConfig fields; what its configuration allows but this engine does
    not implement is refused rather than served wrong."""
    if text.get("attention_bias"):  # q/k/v and o biases: not built for the VL model (untested)
        raise ConfigError("qwen3_vl: attention_bias is not supported")
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"qwen3_vl: hidden_act {text['hidden_act']!r} is not supported")
    rope = dict(vis.get("rope_parameters") or {})
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"qwen3_vl: vision rope_type {rope['rope_type']!r} is not supported")
    positions = int(vis.get("num_position_embeddings", 2304))
    if math.isqrt(positions) ** 2 != positions:
        raise ConfigError("qwen3_vl: num_position_embeddings must be a square")
    blocks = tuple(int(i) for i in vis.get("deepstack_visual_indexes", (8, 16, 24)))
    if any(not 0 <= i < int(vis.get("depth", 27)) for i in blocks):
        raise ConfigError(f"qwen3_vl: deepstack_visual_indexes {blocks} outside the vision tower")
    return {
        "num_position_embeddings": positions,
        # transformers' Qwen3-VL interleaves whatever its config's mrope_interleaved says
        "mrope_interleaved": True,
        "deepstack_blocks": blocks,
        "vision_rope_theta": float(rope.get("rope_theta", 10000.0)),
    }


# the heads of config.json's ``architectures`` other than a language model's: their
# checkpoints hold a classifier or a scorer where the language model has its lm_head
_OTHER_HEADS = {
    "ForSequenceClassification": "a sequence classifier",
    "ForTokenClassification": "a token classifier",
    "ForQuestionAnswering": "a question-answering head",
    "ForRewardModel": "a reward model",
    "ForProcessRewardModel": "a reward model",
}


def _check_head(architectures: Any) -> None:
    """A ConfigError for a checkpoint whose ``architectures`` name only heads that are no
    language model's (``Qwen2ForSequenceClassification``): served as a causal LM, its
    output would be meaningless. ``...ForCausalLM``, ``...ForConditionalGeneration`` and a
    base ``...Model`` (an embedding model's) pass, as does a config without the field."""
    if not isinstance(architectures, list) or not architectures:
        return
    heads = [
        next((what for suffix, what in _OTHER_HEADS.items() if str(a).endswith(suffix)), None)
        for a in architectures
    ]
    if all(heads):
        raise ConfigError(
            f"architectures {architectures[0]!r} is {heads[0]}, not a language model: Tandem "
            "serves ...ForCausalLM and ...ForConditionalGeneration checkpoints (and, with "
            "--task embed, base ...Model ones)"
        )
