"""The Mixture-of-Experts families of ``moe_families`` (with their attention's readers in
``arch_families``): config.json read as transformers 5 reads it, defaults included, and what the
engine does not implement refused with a message instead of served wrong."""

from __future__ import annotations

from typing import Any

import pytest

from services.config import ConfigError
from services.engine.model_config import ArchConfig
from services.engine.tp_layout import TPLayout

BASE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def _arch(model_type: str, **extra: Any) -> ArchConfig:
    return ArchConfig.from_dict({**BASE, "model_type": model_type, **extra})


def test_olmoe_reads_transformers_defaults() -> None:
    arch = _arch("olmoe")
    assert arch.moe is not None and arch.moe.layers == (0, 1, 2, 3)
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.intermediate_size) == (64, 8, 32)
    assert not arch.moe.renormalize and arch.moe.weights_in_model_dtype
    assert arch.qk_norm and arch.qk_norm_whole and arch.clip_qkv == 0.0
    assert (arch.rms_norm_eps, arch.head_dim, arch.sliding_window) == (1e-5, 16, None)
    assert not (arch.attention_bias or arch.o_proj_bias or arch.moe.shared_intermediate_size)


def test_olmoe_reads_its_options() -> None:
    arch = _arch("olmoe", num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                 clip_qkv=8, attention_bias=True)  # fmt: skip
    assert arch.moe is not None and (arch.moe.num_experts, arch.moe.top_k) == (8, 2)
    assert arch.moe.renormalize and arch.clip_qkv == 8.0
    assert arch.attention_bias and arch.o_proj_bias


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"head_dim": 32}, "olmoe: head_dim 32 must be hidden_size / num_attention_heads"),
        ({"clip_qkv": 0}, "olmoe: clip_qkv must be a positive number or null, got 0"),
        ({"clip_qkv": "8"}, "olmoe: clip_qkv must be a positive number"),
        ({"hidden_act": "gelu"}, "olmoe: hidden_act 'gelu'; only silu"),
        ({"num_experts": 4, "num_experts_per_tok": 5}, "olmoe: num_experts_per_tok 5 of 4"),
    ],
)
def test_olmoe_refuses_what_it_does_not_implement(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _arch("olmoe", **extra)


@pytest.mark.parametrize("model_type", ["granitemoe", "granitemoeshared"])
def test_granite_moe_reads_granites_scalings_and_its_experts(model_type: str) -> None:
    arch = _arch(model_type, embedding_multiplier=12, residual_multiplier=0.22,
                 attention_multiplier=0.015625, logits_scaling=8, attention_bias=True)  # fmt: skip
    assert arch.moe is not None and arch.moe.layers == (0, 1, 2, 3)
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.intermediate_size) == (8, 2, 32)
    assert arch.moe.renormalize and arch.moe.weights_in_model_dtype
    assert (arch.embedding_multiplier, arch.residual_multiplier) == (12.0, 0.22)
    assert (arch.attention_multiplier, arch.logits_scaling) == (0.015625, 8.0)
    assert arch.attention_bias and arch.o_proj_bias and arch.sliding_window is None
    assert arch.moe.shared_intermediate_size == 0


def test_granite_moe_shared_reads_its_ungated_shared_mlp() -> None:
    arch = _arch("granitemoeshared", shared_intermediate_size=48)
    assert arch.moe is not None and arch.moe.shared_intermediate_size == 48
    assert not arch.moe.shared_gate
    # the plain Granite MoE has no shared MLP whatever its config carries
    plain = _arch("granitemoe", shared_intermediate_size=48)
    assert plain.moe is not None and plain.moe.shared_intermediate_size == 0
    # over ranks: its shared MLP's rows split (24 + 24), as the experts' are
    assert TPLayout.of(arch, 1, 2).shared_intermediate == (24, 48)


@pytest.mark.parametrize(
    ("model_type", "extra", "message"),
    [
        ("granitemoe", {"logits_scaling": 0}, "granitemoe: logits_scaling must be a positive"),
        ("granitemoeshared", {"residual_multiplier": None},
         "granitemoeshared: residual_multiplier must be a positive"),
        ("granitemoe", {"hidden_act": "gelu"}, "granitemoe: hidden_act 'gelu'; only silu"),
        ("granitemoeshared", {"shared_intermediate_size": -1}, "shared_intermediate_size -1"),
        ("granitemoe", {"num_experts_per_tok": 9}, "granitemoe: num_experts_per_tok 9 of 8"),
    ],
)  # fmt: skip
def test_granite_moe_refuses_what_it_does_not_implement(
    model_type: str, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _arch(model_type, **extra)


def test_ernie4_5_moe_reads_transformers_defaults() -> None:
    arch = _arch("ernie4_5_moe")
    assert arch.moe is not None and arch.moe.layers == (1, 2, 3)  # start index 1, end -1
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.intermediate_size) == (64, 6, 1536)
    assert arch.moe.shared_intermediate_size == 2 * 1536 and not arch.moe.shared_gate
    assert arch.moe.correction_bias and arch.moe.router_fp32 and arch.moe.renormalize
    assert (arch.rope_theta, arch.rms_norm_eps, arch.head_dim) == (500_000.0, 1e-5, 16)
    assert arch.tie_word_embeddings and arch.rotary_interleaved
    assert not (arch.attention_bias or arch.o_proj_bias or arch.mlp_bias)


def test_ernie4_5_moe_reads_its_sparse_layers() -> None:
    arch = _arch("ernie4_5_moe", num_hidden_layers=8, moe_layer_start_index=2,
                 moe_layer_end_index=6, moe_layer_interval=2, moe_num_shared_experts=0,
                 moe_num_experts=8, moe_k=2, moe_intermediate_size=24)  # fmt: skip
    assert arch.moe is not None and arch.moe.layers == (3, 5)
    assert (arch.moe.num_experts, arch.moe.top_k, arch.moe.intermediate_size) == (8, 2, 24)
    assert arch.moe.shared_intermediate_size == 0
    dense = _arch("ernie4_5_moe", moe_layer_start_index=4)  # past the last layer
    assert dense.moe is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"use_bias": True}, "ernie4_5_moe: use_bias .* is not supported"),
        ({"hidden_act": "gelu"}, "ernie4_5_moe: hidden_act 'gelu'; only silu"),
        ({"moe_layer_interval": 0}, "moe_layer_interval 0 must be >= 1"),
        ({"moe_num_experts": 4, "moe_k": 6}, "ernie4_5_moe: num_experts_per_tok 6 of 4"),
    ],
)
def test_ernie4_5_moe_refuses_what_it_does_not_implement(
    extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _arch("ernie4_5_moe", **extra)
