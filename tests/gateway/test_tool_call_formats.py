"""A non-JSON tool-call format through the gateway (fake workers that echo the prompt): with
--tool-call-parser qwen3_coder the model's <function=...> markup becomes tool_calls whose text
arguments are typed by the request's function schema, whole and streamed; a forced choice still
sends its JSON grammar; strict functions under auto are a 400 (the format has no structural
tag)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.stack import Stack, started

CALL = (
    "<tool_call>\n<function=forecast>\n<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"},
                                               "days": {"type": "integer"}}}  # fmt: skip
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": PARAMETERS}}


@pytest.fixture(scope="module")
def qwen_stack(tokenizer_dir: str) -> Iterator[Stack]:
    yield from started(
        tokenizer_dir, ["colocated"], enable_auto_tool_choice=True, tool_call_parser="qwen3_coder"
    )


def _body(stack: Stack, **extra: Any) -> dict[str, Any]:
    """The fake echoes the rendered prompt up to its first <|im_end|>: the system message."""
    messages = [
        {"role": "system", "content": f"Looking. {CALL}"},
        {"role": "user", "content": "hi"},
    ]
    count = httpx.post(f"{stack.base_url}/tokenize", json={"messages": messages}).json()["count"]
    return {"messages": messages, "tools": [FORECAST], "max_tokens": count, **extra}


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reads_the_xml_call_with_typed_arguments(qwen_stack: Stack, stream: bool) -> None:
    url = f"{qwen_stack.base_url}/v1/chat/completions"
    body = _body(qwen_stack, stream=stream)
    if not stream:
        r = httpx.post(url, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        content, calls, finish = (choice["message"]["content"], choice["message"]["tool_calls"],
                                  choice["finish_reason"])  # fmt: skip
    else:
        content, calls, finish = "", [], None
        with httpx.stream("POST", url, json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        finish = c["finish_reason"] or finish
                        content += c["delta"].get("content") or ""
                        calls += c["delta"].get("tool_calls", [])
    assert finish == "tool_calls"
    assert "Looking." in content and "<" not in content
    (call,) = calls
    assert call["id"].startswith("call_") and call["function"]["name"] == "forecast"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "days": 3}


def test_a_forced_choice_still_sends_its_json_grammar(qwen_stack: Stack) -> None:
    qwen_stack.reset()
    body = _body(qwen_stack, tool_choice="required", max_tokens=4)
    r = httpx.post(f"{qwen_stack.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    sent = qwen_stack.workers[0].records.samplings[-1].structured
    assert sent.kind == "json" and json.loads(sent.spec)["type"] == "array"


def test_strict_functions_under_auto_are_refused_with_this_format(qwen_stack: Stack) -> None:
    strict = {"type": "function", "function": {**FORECAST["function"], "strict": True}}
    body = {**_body(qwen_stack), "tools": [strict]}
    r = httpx.post(f"{qwen_stack.base_url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "qwen3_coder" in r.json()["error"]["message"]
