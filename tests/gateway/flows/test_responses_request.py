"""A Responses request becomes the chat request the chat pipeline runs; each field it does
not implement is a 400 naming it, and the chat parser's errors come back in its own terms."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.core.errors import APIError
from gateway.flows.responses_request import parse_responses, previous_response_id
from gateway.http.admin_api import SPEC_PATH

TOOL = {"type": "function", "name": "get_weather", "description": "The weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def parse(**body: Any) -> Any:
    return parse_responses({"input": "hi", **body}, {}, [])


def test_the_chat_request_it_becomes() -> None:
    req = parse(instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9,
                user="u1", metadata={"k": "v"}, store=False)  # fmt: skip
    chat = req.chat
    assert chat.messages == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "hi"}]  # fmt: skip
    assert chat.common.max_tokens == 7 and chat.common.max_tokens_field == "max_completion_tokens"
    assert chat.common.sampling.temperature == 0.5 and chat.common.sampling.top_p == 0.9
    assert chat.common.user == "u1" and chat.add_generation_prompt and not req.store
    assert req.params["metadata"] == {"k": "v"} and req.params["instructions"] == "Be brief."
    assert req.params["text"] == {"format": {"type": "text"}} and req.params["tools"] == []
    echoed = parse(prompt_cache_key="k", safety_identifier="s").params
    assert echoed["prompt_cache_key"] == "k" and echoed["safety_identifier"] == "s"


def test_flat_function_tools_and_tool_choice() -> None:
    req = parse(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
                parallel_tool_calls=False)  # fmt: skip
    tools = req.chat.tools
    assert tools is not None and tools.choice == "function" and tools.function == "get_weather"
    assert not tools.parallel and tools.functions[0].parameters["required"] == ["city"]
    # the template sees the chat form of the tools
    assert req.chat.template_kwargs["tools"][0]["function"]["name"] == "get_weather"
    # the schema the grammar enforces is the function's parameters
    structured = req.chat.common.sampling.structured
    assert structured is not None and json.loads(structured.spec)["required"] == ["city"]
    assert req.params["tools"] == [{**TOOL, "strict": None}]
    assert req.params["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert parse(tools=[TOOL]).params["tool_choice"] == "auto"
    for tools in ({}, {"tools": []}):  # "auto" is the Responses default, echoed without tools
        req = parse(tool_choice="auto", **tools)
        assert req.chat.tools is None and req.params["tool_choice"] == "auto"
    assert parse(tools=[TOOL], tool_choice="required").chat.tools.choice == "required"  # type: ignore[union-attr]


def test_text_format_is_the_response_format() -> None:
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}
    so = parse(text={"format": fmt}).chat.common.sampling.structured
    assert so is not None and so.kind == "json" and json.loads(so.spec) == SCHEMA
    assert so.source == "response_format"
    so = parse(text={"format": {"type": "json_object"}}).chat.common.sampling.structured
    assert so is not None and so.kind == "json_object"
    assert parse(text={"format": {"type": "text"}}).chat.common.sampling.structured is None


def test_reasoning_effort_logprobs_and_passed_fields() -> None:
    req = parse(reasoning={"effort": "high"}, include=["message.output_text.logprobs"],
                top_logprobs=3, seed=5, top_k=4, stop=["x"])  # fmt: skip
    assert req.chat.reasoning_effort == "high" and req.params["reasoning"]["effort"] == "high"
    assert req.logprobs and req.chat.logprobs and req.chat.top_logprobs == 3
    sampling = req.chat.common.sampling
    assert sampling.seed == 5 and sampling.top_k == 4 and sampling.stop == ("x",)


def test_a_final_assistant_message_begun_is_continued() -> None:
    req = parse(input=[{"role": "user", "content": "hi"},
                       {"role": "assistant", "content": "Sure,", "status": "in_progress"}])  # fmt: skip
    assert req.chat.continue_final_message and not req.chat.add_generation_prompt


def test_the_history_is_read_first_and_kept_apart_from_the_input() -> None:
    history = parse(input="first").items
    req = parse_responses({"input": "second", "previous_response_id": "resp_1"}, {}, history)
    assert [m["content"] for m in req.chat.messages] == ["first", "second"]
    assert req.context == history + req.items and req.params["previous_response_id"] == "resp_1"


def test_previous_response_id_is_read_first() -> None:
    assert previous_response_id({"previous_response_id": "resp_x"}) == "resp_x"
    assert previous_response_id({}) is None
    with pytest.raises(APIError):
        previous_response_id({"previous_response_id": ""})


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"background": True}, "background", "background responses are not supported"),
        ({"conversation": "conv_1"}, "conversation", "conversations are not supported"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates are not supported"),
        ({"truncation": "auto"}, "truncation", "only 'disabled'"),
        ({"service_tier": "flex"}, "service_tier", "service tiers"),
        ({"context_management": [{"type": "compaction"}]}, "context_management", "compaction"),
        ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs", "text.format"),
        ({"tools": [{"type": "web_search"}]}, "tools", "tools[0].type 'web_search': built-in"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools", "built-in"),
        ({"tools": [{"type": "code_interpreter", "container": "auto"}]}, "tools", "built-in"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
         "tools[0].function is not a field of a function tool"),
        ({"tools": [{"type": "function", "name": "bad name"}]}, "tools",
         "tools[0].name must be 1 to 64"),
        ({"tools": [TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice",
         "got type 'web_search_preview'"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
         "nope"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools' are specified"),
        ({"tool_choice": {"type": "function", "name": "f"}, "tools": []}, "tool_choice",
         "only allowed when 'tools' are specified"),
        ({"text": {"format": {"type": "json_schema", "schema": SCHEMA}}},
         "text.format.name", "text.format json_schema needs a name"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format", "text.format must be"),
        ({"text": {"format": {}}}, "text.format", "text.format must be"),
        ({"text": {"verbosity": "low"}}, "text", "text.verbosity is not supported"),
        ({"reasoning": {"summary": "auto"}}, "reasoning", "reasoning.summary is not supported"),
        ({"reasoning": {"effort": "minimal"}}, "reasoning.effort", "reasoning.effort must be"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "encrypted reasoning"),
        ({"include": ["file_search_call.results"]}, "include", "built-in tool"),
        ({"top_logprobs": 2}, "top_logprobs", "needs include"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be between 1"),
        ({"temperature": -1}, "temperature", "temperature must be between"),
        ({"stream_options": {"include_obfuscation": True}, "stream": True}, "stream_options",
         "include_obfuscation is not supported"),
        ({"stream_options": {"include_usage": True}, "stream": True}, "stream_options",
         "include_obfuscation (true or false) only"),
        ({"store": "yes"}, "store", "store must be true or false"),
        ({"metadata": {"k": 1}}, "metadata", "metadata keys"),
        ({"n": 2}, "n", "Unrecognized request argument supplied: n"),
        ({"messages": []}, "messages", "Unrecognized request argument supplied: messages"),
        ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                  "image_url": "data:text/plain;base64,aGk="}]}]},
         "input", "input[0].content: the data URL holds 'text/plain'"),
    ],
)  # fmt: skip
def test_refused_fields_are_a_400_naming_them(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(APIError) as e:
        parse(**body)
    assert e.value.status == 400, e.value.message
    assert e.value.param == param, e.value.message
    assert words in e.value.message


@pytest.mark.parametrize(
    "body",
    [
        {"background": False, "truncation": "disabled", "conversation": None, "prompt": None},
        {"service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s"},
        {"include": [], "stream_options": None, "max_tool_calls": 3, "reasoning": {}},
        {"text": {"format": {"type": "text"}, "verbosity": None}, "tools": []},
    ],
)
def test_neutral_values_pass(body: dict[str, Any]) -> None:
    parse(**body)


def test_every_documented_field_is_known() -> None:
    spec = json.loads(Path(SPEC_PATH).read_text())["components"]["schemas"]
    fields = spec["ResponseCreateRequest"]
    assert fields["additionalProperties"] is False
    for name in fields["properties"]:
        if name != "input":
            parse(**{name: None})
