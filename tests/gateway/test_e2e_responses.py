"""/v1/responses against a REAL colocated worker (the embedded model on the CPU) through the
official openai client: a response is the chat endpoint's greedy answer to the same messages,
streamed or whole; responses.parse holds the output to a pydantic model; a function call and
its output continue through previous_response_id with the prompt the chat endpoint renders
for those turns; max_output_tokens cuts it short as incomplete; store false is not kept; bad
input (a schema the grammar engine refuses) is a 400 in the Responses API's terms; a client
that leaves a stream frees the worker's KV blocks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response
from pydantic import BaseModel

from tests.gateway.test_e2e_real import pools_free, wait_healthy
from tests.services.procs import Fleet, Proc, fleet

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                          "maxLength": 20}}, "required": ["city"]}}  # fmt: skip
CHAT_WEATHER = {"type": "function",
                "function": {k: v for k, v in WEATHER.items() if k != "type"}}  # fmt: skip


class City(BaseModel):
    name: str
    country: str


@pytest.fixture(scope="module")
def served(fleet: Fleet) -> Iterator[tuple[Proc, Proc]]:
    (worker,) = fleet.shared("worker")
    gateway = fleet.gateway(
        worker=[worker], args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    )
    wait_healthy(gateway, 1)
    yield worker, gateway
    try:
        asyncio.run(pools_free(worker, timeout_s=10.0))
    finally:
        gateway.kill()


@pytest.fixture
def client(served: tuple[Proc, Proc]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served[1].url}/v1", api_key="none", max_retries=0) as c:
        yield c


def test_a_response_is_the_chat_endpoints_answer(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_completion_tokens=40,
        messages=[{"role": "system", "content": "Answer in one sentence."},
                  {"role": "user", "content": ASK}],
    )  # fmt: skip
    whole = client.responses.create(
        model=MODEL, instructions="Answer in one sentence.", input=ASK, temperature=0,
        max_output_tokens=40,
    )  # fmt: skip
    Response.model_validate(whole.model_dump())
    assert chat.choices[0].finish_reason == "stop" and whole.status == "completed"
    assert whole.output_text == chat.choices[0].message.content and "Paris" in whole.output_text
    assert whole.usage is not None and chat.usage is not None
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    with client.responses.stream(
        model=MODEL, instructions="Answer in one sentence.", input=ASK, temperature=0,
        max_output_tokens=40,
    ) as stream:  # fmt: skip
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_parse_holds_the_output_to_a_pydantic_model(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(
        model=MODEL, input="Describe the capital of France as JSON.", text_format=City,
        temperature=0, max_output_tokens=60,
    )  # fmt: skip
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name
    assert parsed.text is not None and parsed.text.format.type == "json_schema"


def test_a_function_call_round_trip(client: openai.OpenAI) -> None:
    ask = "What is the weather in Oslo?"
    first = client.responses.create(
        model=MODEL, input=ask, tools=[WEATHER], temperature=0, max_output_tokens=60,  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
    )  # fmt: skip
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)  # held to the parameters by the grammar
    assert isinstance(arguments["city"], str)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": '{"temperature": -3}'}],
        temperature=0, max_output_tokens=30,
    )  # fmt: skip
    assert second.output_text and second.output[-1].type == "message"
    # the same turns through the chat endpoint: the same prompt, the same greedy answer
    chat = client.chat.completions.create(
        model=MODEL, tools=[CHAT_WEATHER], tool_choice="none", temperature=0,  # type: ignore[list-item]
        max_completion_tokens=30,
        messages=[
            {"role": "user", "content": ask},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id,
             "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": -3}'},
        ],
    )  # fmt: skip
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    items = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == ["message", "function_call", "function_call_output"]


def test_max_output_tokens_is_incomplete_and_store_false_is_not_kept(
    client: openai.OpenAI, served: tuple[Proc, Proc]
) -> None:
    cut = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, store=False)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage is not None and cut.usage.output_tokens == 2
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(cut.id)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
         "text.format", "invalid JSON schema"),
        ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools",
         "built-in tools are not supported"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input",
         "no function_call found"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "get_weather",
                     "arguments": "{}"}]}, "input", "no tool output found for function call"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id", "not found"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_in_the_responses_terms(
    served: tuple[Proc, Proc], body: dict[str, Any], param: str, words: str
) -> None:
    r = httpx.post(f"{served[1].url}/v1/responses", json={"input": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


async def test_a_client_that_leaves_a_stream_frees_the_worker(served: tuple[Proc, Proc]) -> None:
    worker, gateway = served
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 400,
            "ignore_eos": True, "stream": True}  # fmt: skip
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=60) as http,
        http.stream("POST", "/v1/responses", json=body) as r,
    ):
        async for line in r.aiter_lines():
            if line == "event: response.output_text.delta":
                break
    await pools_free(worker, timeout_s=5.0)
