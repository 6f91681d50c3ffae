"""Structured outputs and tool calling through the official openai client, against real workers
(the embedded model on the CPU) in both topologies: a gateway in front of a prefill and a decode
worker, and one in front of a colocated worker.

Over 50 JSON schemas generated here (split between the topologies), every output validates,
greedy and sampled, and the greedy outputs of the two topologies are the same (the decode worker
continues the grammar the prefill worker started). Bad schemas, regexes and tool names are 400s
that leave no KV behind."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.gateway.test_e2e_real import both_topologies, pools_free
from tests.services.clients import tokenizer
from tests.services.procs import Fleet, Proc, fleet

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Describe a fictional person as JSON."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


class Person(BaseModel):
    name: str
    age: int
    likes_cats: bool


@pytest.fixture(scope="module")
def gateways(fleet: Fleet) -> Iterator[dict[str, Proc]]:
    yield from both_topologies(fleet)


def _client(gateway: Proc) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)


# ---- generated schemas ---------------------------------------------------------------------


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["integer", "number", "string", "boolean", "enum"])
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 16)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "x y", "é"], rng.randint(1, 4))}
    return {"type": "boolean"}


def _schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object of 1-4 fields: leaves, arrays of leaves, nested objects; some required."""
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            props[f"obj{i}"] = _schema(rng, depth + 1)
        elif roll < 0.4:
            props[f"list{i}"] = {
                "type": "array",
                "items": _leaf(rng),
                "maxItems": rng.randint(1, 3),
            }
        else:
            props[f"field{i}"] = _leaf(rng)
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required}


def generated_schemas(count: int = 50, seed: int = 17) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [_schema(rng) for _ in range(count)]


async def _json_replies(gateway: Proc, schemas: list[dict[str, Any]], **kw: Any) -> list[str]:
    async with _client(gateway) as client:

        async def one(i: int, schema: dict[str, Any]) -> str:
            reply = await client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=300,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": f"s{i}", "schema": schema}},
                **kw,
            )  # fmt: skip
            choice = reply.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            return choice.message.content or ""

        return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas))))


async def test_fifty_generated_schemas_validate_across_both_topologies(
    gateways: dict[str, Proc],
) -> None:
    """The fifty alternate between the colocated worker (even) and the disaggregated pair (odd,
    the grammar crosses the hand-off): the first twenty greedily, the other thirty sampled. The
    first six greedy schemas of the colocated worker also go through the pair, which must give
    the colocated worker's greedy text. (Not all fifty in both topologies, nor greedily and
    sampled: the suite's time; the engine's tests sample under every option.)"""
    schemas = generated_schemas()
    colocated, disagg = gateways["colocated"], gateways["disagg"]
    sample = {"temperature": 1.0, "top_p": 0.95, "seed": 7}
    by_topology = [
        (colocated, schemas[0:20:2], {"temperature": 0}),
        (disagg, schemas[1:20:2], {"temperature": 0}),
        (colocated, schemas[20::2], sample),
        (disagg, schemas[21::2], sample),
        (disagg, schemas[0:12:2], {"temperature": 0}),  # crossed: the colocated greedy's first 6
    ]
    replies = await asyncio.gather(*(_json_replies(g, s, **kw) for g, s, kw in by_topology))
    for (_, group, _), texts in zip(by_topology, replies, strict=True):
        for schema, text in zip(group, texts, strict=True):
            jsonschema.validate(json.loads(text), schema)
    assert replies[4] == replies[0][:6]


# ---- the openai client's forms ---------------------------------------------------------------


@pytest.mark.parametrize("topology", ["disagg", "colocated"])
async def test_parse_with_a_pydantic_model_and_json_mode(
    gateways: dict[str, Proc], topology: str
) -> None:
    """The four requests are independent: sent together, the worker batches them."""
    async with _client(gateways[topology]) as client:
        parsed, reply, several, done = await asyncio.gather(
            client.chat.completions.parse(
                model=MODEL, messages=ASK, response_format=Person, temperature=0, max_tokens=100
            ),
            client.chat.completions.create(
                model=MODEL, messages=ASK, response_format={"type": "json_object"},
                max_tokens=200, temperature=0,
            ),
            client.chat.completions.parse(
                model=MODEL, messages=ASK, response_format=Person, temperature=1.0, n=3, seed=5,
                max_tokens=100, stop=["\n\n\n"], logprobs=True,
            ),
            client.completions.create(
                model=MODEL, prompt="The answer is", max_tokens=8, temperature=0,
                extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
            ),
        )  # fmt: skip
        person = parsed.choices[0].message.parsed
        assert isinstance(person, Person)
        assert reply.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
        for choice in several.choices:
            assert isinstance(choice.message.parsed, Person)
            assert choice.logprobs is not None and choice.logprobs.content
        assert done.choices[0].text in ("yes", "no")


def _valid_calls(calls: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for call in calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        assert call.id and call.type == "function"
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("topology", ["disagg", "colocated"])
async def test_required_and_named_tool_calls_stream_and_not(
    gateways: dict[str, Proc], topology: str
) -> None:
    """Each tool choice's call, and the same streamed: greedy, so the two are asked side by side
    (the worker batches them), as are the two choices."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]

    async def check(client: openai.AsyncOpenAI, choice: Any) -> None:
        kw: dict[str, Any] = {"model": MODEL, "messages": ask, "tools": [WEATHER, TIME],
                              "tool_choice": choice, "temperature": 0, "max_tokens": 120}  # fmt: skip
        # OpenAI's and vLLM's: "tool_calls" for required, "stop" for a named function
        finish = "tool_calls" if choice == "required" else "stop"
        reply, streamed = await asyncio.gather(
            client.chat.completions.create(**kw), _streamed_calls(client, kw, finish)
        )
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == finish
        calls = _valid_calls(message.tool_calls or [])
        assert calls and message.content is None
        if choice != "required":
            assert [name for name, _ in calls] == ["get_weather"]
        assert streamed == [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]

    named = {"type": "function", "function": {"name": "get_weather"}}
    async with _client(gateways[topology]) as client:
        await asyncio.gather(check(client, "required"), check(client, named))


async def _streamed_calls(
    client: openai.AsyncOpenAI, kw: dict[str, Any], finish_reason: str
) -> list[tuple[str, str]]:
    """Tool-call deltas assembled as OpenAI clients do (by index); arguments re-serialized."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    stream = await client.chat.completions.create(**kw, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function and delta.function.name:
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
    assert finish == finish_reason
    return [
        (c["name"], json.dumps(json.loads(c["arguments"]), ensure_ascii=False))
        for _, c in sorted(calls.items())
    ]


async def test_a_multi_turn_exchange_with_a_tool_message(gateways: dict[str, Proc]) -> None:
    ask: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    async with _client(gateways["disagg"]) as client:
        first = await client.chat.completions.create(
            model=MODEL, messages=ask, tools=[WEATHER], tool_choice="required", temperature=0,
            max_tokens=100,
        )  # fmt: skip
        call = (first.choices[0].message.tool_calls or [])[0]
        history = [
            *ask,
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": -3}'},
        ]
        final = await client.chat.completions.create(
            model=MODEL, messages=history, tools=[WEATHER], tool_choice="none", temperature=0,
            max_tokens=30,
        )  # fmt: skip
    assert final.choices[0].message.content
    assert final.choices[0].message.tool_calls is None


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "invalid JSON schema: Unsupported type"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "invalid regex"),
        ({"guided_grammar": "root ::= 'a' |"}, "guided_grammar", "invalid grammar"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "names the function 'nope', which is not in tools"),
        ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
    ],
)  # fmt: skip
async def test_bad_structured_input_is_a_400_that_leaks_nothing(
    fleet: Fleet, gateways: dict[str, Proc], body: dict[str, Any], param: str | None, words: str
) -> None:
    """The gateway checks shapes and names; whether a spec compiles the workers say (they hold
    the tokenizer and the grammar library): their message comes back, naming the field the
    client sent (a worker names structured_outputs; the gateway knows which field it was)."""
    for gateway in gateways.values():
        r = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": ASK, "max_tokens": 8, **body})  # fmt: skip
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert words in error["message"] and error["param"] == param, error
    await pools_free(*fleet.shared("prefill", "decode", "worker"))


async def test_a_grammar_and_allowed_token_ids_that_leave_no_token_are_a_400(
    fleet: Fleet, gateways: dict[str, Proc]
) -> None:
    """A grammar whose next tokens allowed_token_ids all exclude: no check up front sees it; the
    worker's sampler finds nothing left and the request ends refused (token 0 was sampled
    before: a 200 of garbage, or disaggregated a 400 naming output_token_ids, the decode
    worker's refusal of that token). At the first token ("x" starts neither choice: the
    prefill worker's, disaggregated) or after one ("{" may start the JSON, then nothing may
    follow it: the decode worker's): a 400 naming allowed_token_ids, streamed an error event;
    nothing leaks."""
    tok = tokenizer()
    brace, x = (tok.encode(t, add_special_tokens=False)[0] for t in ("{", "x"))
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["get_time"]}}
    cases = [({"guided_choice": ["yes", "no"], "allowed_token_ids": [x]}, 0),
             ({"response_format": schema, "allowed_token_ids": [brace]}, 1)]  # fmt: skip

    async def check(
        client: httpx.AsyncClient, url: str, extra: dict[str, Any], before: int
    ) -> None:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0, **extra}

        async def stream() -> list[str]:
            async with client.stream("POST", url, json={**body, "stream": True}) as s:
                return [ln[6:] async for ln in s.aiter_lines() if ln.startswith("data: ")]

        r, lines = await asyncio.gather(client.post(url, json=body), stream())
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "allowed_token_ids", error
        assert error["message"].startswith("no token is allowed at this point"), error
        assert "grammar" in error["message"] and "output_token_ids" not in error["message"]
        assert lines[-1] == "[DONE]", lines
        *frames, last = [json.loads(ln) for ln in lines[:-1]]
        assert last["error"] == error, last
        text = "".join(c["delta"].get("content") or "" for f in frames for c in f["choices"])
        assert text == "{" * before, frames

    # both cases in both topologies, whole and streamed, side by side: each request is its own
    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*(check(client, f"{gateway.url}/v1/chat/completions", extra, before)
                               for gateway in gateways.values() for extra, before in cases))  # fmt: skip
    await pools_free(*fleet.shared("prefill", "decode", "worker"))


async def test_metrics_count_structured_requests_and_compile_time(
    gateways: dict[str, Proc],
) -> None:
    async with _client(gateways["colocated"]) as client:
        await client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=40, temperature=0,
            extra_body={"guided_regex": "[a-z]{1,8}"},
        )  # fmt: skip
    text = httpx.get(f"{gateways['colocated'].url}/metrics", timeout=10).text
    assert 'tandem:structured_output_requests_total{kind="regex"' in text
    compiled = [line for line in text.splitlines()
                if line.startswith("tandem:grammar_compile_seconds_count")]  # fmt: skip
    assert compiled and float(compiled[0].rsplit(" ", 1)[1]) >= 1
