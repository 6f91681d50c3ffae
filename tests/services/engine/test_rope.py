"""Rotary tables against transformers' own rotary embedding: every supported rope scaling gives
transformers' float32 cos and sin exactly (YaRN with each way of setting its attention factor
and correction range), and the kinds this engine does not implement are refused at load."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.config import ConfigError
from services.engine.model_config import ArchConfig
from services.engine.rope import cos_sin_cache

HEAD_DIM, MAX_POS, POSITIONS = 16, 256, 200
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        YARN,
        # Qwen's published long-context setting's shape: factor 4 over 32k, theta 1e6
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
         "rope_theta": 1e6},
        {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
        {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},  # DeepSeek's attention factor
        {**YARN, "attention_factor": 1.3},
    ],
)  # fmt: skip
def test_the_table_is_transformers_cos_and_sin(rope: dict[str, Any]) -> None:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    rope = {"rope_theta": 10000.0, **rope}
    cfg = Qwen3Config(
        hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS, rope_parameters=dict(rope),
    )  # fmt: skip
    cos, sin = Qwen3RotaryEmbedding(cfg)(torch.zeros(1, 1, HEAD_DIM), torch.arange(POSITIONS)[None])
    arch = ArchConfig.from_dict(cfg.to_dict())  # as the engine reads the saved config
    ours = cos_sin_cache(
        HEAD_DIM, POSITIONS, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings
    )
    half = HEAD_DIM // 2
    assert torch.equal(ours[:, :half], cos[0, :, :half])
    assert torch.equal(ours[:, half:], sin[0, :, :half])


LONG = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.8, 2.5, 4.0],
        "long_factor": [1.0, 1.9, 3.1, 5.0, 7.2, 12.0]}  # fmt: skip


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    ("given", "partial"),
    [({}, 0.75), ({"attention_factor": 1.1}, 0.75), ({"factor": 8.0}, 0.75)],
)
def test_longrope_is_transformers_short_below_the_original_length_long_from_it(
    given: dict[str, Any], partial: float
) -> None:
    """Phi-3.5's and Phi-4-mini's LongRoPE (with Phi-4-mini's partial rotary: 12 of 16 dims):
    the short factors where transformers' sequence fits the original length, the long ones
    where it is longer, cos and sin scaled by the attention factor (from max/original, from
    ``factor``, or given)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    old_len = 64
    cfg = Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=MAX_POS,
        original_max_position_embeddings=old_len, partial_rotary_factor=partial,
        rope_scaling={**LONG, **given},
    )  # fmt: skip
    arch = ArchConfig.from_dict(cfg.to_dict())
    rot = arch.rotary_dim
    assert rot == int(HEAD_DIM * partial)
    ours = cos_sin_cache(rot, POSITIONS, arch.rope_theta, arch.rope_scaling, MAX_POS)
    rope = Phi3RotaryEmbedding(cfg)
    x = torch.zeros(1, 1, HEAD_DIM)
    short_cos, short_sin = rope(x, torch.arange(old_len)[None])
    long_cos, long_sin = rope(x, torch.arange(old_len, POSITIONS)[None])
    half = rot // 2
    assert torch.equal(ours[:old_len, :half], short_cos[0, :, :half])
    assert torch.equal(ours[:old_len, half:], short_sin[0, :, :half])
    assert torch.equal(ours[old_len:, :half], long_cos[0, :, :half])
    assert torch.equal(ours[old_len:, half:], long_sin[0, :, :half])


def test_a_published_phi_config_reads_its_longrope_and_partial_rotary() -> None:
    """Phi-4-mini-instruct's config.json as published (rope_scaling with ``type``, the
    original length beside it, partial_rotary_factor at the top)."""
    cfg = {
        "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "sliding_window": 262144,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48,
                         "long_factor": [1.5] * 48},
    }  # fmt: skip
    arch = ArchConfig.from_dict(cfg)
    assert (arch.head_dim, arch.rotary_dim) == (128, 96)
    assert arch.rope_scaling["original_max_position_embeddings"] == 4096


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "'dynamic' is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}},
            "longrope needs original_max_position_embeddings",
        ),
        (
            {
                "original_max_position_embeddings": 64,
                "rope_parameters": {
                    "rope_type": "longrope",
                    "short_factor": [1.0],
                    "long_factor": [1.0] * 8,
                },
            },
            "longrope's short_factor must be 8 positive numbers",
        ),
        (
            {
                "original_max_position_embeddings": 64,
                "rope_parameters": {
                    "rope_type": "longrope",
                    "short_factor": [1.0] * 8,
                    "long_factor": [0.0] * 8,
                },
            },
            "long_factor must be 8 positive numbers",
        ),
        ({"rope_scaling": {"type": "su"}}, "'su' is not supported"),
        ({"partial_rotary_factor": 0.5}, "llama: partial_rotary_factor 0.5 is not supported"),
        (
            {"model_type": "phi3", "partial_rotary_factor": 0.05},
            "gives 0 rotary dims of head_dim 16",
        ),
        (
            {"model_type": "phi3", "partial_rotary_factor": 0.1},
            "gives 1 rotary dims of head_dim 16",
        ),
        ({"rope_parameters": {"rope_type": "yarn"}}, "'yarn' needs a factor"),
    ],
)
def test_rope_variants_this_engine_does_not_implement_are_refused(
    extra: dict[str, Any], message: str
) -> None:
    cfg = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, **extra}  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        ArchConfig.from_dict(cfg)
