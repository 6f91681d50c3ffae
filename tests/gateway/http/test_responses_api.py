"""/v1/responses through the official openai client against fake workers (they echo the
rendered prompt): whole and streamed responses validate as the client's types and agree, the
store serves previous_response_id, GET, DELETE and input_items (an unknown id a 404 in OpenAI's
shape), a client that leaves a stream cancels its generation, and the prompt a conversation
renders is the chat endpoint's for the same messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from tests.gateway.stack import Stack, wait_for

pytestmark = pytest.mark.timeout(60)
TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip


@pytest.fixture(scope="module")
def stack(tokenizer_dir: str) -> Iterator[Stack]:
    stack = Stack(tokenizer_dir, ["colocated"], responses_store_size=3)
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def client(stack: Stack) -> Iterator[openai.OpenAI]:
    stack.reset()
    with openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def prompt_tokens(stack: Stack, messages: list[dict[str, Any]], **extra: Any) -> int:
    body = {"messages": messages, **extra}
    count: int = httpx.post(f"{stack.base_url}/tokenize", json=body).json()["count"]
    return count


def test_a_response_whole_and_streamed(stack: Stack, client: openai.OpenAI) -> None:
    whole = client.responses.create(
        model="embedded", input="Tell me.", instructions="Be brief.", max_output_tokens=64
    )
    Response.model_validate(whole.model_dump())
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "completed" and whole.output_text == "system\nBe brief."
    assert whole.instructions == "Be brief." and whole.max_output_tokens == 64
    assert (whole.tool_choice, whole.tools) == ("auto", [])  # OpenAI's defaults echoed
    assert whole.usage is not None and whole.usage.input_tokens == prompt_tokens(
        stack, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me."}]
    )
    with client.responses.stream(
        model="embedded", input="Tell me.", instructions="Be brief.", max_output_tokens=64
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.usage == whole.usage
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    r = client.responses.create(model="embedded", input="Tell me.", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 2


def test_the_stream_is_openais_sse_without_done(stack: Stack, client: openai.OpenAI) -> None:
    body = {"input": "hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/responses", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in lines if line.startswith("event: ")]
    assert events[0] == "event: response.created" and events[-1] == "event: response.incomplete"
    assert not any("[DONE]" in line for line in lines)


def test_a_conversation_goes_on_with_previous_response_id(
    stack: Stack, client: openai.OpenAI
) -> None:
    first = client.responses.create(model="embedded", input="My name is Ada.", instructions="X")
    second = client.responses.create(
        model="embedded", input="What is my name?", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id and second.instructions is None
    # the earlier input and output come first; the earlier instructions do not carry over
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage is not None
    assert second.usage.input_tokens == prompt_tokens(stack, messages)
    items = client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, getattr(i, "role", None)) for i in items.data] == [
        ("message", "user"), ("message", "assistant"), ("message", "user")]  # fmt: skip
    newest = client.responses.input_items.list(second.id, limit=1)
    assert newest.data[0].id == items.data[-1].id and newest.has_more


def test_a_tool_round_trip_renders_as_the_chat_endpoints(
    stack: Stack, client: openai.OpenAI
) -> None:
    call = client.responses.create(
        model="embedded", input="Weather in Oslo?", tools=[TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=8,
    )  # fmt: skip
    (item,) = call.output  # a named function: the output is its call (the fake's text)
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.call_id.startswith("call_") and call.tools[0].name == "get_weather"  # type: ignore[union-attr]
    # the fake's arguments are no JSON: a history holding them is refused, as a chat's is
    r = httpx.post(f"{stack.base_url}/v1/responses", json={"previous_response_id": call.id,
                   "input": [{"type": "function_call_output", "call_id": item.call_id,
                              "output": "rain"}]})  # fmt: skip
    assert r.status_code == 400 and "arguments is not valid JSON" in r.json()["error"]["message"]
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
    ]  # fmt: skip
    answer = client.responses.create(
        model="embedded",
        input=history,
        tools=[TOOL],
        tool_choice="none",  # type: ignore[arg-type,list-item]
    )
    chat_tools = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]  # fmt: skip
    assert answer.usage is not None
    assert answer.usage.input_tokens == prompt_tokens(stack, messages, tools=chat_tools)


def test_get_delete_and_store_false(stack: Stack, client: openai.OpenAI) -> None:
    kept = client.responses.create(model="embedded", input="hi", max_output_tokens=3)
    got = client.responses.retrieve(kept.id)
    assert got.model_dump() == kept.model_dump()
    deleted = httpx.delete(f"{stack.base_url}/v1/responses/{kept.id}")
    assert deleted.json() == {"id": kept.id, "object": "response.deleted", "deleted": True}
    for call in (lambda: client.responses.retrieve(kept.id),
                 lambda: client.responses.delete(kept.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.status_code == 404 and kept.id in e.value.message
    unkept = client.responses.create(model="embedded", input="hi", max_output_tokens=3, store=False)
    assert unkept.store is False
    r = httpx.get(f"{stack.base_url}/v1/responses/{unkept.id}")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{stack.base_url}/v1/responses",
                   json={"input": "x", "previous_response_id": unkept.id})  # fmt: skip
    error = r.json()["error"]  # OpenAI's answer, which clients such as Codex look for
    assert r.status_code == 400 and error["param"] == "previous_response_id"
    assert error["code"] == "previous_response_not_found" and unkept.id in error["message"]


def test_the_store_keeps_the_latest(stack: Stack, client: openai.OpenAI) -> None:
    ids = [client.responses.create(model="embedded", input="hi", max_output_tokens=1).id
           for _ in range(4)]  # fmt: skip
    assert httpx.get(f"{stack.base_url}/v1/responses/{ids[0]}").status_code == 404
    assert all(httpx.get(f"{stack.base_url}/v1/responses/{i}").status_code == 200 for i in ids[1:])


def test_bad_input_is_a_400_and_runs_nothing(stack: Stack, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="embedded", input="hi",
                                tools=[{"type": "web_search"}])  # fmt: skip
    assert e.value.code is None and "built-in tools are not supported" in e.value.message
    r = httpx.post(f"{stack.base_url}/v1/responses", json={"input": "hi", "background": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"
    r = httpx.get(f"{stack.base_url}/v1/responses/x?stream=true")
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    assert not stack.workers[0].records.requests


def test_a_client_that_leaves_a_stream_cancels_the_generation(
    stack: Stack, client: openai.OpenAI
) -> None:
    stack.workers[0].behavior.token_delay_s = 0.05
    body = {"input": "hi", "max_output_tokens": 500, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/responses", json=body) as r:
        lines = r.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        next(line for line in lines if line == "event: response.output_text.delta")
    assert wait_for(lambda: not stack.state.active)
    spans = [s for s in stack.exporter.get_finished_spans() if s.name.startswith("chat ")]
    assert spans[-1].attributes is not None
    assert spans[-1].attributes["gen_ai.response.id"] == created["response"]["id"]
    assert spans[-1].status.description == "cancelled"
    # kept as OpenAI shows one that did not end: cancelled, with the output so far
    r = httpx.get(f"{stack.base_url}/v1/responses/{created['response']['id']}")
    left = Response.model_validate(r.json())
    assert left.status == "cancelled" and [item.type for item in left.output] == ["message"]
    assert left.output[0].status == "incomplete" and not stack.state.responses._running


def _started(stack: Stack, body: dict[str, Any]) -> tuple[Iterator[str], str, Any]:
    """A streamed response begun (its first text delta read): its lines, its id, the stream."""
    cm = httpx.stream("POST", f"{stack.base_url}/v1/responses", json=body)
    r = cm.__enter__()
    lines = r.iter_lines()
    created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
    next(line for line in lines if line == "event: response.output_text.delta")
    return lines, created["response"]["id"], cm


def test_a_running_response_is_in_progress_and_cannot_be_cancelled_or_continued(
    stack: Stack, client: openai.OpenAI
) -> None:
    stack.workers[0].behavior.token_delay_s = 0.02
    lines, rid, cm = _started(stack, {"input": "hi", "max_output_tokens": 20, "stream": True})
    try:
        running = client.responses.retrieve(rid)
        assert running.status == "in_progress" and running.output == []
        with pytest.raises(openai.BadRequestError) as e:  # OpenAI's for a non-background one
            client.responses.cancel(rid)
        assert "Cannot cancel a synchronous response" in e.value.message
        r = httpx.post(f"{stack.base_url}/v1/responses",
                       json={"input": "x", "previous_response_id": rid})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        assert "in progress" in r.json()["error"]["message"]
        last = [line for line in lines if line.startswith("data: ")][-1]
    finally:
        cm.__exit__(None, None, None)
    assert json.loads(last[6:])["type"] == "response.completed"
    done = client.responses.retrieve(rid)
    assert done.status == "completed" and done.output_text
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(rid)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_a_response_deleted_while_it_runs_ends_for_its_client_and_stays_deleted(
    stack: Stack, client: openai.OpenAI
) -> None:
    stack.workers[0].behavior.token_delay_s = 0.02
    lines, rid, cm = _started(stack, {"input": "hi", "max_output_tokens": 20, "stream": True})
    try:
        deleted = httpx.delete(f"{stack.base_url}/v1/responses/{rid}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        last = [line for line in lines if line.startswith("data: ")][-1]
    finally:
        cm.__exit__(None, None, None)
    assert json.loads(last[6:])["type"] == "response.completed"
    assert httpx.get(f"{stack.base_url}/v1/responses/{rid}").status_code == 404
    assert not stack.state.responses._running


@pytest.fixture(scope="module")
def thinking(tokenizer_dir: str) -> Iterator[Stack]:
    """A gateway with a reasoning parser whose prompt opens the thinking block (deepseek_r1):
    what the fake echoes before </think> is reasoning."""
    stack = Stack(tokenizer_dir, ["colocated"], reasoning_parser="deepseek_r1")
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def test_reasoning_is_an_item_and_counts_its_tokens(thinking: Stack) -> None:
    body = {"input": "hi", "instructions": "why</think>Because.", "max_output_tokens": 64}
    r = httpx.post(f"{thinking.base_url}/v1/responses", json=body)
    response = Response.model_validate(r.json())
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content is not None and reasoning.content[0].text == "system\nwhy"
    assert response.output_text == "Because."
    assert response.usage is not None
    ids = thinking.state.tokenizer.encode("system\nwhy", False)
    assert response.usage.output_tokens_details.reasoning_tokens == len(ids)
    client = openai.OpenAI(base_url=f"{thinking.base_url}/v1", api_key="none", max_retries=0)
    with client, client.responses.stream(model="embedded", **body) as stream:  # type: ignore[arg-type]
        kinds = {event.type for event in stream}
        final = stream.get_final_response()
    assert {"response.reasoning_text.delta", "response.reasoning_text.done"} <= kinds
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.usage == response.usage


def test_a_worker_failing_mid_stream_is_an_error_event_then_failed(
    stack: Stack, client: openai.OpenAI
) -> None:
    stack.workers[0].behavior.fail_after_tokens = 2
    body = {"input": "hi", "max_output_tokens": 50, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/responses", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    failed = Response.model_validate(events[-1]["response"])
    assert failed.status == "failed" and failed.error is not None
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert httpx.get(f"{stack.base_url}/v1/responses/{failed.id}").status_code == 404


def test_an_image_for_a_text_only_model_is_a_400_in_the_responses_terms(stack: Stack) -> None:
    png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="  # fmt: skip
    body = {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": png}]}]}
    r = httpx.post(f"{stack.base_url}/v1/responses", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input" and "drop the input_image parts" in error["message"]
    body["input"][0]["content"][0]["detail"] = "low"  # type: ignore[index]
    error = httpx.post(f"{stack.base_url}/v1/responses", json=body).json()["error"]
    assert "input[0].content: detail 'low' is not supported" in error["message"]


def test_logprobs_when_included(client: openai.OpenAI) -> None:
    ask: dict[str, Any] = {"model": "embedded", "input": "hi", "max_output_tokens": 4,
                           "include": ["message.output_text.logprobs"], "top_logprobs": 2}  # fmt: skip
    whole = client.responses.create(**ask)
    part = whole.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert len(part.logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text
    with client.responses.stream(**ask) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
    assert sum(len(d.logprobs) for d in deltas) == 4
    plain = client.responses.create(model="embedded", input="hi", max_output_tokens=4)
    assert plain.output[0].content[0].logprobs is None  # type: ignore[union-attr]
