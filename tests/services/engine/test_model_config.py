"""Architecture facts from config.json: the sparse layers of MoE models, Qwen3-VL's tower and
the sliding window, and the MoE and Qwen3-VL variants this engine does not implement refused with
a message instead of served wrong."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.config import ConfigError
from services.engine.model_config import ArchConfig

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def _qwen3_moe(**extra: Any) -> dict[str, Any]:
    return {**BASE, "model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts": 8,
            "num_experts_per_tok": 2, **extra}  # fmt: skip


def test_qwen3_moe_sparse_layers_follow_mlp_only_layers_and_the_sparse_step() -> None:
    arch = ArchConfig.from_dict(_qwen3_moe(mlp_only_layers=[0], norm_topk_prob=True))
    assert arch.moe is not None and arch.qk_norm
    assert arch.moe.layers == (1, 2, 3)
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.intermediate_size) == (8, 2, 32)
    assert arch.moe.renormalize and arch.moe.weights_in_model_dtype
    stepped = ArchConfig.from_dict(_qwen3_moe(decoder_sparse_step=2))
    assert stepped.moe is not None and stepped.moe.layers == (1, 3)
    assert not stepped.moe.renormalize


def test_transformers_saves_num_experts_as_num_local_experts() -> None:
    cfg = _qwen3_moe()
    cfg["num_local_experts"] = cfg.pop("num_experts")
    arch = ArchConfig.from_dict(cfg)
    assert arch.moe is not None and arch.moe.num_experts == 8


def test_qwen3_moe_without_sparse_layers_is_dense() -> None:
    assert ArchConfig.from_dict(_qwen3_moe(mlp_only_layers=[0, 1, 2, 3])).moe is None
    assert ArchConfig.from_dict(_qwen3_moe(num_experts=0)).moe is None


def test_mixtral_every_layer_sparse_and_renormalized() -> None:
    cfg = {**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
           "sliding_window": None}  # fmt: skip
    arch = ArchConfig.from_dict(cfg)
    assert arch.moe is not None and not arch.qk_norm
    assert arch.moe.layers == (0, 1, 2, 3) and arch.moe.intermediate_size == 96
    assert arch.moe.renormalize and not arch.moe.weights_in_model_dtype


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (_qwen3_moe(shared_expert_intermediate_size=64), "shared experts"),
        (_qwen3_moe(n_shared_experts=1), "shared experts"),
        (_qwen3_moe(hidden_act="gelu"), "only silu"),
        (_qwen3_moe(num_experts_per_tok=9), "num_experts_per_tok 9 of 8"),
        (_qwen3_moe(decoder_sparse_step=0), "decoder_sparse_step"),
        ({**_qwen3_moe(), "model_type": "qwen2_moe", "shared_expert_intermediate_size": 0},
         "shared_expert_intermediate_size 0 must be >= 1"),
        ({**_qwen3_moe(), "model_type": "dbrx"}, "not supported"),
    ],
)  # fmt: skip
def test_unsupported_moe_variants_are_refused(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ArchConfig.from_dict(cfg)


ALL = (0, 1, 2, 3)  # BASE's layers


@pytest.mark.parametrize(
    ("cfg", "window", "layers"),
    [
        ({"model_type": "llama", "sliding_window": 64}, None, ()),  # Llama never windows
        ({"model_type": "mistral", "sliding_window": 64}, 64, ALL),
        ({"model_type": "mistral", "sliding_window": None}, None, ()),
        ({"model_type": "mistral"}, 4096, ALL),  # transformers' default window
        ({"model_type": "phi3"}, None, ()),  # Phi-3's default: none
        ({"model_type": "phi3", "sliding_window": 64}, 64, ALL),
        # SmolLM3: only with use_sliding_window, on its NoPE layers (every 4th by default)
        ({"model_type": "smollm3", "sliding_window": 64}, None, ()),
        ({"model_type": "smollm3", "sliding_window": 64, "use_sliding_window": True}, 64, (3,)),
        # Mistral's modelling code ignores layer_types: every layer
        ({"model_type": "mistral", "sliding_window": 64, "layer_types": ["full_attention"] * 4}, 64, ALL),
        ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}, None, ()),
        ({"model_type": "mixtral", "sliding_window": 64, "num_local_experts": 4,
          "num_experts_per_tok": 2}, 64, ALL),
        # the Qwen families window only with use_sliding_window...
        ({"model_type": "qwen2", "sliding_window": 64}, None, ()),
        ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": False}, None, ()),
        # ...and then the layers from max_window_layers on (transformers' default: 28)
        ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True}, None, ()),
        ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True,
          "max_window_layers": 2}, 64, (2, 3)),
        ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True,
          "max_window_layers": 4}, None, ()),
        # or those layer_types names
        ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True,
          "layer_types": ["full_attention"] * 3 + ["sliding_attention"]}, 64, (3,)),
        ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True,
          "max_window_layers": 0, "layer_types": ["full_attention"] * 4}, None, ()),
        # Qwen3-MoE windows every layer (its modelling code reads no max_window_layers)
        (_qwen3_moe(use_sliding_window=True, sliding_window=128, max_window_layers=1), 128, ALL),
        (_qwen3_moe(use_sliding_window=True), 4096, ALL),

    ],
)  # fmt: skip
def test_the_sliding_window_is_read_as_transformers_reads_it(
    cfg: dict[str, Any], window: int | None, layers: tuple[int, ...]
) -> None:
    """A window missed would attend past it; one made up would drop keys the model sees."""
    arch = ArchConfig.from_dict({**BASE, **cfg})
    assert (arch.sliding_window, arch.sliding_layers) == (window, layers)
    assert [arch.window(i) for i in ALL] == [window if i in layers else 0 for i in ALL]


@pytest.mark.parametrize(
    ("cfg", "biases"),
    [
        ({"model_type": "llama"}, (False, False, False)),
        ({"model_type": "llama", "attention_bias": True, "mlp_bias": True}, (True, True, True)),
        ({"model_type": "qwen3", "attention_bias": True, "mlp_bias": True}, (True, True, False)),
        ({"model_type": "qwen2"}, (True, False, False)),  # always, as transformers builds it
        ({"model_type": "qwen2", "attention_bias": False}, (True, False, False)),
        ({"model_type": "mistral", "attention_bias": True}, (False, False, False)),  # never
    ],
)  # fmt: skip
def test_projection_biases_follow_each_family(
    cfg: dict[str, Any], biases: tuple[bool, bool, bool]
) -> None:
    """(q/k/v, o, MLP) biases as transformers' modelling code builds each family, whatever the
    config's flags say where that code ignores them."""
    arch = ArchConfig.from_dict({**BASE, **cfg})
    assert (arch.attention_bias, arch.o_proj_bias, arch.mlp_bias) == biases


def test_an_activation_other_than_silu_is_refused() -> None:
    """Not served as SiLU: the model would compute another function than the checkpoint's."""
    with pytest.raises(ConfigError, match="hidden_act 'gelu'; only silu"):
        ArchConfig.from_dict({**BASE, "model_type": "llama", "hidden_act": "gelu"})


def test_the_vision_language_models_windows() -> None:
    """Qwen2-VL's max_window_layers defaults to 80 (so its 28 layers never window unless it is
    set); Qwen3-VL's modelling code never windows."""
    import json
    from pathlib import Path

    from services.engine import model_config

    path = Path(model_config.__file__).parent / "configs" / "qwen2-vl-7b" / "config.json"
    cfg = {**json.loads(path.read_text()), "use_sliding_window": True, "sliding_window": 64}
    cfg.pop("max_window_layers", None)
    assert ArchConfig.from_dict(cfg).sliding_layers == ()
    arch = ArchConfig.from_dict({**cfg, "max_window_layers": 26})
    assert (arch.sliding_window, arch.sliding_layers) == (64, (26, 27))
    text = {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}
    assert ArchConfig.from_dict(_qwen3_vl(text=text)).sliding_window is None


def test_a_window_under_one_token_or_layer_types_of_another_depth_are_refused() -> None:
    with pytest.raises(ConfigError, match="sliding_window 0"):
        ArchConfig.from_dict({**BASE, "model_type": "mistral", "sliding_window": 0})
    with pytest.raises(ConfigError, match="layer_types names 2 of 4 layers"):
        ArchConfig.from_dict({**BASE, "model_type": "qwen3", "sliding_window": 8,
                              "use_sliding_window": True, "layer_types": ["full_attention"] * 2})  # fmt: skip


def _qwen3_vl(text: dict[str, Any] | None = None, vision: dict[str, Any] | None = None) -> dict:
    return {"model_type": "qwen3_vl", "image_token_id": 9,
            "text_config": {**BASE, "head_dim": 16, "rope_parameters": {"rope_theta": 1e4,
                            "mrope_section": [4, 2, 2], "mrope_interleaved": True}, **(text or {})},
            "vision_config": {"depth": 4, "hidden_size": 32, "num_heads": 2,
                              "deepstack_visual_indexes": [1, 2], **(vision or {})}}  # fmt: skip


def test_qwen3_vl_reads_as_qwen3_text_with_an_interleaved_deepstack_tower() -> None:
    arch = ArchConfig.from_dict(_qwen3_vl())
    assert (arch.model_type, arch.qk_norm, arch.attention_bias, arch.head_dim) == (
        "qwen3_vl", True, False, 16,
    )  # fmt: skip
    vis = arch.vision
    assert vis is not None and vis.qwen3 and vis.mrope_interleaved
    assert (vis.patch_size, vis.deepstack_blocks, vis.num_position_embeddings) == (16, (1, 2), 2304)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (_qwen3_vl(text={"attention_bias": True}), "attention_bias"),
        (_qwen3_vl(text={"hidden_act": "gelu"}), "hidden_act"),
        (_qwen3_vl(vision={"hidden_act": "silu"}), "vision hidden_act"),
        (_qwen3_vl(vision={"deepstack_visual_indexes": [4]}), "outside the vision tower"),
        (_qwen3_vl(vision={"num_position_embeddings": 50}), "a square"),
        (_qwen3_vl(vision={"rope_parameters": {"rope_type": "default"}}), "rope_type"),
        ({**_qwen3_vl(), "model_type": "qwen3_vl_moe"}, "not supported"),
    ],
)  # fmt: skip
def test_unsupported_qwen3_vl_variants_are_refused(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ArchConfig.from_dict(cfg)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"model_type": "llama", "num_attention_heads', "not a readable JSON model config"),
        ("", "not a readable JSON model config"),
        ("[1, 2]", "must hold a JSON object, got list"),
        ('{"model_type": "llama"}', "lacks 'num_attention_heads'"),
        ('{"model_type": "llama", "num_attention_heads": "x"}', "wrong type or value"),
    ],
)
def test_a_broken_config_file_is_a_config_error_naming_it(
    tmp_path: Any, text: str, words: str
) -> None:
    """A truncated, empty, non-object or incomplete config.json: a clean error (exit 2 from the
    CLI), not a JSONDecodeError, AttributeError or KeyError traceback."""
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as info:
        ArchConfig.from_file(path)
    assert str(path) in str(info.value)


def test_an_unsupported_model_type_is_said_as_such_not_as_a_wrong_field(tmp_path: Any) -> None:
    """A gpt2 checkpoint read "has a field of the wrong type or value: model_type 'gpt2' is not
    supported"; the reason stands alone, after the file's name."""
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "gpt2", "n_layer": 1}')
    with pytest.raises(ConfigError) as info:
        ArchConfig.from_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: model_type 'gpt2' is not supported; supported: llama")
    assert "wrong type or value" not in message


@pytest.mark.parametrize(
    ("generation", "eos"),
    [
        (None, (1,)),  # no generation_config.json
        ({"eos_token_id": [1, 107]}, (1, 107)),  # Gemma 2/3 instruct: <end_of_turn> added
        ({"eos_token_id": 107}, (1, 107)),
        ({"eos_token_id": [107, 1, 107]}, (1, 107)),  # each id once, config.json's first
        ({"temperature": 0.6}, (1,)),  # sampling defaults only
    ],
)
def test_generation_config_eos_ids_are_stop_ids_too(
    tmp_path: Any, generation: dict[str, Any] | None, eos: tuple[int, ...]
) -> None:
    """transformers' ``generate`` stops at generation_config.json's eos_token_id, and vLLM adds
    it to the stop ids: a chat model that lists its end-of-turn token only there must stop at
    it here too."""
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 1}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    assert ArchConfig.from_file(tmp_path / "config.json").eos_token_ids == eos


@pytest.mark.parametrize(
    ("text", "words"),
    [("{", "not a readable JSON generation config"), ('{"eos_token_id": "x"}', "token id")],
)
def test_a_broken_generation_config_is_a_config_error_naming_it(
    tmp_path: Any, text: str, words: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ConfigError, match=words) as info:
        ArchConfig.from_file(tmp_path / "config.json")
    assert "generation_config.json" in str(info.value)


GEMMA = {**BASE, "model_type": "gemma3_text", "head_dim": 16, "num_hidden_layers": 6}


def test_gemma3_reads_the_older_rope_keys_and_the_sliding_pattern() -> None:
    """Gemma 3's published configs (transformers 4.5x): rope_theta and rope_scaling for the
    global layers, rope_local_base_freq for the sliding ones, every sliding_window_pattern-th
    layer global; the query scale from query_pre_attn_scalar, the embeddings by sqrt(hidden)."""
    arch = ArchConfig.from_dict({
        **GEMMA, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 512,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 3,
        "query_pre_attn_scalar": 64,
    })  # fmt: skip
    assert arch.gemma is not None and arch.qk_norm and arch.tie_word_embeddings
    assert (arch.rope_theta, arch.rope_scaling["factor"], arch.gemma.local_rope_theta) == (
        1e6,
        8.0,
        1e4,
    )
    assert (arch.sliding_window, arch.sliding_layers) == (512, (0, 1, 3, 4))
    assert (arch.gemma.query_scale, arch.gemma.embed_scale) == (64**-0.5, 64**0.5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping 30.0"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "silu"}, "hidden_activation 'silu'"),
        ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                              "full_attention": {"rope_type": "default"}}}, "on the sliding layers"),
    ],
)  # fmt: skip
def test_gemma_variants_this_engine_does_not_implement_are_refused(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ArchConfig.from_dict({**GEMMA, **extra})


def test_gemma2_reads_transformers_defaults_and_refuses_what_it_cannot_serve() -> None:
    """Gemma 2 as transformers builds it from a published config: every other layer sliding
    (the even ones) over 4096 keys, scores capped at 50 and logits at 30 unless given (null:
    not capped), one rotary base, no q/k norms, o_proj biased with attention_bias."""
    arch = ArchConfig.from_dict({**BASE, "model_type": "gemma2", "head_dim": 16})
    assert arch.gemma is not None and not arch.qk_norm
    assert (arch.sliding_window, arch.sliding_layers) == (4096, (0, 2))
    assert (arch.gemma.attn_softcap, arch.gemma.final_softcap) == (50.0, 30.0)
    assert arch.gemma.query_scale == 256**-0.5 and arch.gemma.local_rope_theta == 10000.0
    off = ArchConfig.from_dict({**BASE, "model_type": "gemma2", "attn_logit_softcapping": None,
                                "final_logit_softcapping": None, "attention_bias": True})  # fmt: skip
    assert off.gemma is not None and (off.gemma.attn_softcap, off.gemma.final_softcap) == (0, 0)
    assert off.attention_bias and off.o_proj_bias
    for extra, message in (
        ({"attn_logit_softcapping": -1}, "attn_logit_softcapping must be a positive number"),
        ({"hidden_activation": "gelu"}, "only gelu_pytorch_tanh"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope scaling 'linear'"),
    ):
        with pytest.raises(ConfigError, match=message):
            ArchConfig.from_dict({**BASE, "model_type": "gemma2", **extra})


def test_granite_reads_its_scalings_and_refuses_a_bad_one() -> None:
    arch = ArchConfig.from_dict({**BASE, "model_type": "granite", "embedding_multiplier": 12,
                                 "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                                 "logits_scaling": 16, "mlp_bias": True})  # fmt: skip
    assert (arch.embedding_multiplier, arch.residual_multiplier) == (12.0, 0.22)
    assert (arch.attention_multiplier, arch.logits_scaling) == (0.0078125, 16.0)
    assert arch.mlp_bias and arch.sliding_window is None
    plain = ArchConfig.from_dict({**BASE, "model_type": "granite"})  # transformers' defaults
    assert (plain.embedding_multiplier, plain.logits_scaling, plain.attention_multiplier) == (
        1,
        1,
        1,
    )
    llama = ArchConfig.from_dict({**BASE, "model_type": "llama", "logits_scaling": 16})
    assert llama.logits_scaling == 1.0 and llama.attention_multiplier == 0.0  # Granite's only
    with pytest.raises(ConfigError, match="logits_scaling must be a positive number"):
        ArchConfig.from_dict({**BASE, "model_type": "granite", "logits_scaling": 0})


def test_the_first_gemma_takes_its_published_gelu_and_head_dim() -> None:
    """Gemma 7B's config.json says hidden_act "gelu", which transformers takes as the tanh
    approximation; head_dim 256 when left out; two norms a layer."""
    arch = ArchConfig.from_dict({**BASE, "model_type": "gemma", "hidden_act": "gelu"})
    assert arch.gemma is not None and not arch.gemma.sandwich_norms and arch.head_dim == 256
    assert arch.gemma.query_scale == 256**-0.5 and arch.tie_word_embeddings
    assert arch.sliding_window is None and not arch.qk_norm
    with pytest.raises(ConfigError, match="only gelu_pytorch_tanh"):
        ArchConfig.from_dict({**BASE, "model_type": "gemma", "hidden_act": "relu"})


def test_qwen2_moe_reads_its_shared_expert_and_refuses_its_windows() -> None:
    arch = ArchConfig.from_dict({**BASE, "model_type": "qwen2_moe", "num_experts": 8,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                 "shared_expert_intermediate_size": 48, "sliding_window": 0})  # fmt: skip
    assert arch.moe is not None and arch.moe.shared_intermediate_size == 48
    assert arch.attention_bias and not arch.o_proj_bias and arch.sliding_window is None
    assert arch.moe.weights_in_model_dtype and not arch.moe.renormalize
    with pytest.raises(ConfigError, match="use_sliding_window is not supported"):
        ArchConfig.from_dict({**BASE, "model_type": "qwen2_moe", "num_experts": 8,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "use_sliding_window": True})  # fmt: skip
    with pytest.raises(ConfigError, match="shared experts"):  # another family's: refused
        ArchConfig.from_dict({**BASE, "model_type": "qwen3_moe", "num_experts": 8,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                              "shared_expert_intermediate_size": 48})  # fmt: skip


@pytest.mark.parametrize(
    ("scaling", "expected"),
    [
        ({}, 4096),
        ({"rope_type": "linear", "factor": 2.0}, 8192),
        ({"type": "dynamic", "factor": 4.0}, 16384),
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192),
        ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 512}, 4096),
        ({"rope_type": "longrope", "factor": 32.0, "original_max_position_embeddings": 128}, 4096),
    ],
)
def test_the_derived_max_model_len_follows_the_rope_scaling(
    scaling: dict[str, Any], expected: int
) -> None:
    from services.engine.model_config import derived_max_model_len

    assert derived_max_model_len(4096, scaling) == expected


def test_either_variable_allows_a_long_max_model_len() -> None:
    from services.engine.model_config import allow_long_max_model_len

    assert allow_long_max_model_len({}) is None
    assert allow_long_max_model_len({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0"}) is None
    assert allow_long_max_model_len({"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}) is not None
    assert allow_long_max_model_len({"TANDEM_ALLOW_LONG_MAX_MODEL_LEN": "true"}) is not None


def test_mistral3_reads_its_text_config_as_transformers_does(tmp_path: Any) -> None:
    """A Mistral 3 checkpoint is served as its Mistral decoder: the text config with
    MistralConfig's defaults (Mistral Small 3.1's where it is absent), the checkpoint's dtype
    and eos; tied as Mistral3Config says unless the checkpoint holds an lm_head (read from the
    safetensors index, no tensor read); a Ministral 3 decoder refused."""
    import json

    text = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
            "intermediate_size": 96, "vocab_size": 256, "sliding_window": None,
            "rope_theta": 1e9}  # fmt: skip
    cfg = {"model_type": "mistral3", "text_config": text, "torch_dtype": "bfloat16",
           "eos_token_id": 7, "vision_config": {"model_type": "pixtral"}}  # fmt: skip
    arch = ArchConfig.from_dict(cfg)
    assert (arch.model_type, arch.language_of, arch.head_dim, arch.rope_theta) == (
        "mistral", "", 32, 1e9
    )  # fmt: skip
    assert (arch.torch_dtype, arch.eos_token_ids, arch.sliding_window) == ("bfloat16", (7,), None)
    assert arch.tie_word_embeddings and not arch.attention_bias
    assert arch.vision is not None and arch.vision.model_type == "mistral3"
    published = ArchConfig.from_dict({"model_type": "mistral3"})  # Mistral Small 3.1's sizes
    assert (published.num_layers, published.hidden_size, published.head_dim) == (40, 5120, 128)
    assert (published.num_heads, published.num_kv_heads, published.vocab_size) == (32, 8, 131072)
    untied = ArchConfig.from_dict({**cfg, "tie_word_embeddings": False})
    assert not untied.tie_word_embeddings
    # the Hub's sharded layout: an index naming language_model.lm_head.weight
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    weight_map = {"language_model.model.embed_tokens.weight": "a.safetensors"}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert ArchConfig.from_file(tmp_path / "config.json").tie_word_embeddings
    weight_map["language_model.lm_head.weight"] = "a.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert not ArchConfig.from_file(tmp_path / "config.json").tie_word_embeddings
    # no image processor beside it: the language model alone
    assert ArchConfig.from_file(tmp_path / "config.json").language_of == "mistral3"
    (tmp_path / "preprocessor_config.json").write_text("{}")
    with_images = ArchConfig.from_file(tmp_path / "config.json")
    assert with_images.vision is not None and not with_images.language_of
    assert not with_images.tie_word_embeddings
    with pytest.raises(ConfigError, match="'ministral3' language model is not supported"):
        ArchConfig.from_dict({**cfg, "text_config": {**text, "model_type": "ministral3"}})


def test_mistral3_reads_its_vision_tower_as_transformers_does() -> None:
    """Pixtral's tower and Mistral 3's projector from Mistral3Config (its defaults: Mistral
    Small 3.1's tower); what the engine does not implement refused."""
    vision = ArchConfig.from_dict({"model_type": "mistral3"}).vision
    assert vision is not None
    assert (vision.depth, vision.embed_dim, vision.num_heads, vision.intermediate_size) == (
        24, 1024, 16, 4096
    )  # fmt: skip
    assert (vision.patch_size, vision.spatial_merge_size, vision.out_hidden_size) == (14, 2, 5120)
    assert (vision.image_token_id, vision.feature_layer, vision.mrope) == (10, 24, False)
    assert (vision.hidden_act, vision.projector_act, vision.projector_bias) == (
        "gelu",
        "gelu",
        False,
    )
    small = {"model_type": "mistral3", "vision_feature_layer": -2, "image_token_index": 7,
             "vision_config": {"hidden_act": "silu", "num_hidden_layers": 3}}  # fmt: skip
    vision = ArchConfig.from_dict(small).vision
    assert vision is not None
    assert (vision.feature_layer, vision.image_token_id, vision.hidden_act) == (2, 7, "silu")
    for bad, message in [
        ({"vision_feature_layer": [-1, -2]}, "several layers"),
        ({"vision_feature_layer": 9}, "outside the vision tower"),
        ({"projector_hidden_act": "relu"}, "projector_hidden_act 'relu'"),
        ({"vision_config": {"hidden_act": "quick_gelu"}}, "vision hidden_act 'quick_gelu'"),
        ({"vision_config": {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}},
         "vision head_dim 32"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            ArchConfig.from_dict({**small, **bad})


def test_gemma3_reads_its_siglip_tower_as_transformers_does(tmp_path: Any) -> None:
    """Gemma 3 4B's SigLIP tower and projector from Gemma3Config (896-pixel images of 14-pixel
    patches, 64x64 pooled 4x4 to 256 tokens); its images need the image processor beside the
    checkpoint (else the language model alone); what the engine does not implement refused."""
    import json

    vision_cfg = {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                  "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
                  "vision_use_head": False}  # fmt: skip
    cfg = {"model_type": "gemma3", "text_config": {"hidden_size": 2560, "num_hidden_layers": 2},
           "vision_config": vision_cfg, "mm_tokens_per_image": 256}  # fmt: skip
    arch = ArchConfig.from_dict(cfg)
    vision = arch.vision
    assert vision is not None and (arch.model_type, arch.language_of) == ("gemma3_text", "")
    assert (vision.depth, vision.embed_dim, vision.num_heads, vision.intermediate_size) == (
        27, 1152, 16, 4304
    )  # fmt: skip
    assert (vision.patch_size, vision.spatial_merge_size, vision.num_position_embeddings) == (
        14, 4, 4096
    )  # fmt: skip
    assert (vision.out_hidden_size, vision.image_token_id, vision.hidden_act) == (
        2560, 262144, "gelu_pytorch_tanh"
    )  # fmt: skip
    assert vision.bidirectional and not vision.mrope and vision.projector_eps == 1e-6
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    alone = ArchConfig.from_file(tmp_path / "config.json")
    assert alone.vision is None and alone.language_of == "gemma3"
    assert "preprocessor_config.json" in alone.language_only
    (tmp_path / "preprocessor_config.json").write_text("{}")
    assert ArchConfig.from_file(tmp_path / "config.json").vision == vision
    for bad, message in [
        ({"vision_config": {**vision_cfg, "hidden_act": "relu"}}, "vision hidden_act 'relu'"),
        ({"mm_tokens_per_image": 100}, "mm_tokens_per_image 100"),
        ({"mm_tokens_per_image": 49}, "mm_tokens_per_image 49"),  # 7 does not divide 64
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=message):
            ArchConfig.from_dict({**cfg, **bad})


@pytest.mark.parametrize(
    ("architectures", "refused"),
    [
        (["Qwen2ForSequenceClassification"], "is a sequence classifier, not a language model"),
        (["LlamaForTokenClassification"], "is a token classifier"),
        (["Qwen2ForRewardModel"], "is a reward model"),
        (["LlamaForCausalLM"], None),
        (["MistralModel"], None),  # an embedding model's base model (--task embed)
        (["Qwen2ForSequenceClassification", "Qwen2ForCausalLM"], None),
        (None, None),
    ],
)
def test_a_checkpoint_whose_head_is_no_language_models_is_refused(
    architectures: list[str] | None, refused: str | None
) -> None:
    """Its classifier or scorer where the lm_head would be: served as a causal LM, its output
    would mean nothing."""
    cfg = {**BASE, "model_type": "qwen2", "architectures": architectures}
    if refused is None:
        ArchConfig.from_dict(cfg)
        return
    with pytest.raises(ConfigError, match=refused):
        ArchConfig.from_dict(cfg)
