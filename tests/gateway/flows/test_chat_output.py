"""A chat choice's text read into the assistant message: the whole response and the stream of
deltas agree, for named and required tool choices, auto parsing and reasoning."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.flows import reasoning, tool_parsers
from gateway.flows.chat_output import ChoiceOutput, OutputPlan
from gateway.flows.tools import Function, ToolPlan

FUNCS = (Function("get_weather", {"type": "object"}), Function("ping", {"type": "object"}))


def _stream(plan: OutputPlan, pieces: list[str]) -> tuple[list[dict[str, Any]], ChoiceOutput]:
    out = ChoiceOutput(plan)
    deltas = [d for p in pieces for d in out.feed(p)] + out.finish()
    return deltas, out


def _assemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Deltas merged as an OpenAI client does (tool calls by index, arguments appended)."""
    message: dict[str, Any] = {"content": "", "reasoning_content": "", "tool_calls": {}}
    for d in deltas:
        message["content"] += d.get("content") or ""
        message["reasoning_content"] += d.get("reasoning_content") or ""
        for call in d.get("tool_calls", []):
            slot = message["tool_calls"].setdefault(
                call["index"], {"id": None, "name": "", "arguments": ""}
            )
            slot["id"] = call.get("id") or slot["id"]
            fn = call.get("function", {})
            slot["name"] += fn.get("name") or ""
            slot["arguments"] += fn.get("arguments") or ""
    return message


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 3, 100])
def test_a_named_choice_is_one_call_whose_arguments_stream(size: int) -> None:
    plan = OutputPlan(ToolPlan(FUNCS, "function", "get_weather"))
    text = '{"city": "Oslo"}'
    whole = ChoiceOutput(plan)
    message = whole.message(text)
    assert message["content"] is None and whole.finish_reason("stop") == "stop"  # as OpenAI
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", text)
    ]
    deltas, _ = _stream(plan, _pieces(text, size))
    assembled = _assemble(deltas)
    assert assembled["tool_calls"][0]["name"] == "get_weather"
    assert assembled["tool_calls"][0]["arguments"] == text and assembled["tool_calls"][0]["id"]
    assert "id" in deltas[0]["tool_calls"][0] and all(
        "id" not in d["tool_calls"][0] for d in deltas[1:]
    )


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_required_calls_are_announced_by_name_and_their_arguments_stream(size: int) -> None:
    plan = OutputPlan(ToolPlan(FUNCS, "required"))
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo", "note": "a \\"}, {x\\""}}, {"name": "ping", "arguments": {}}]'
    message = ChoiceOutput(plan).message(text)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    # the arguments as the model wrote them (a named function's are too)
    assert calls == [("get_weather", '{"city": "Oslo", "note": "a \\"}, {x\\""}'), ("ping", "{}")]
    assert json.loads(calls[0][1]) == {"city": "Oslo", "note": 'a "}, {x"'}
    assert message["content"] is None
    ids = [c["id"] for c in message["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    deltas, _ = _stream(plan, _pieces(text, size))
    assembled = _assemble(deltas)
    assert [(c["name"], c["arguments"]) for c in assembled["tool_calls"].values()] == calls
    assert assembled["content"] == ""
    if size == 1000:  # one feed: each call's announcement, then its arguments in one delta
        assert len(deltas) == 4
    if size == 1:  # the first call is out before its arguments end, and they come in pieces
        first = [d for d in deltas if d["tool_calls"][0]["index"] == 0]
        assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
        assert len(first) > 10


def test_whitespace_around_the_arguments_is_not_theirs() -> None:
    plan = OutputPlan(ToolPlan(FUNCS, "required"))
    text = '[ {\n  "name" : "ping" ,\n  "arguments" :  { "a" : [1, 2] }  \n} ]'
    for size in (1, 1000):
        deltas, _ = _stream(plan, _pieces(text, size))
        assert _assemble(deltas)["tool_calls"][0]["arguments"] == '{ "a" : [1, 2] }'
    (call,) = ChoiceOutput(plan).message(text)["tool_calls"]
    assert call["function"] == {"name": "ping", "arguments": '{ "a" : [1, 2] }'}


@pytest.mark.parametrize("size", [1, 1000])
def test_a_required_output_cut_short_reads_as_a_named_one_does(size: int) -> None:
    """Cut inside a call's arguments: the call with the arguments so far, as a named function
    cut short gives, in the whole message and in the stream alike; finish_reason "length"."""
    plan = OutputPlan(ToolPlan(FUNCS, "required"))
    text = '[{"name": "get_weather", "arguments": {"city": "Os'
    out = ChoiceOutput(plan)
    message = out.message(text)
    assert message["content"] is None and out.finish_reason("length") == "length"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Os')
    ]
    named = ChoiceOutput(OutputPlan(ToolPlan(FUNCS, "function", "get_weather")))
    assert named.message('{"city": "Os')["tool_calls"][0]["function"]["arguments"] == '{"city": "Os'
    assembled = _assemble(_stream(plan, _pieces(text, size))[0])
    assert assembled["tool_calls"][0]["name"] == "get_weather"
    assert assembled["tool_calls"][0]["arguments"] == '{"city": "Os' and assembled["content"] == ""


@pytest.mark.parametrize("size", [1, 1000])
@pytest.mark.parametrize("text", ['[{"', "[{", '[{"name": "get_wea', '[{"name": "get_weather'])
@pytest.mark.parametrize("reason", ["length", "stop"])
def test_cut_short_before_a_name_there_is_no_call_and_no_content(
    text: str, reason: str, size: int
) -> None:
    """max_tokens or a stop string before the first name is whole: no tool_calls, and the
    grammar's array is no content either (the message's content is empty, as for no text at
    all); the stream sends no content delta; finish_reason stays the engine's."""
    plan = OutputPlan(ToolPlan(FUNCS, "required"))
    out = ChoiceOutput(plan)
    message = out.message(text)
    assert "tool_calls" not in message and message["content"] == ""
    assert out.finish_reason(reason) == reason
    deltas, streamed = _stream(plan, _pieces(text, size))
    assert not any("content" in d or "tool_calls" in d for d in deltas)
    assert streamed.finish_reason(reason) == reason


@pytest.mark.parametrize("size", [1, 1000])
def test_a_stop_string_inside_the_arguments_keeps_stop(size: int) -> None:
    """A stop string cuts a call's arguments: the call with the arguments so far, content null,
    and finish_reason "stop" (not "tool_calls": the array was not finished)."""
    plan = OutputPlan(ToolPlan(FUNCS, "required"))
    text = '[{"name": "ping", "arguments": {}}, {"name": "get_weather", "arguments": {"city": '
    out = ChoiceOutput(plan)
    message = out.message(text)
    assert message["content"] is None and out.finish_reason("stop") == "stop"
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("ping", "{}"), ("get_weather", '{"city":')]
    deltas, streamed = _stream(plan, _pieces(text, size))
    assert not any("content" in d for d in deltas) and streamed.finish_reason("stop") == "stop"
    assembled = _assemble(deltas)
    assert [(c["name"], c["arguments"]) for c in assembled["tool_calls"].values()] == calls


@pytest.mark.parametrize("size", [1, 2, 1000])
def test_every_cut_of_a_required_output_agrees_and_is_never_content(size: int) -> None:
    """Whatever prefix of the array the output is: the calls whose names are whole, each with
    the arguments generated so far; no content, in the message or the stream; "tool_calls" for
    the whole array only."""
    plan = OutputPlan(ToolPlan(FUNCS, "required"))
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "ping", "arguments": {}}]'
    for cut in range(len(text) + 1):
        out = ChoiceOutput(plan)
        message = out.message(text[:cut])
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in message.get("tool_calls", [])]  # fmt: skip
        assert message["content"] == (None if calls else ""), cut
        names = [n for n in ("get_weather", "ping") if f'"{n}"' in text[:cut]]
        assert [name for name, _ in calls] == names, cut
        for name, arguments in calls:
            assert arguments in '{"city": "Oslo"}' if name == "get_weather" else "{}", cut
        whole = cut == len(text)
        assert out.finish_reason("stop") == ("tool_calls" if whole else "stop"), cut
        assert out.finish_reason("length") == "length"
        deltas, streamed = _stream(plan, _pieces(text[:cut], size))
        assert not any("content" in d for d in deltas), cut
        assembled = _assemble(deltas)
        assert [(c["name"], c["arguments"]) for c in assembled["tool_calls"].values()] == calls
        assert streamed.finish_reason("stop") == out.finish_reason("stop")


@pytest.mark.parametrize("size", [1, 2, 1000])
def test_every_cut_of_a_named_output_agrees_and_says_what_ended_it(size: int) -> None:
    """A named function's arguments cut short (a stop string, max_tokens): the call with the
    arguments so far, whole and streamed alike; finish_reason the engine's "stop" or "length",
    also for the whole call (as OpenAI and vLLM report a named choice: never "tool_calls")."""
    plan = OutputPlan(ToolPlan(FUNCS, "function", "get_weather"))
    text = '{"city": "Oslo}", "q": "a \\"}\\\\", "n": [{"x": {}}]}'
    assert json.loads(text)["q"] == 'a "}\\'
    for cut in range(len(text) + 1):
        out = ChoiceOutput(plan)
        message = out.message(text[:cut])
        (call,) = message["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": text[:cut]}, cut
        assert message["content"] is None, cut
        assert out.finish_reason("stop") == "stop", cut
        assert out.finish_reason("length") == "length", cut
        # a stream has a chunk, its finish's, even when no text came
        deltas, streamed = _stream(plan, _pieces(text[:cut], size) or [""])
        assert not any("content" in d for d in deltas), cut
        (got,) = _assemble(deltas)["tool_calls"].values()
        assert (got["name"], got["arguments"]) == ("get_weather", text[:cut]), cut
        assert streamed.finish_reason("stop") == out.finish_reason("stop"), cut
        assert streamed.finish_reason("length") == "length", cut


@pytest.mark.parametrize("size", [1, 1000])
def test_a_named_choice_ends_with_stop_as_openai_reports_it(size: int) -> None:
    """The arguments a stop string cut: the call with them as they are, content null, and
    finish_reason "stop"; a whole object is "stop" too (OpenAI's and vLLM's rule for a named
    choice), where a whole required array is "tool_calls"."""
    plan = OutputPlan(ToolPlan(FUNCS, "function", "get_weather"))
    out = ChoiceOutput(plan)
    message = out.message('{"city": ')
    assert message["content"] is None and out.finish_reason("stop") == "stop"
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": '
    _, streamed = _stream(plan, _pieces('{"city": ', size))
    assert streamed.finish_reason("stop") == "stop"
    _, streamed = _stream(plan, _pieces('{"city": "Oslo"} \n', size))
    assert streamed.finish_reason("stop") == "stop"
    required = OutputPlan(ToolPlan(FUNCS, "required"))
    _, streamed = _stream(required, _pieces('[{"name": "ping", "arguments": {}}]', size))
    assert streamed.finish_reason("stop") == "tool_calls"
    empty = ChoiceOutput(plan)  # cut before the object began
    assert empty.message("")["tool_calls"][0]["function"]["arguments"] == ""
    assert empty.finish_reason("stop") == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call_only() -> None:
    plan = OutputPlan(ToolPlan(FUNCS, "required", parallel=False))
    text = (
        '[{"name": "ping", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "X"}}]'
    )
    for size in (1, 1000):
        deltas, out = _stream(plan, _pieces(text, size))
        assert [c["function"]["name"] for c in out.tool_calls] == ["ping"]
        assert list(_assemble(deltas)["tool_calls"]) == [0] and _assemble(deltas)["content"] == ""


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_auto_reads_calls_with_the_parser_and_keeps_the_content(size: int) -> None:
    plan = OutputPlan(ToolPlan(FUNCS, "auto"), tool_parsers.get_parser("hermes"))
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    message = ChoiceOutput(plan).message(text)
    assert message["content"] == "Let me check."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    assembled = _assemble(_stream(plan, _pieces(text, size))[0])
    assert (
        assembled["content"].strip() == "Let me check."
        and "<tool_call>" not in assembled["content"]
    )
    assert assembled["tool_calls"][0]["name"] == "get_weather"
    plain = ChoiceOutput(plan)
    assert plain.message("Just text.") == {"role": "assistant", "content": "Just text."}
    assert plain.finish_reason("stop") == "stop"


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        '\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n\n',
        'Sure.\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\nDone. ',
        "No tools needed. \n",
        "   ",
    ],
)
def test_auto_streams_the_content_the_whole_message_has(text: str, size: int) -> None:
    """Whitespace around and between calls is no content in either form (it was streamed as a
    content delta that the whole message stripped); plain text keeps all of it in both."""
    plan = OutputPlan(ToolPlan(FUNCS, "auto"), tool_parsers.get_parser("hermes"))
    message = ChoiceOutput(plan).message(text)
    deltas, _ = _stream(plan, _pieces(text, size))
    assembled = _assemble(deltas)
    assert assembled["content"] == (message["content"] or "")
    assert [c["name"] for c in assembled["tool_calls"].values()] == [
        c["function"]["name"] for c in message.get("tool_calls", [])
    ]
    assert all(d.get("content") != "" for d in deltas)


@pytest.mark.parametrize("size", [1, 2, 1000])
def test_reasoning_is_split_off_in_both_forms(size: int) -> None:
    plan = OutputPlan(reasoning=reasoning.get_parser("qwen3"))
    text = "<think>\nFirst, think.\n</think>\n\nThe answer."
    message = ChoiceOutput(plan).message(text)
    assert message == {
        "role": "assistant",
        "content": "The answer.",
        "reasoning_content": "First, think.",
    }
    assembled = _assemble(_stream(plan, _pieces(text, size))[0])
    assert (assembled["reasoning_content"], assembled["content"]) == (
        "First, think.",
        "The answer.",
    )


def test_reasoning_then_a_named_call() -> None:
    plan = OutputPlan(
        ToolPlan(FUNCS, "function", "ping"),
        reasoning=reasoning.get_parser("deepseek_r1"),
        prompt_open=True,
    )
    message = ChoiceOutput(plan).message('Hmm.</think>{"x": 1}')
    assert message["reasoning_content"] == "Hmm." and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "ping", "arguments": '{"x": 1}'}


# gpt-oss deciding to call a tool: its thinking, then a message to functions.get_weather
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>'
)


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_harmony_calls_are_read_out_under_auto_in_both_forms(size: int) -> None:
    plan = OutputPlan(ToolPlan(FUNCS, "auto"), reasoning=reasoning.get_parser("openai_gptoss"))
    out = ChoiceOutput(plan)
    message = out.message(HARMONY_CALL)
    assert message["reasoning_content"] == "Need the weather." and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert out.finish_reason("stop") == "tool_calls"
    deltas, _ = _stream(plan, _pieces(HARMONY_CALL, size))
    assembled = _assemble(deltas)
    assert assembled["reasoning_content"] == "Need the weather." and assembled["content"] == ""
    assert [(c["name"], c["arguments"]) for c in assembled["tool_calls"].values()] == [
        ("get_weather", '{"city": "Oslo"}')
    ]
    # the recipient before the channel, as gpt-oss also writes it
    other = "<|start|>assistant to=functions.ping<|channel|>commentary json<|message|>{}<|call|>"
    assert ChoiceOutput(plan).message(other)["tool_calls"][0]["function"]["name"] == "ping"


def test_harmony_calls_stay_text_where_the_request_lets_no_tool_be_called() -> None:
    plan = OutputPlan(reasoning=reasoning.get_parser("openai_gptoss"))
    message = ChoiceOutput(plan).message(HARMONY_CALL)
    assert "tool_calls" not in message and message["content"] == '{"city": "Oslo"}'


def test_plain_plans_leave_the_text_alone() -> None:
    assert OutputPlan().plain and OutputPlan(ToolPlan(FUNCS, "none")).plain
    assert not OutputPlan(ToolPlan(FUNCS, "required")).plain


def test_parallel_tool_calls_false_keeps_the_first_call_under_auto() -> None:
    plan = OutputPlan(ToolPlan(FUNCS, "auto", parallel=False), tool_parsers.get_parser("hermes"))
    text = '<tool_call>{"name": "ping", "arguments": {}}</tool_call><tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    message = ChoiceOutput(plan).message(text)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["ping"]


# the check Mistral's chat templates make of a history's tool call ids (v0.3's, in Jinja)
_MISTRAL_ID_CHECK = (
    "{%- for message in messages %}{%- for call in message.tool_calls | default([]) %}"
    "{%- if not (call.id is string and call.id | length == 9) %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{%- endfor %}{%- endfor %}ok"
)


@pytest.mark.parametrize(
    ("tools", "text"),
    [
        (ToolPlan(FUNCS, "auto"), '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'),
        (ToolPlan(FUNCS, "required"), '[{"name": "get_weather", "arguments": {}}]'),
        (ToolPlan(FUNCS, "function", "get_weather"), '{"city": "Oslo"}'),
    ],
)
def test_mistral_call_ids_are_nine_letters_and_digits_a_history_can_carry(
    tools: ToolPlan, text: str
) -> None:
    """Mistral's templates refuse a history whose tool call ids are not 9 letters and digits:
    under --tool-call-parser mistral every call's id is one (vLLM's), streamed or whole, so
    the client can send the turn back; other parsers keep OpenAI's call_ ids."""
    from gateway.flows.chat_template import ChatTemplate
    from gateway.flows.protocol import parse_chat_messages

    plan = OutputPlan(tools, tool_parsers.get_parser("mistral"))
    message = ChoiceOutput(plan).message(text)
    deltas, _ = _stream(plan, _pieces(text, 2))
    ids = [c["id"] for c in message["tool_calls"]]
    ids += [slot["id"] for slot in _assemble(deltas)["tool_calls"].values()]
    assert len(ids) == 2 and all(len(i) == 9 and i.isalnum() for i in ids), ids
    history, _ = parse_chat_messages([{"role": "user", "content": "hi"}, message])
    assert ChatTemplate(_MISTRAL_ID_CHECK, {}).render(history) == "ok"
    if tools.choice != "auto":  # without the mistral parser: OpenAI's ids
        for parser in (None, tool_parsers.get_parser("hermes")):
            (call,) = ChoiceOutput(OutputPlan(tools, parser)).message(text)["tool_calls"]
            assert call["id"].startswith("call_") and len(call["id"]) == 29


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_auto_types_text_arguments_by_the_offered_functions_schemas(size: int) -> None:
    """qwen3_coder writes each argument as text: the request's function schemas type it, in the
    whole message and the stream alike (without them "3" would stay a string)."""
    schema = {"type": "object", "properties": {"days": {"type": "integer"},
                                               "city": {"type": "string"}}}  # fmt: skip
    plan = OutputPlan(
        ToolPlan((Function("forecast", schema),), "auto"), tool_parsers.get_parser("qwen3_coder")
    )
    text = (
        "On it.\n<tool_call>\n<function=forecast>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=city>\n10\n</parameter>\n</function>\n</tool_call>"
    )
    message = ChoiceOutput(plan).message(text)
    assert message["content"] == "On it."
    (call,) = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"days": 3, "city": "10"}
    assembled = _assemble(_stream(plan, _pieces(text, size))[0])
    assert assembled["content"].strip() == "On it."
    assert json.loads(assembled["tool_calls"][0]["arguments"]) == {"days": 3, "city": "10"}
