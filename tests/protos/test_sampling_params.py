from __future__ import annotations

from typing import Any

import pytest

from protos.sampling_params import (
    MIN_TEMPERATURE,
    UNTIL_CONTEXT,
    InvalidRequestError,
    SamplingParams,
)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 2.01}, "temperature"),  # above OpenAI's (and vLLM's) 2
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "x"}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0, "top_p": 1.0, "max_tokens": 1},
        {"temperature": 2.0},
        {"min_tokens": 4, "max_tokens": 4},
        {"logprobs": 0},
        {"logprobs": 20},
        {"top_k": -1},
        {"repetition_penalty": 2.5},  # vLLM takes any finite penalty above 0
        {"repetition_penalty": 0.5},
        {"stop": [str(i) for i in range(16)]},
        {"logit_bias": {"0": -100, "7": 100}},
        {"logit_bias": {str(i): 1 for i in range(300)}},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_stop_and_stop_token_ids_are_normalised() -> None:
    params = SamplingParams(stop="END", stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert params.stop == ("END",)
    assert params.stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0.0).greedy
    assert hash(params) == hash(SamplingParams(stop=("END",), stop_token_ids=(3, 4)))


def test_logit_bias_mapping_becomes_sorted_pairs() -> None:
    params = SamplingParams(logit_bias={"7042": -100, 5: 2})  # type: ignore[arg-type]
    assert params.logit_bias == ((5, 2.0), (7042, -100.0))
    assert SamplingParams(logit_bias=params.logit_bias) == params
    assert len(SamplingParams(logit_bias={"5": 1, "05": 2}).logit_bias) == 1  # type: ignore[arg-type]


def test_a_tiny_temperature_is_raised_to_vllms_floor() -> None:
    """Below 0.01 the logits divided by the temperature overflow float32 (NaN probabilities):
    vLLM raises such a temperature to 0.01, and so does this; 0 stays greedy."""
    assert SamplingParams(temperature=1e-45).temperature == MIN_TEMPERATURE == 0.01
    assert SamplingParams(temperature=0.009).temperature == 0.01
    assert SamplingParams(temperature=0.02).temperature == 0.02
    assert SamplingParams(temperature=0.0).greedy


def test_max_tokens_none_means_up_to_the_context() -> None:
    """vLLM's offline SamplingParams take max_tokens=None (as many tokens as the context holds);
    it used to fail with a bare TypeError in validation."""
    params = SamplingParams(max_tokens=None)  # type: ignore[arg-type]
    params.validate()
    assert params.max_tokens == UNTIL_CONTEXT
