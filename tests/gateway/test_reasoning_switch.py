"""--reasoning-parser deepseek_v3 and glm45 through the gateway (fake workers that echo the
prompt from its system turn): the request's chat_template_kwargs switch the thinking as vLLM's
parsers read them, whole and streamed; a switch that is no boolean is a 400; GLM's <tool_call>
written while thinking ends the thinking and is read out by --tool-call-parser glm45."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.stack import Stack, started

CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object",
                 "properties": {"city": {"type": "string"}}}},
}  # fmt: skip


@pytest.fixture(scope="module")
def v3(tokenizer_dir: str) -> Iterator[Stack]:
    yield from started(tokenizer_dir, ["colocated"], reasoning_parser="deepseek_v3")


@pytest.fixture(scope="module")
def glm(tokenizer_dir: str) -> Iterator[Stack]:
    yield from started(tokenizer_dir, ["colocated"], reasoning_parser="glm45", enable_auto_tool_choice=True,
                      tool_call_parser="glm45")  # fmt: skip


def _body(stack: Stack, system: str, **extra: Any) -> dict[str, Any]:
    """The fake echoes the rendered prompt up to its first <|im_end|>: "system\\n" + system."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    count = httpx.post(f"{stack.base_url}/tokenize", json={"messages": messages}).json()["count"]
    return {"messages": messages, "max_tokens": count, **extra}


def _chat(stack: Stack, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The message (joined from the deltas when streamed): content, reasoning, calls."""
    url = f"{stack.base_url}/v1/chat/completions"
    if not stream:
        r = httpx.post(url, json=body)
        assert r.status_code == 200, r.text
        message: dict[str, Any] = r.json()["choices"][0]["message"]
        return message
    content, thought, calls = "", "", []
    with httpx.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            content += delta.get("content") or ""
            thought += delta.get("reasoning_content") or ""
            calls += delta.get("tool_calls") or []
    return {"content": content or None, "reasoning_content": thought or None, "tool_calls": calls}


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_v3_thinks_only_when_chat_template_kwargs_ask(v3: Stack, stream: bool) -> None:
    system = "Hmm.</think>\n\nIt is 4."
    for kwargs in ({}, {"thinking": False}):
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        message = _chat(v3, _body(v3, system, **extra), stream)
        assert message["content"] == f"system\n{system}"
        assert message["reasoning_content"] is None
    for kwargs in ({"thinking": True}, {"enable_thinking": True}):
        message = _chat(v3, _body(v3, system, chat_template_kwargs=kwargs), stream)
        assert message["reasoning_content"] == "system\nHmm."
        assert message["content"] == "It is 4."


def test_a_thinking_switch_that_is_no_boolean_is_a_400(v3: Stack, glm: Stack) -> None:
    for stack in (v3, glm):
        body = _body(stack, "x", chat_template_kwargs={"thinking": "false"})
        r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "chat_template_kwargs"
        assert "chat_template_kwargs.thinking must be true or false" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_glm45_thinks_by_default_and_a_tool_call_ends_it(glm: Stack, stream: bool) -> None:
    # never closed: all of it is thinking
    message = _chat(glm, _body(glm, "Still thinking"), stream)
    assert message["reasoning_content"] == "system\nStill thinking"
    assert not message["content"]
    # switched off: all answer, tags and all
    system = "Hmm.</think>\n\nIt is 4."
    off = _body(glm, system, chat_template_kwargs={"enable_thinking": False})
    message = _chat(glm, off, stream)
    assert message["content"] == f"system\n{system}" and message["reasoning_content"] is None
    # a call written while thinking ends it, and is read out
    body = _body(glm, f"Let me check.\n{CALL}", tools=[WEATHER])
    message = _chat(glm, body, stream)
    assert message["reasoning_content"] == "system\nLet me check."
    assert not message["content"]
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


def test_a_grammar_waits_for_the_thinking_only_when_there_is_some(v3: Stack, glm: Stack) -> None:
    """glm45's output starts inside its thinking (the grammar after its </think>); a request
    that switched the thinking off is constrained from its first token."""
    cases = [
        (glm, {}, ("<think>", "</think>", True)),
        (glm, {"enable_thinking": False}, ("", "", False)),
        (v3, {}, ("", "", False)),
        (v3, {"thinking": True}, ("<think>", "</think>", False)),  # this template opens none
    ]
    for stack, kwargs, expected in cases:
        body = _body(stack, "x", chat_template_kwargs=kwargs,
                     response_format={"type": "json_object"})  # fmt: skip
        r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        so = stack.workers[0].records.samplings[-1].structured
        assert so is not None
        assert (so.reasoning_start, so.reasoning_end, so.reasoning_open) == expected


@pytest.fixture(scope="module")
def v3_thinking(tokenizer_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """--default-chat-template-kwargs '{"thinking": true, "greeting": "HELLO"}' (vLLM's flag),
    with a template that shows its greeting variable before the chat's."""
    template = tmp_path_factory.mktemp("template") / "greeting.jinja"
    template.write_text(
        "{{ greeting }}:{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    defaults = {"thinking": True, "greeting": "HELLO"}
    yield from started(tokenizer_dir, ["colocated"], reasoning_parser="deepseek_v3", chat_template=str(template),
                      default_chat_template_kwargs=defaults)  # fmt: skip


def _rendered(stack: Stack, **extra: Any) -> str:
    body = {"messages": [{"role": "user", "content": "hi"}], **extra}
    tokens = httpx.post(f"{stack.base_url}/tokenize", json=body).json()["tokens"]
    text: str = httpx.post(f"{stack.base_url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    return text


@pytest.mark.parametrize("stream", [False, True])
def test_the_servers_default_chat_template_kwargs_go_under_the_requests(
    v3_thinking: Stack, stream: bool
) -> None:
    """The defaults reach the template and the reasoning parser; a request's own keys win."""
    assert _rendered(v3_thinking).startswith("HELLO:<|im_start|>user\nhi")
    chosen = {"chat_template_kwargs": {"greeting": "BYE"}}
    assert _rendered(v3_thinking, **chosen).startswith("BYE:<|im_start|>user\nhi")
    # the fake echoes the prompt up to its first <|im_end|>: "HELLO:<|im_start|>system\n" + ...
    system = "Hmm.</think>\n\nIt is 4."
    message = _chat(v3_thinking, _body(v3_thinking, system), stream)  # thinking by default
    assert message["content"] == "It is 4."
    assert message["reasoning_content"] == "HELLO:system\nHmm."
    off = _body(v3_thinking, system, chat_template_kwargs={"thinking": False})
    message = _chat(v3_thinking, off, stream)
    assert message["content"] == f"HELLO:system\n{system}" and message["reasoning_content"] is None
