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


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "'dynamic' is not supported",
        ),
        ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}}, "'longrope'"),
        ({"rope_scaling": {"type": "su"}}, "'su' is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
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
