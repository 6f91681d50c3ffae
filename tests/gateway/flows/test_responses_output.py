"""A chat choice's output as Responses items and stream events: every object validates as the
openai client's type, the events accumulate (as its stream helper does) into the same items as
the whole response, and a cut-short output is incomplete."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from gateway.flows.chat_output import ChoiceOutput, OutputPlan
from gateway.flows.reasoning import get_parser as reasoning_parser
from gateway.flows.responses_output import (
    EventWriter,
    finished,
    output_items,
    output_text,
    response_object,
    status_of,
    usage,
)
from gateway.flows.tool_parsers import get_parser as tool_parser
from gateway.flows.tools import Function, ToolPlan

EVENTS: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
PARAMS = {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "store": True}
LOGPROB = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}
THINKING = OutputPlan(reasoning=reasoning_parser("qwen3"))
TOOLS = OutputPlan(
    ToolPlan((Function("get_weather", {"type": "object"}),), "auto"), tool_parser("hermes")
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _response() -> dict[str, Any]:
    return response_object("resp_1", "m", PARAMS, 1)


def _whole(plan: OutputPlan, text: str, finish: str = "stop") -> dict[str, Any]:
    message = ChoiceOutput(plan).message(text)
    items = output_items(message, status_of(finish)[0], None)
    return finished(_response(), items, finish, usage(5, 3, 0, 0))


def _streamed(plan: OutputPlan, pieces: list[str], finish: str = "stop") -> list[dict[str, Any]]:
    out, writer = ChoiceOutput(plan), EventWriter(_response(), logprobs=False)
    events = writer.start()
    for i, piece in enumerate(pieces):
        deltas = out.feed(piece)
        if i == len(pieces) - 1:
            deltas += out.finish()
        events += writer.feed(deltas, [])
    return events + writer.finish(finish, usage(5, 3, 0, 0))


def _accumulate(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items as the client's stream helper builds them from the deltas."""
    items: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["type"] == "response.output_item.added":
            items[e["output_index"]] = {**e["item"], "content": [], "text": "", "args": ""}
        elif e["type"] in ("response.output_text.delta", "response.reasoning_text.delta"):
            items[e["output_index"]]["text"] += e["delta"]
        elif e["type"] == "response.function_call_arguments.delta":
            items[e["output_index"]]["args"] += e["delta"]
    return [items[i] for i in sorted(items)]


def _check_events(events: list[dict[str, Any]]) -> None:
    for e in events:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]


@pytest.mark.parametrize(
    ("plan", "pieces"),
    [
        (OutputPlan(), ["Hel", "lo", " there"]),
        (THINKING, ["<think>", "hmm, ", "ok</think>", "The answer", " is 4."]),
        (TOOLS, ["Let me check. ", CALL[:20], CALL[20:]]),
        (OutputPlan(), [""]),
    ],
)
def test_streamed_events_build_the_whole_responses_items(
    plan: OutputPlan, pieces: list[str]
) -> None:
    whole = _whole(plan, "".join(pieces))
    Response.model_validate(whole)
    events = _streamed(plan, pieces)
    _check_events(events)
    final = events[-1]
    assert final["type"] == "response.completed"
    streamed = final["response"]
    Response.model_validate(streamed)

    def strip(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]

    assert strip(streamed["output"]) == strip(whole["output"])
    built = _accumulate(events)
    for item, got in zip(streamed["output"], built, strict=True):
        if item["type"] == "function_call":
            assert got["args"] == item["arguments"] and got["call_id"] == item["call_id"]
        else:
            assert got["text"] == item["content"][0]["text"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert sorted(d["id"] for d in done) == sorted(i["id"] for i in streamed["output"])


def test_reasoning_then_text_are_two_items() -> None:
    response = Response.model_validate(_whole(THINKING, "<think>why</think>Because."))
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    assert response.output_text == "Because."
    assert response.output[0].content[0].text == "why"  # type: ignore[union-attr,index]


def test_a_tool_call_is_a_function_call_item() -> None:
    response = Response.model_validate(_whole(TOOLS, CALL))
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.arguments == '{"city": "Oslo"}'


def test_a_length_cut_is_incomplete_with_max_output_tokens() -> None:
    whole = Response.model_validate(_whole(OutputPlan(), "cut sh", "length"))
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete"  # type: ignore[union-attr]
    events = _streamed(OutputPlan(), ["cut", " sh"], "length")
    _check_events(events)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_usage_and_the_echoed_parameters() -> None:
    skeleton = response_object("resp_1", "m", {**PARAMS, "temperature": 0.2}, 1)
    response = Response.model_validate(finished(skeleton, [], "stop", usage(10, 4, 6, 2)))
    assert response.usage is not None and response.usage.total_tokens == 14
    assert response.usage.input_tokens_details.cached_tokens == 6
    assert response.usage.output_tokens_details.reasoning_tokens == 2
    assert response.temperature == 0.2 and response.status == "completed"


def test_logprobs_ride_on_the_text_deltas_and_the_message() -> None:
    writer = EventWriter(_response(), logprobs=True)
    events = writer.start() + writer.feed([{"content": "a"}], [LOGPROB])
    events += writer.feed([], [LOGPROB])  # a chunk that brought no text: held for the next
    events += writer.feed([{"content": "b"}], [])
    events += writer.finish("stop", usage(1, 2, 0, 0))
    _check_events(events)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [len(d["logprobs"]) for d in deltas] == [1, 1]
    final = Response.model_validate(events[-1]["response"])
    assert len(final.output[0].content[0].logprobs or []) == 2  # type: ignore[union-attr,index]


def test_an_error_mid_stream_is_an_error_event_then_failed() -> None:
    writer = EventWriter(_response(), logprobs=False)
    events = writer.start() + writer.feed([{"content": "a"}], [])
    events += writer.failed({"type": "invalid_request_error", "message": "bad", "param": "x",
                             "code": None})  # fmt: skip
    _check_events(events)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert Response.model_validate(events[-1]["response"]).status == "failed"


def test_output_text_joins_the_message_items() -> None:
    items = output_items({"content": "hi", "reasoning_content": "r"}, "completed", None)
    assert output_text(items) == "hi"
