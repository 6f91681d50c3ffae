"""The Llama-delta families' config.json as transformers 5 reads it (its defaults for the keys
a published config leaves out), and their variants this engine does not implement refused
with a message instead of served wrong."""

from __future__ import annotations

from typing import Any

import pytest

from services.config import ConfigError
from services.engine.model_config import ArchConfig
from services.engine.tp_layout import CheckpointSlice, TPLayout

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def _arch(model_type: str, **extra: Any) -> ArchConfig:
    return ArchConfig.from_dict({**BASE, "model_type": model_type, **extra})


def test_olmo2_norms_q_and_k_over_the_whole_projection() -> None:
    arch = _arch("olmo2", attention_bias=True)
    assert arch.qk_norm and arch.qk_norm_whole
    assert (arch.attention_bias, arch.o_proj_bias, arch.rms_norm_eps) == (True, True, 1e-5)
    assert (arch.sliding_window, arch.local_rope_theta) == (None, 0.0)


def test_olmo3_reads_its_layer_types_and_a_rotary_table_per_type() -> None:
    """Every fourth layer full unless layer_types says; the published configs' rope_theta and
    rope_scaling: YaRN on the full layers only, the sliding ones default at the same base."""
    arch = _arch("olmo3", rope_theta=500000.0, rope_scaling={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192})  # fmt: skip
    assert (arch.sliding_window, arch.sliding_layers) == (4096, (0, 1, 2))
    assert arch.rope_scaling["rope_type"] == "yarn" and arch.rope_theta == 500000.0
    assert arch.local_rope_theta == 500000.0  # its own table: the full layers' is YaRN's
    plain = _arch("olmo3", rope_theta=10000.0)  # one table serves both kinds
    assert (plain.rope_theta, plain.local_rope_theta) == (10000.0, 0.0)
    nested = _arch("olmo3", sliding_window=24, layer_types=["full_attention"] * 4, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})  # fmt: skip
    assert (nested.sliding_window, nested.sliding_layers) == (None, ())
    assert (nested.rope_theta, nested.local_rope_theta) == (1e6, 1e4)


def test_olmo3_refuses_rope_scaling_on_its_sliding_layers() -> None:
    with pytest.raises(ConfigError, match="olmo3: rope scaling 'linear' on the sliding layers"):
        _arch("olmo3", rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}})  # fmt: skip


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3"])
def test_olmo_q_and_k_norm_weights_are_cut_as_their_rows(model_type: str) -> None:
    """Its q/k norms span every head: a rank holds the weights of its own q and k rows (the
    squares summed over the ranks at run time); Qwen3's per-head norms stay whole."""
    arch = _arch(model_type, head_dim=16)  # 4 q heads, 2 KV heads: one KV head a rank
    rank1 = TPLayout.of(arch, 1, 2)
    q, k = "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"
    assert rank1.checkpoint_slice(q, (64,)) == CheckpointSlice(0, 32, 64)
    assert rank1.checkpoint_slice(k, (32,)) == CheckpointSlice(0, 16, 32)
    assert TPLayout.of(_arch("qwen3", head_dim=16), 1, 2).checkpoint_slice(q, (16,)) is None


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3"])
def test_another_activation_is_refused(model_type: str) -> None:
    with pytest.raises(ConfigError, match=f"{model_type}: hidden_act 'gelu'; only silu"):
        _arch(model_type, hidden_act="gelu")


@pytest.mark.parametrize("model_type", ["glm", "glm4"])
def test_glm_reads_transformers_defaults(model_type: str) -> None:
    """Half of each head rotating with its dims paired, q/k/v biased (o not), head_dim 128:
    transformers' defaults where the config leaves them out."""
    arch = _arch(model_type)
    assert (arch.partial_rotary_factor, arch.rotary_dim, arch.head_dim) == (0.5, 64, 128)
    assert arch.rotary_interleaved
    assert (arch.attention_bias, arch.o_proj_bias, arch.mlp_bias) == (True, False, False)
    given = _arch(model_type, head_dim=32, attention_bias=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                   "partial_rotary_factor": 0.25})  # fmt: skip
    assert (given.rotary_dim, given.attention_bias) == (8, False)


def test_glm_refuses_longrope() -> None:
    with pytest.raises(ConfigError, match="glm4: rope scaling 'longrope' is not supported"):
        _arch("glm4", rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 32,
                                    "long_factor": [1.0] * 32})  # fmt: skip


def test_starcoder2_reads_transformers_defaults() -> None:
    """LayerNorm epsilon from norm_epsilon, biases on every projection (use_bias), tied
    embeddings, no window unless sliding_window is given (then on every layer)."""
    arch = _arch("starcoder2", norm_epsilon=1e-4)
    assert (arch.rms_norm_eps, arch.tie_word_embeddings, arch.sliding_window) == (1e-4, True, None)
    assert (arch.attention_bias, arch.o_proj_bias, arch.mlp_bias) == (True, True, True)
    windowed = _arch("starcoder2", sliding_window=32, use_bias=False, tie_word_embeddings=False)
    assert (windowed.sliding_window, windowed.sliding_layers) == (32, (0, 1, 2, 3))
    assert (windowed.attention_bias, windowed.mlp_bias, windowed.tie_word_embeddings) == (
        False, False, False)  # fmt: skip
    with pytest.raises(ConfigError, match="starcoder2: hidden_act 'gelu'; only gelu_pytorch_tanh"):
        _arch("starcoder2", hidden_act="gelu")


def test_cohere_reads_transformers_defaults() -> None:
    """Logits times 0.0625, a 500000 rotary base, tied embeddings, LayerNorm epsilon from
    layer_norm_eps, rotary dims paired, q/k norms only with use_qk_norm."""
    arch = _arch("cohere", layer_norm_eps=1e-4)
    assert (arch.logit_scale, arch.rope_theta, arch.tie_word_embeddings) == (0.0625, 5e5, True)
    assert (arch.rms_norm_eps, arch.rotary_interleaved, arch.qk_norm) == (1e-4, True, False)
    assert _arch("cohere", use_qk_norm=True, logit_scale=0.5).qk_norm
    for bad in (0, -1.0, "0.5", True):
        with pytest.raises(ConfigError, match="cohere: logit_scale must be a positive number"):
            _arch("cohere", logit_scale=bad)


def test_ernie4_5_and_seed_oss_read_transformers_defaults() -> None:
    """ERNIE 4.5: use_bias on every projection, rotary dims paired, head_dim 128 and tied
    embeddings unless given. Seed-OSS: q/k/v biased unless attention_bias says no, o_proj by
    attention_out_bias, head_dim 128."""
    ernie = _arch("ernie4_5", use_bias=True)
    assert (ernie.attention_bias, ernie.o_proj_bias, ernie.mlp_bias) == (True, True, True)
    assert (ernie.head_dim, ernie.rotary_dim, ernie.tie_word_embeddings) == (128, 128, True)
    assert ernie.rotary_interleaved and not _arch("ernie4_5").attention_bias
    seed = _arch("seed_oss")
    assert (seed.attention_bias, seed.o_proj_bias, seed.mlp_bias, seed.head_dim) == (
        True, False, False, 128)  # fmt: skip
    seed = _arch("seed_oss", attention_bias=False, attention_out_bias=True, mlp_bias=True)
    assert (seed.attention_bias, seed.o_proj_bias, seed.mlp_bias) == (False, True, True)


@pytest.mark.parametrize(
    ("extra", "window", "sliding"),
    [
        ({}, 4096, (0, 1, 2)),  # transformers' defaults: a 4096-key window, every 4th global
        ({"sliding_window": 32, "sliding_window_pattern": "LG"}, 32, (0, 2)),  # the published
        ({"sliding_window": 32, "layer_types": ["full_attention", "sliding_attention"] * 2},
         32, (1, 3)),
        ({"sliding_window": None}, None, ()),  # every layer global, every layer rotated
    ],
)  # fmt: skip
def test_exaone4_windows_its_local_layers_and_leaves_its_global_ones_unrotated(
    extra: dict[str, Any], window: int | None, sliding: tuple[int, ...]
) -> None:
    arch = _arch("exaone4", **extra)
    assert (arch.sliding_window, arch.sliding_layers) == (window, sliding)
    nope = tuple(i for i in range(4) if i not in sliding) if window else ()
    assert arch.nope_layers == nope and arch.qk_norm and not arch.qk_norm_whole


def test_exaone4_refuses_a_pattern_it_cannot_read() -> None:
    with pytest.raises(ConfigError, match="exaone4: sliding_window_pattern 'LXG'"):
        _arch("exaone4", sliding_window=32, sliding_window_pattern="LXG")
    with pytest.raises(ConfigError, match="exaone4: layer_types names 2 of 4 layers"):
        _arch("exaone4", sliding_window=32, layer_types=["full_attention"] * 2)


def test_arcee_takes_relu_squared_only() -> None:
    assert _arch("arcee", hidden_act="relu2", mlp_bias=True).mlp_bias
    with pytest.raises(ConfigError, match="arcee: hidden_act 'silu'; only relu2"):
        _arch("arcee", hidden_act="silu")
