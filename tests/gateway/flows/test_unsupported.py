"""Every field of the unsupported table is a 400 naming it when it asks for something, and passes
when it does not; unsupported endpoints are OpenAI-shaped 404s that say so."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.core.errors import APIError
from gateway.flows.embeddings import parse_embedding
from gateway.flows.protocol import parse_chat, parse_completion, parse_tokenize
from gateway.flows.unsupported import (
    CHAT,
    COMPLETION,
    ENDPOINTS,
    NEUTRAL,
    NO_EFFECT,
    SAMPLING,
    TOKENIZE,
)
from gateway.http.admin_api import SPEC_PATH
from tests.gateway.stack import Stack

MESSAGES = [{"role": "user", "content": "hi"}]
# a value that asks for something, per field (anything truthy does, but be realistic)
ASKING: dict[str, Any] = {
    "guided_whitespace_pattern": " ",
    "structural_tag": "{}",
    "use_beam_search": True,
    "length_penalty": 0.5,
    "logits_processors": ["x"],
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"a": 1},
    "mm_processor_kwargs": {"a": 1},
    "lora_request": {"lora_name": "x"},
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "chat_template": "{{ messages }}",
    "documents": [{"title": "t", "text": "x"}],
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {"search_context_size": "low"},
    "media_io_kwargs": {"a": 1},
    "store": True,
    "verbosity": "low",
    "service_tier": "flex",
    "moderation": {"model": "omni-moderation-latest"},
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_embeds": "AAAA",
}


def test_every_row_has_an_asking_value() -> None:
    assert set(ASKING) == {*SAMPLING, *CHAT, *COMPLETION, *TOKENIZE}


def _cases() -> list[tuple[str, str]]:
    return [
        *((name, "chat") for name in [*SAMPLING, *CHAT]),
        *((name, "completion") for name in [*SAMPLING, *COMPLETION]),
        *((name, "tokenize") for name in TOKENIZE),
    ]


def _parse(endpoint: str, extra: dict[str, Any]) -> None:
    if endpoint == "chat":
        parse_chat({"messages": MESSAGES, **extra})
    elif endpoint == "tokenize":
        parse_tokenize({"messages": MESSAGES, **extra}, 1 << 20)
    elif endpoint == "tokenize_prompt":
        parse_tokenize({"prompt": "hi", **extra}, 1 << 20)
    else:
        parse_completion({"prompt": "hi", **extra})


@pytest.mark.parametrize(("name", "endpoint"), _cases())
def test_a_field_that_asks_for_something_is_a_400_naming_it(name: str, endpoint: str) -> None:
    with pytest.raises(APIError) as err:
        _parse(endpoint, {name: ASKING[name]})
    assert err.value.status == 400 and err.value.param == name
    assert f"{name} is not supported" in err.value.message


@pytest.mark.parametrize(("name", "endpoint"), _cases())
def test_a_field_that_asks_for_nothing_passes(name: str, endpoint: str) -> None:
    table = TOKENIZE if endpoint == "tokenize" else {**SAMPLING, **CHAT, **COMPLETION}
    for value in table[name][1]:
        _parse(endpoint, {name: value})  # no error


def test_web_search_with_its_default_options_is_refused_too() -> None:
    # OpenAI turns web search on for any web_search_options object, the empty one included
    with pytest.raises(APIError) as err:
        parse_chat({"messages": MESSAGES, "web_search_options": {}})
    assert err.value.param == "web_search_options"


def test_openai_prompt_caching_and_moderation_fields_are_named_not_unknown() -> None:
    # the official client's prompt_cache_retention, prompt_cache_options and moderation: what
    # the implicit in-memory prefix cache does passes, the rest is a 400 saying why
    parse_chat({"messages": MESSAGES, "prompt_cache_retention": "in_memory",
                "prompt_cache_options": {"mode": "implicit"}, "moderation": None})  # fmt: skip
    for name, value in (("prompt_cache_retention", "24h"), ("moderation", {"model": "m"}),
                        ("prompt_cache_options", {"mode": "explicit"})):  # fmt: skip
        with pytest.raises(APIError) as err:
            parse_chat({"messages": MESSAGES, name: value})
        assert err.value.param == name and f"{name} is not supported" in err.value.message


def test_neutral_values_are_type_strict() -> None:
    assert False in NEUTRAL  # and 0 == False, yet 0 asks for something:
    with pytest.raises(APIError):
        parse_completion({"prompt": "hi", "use_beam_search": 0})
    parse_completion({"prompt": "hi", "use_beam_search": False})


@pytest.mark.parametrize("endpoint", ["chat", "completion", "embedding", "tokenize",
                                      "tokenize_prompt"])  # fmt: skip
@pytest.mark.parametrize("name", ["max_token", "frobnicate", "top_kk", "guided_jsn"])
def test_a_field_no_parser_reads_is_a_400_naming_it(name: str, endpoint: str) -> None:
    # a misspelt field, or a vLLM extension Tandem does not know, must not quietly do nothing
    with pytest.raises(APIError) as err:
        if endpoint == "embedding":
            parse_embedding({"input": "hi", name: 1})
        else:
            _parse(endpoint, {name: 1})
    assert err.value.status == 400 and err.value.param == name
    assert f"Unrecognized request argument supplied: {name}" in err.value.message


def test_scoring_the_prompt_keeps_what_was_read() -> None:
    # max_tokens 0 with echo re-reads the body with max_tokens 1: what was read before counts
    parse_completion({"prompt": "hi", "echo": True, "logprobs": 1, "max_tokens": 0})


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_token": 4}),
        ("/tokenize", {"prompt": "hi", "add_bos": True}),
        ("/detokenize", {"tokens": [1], "skip": True}),
    ],
)
def test_an_unknown_field_is_an_openai_shaped_400(
    colocated: Stack, path: str, body: dict[str, Any]
) -> None:
    r = httpx.post(f"{colocated.base_url}{path}", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    unknown = next(name for name in body if name not in ("messages", "prompt", "tokens"))
    assert error["param"] == unknown and "Unrecognized request argument" in error["message"]


@pytest.mark.parametrize("name", sorted(NO_EFFECT))
def test_fields_that_change_nothing_pass(name: str) -> None:
    value: Any = {"k": "x"} if name == "metadata" else "x"  # metadata: OpenAI's shape (checked)
    parse_chat({"messages": MESSAGES, name: value})
    parse_completion({"prompt": "hi", name: value})


@pytest.mark.parametrize(
    ("schema", "parse", "required"),
    [
        ("ChatCompletionRequest", parse_chat, {"messages": MESSAGES}),
        ("CompletionRequest", parse_completion, {"prompt": "hi"}),
        ("EmbeddingRequest", parse_embedding, {"input": "hi"}),
    ],
)
def test_every_documented_field_is_known(
    schema: str, parse: Callable[[Any], Any], required: dict[str, Any]
) -> None:
    # the OpenAPI document lists what the server takes: each of its fields, given as null
    # ("not given"), passes the unknown-field check
    spec = json.loads(Path(SPEC_PATH).read_text())["components"]["schemas"][schema]
    assert spec["additionalProperties"] is False
    for name in spec["properties"]:
        parse({**required, name: None} if name not in required else required)


def test_every_documented_tokenize_field_is_known() -> None:
    # /tokenize's two forms: each field of its OpenAPI document is one of either form's
    spec = json.loads(Path(SPEC_PATH).read_text())["components"]["schemas"]["TokenizeRequest"]
    assert spec["additionalProperties"] is False
    for name in spec["properties"]:
        taken = 0
        for form in ({"prompt": "hi"}, {"messages": MESSAGES}):
            try:
                parse_tokenize({**form, name: None} if name not in form else form, 1 << 20)
                taken += 1
            except APIError:
                pass  # a field of the other form
        assert taken, name


def test_a_custom_whitespace_pattern_is_a_400_and_runs_nothing(colocated: Stack) -> None:
    body = {"messages": MESSAGES, "guided_regex": "[a-z]+", "guided_whitespace_pattern": " *"}
    r = httpx.post(f"{colocated.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "guided_whitespace_pattern"
    assert error["type"] == "invalid_request_error"
    assert not colocated.workers[0].records.requests


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_unsupported_endpoints_are_openai_shaped_404s(colocated: Stack, path: str) -> None:
    r = httpx.post(f"{colocated.base_url}{path}", json={"input": "hi"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "not_found" and "is not supported" in error["message"]
    assert path in error["message"]


def test_an_unknown_path_says_what_the_server_serves(colocated: Stack) -> None:
    r = httpx.get(f"{colocated.base_url}/v1/nope")
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "/v1/nope does not exist" in message and "/v1/chat/completions" in message


def test_embedding_inputs_refuse_the_chat_style_fields_only_when_given() -> None:
    """add_generation_prompt and the other template fields belong to vLLM's chat-style
    embeddings (messages): beside input, null, false or {} ask for nothing; a value that asks
    is a 400 naming it."""
    for name, neutral, asking in (
        ("add_generation_prompt", False, True),
        ("continue_final_message", False, True),
        ("chat_template_kwargs", {}, {"enable_thinking": False}),
    ):
        for value in (None, neutral):
            assert parse_embedding({"input": "hi", name: value}).inputs == ("hi",)
        with pytest.raises(APIError) as e:
            parse_embedding({"input": "hi", name: asking})
        assert e.value.param == name and "messages" in str(e.value)
