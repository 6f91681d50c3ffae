"""Choosing the method: the checkpoint's quantization_config, --quantization, and refusals that
say what to change."""

from __future__ import annotations

from typing import Any

import pytest

from services.cli import build_parser
from services.config import ConfigError, ModelConfig
from services.engine.llm import config_from_args
from services.engine.quantization.config import QuantConfig, resolve_quantization

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def ct_fp8(strategy: str = "channel", acts: dict[str, Any] | None = None) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy}
    group = {"weights": weights, "input_activations": acts, "targets": ["Linear"]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"], "config_groups": {"group_0": group}}  # fmt: skip


@pytest.mark.parametrize(
    ("checkpoint", "flag", "expected"),
    [
        (None, None, None),
        ({}, "fp8", QuantConfig("fp8", serialized=False)),
        (AWQ, None, QuantConfig("awq")),
        (AWQ, "awq", QuantConfig("awq")),
        ({**AWQ, "group_size": 64}, None, QuantConfig("awq", group_size=64)),
        (GPTQ, None, QuantConfig("gptq", desc_act=True)),
        (FP8_BLOCK, "fp8", QuantConfig("fp8", weight_block=(128, 128))),
        (ct_fp8(), None, QuantConfig("fp8")),
        (ct_fp8(acts={"dynamic": True, "strategy": "token"}), None, QuantConfig("fp8")),
    ],
)
def test_the_method_comes_from_the_checkpoint_or_the_flag(
    checkpoint: dict[str, Any] | None, flag: str | None, expected: QuantConfig | None
) -> None:
    assert resolve_quantization(checkpoint, flag) == expected


def test_random_weights_can_take_any_method() -> None:
    assert resolve_quantization(None, "awq", has_weights=False) == QuantConfig("awq")
    fp8 = resolve_quantization(FP8_BLOCK, None, has_weights=False)
    assert fp8 == QuantConfig("fp8", serialized=False)  # quantized as the weights are made


@pytest.mark.parametrize(
    ("checkpoint", "flag", "message"),
    [
        ({}, "gptq", "--quantization gptq needs a GPTQ checkpoint"),
        (AWQ, "gptq", "drop --quantization or pass --quantization awq"),
        (AWQ, "int8", "--quantization must be one of fp8, awq, gptq"),
        ({"quant_method": "bitsandbytes"}, None, "quant_method 'bitsandbytes' is not supported"),
        ({**AWQ, "bits": 8}, None, "awq with 8 bits is not supported"),
        ({**GPTQ, "bits": 3}, None, "gptq with 3 bits"),
        ({**AWQ, "group_size": 256}, None, "group_size 256 is not supported"),
        ({**GPTQ, "group_size": -1}, None, "group_size -1 is not supported"),
        ({**AWQ, "version": "gemv"}, None, "awq version 'gemv'"),
        ({**AWQ, "zero_point": False}, None, "zero_point=False"),
        ({**GPTQ, "checkpoint_format": "gptq_v2"}, None, "checkpoint_format 'gptq_v2'"),
        ({**GPTQ, "static_groups": True}, None, "static_groups"),
        ({**GPTQ, "lm_head": True}, None, "quantized lm_head"),
        ({**AWQ, "ignore": ["re:*.gate"]}, None, "'re:\\*.gate' is not a valid regular"),
        ({**FP8_BLOCK, "activation_scheme": "static"}, None, "activation_scheme 'static'"),
        ({**FP8_BLOCK, "weight_block_size": [128, 100]}, None, "multiple of 16"),
        (ct_fp8(acts={"dynamic": False, "strategy": "tensor"}), None, "static input_activations"),
        (ct_fp8("group"), None, "strategy 'group'"),
        ({**ct_fp8(), "format": "pack-quantized"}, None, "format 'pack-quantized'"),
    ],
)
def test_what_cannot_run_is_refused(
    checkpoint: dict[str, Any], flag: str | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        resolve_quantization(checkpoint, flag)


def test_the_flag_reaches_the_model_config() -> None:
    args = build_parser().parse_args(["worker", "--port", "0", "-q", "fp8"])
    assert config_from_args(args).model.quantization == "fp8"
    assert (
        config_from_args(build_parser().parse_args(["worker", "--port", "0"])).model.quantization
        is None
    )
    with pytest.raises(ConfigError, match="--quantization must be one of"):
        ModelConfig(quantization="int4")


@pytest.mark.parametrize(
    ("entries", "module", "left"),
    [(["mlp.gate"], "model.layers.3.mlp.gate", True),
     (["mlp.gate"], "model.layers.3.mlp.gate_proj", False),
     (["gate"], "model.layers.3.mlp.gate", True),  # AWQ's bare names
     (["gate"], "model.layers.3.mlp.experts.0.gate_proj", False),
     (["model.layers.0.self_attn.o_proj"], "model.layers.0.self_attn.o_proj", True),
     (["model.layers.0.self_attn.o_proj"], "model.layers.10.self_attn.o_proj", False),
     (["re:.*mlp.gate$"], "model.layers.3.mlp.gate", True),
     (["re:.*mlp.gate$"], "model.layers.3.mlp.gate_proj", False),
     (["lm_head"], "lm_head", False),  # never quantized here: not kept in the list
     # a multimodal checkpoint served as its language model (Gemma 3, Mistral 3) names its
     # layers as transformers 5 (model.language_model.) or 4 (language_model.model.) does
     (["model.language_model.layers.0.self_attn.o_proj"], "model.layers.0.self_attn.o_proj", True),
     (["language_model.model.layers.0.self_attn.o_proj"], "model.layers.0.self_attn.o_proj", True),
     (["model.language_model.layers.0.self_attn.o_proj"], "model.layers.1.self_attn.o_proj", False),
     (["re:model[.]language_model[.]layers[.]1[.].*"], "model.layers.1.mlp.down_proj", True),
     (["re:model[.]language_model[.]layers[.]1[.].*"], "model.layers.2.mlp.down_proj", False),
     (["re:language_model.model.layers.1.mlp.*"], "model.layers.1.mlp.down_proj", True),
     (["re:vision_tower.*", "model.vision_tower"], "model.layers.0.mlp.down_proj", False)],
)  # fmt: skip
def test_modules_the_checkpoint_leaves_unquantized(
    entries: list[str], module: str, left: bool
) -> None:
    for key, base in (("modules_to_not_convert", AWQ), ("ignored_layers", FP8_BLOCK)):
        q = resolve_quantization({**base, key: entries}, None)
        assert q is not None and q.leaves_unquantized(module) is left
