"""tool_choice "auto" through the gateway (fake workers that echo the prompt): with
--enable-auto-tool-choice and --tool-call-parser hermes the model's <tool_call> text becomes
tool_calls, whole and streamed; the grammar a forced choice sends reaches the workers; a
required choice cut short (max_tokens, a stop string) gives the calls named so far and never the
grammar's array as content, a named one its arguments so far, both with the engine's
finish_reason ("tool_calls" only for a whole required array; a named choice's is never
"tool_calls", as OpenAI and vLLM report it); a gateway without the flags refuses "auto"."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.core.config import GatewayConfig
from gateway.flows.chat_output import check_parser_flags
from services.config import ConfigError
from tests.gateway.stack import Stack

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object",
                 "properties": {"city": {"type": "string"}}}},
}  # fmt: skip


@pytest.fixture(scope="module")
def auto_stack(tokenizer_dir: str) -> Iterator[Stack]:
    stack = Stack(
        tokenizer_dir, ["colocated"], enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def _body(stack: Stack, **extra: Any) -> dict[str, Any]:
    """The fake echoes the rendered prompt up to its first <|im_end|> (the EOS): the system
    message, the call in it."""
    messages = [
        {"role": "system", "content": f"Check this. {CALL}"},
        {"role": "user", "content": "hi"},
    ]
    count = httpx.post(f"{stack.base_url}/tokenize", json={"messages": messages}).json()["count"]
    return {"messages": messages, "tools": [WEATHER], "max_tokens": count, **extra}


def test_auto_reads_the_call_out_of_the_text(auto_stack: Stack) -> None:
    r = httpx.post(f"{auto_stack.base_url}/v1/chat/completions", json=_body(auto_stack))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == "system\nCheck this."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_auto_streams_content_then_the_call(auto_stack: Stack) -> None:
    deltas, finish = [], []
    body = _body(auto_stack, stream=True)
    with httpx.stream("POST", f"{auto_stack.base_url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                deltas += [c["delta"] for c in choices]
                finish += [c["finish_reason"] for c in choices if c["finish_reason"]]
    assert finish == ["tool_calls"]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert "<tool_call>" not in content and "Check this." in content
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_a_forced_choice_sends_its_grammar_to_the_worker(auto_stack: Stack) -> None:
    auto_stack.reset()
    body = _body(auto_stack, tool_choice="required", max_tokens=4)
    assert httpx.post(f"{auto_stack.base_url}/v1/chat/completions", json=body).status_code == 200
    sent = auto_stack.workers[0].records.samplings[-1].structured
    schema = json.loads(sent.spec)
    assert sent.kind == "json" and schema["type"] == "array" and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"enum": ["get_weather"]}


ARRAY = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'


def _forced(
    stack: Stack, stream: bool, choice: Any = "required", system: str = ARRAY, **extra: Any
) -> tuple[dict[str, Any], str | None]:
    """A forced tool_choice (required, or a named function), the fake echoing a system message
    that is what the grammar makes (the array, the arguments): the message (streamed deltas
    assembled as a client does: content, calls by index) and the finish_reason."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "weather?"}]
    body = {"messages": messages, "tools": [WEATHER], "tool_choice": choice, **extra}
    url = f"{stack.base_url}/v1/chat/completions"
    if not stream:
        r = httpx.post(url, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"], choice["finish_reason"]
    content, calls, finish = "", {}, None
    with httpx.stream("POST", url, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                finish = c["finish_reason"] or finish
                content += c["delta"].get("content") or ""
                for call in c["delta"].get("tool_calls", []):
                    slot = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                    slot["name"] += call["function"].get("name") or ""
                    slot["arguments"] += call["function"].get("arguments") or ""
    message = {"content": content, "tool_calls": [{"function": c} for c in calls.values()]}
    return message, finish


@pytest.mark.parametrize(
    ("extra", "calls", "finish"),
    [
        ({"max_tokens": 3}, [], "length"),  # '[{"': the wrapper cut short before a name
        ({"stop": ['"']}, [], "stop"),  # '[{'
        ({"stop": ["get_weather"]}, [], "stop"),  # '[{"name": "'
        ({"stop": ["}"]}, [("get_weather", '{"city": "Oslo"')], "stop"),  # in the arguments
        ({}, [("get_weather", '{"city": "Oslo"}')], "tool_calls"),  # the whole array
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_required_choice_cut_short_never_sends_the_wrapper_as_content(
    colocated: Stack, extra: dict[str, Any], calls: list[tuple[str, str]], finish: str,
    stream: bool,
) -> None:  # fmt: skip
    message, reason = _forced(colocated, stream, **extra)
    got = [(c["function"]["name"], c["function"]["arguments"])
           for c in message.get("tool_calls") or []]  # fmt: skip
    assert (got, reason) == (calls, finish)
    assert not message["content"] and "[" not in (message["content"] or "")
    if not stream:
        assert message["content"] == ("" if not calls else None)


def test_every_max_tokens_cut_of_a_required_choice_streams_what_it_returns(
    colocated: Stack,
) -> None:
    """For each max_tokens short of the whole array: no content, and the stream's calls are the
    whole response's (a call once its name is whole, the arguments generated so far)."""
    for n in range(1, 40):
        message, reason = _forced(colocated, False, max_tokens=n)
        if reason != "length":
            (call,) = message["tool_calls"]
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
            assert message["content"] is None and reason == "tool_calls"
            return
        streamed, streamed_reason = _forced(colocated, True, max_tokens=n)
        assert streamed_reason == "length" and streamed["content"] == ""
        assert message["content"] == ("" if "tool_calls" not in message else None), n
        assert [c["function"] for c in streamed["tool_calls"]] == [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in message.get("tool_calls", [])
        ], n
    raise AssertionError("the array never ended within 40 tokens")


NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGUMENTS = '{"city": "Oslo"}'
# the fake echoes the prompt from its first token: the system turn's role, then its content
ECHOED = "system\n" + ARGUMENTS


@pytest.mark.parametrize(
    ("extra", "arguments", "finish"),
    [
        ({"max_tokens": 4}, None, "length"),  # cut inside the arguments
        ({"stop": ["}"]}, ECHOED[:-1], "stop"),  # the object's closing brace never came
        ({}, ECHOED, "stop"),  # the whole object (the fake's EOS, as the grammar's end)
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_choice_cut_short_says_what_cut_it(
    colocated: Stack, extra: dict[str, Any], arguments: str | None, finish: str, stream: bool
) -> None:
    """A named function's arguments cut by a stop string or max_tokens: the call with the
    arguments so far and finish_reason "stop" or "length"; the whole object "stop" too (OpenAI's
    and vLLM's named choice); the stream and the whole response agree."""
    message, reason = _forced(colocated, stream, NAMED, ARGUMENTS, **extra)
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and reason == finish
    if arguments is None:  # max_tokens: a prefix of what the whole call has
        assert ECHOED.startswith(call["function"]["arguments"]) and call["function"]["arguments"]
        assert call["function"]["arguments"] != ECHOED
    else:
        assert call["function"]["arguments"] == arguments
    assert not message["content"]
    other, other_reason = _forced(colocated, not stream, NAMED, ARGUMENTS, **extra)
    assert (other["tool_calls"][0]["function"], other_reason) == (call["function"], reason)


def test_a_gateway_without_the_flags_refuses_auto(colocated: Stack) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    r = httpx.post(f"{colocated.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
    assert not colocated.workers[0].records.requests


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"enable_auto_tool_choice": True}, "--enable-auto-tool-choice needs --tool-call-parser"),
        ({"tool_call_parser": "kimi_k2"}, "--tool-call-parser must be one of hermes"),
        ({"reasoning_parser": "r2"}, "--reasoning-parser must be one of"),
    ],
)
def test_parser_flags_are_checked_at_start(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        check_parser_flags(GatewayConfig(tokenizer="x", **kwargs))


def test_harmony_reads_its_own_calls_without_a_tool_call_parser() -> None:
    check_parser_flags(
        GatewayConfig(tokenizer="x", enable_auto_tool_choice=True, reasoning_parser="openai_gptoss")
    )


@pytest.fixture(scope="module")
def harmony_stack(tokenizer_dir: str) -> Iterator[Stack]:
    stack = Stack(tokenizer_dir, ["colocated"], reasoning_parser="openai_gptoss")
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def test_the_harmony_parser_reads_the_special_tokens_and_refuses_a_grammar(
    harmony_stack: Stack,
) -> None:
    """gpt-oss's channel markers are special tokens: with --reasoning-parser openai_gptoss a
    chat's tokens come back with them (then read out); a grammar beside it is a 400."""
    url = f"{harmony_stack.base_url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = httpx.post(url, json=body)
    assert r.status_code == 200, r.text
    assert harmony_stack.workers[0].records.samplings[-1].skip_special_tokens is False
    message = r.json()["choices"][0]["message"]  # the echoed prompt: no harmony in it
    assert message["content"] and message["reasoning_content"] is None
    for extra in ({"response_format": {"type": "json_object"}},
                  {"tools": [WEATHER], "tool_choice": "required"}):  # fmt: skip
        r = httpx.post(url, json={**body, **extra})
        assert r.status_code == 400 and "openai_gptoss" in r.json()["error"]["message"], r.text


@pytest.fixture(scope="module")
def special_markup_stack(
    tokenizer_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The embedded tokenizer with <tool_call> and </tool_call> as special tokens (Hermes 2
    Pro's), typed into a system message as those tokens, so that the fake echoes them."""
    directory = tmp_path_factory.mktemp("special_markup")
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), directory / name)
    spec = json.loads((directory / "tokenizer.json").read_text())
    renamed = {"<jupyter_start>": "<tool_call>", "<jupyter_text>": "</tool_call>"}  # unused ids
    for token in spec["added_tokens"]:
        if token["content"] in renamed:
            vocab = spec["model"]["vocab"]
            token["content"] = renamed[token["content"]]
            vocab[token["content"]] = token["id"]
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    for token in config.get("added_tokens_decoder", {}).values():
        token["content"] = renamed.get(token["content"], token["content"])
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    stack = Stack(str(directory), ["colocated"], enable_auto_tool_choice=True,
                  tool_call_parser="hermes", allow_special_tokens_in_messages=True)  # fmt: skip
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_marked_by_special_tokens_is_still_read(
    special_markup_stack: Stack, stream: bool
) -> None:
    """Decoding skips special tokens by default; under auto the parser's markup must survive
    it, else the call comes back as its bare JSON in content. tool_choice none keeps the
    default (nothing is read out of the text there)."""
    stack = special_markup_stack
    system = f"Check this. {CALL}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "weather?"}]
    count = httpx.post(f"{stack.base_url}/tokenize", json={"messages": messages}).json()["count"]
    message, finish = _forced(stack, stream, "auto", system, max_tokens=count)
    assert finish == "tool_calls" and "<tool_call>" not in message["content"]
    ((function),) = [c["function"] for c in message["tool_calls"]]
    assert function["name"] == "get_weather"
    assert json.loads(function["arguments"]) == {"city": "Oslo"}
    assert stack.workers[0].records.samplings[-1].skip_special_tokens is False
    _forced(stack, stream, "none", system, max_tokens=2)
    assert stack.workers[0].records.samplings[-1].skip_special_tokens is True


STRICT_WEATHER = {
    "type": "function",
    "function": {**WEATHER["function"], "strict": True,  # type: ignore[dict-item]
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"], "additionalProperties": False}},
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_strict_functions_under_auto_send_a_structural_tag_that_holds_their_calls(
    auto_stack: Stack,
) -> None:
    """OpenAI's strict (the openai client's pydantic_function_tool sets it): under auto the
    workers get xgrammar's structural tag, free text until the parser's <tool_call>, then one
    of the functions' calls, a strict one's arguments held to its schema. Without strict
    nothing is sent (the model is free, as before)."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    auto_stack.reset()
    body = _body(auto_stack, tools=[STRICT_WEATHER, TIME])
    r = httpx.post(f"{auto_stack.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["tool_calls"]  # read as before
    sent = auto_stack.workers[0].records.samplings[-1].structured
    assert sent.kind == "structural_tag"
    tag = json.loads(sent.spec)
    assert tag["format"]["triggers"] == ["<tool_call>"]
    assert tag["format"]["stop_after_first"] is False
    info = xgr.TokenizerInfo.from_huggingface(
        AutoTokenizer.from_pretrained(auto_stack.tokenizer_dir)
    )
    grammar = xgr.GrammarCompiler(info).compile_structural_tag(sent.spec)

    def accepts(text: str) -> bool:
        return bool(xgr.GrammarMatcher(grammar).accept_string(text))

    assert accepts("No call needed: it is sunny.")
    assert accepts(f"Let me check. {CALL} And the time: "
                   '<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')  # fmt: skip
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Oslo"}}')
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}')
    assert not accepts('<tool_call>\n{"name": "set_alarm", "arguments": {}}')
    one = httpx.post(f"{auto_stack.base_url}/v1/chat/completions",
                     json={**body, "parallel_tool_calls": False})  # fmt: skip
    assert one.status_code == 200, one.text
    tag = json.loads(auto_stack.workers[0].records.samplings[-1].structured.spec)
    assert tag["format"]["stop_after_first"] is True
    plain = httpx.post(f"{auto_stack.base_url}/v1/chat/completions", json=_body(auto_stack))
    assert plain.status_code == 200
    assert not auto_stack.workers[0].records.samplings[-1].HasField("structured")


def _strict_with(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {**STRICT_WEATHER["function"], **function}}


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
        ({"tools": [_strict_with(strict="yes")]}, "tools", "strict must be true or false"),
        (
            {"tools": [_strict_with(parameters={"type": "object", "uniqueItems": True})]},
            "tools[0].function.parameters",
            "uniqueItems",
        ),
    ],
)
def test_strict_functions_under_auto_refuse_what_they_cannot_hold(
    auto_stack: Stack, extra: dict[str, Any], param: str, words: str
) -> None:
    body = {**_body(auto_stack, tools=[STRICT_WEATHER]), **extra}
    r = httpx.post(f"{auto_stack.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert words in r.json()["error"]["message"]


def test_strict_functions_under_auto_need_a_parser_with_plain_markup(
    special_markup_stack: Stack,
) -> None:
    """Hermes 2 Pro's <tool_call> is a special token there: the grammar engine does not match
    it as text, so strict cannot be held: a 400, not a strict flag quietly ignored."""
    stack = special_markup_stack
    messages = [{"role": "user", "content": "weather?"}]
    body = {"messages": messages, "tools": [STRICT_WEATHER], "max_tokens": 2}
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "special tokens" in r.json()["error"]["message"]
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    assert httpx.post(f"{stack.base_url}/v1/chat/completions", json=named).status_code == 200
