"""Tool calls parsed out of generated text, whole and streamed: hermes, llama3_json, mistral,
qwen3_coder, glm45, deepseek_v3, deepseek_v31 and pythonic."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.flows.tool_parsers import (
    PARSERS,
    Parsed,
    StreamStep,
    ToolCall,
    ToolParser,
    get_parser,
)
from tests.gateway.text_splits import random_split

HERMES = get_parser("hermes")
LLAMA = get_parser("llama3_json")
MISTRAL = get_parser("mistral")
WEATHER = ToolCall("get_weather", '{"city": "Paris", "unit": "C"}')
TIME = ToolCall("get_time", "{}")


def _streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, tuple[ToolCall, ...]]:
    """All content the client is sent (unstripped) and all calls, feeding pieces one by one."""
    stream = parser.stream()
    steps = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(s.content for s in steps), tuple(c for s in steps for c in s.tool_calls)


def _hermes_block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


# ---------------------------------------------------------------- hermes


def test_hermes_content_then_two_calls() -> None:
    text = (
        "I'll look both up.\n\n"
        + _hermes_block("get_weather", '{"city": "Paris", "unit": "C"}')
        + "\n"
        + _hermes_block("get_time", "{}")
    )
    assert HERMES.parse(text) == Parsed("I'll look both up.", (WEATHER, TIME))


def test_hermes_only_calls_has_no_content() -> None:
    assert HERMES.parse(_hermes_block("get_time", "{}") + "\n") == Parsed(None, (TIME,))


def test_hermes_plain_answer_is_all_content() -> None:
    assert HERMES.parse("  The answer is 4.\n") == Parsed("The answer is 4.", ())


def test_hermes_malformed_json_stays_content() -> None:
    text = 'Hi <tool_call>{"name": "f", "arguments": {</tool_call>'
    assert HERMES.parse(text) == Parsed(text, ())


def test_hermes_block_without_string_name_stays_content_and_others_still_parse() -> None:
    bad = '<tool_call>{"name": 7, "arguments": {}}</tool_call>'
    parsed = HERMES.parse(bad + _hermes_block("get_time", "{}"))
    assert parsed == Parsed(bad, (TIME,))


def test_hermes_unterminated_block_is_shown_not_lost() -> None:
    text = 'Checking. <tool_call>{"name": "get_weather", "argu'
    assert HERMES.parse(text) == Parsed(text, ())


def test_hermes_block_left_open_after_a_whole_call_is_a_call() -> None:
    """The output ended (EOS, a stop string on the closing tag) with a whole call in an open
    block: a call, as vLLM reads it, whole or streamed; its text before stays content."""
    text = 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
    text += '"unit": "C"}}\n'
    assert HERMES.parse(text) == Parsed("Checking.", (WEATHER,))
    assert _streamed(HERMES, list(text)) == ("Checking. ", (WEATHER,))
    text = _hermes_block("get_time", "{}") + '<tool_call>{"name": "get_time", "arguments": {}}'
    assert HERMES.parse(text) == Parsed(None, (TIME, TIME))


def test_hermes_arguments_given_as_json_string_are_decoded_once() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'
    assert HERMES.parse(text).tool_calls == (ToolCall("get_time", '{"tz": "UTC"}'),)


def test_hermes_arguments_that_are_not_an_object_make_no_call() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": [1, 2]}</tool_call>'
    assert HERMES.parse(text) == Parsed(text, ())


def test_unicode_arguments_are_kept_readable() -> None:
    text = _hermes_block("translate", '{"text": "Grüße, 世界 👋"}')
    (call,) = HERMES.parse(text).tool_calls
    assert call.arguments == '{"text": "Grüße, 世界 👋"}'
    assert json.loads(call.arguments) == {"text": "Grüße, 世界 👋"}


def test_hermes_stream_sends_content_at_once_and_each_call_when_its_block_closes() -> None:
    stream = HERMES.stream({"get_time": {}})
    assert stream.feed("Sure").content == "Sure"
    assert stream.feed(" <tool").content == " "  # "<tool" may be a marker: held back
    assert stream.feed("_call>\n").content == ""
    assert stream.feed('{"name": "get_time"}\n</tool_').tool_calls == ()
    assert stream.feed("call>").tool_calls == (TIME,)
    assert stream.feed(" <b>").content == " <b>"  # held "<" turned out to be no marker
    assert stream.finish().content == ""


def test_hermes_stream_gives_back_a_lone_bracket_at_the_end() -> None:
    stream = HERMES.stream()
    assert stream.feed("a <").content == "a "
    assert stream.finish().content == "<"


def test_hermes_stream_never_sends_markup_char_by_char() -> None:
    text = "Let me see. " + _hermes_block("get_time", "{}") + _hermes_block("get_time", "{}")
    stream = HERMES.stream()
    calls_at = []
    for i, char in enumerate(text):
        step = stream.feed(char)
        assert "<" not in step.content
        if step.tool_calls:
            calls_at.append(i + 1)
    assert calls_at == [i + len("</tool_call>") for i in _ends(text, "</tool_call>")]
    assert stream.finish() == StreamStep("", ())  # nothing held back


def _ends(text: str, marker: str) -> list[int]:
    found, at = [], text.find(marker)
    while at >= 0:
        found.append(at)
        at = text.find(marker, at + 1)
    return found


# ---------------------------------------------------------------- llama3_json


def test_llama3_single_call_with_python_tag_and_parameters() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}'
    assert LLAMA.parse(text) == Parsed(None, (WEATHER,))


def test_llama3_calls_separated_by_semicolons_and_arguments_key() -> None:
    text = (
        '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}; '
        '{"name": "get_time", "parameters": {}};'
    )
    assert LLAMA.parse(text) == Parsed(None, (WEATHER, TIME))


def test_llama3_text_answer_is_all_content() -> None:
    text = 'The JSON you want is {"name": "x"}.'
    assert LLAMA.parse(text) == Parsed(text, ())


def test_llama3_json_that_is_not_a_call_is_all_content() -> None:
    text = '<|python_tag|>{"answer": 42}'
    assert LLAMA.parse(text) == Parsed(text, ())


def test_llama3_malformed_json_is_all_content() -> None:
    text = '{"name": "get_time", "parameters": {'
    assert LLAMA.parse(text) == Parsed(text, ())


def test_llama3_text_after_complete_calls_is_content() -> None:
    text = '{"name": "get_time", "parameters": {}} and that is all'
    assert LLAMA.parse(text) == Parsed("and that is all", (TIME,))


def test_llama3_missing_parameters_are_an_empty_object() -> None:
    assert LLAMA.parse('{"name": "get_time"}', {"get_time": {}}) == Parsed(None, (TIME,))


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "Alice", "age": 30}',  # llama3_json's bare object
        '<tool_call>\n{"name": "Alice", "age": 30}\n</tool_call>',  # hermes
        '[{"name": "Alice", "age": 30}, {"name": "Bob", "age": 25}]',  # mistral, no marker
        '[TOOL_CALLS][{"name": "Alice", "age": 30}]',
    ],
)
def test_an_answer_with_a_name_but_no_arguments_is_content_unless_it_names_a_tool(
    text: str,
) -> None:
    """A JSON answer (a response_format's person) is no call to a function never offered:
    vLLM's parsers fail on the missing arguments and give the text back. Without the
    arguments, only a name among the offered tools is a call (of no arguments)."""
    tools = {"get_weather": {"type": "object"}}
    for parser in (LLAMA, HERMES, MISTRAL):
        assert parser.parse(text, tools).tool_calls == ()
        content, calls = _streamed(parser, list(text))
        assert calls == () and content == text
    if text.startswith("{"):
        offered = {"Alice": {"type": "object"}}
        assert LLAMA.parse(text, offered).tool_calls == (ToolCall("Alice", "{}"),)


def test_llama3_stream_sends_a_text_answer_immediately() -> None:
    stream = LLAMA.stream()
    assert stream.feed("  ").content == ""  # could still be followed by a call
    assert stream.feed("Hi").content == "  Hi"
    assert stream.feed(" {").content == " {"


def test_llama3_stream_sends_each_call_when_its_json_completes() -> None:
    stream = LLAMA.stream()
    assert stream.feed("<|python_").content == ""
    assert stream.feed('tag|>{"name": "get_time", "parameters": {}').tool_calls == ()
    assert stream.feed('}; {"name": "get_weather"').tool_calls == (TIME,)
    step = stream.feed(', "parameters": {"city": "Paris", "unit": "C"}}')
    assert step == StreamStep("", (WEATHER,))
    assert stream.finish() == StreamStep("", ())


# ---------------------------------------------------------------- mistral


def test_mistral_array_after_content() -> None:
    text = (
        'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "C"}}, {"name": "get_time", "arguments": {}}]'
    )
    assert MISTRAL.parse(text) == Parsed("Let me check.", (WEATHER, TIME))


def test_mistral_named_entries_with_and_without_call_id() -> None:
    text = (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}'
        "[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}"
    )
    assert MISTRAL.parse(text) == Parsed(None, (WEATHER, TIME))


def test_mistral_array_without_its_marker_is_still_calls() -> None:
    text = ' [{"name": "get_time", "arguments": {}}]'
    assert MISTRAL.parse(text) == Parsed(None, (TIME,))


def test_mistral_v11_name_then_object() -> None:
    """The v11+ tokenizers' form, ``[TOOL_CALLS]add{"a": 3.5}`` (vLLM's fn_name_regex), one
    call after another, and streamed in any split."""
    text = 'Sure. [TOOL_CALLS]get_weather{"city": "Paris", "unit": "C"}[TOOL_CALLS]get_time{}'
    assert MISTRAL.parse(text) == Parsed("Sure.", (WEATHER, TIME))
    assert _streamed(MISTRAL, list(text)) == ("Sure. ", (WEATHER, TIME))
    for bad in (
        "[TOOL_CALLS]{}",
        "[TOOL_CALLS]get time{}",
        '[TOOL_CALLS]f{"a": 1',
        "[TOOL_CALLS]f[1]",
    ):
        assert MISTRAL.parse(bad) == Parsed(bad, ()), bad


def test_mistral_bracketed_text_is_content() -> None:
    text = "[1] Smith et al. found [TOOL_CALLS elsewhere"
    assert MISTRAL.parse(text) == Parsed(text, ())


def test_mistral_marker_followed_by_prose_or_bad_json_stays_content() -> None:
    assert MISTRAL.parse("[TOOL_CALLS] I cannot") == Parsed("[TOOL_CALLS] I cannot", ())
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}'
    assert MISTRAL.parse(text) == Parsed(text, ())


def test_mistral_arguments_as_string() -> None:
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}]'
    assert MISTRAL.parse(text).tool_calls == (ToolCall("get_time", '{"tz": "UTC"}'),)


def test_mistral_stream_holds_the_marker_and_sends_the_call_when_complete() -> None:
    stream = MISTRAL.stream()
    assert stream.feed("Sure ").content == "Sure "
    assert stream.feed("[TOOL").content == ""
    assert stream.feed("_CALLS]get_time[AR").content == ""
    assert stream.feed("GS]{").tool_calls == ()
    assert stream.feed("}").tool_calls == (TIME,)
    assert stream.finish().content == ""


# ---------------------------------------------------------------- qwen3_coder

QWEN = get_parser("qwen3_coder")
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string"},
            "days": {"type": "integer"},
            "scale": {"type": "number"},
            "metric": {"type": "boolean"},
            "opts": {"type": "object"},
            "tags": {"type": ["array", "null"]},
            "any": {},
        },
    }
}


def _qwen_block(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_content_then_two_calls() -> None:
    text = (
        "I'll look both up.\n"
        + _qwen_block("get_weather", city="Paris", unit="C")
        + "\n"
        + _qwen_block("get_time")
    )
    assert QWEN.parse(text, SCHEMAS) == Parsed("I'll look both up.", (WEATHER, TIME))


def test_qwen3_coder_types_values_by_the_schema_as_vllm() -> None:
    block = _qwen_block(
        "get_weather", city="42", days="3", scale="2.5", metric="True", opts='{"a": [1, 2]}',
        tags="['x', 'y']", any="7", unknown="{}",
    )  # fmt: skip
    (call,) = QWEN.parse(block, SCHEMAS).tool_calls
    assert json.loads(call.arguments) == {
        "city": "42", "days": 3, "scale": 2.5, "metric": True, "opts": {"a": [1, 2]},
        "tags": ["x", "y"], "any": "7", "unknown": "{}",
    }  # fmt: skip
    block = _qwen_block("get_weather", days="three", scale="4.0", metric="yes", city="null")
    (call,) = QWEN.parse(block, SCHEMAS).tool_calls
    assert json.loads(call.arguments) == {"days": "three", "scale": 4, "metric": False,
                                          "city": None}  # fmt: skip
    # an unparsable object and a number too large stay strings; without schemas all are text
    block = _qwen_block("get_weather", opts="{oops", scale="1e999", days="2")
    (call,) = QWEN.parse(block, SCHEMAS).tool_calls
    assert json.loads(call.arguments) == {"opts": "{oops", "scale": "1e999", "days": 2}
    (call,) = QWEN.parse(block).tool_calls
    assert json.loads(call.arguments) == {"opts": "{oops", "scale": "1e999", "days": "2"}


def test_qwen3_coder_keeps_multiline_values_but_one_newline_each_side() -> None:
    code = "def f():\n    return 1\n"
    (call,) = QWEN.parse(_qwen_block("write", code=code)).tool_calls
    assert json.loads(call.arguments) == {"code": code}


def test_qwen3_coder_a_closed_block_may_leave_out_closing_tags() -> None:
    text = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</tool_call>"
    assert QWEN.parse(text).tool_calls == (ToolCall("get_time", '{"tz": "UTC"}'),)


def test_qwen3_coder_cut_short_or_malformed_stays_content() -> None:
    cut = "Checking. <tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    assert QWEN.parse(cut) == Parsed(cut, ())
    assert _streamed(QWEN, list(cut)) == (cut, ())
    bad = "<tool_call>\nnot a function\n</tool_call>"
    assert QWEN.parse(bad + _qwen_block("get_time")) == Parsed(bad, (TIME,))
    # left open but the function whole (a stop string on the closing tag): a call
    text = "<tool_call>\n<function=get_time>\n</function>\n"
    assert QWEN.parse(text) == Parsed(None, (TIME,))


def test_qwen3_coder_functions_without_their_tool_call_block() -> None:
    """Qwen3-Coder models drop the ``<tool_call>`` wrapper at times; vLLM reads the functions
    anyway. One left open at the end stays content."""
    bare = "<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>"
    days = ToolCall("get_weather", '{"days": 3}')
    text = "Sure. " + bare + " and " + _qwen_block("get_time") + "\n" + bare
    assert QWEN.parse(text, SCHEMAS) == Parsed("Sure.  and", (days, TIME, days))
    stream = QWEN.stream(SCHEMAS)
    steps = [stream.feed(c) for c in text] + [stream.finish()]
    assert "".join(s.content for s in steps) == "Sure.  and \n"
    assert tuple(c for s in steps for c in s.tool_calls) == (days, TIME, days)
    cut = "Checking. <function=get_weather>\n<parameter=city>\nPar"
    assert QWEN.parse(cut) == Parsed(cut, ()) and _streamed(QWEN, list(cut)) == (cut, ())
    prose = "use <function=NAME> markup</function>"
    assert QWEN.parse(prose) == Parsed(prose, ())


def test_qwen3_coder_stream_holds_the_markup_and_sends_the_call_when_the_block_closes() -> None:
    stream = QWEN.stream(SCHEMAS)
    assert stream.feed("Sure <tool").content == "Sure "
    assert stream.feed("_call>\n<function=get_weather>\n<parameter=days>\n") == StreamStep("", ())
    assert stream.feed("3\n</parameter>\n</function>\n</tool_") == StreamStep("", ())
    assert stream.feed("call>") == StreamStep("", (ToolCall("get_weather", '{"days": 3}'),))
    assert stream.finish() == StreamStep("", ())


# ---------------------------------------------------------------- glm45

GLM = get_parser("glm45")


def _glm_block(name: str, **args: str) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return f"<tool_call>{name}\n{body}</tool_call>"


def test_glm45_content_then_two_calls() -> None:
    text = "Let me check.\n" + _glm_block("get_weather", city="Paris", unit="C")
    text += _glm_block("get_time")
    assert GLM.parse(text, SCHEMAS) == Parsed("Let me check.", (WEATHER, TIME))


def test_glm45_reads_non_string_values_as_json_or_python_literals() -> None:
    block = _glm_block("get_weather", city=" 42 ", days="3", opts='{"a": true}', tags="['x']",
                       unit="plain words")  # fmt: skip
    (call,) = GLM.parse(block, SCHEMAS).tool_calls
    assert json.loads(call.arguments) == {"city": " 42 ", "days": 3, "opts": {"a": True},
                                          "tags": ["x"], "unit": "plain words"}  # fmt: skip
    (call,) = GLM.parse(block).tool_calls  # no schema: every value is read
    assert json.loads(call.arguments)["city"] == 42


def test_glm45_name_may_run_straight_into_its_first_key() -> None:
    text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    assert GLM.parse(text, SCHEMAS).tool_calls == (ToolCall("get_weather", '{"city": "Paris"}'),)


def test_glm45_cut_short_or_malformed_stays_content() -> None:
    cut = "Hi <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"
    assert GLM.parse(cut) == Parsed(cut, ())
    assert _streamed(GLM, list(cut)) == (cut, ())
    bad = "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>"
    assert GLM.parse(bad) == Parsed(bad, ())
    twice = "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value>"
    twice += "<arg_key>a</arg_key><arg_value>2</arg_value></tool_call>"
    assert GLM.parse(twice) == Parsed(twice, ())  # a key given twice is refused, not dropped


# ---------------------------------------------------------------- deepseek

DS3 = get_parser("deepseek_v3")
DS31 = get_parser("deepseek_v31")
CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _ds3_call(name: str, arguments: str) -> str:
    return f"{CALL}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def _ds31_call(name: str, arguments: str) -> str:
    return f"{CALL}{name}{SEP}{arguments}{CALL_END}"


@pytest.mark.parametrize(("parser", "call"), [(DS3, _ds3_call), (DS31, _ds31_call)])
def test_deepseek_content_then_two_calls_then_content(
    parser: ToolParser, call: Callable[[str, str], str]
) -> None:
    text = "Let me check." + CALLS + call("get_weather", '{"city": "Paris", "unit": "C"}') + "\n"
    text += call("get_time", "{}") + CALLS_END + " Done."
    assert parser.parse(text) == Parsed("Let me check. Done.", (WEATHER, TIME))
    assert _streamed(parser, list(text)) == ("Let me check. Done.", (WEATHER, TIME))


def test_deepseek_calls_of_the_other_version_or_bad_json_stay_content() -> None:
    v31 = CALLS + _ds31_call("get_time", "{}") + CALLS_END
    assert DS3.parse(v31) == Parsed(CALLS + _ds31_call("get_time", "{}"), ())
    bad = CALLS + _ds3_call("get_time", "{oops") + CALLS_END
    assert DS3.parse(bad).tool_calls == ()
    assert DS31.parse(CALLS + "I cannot") == Parsed(CALLS + "I cannot", ())
    cut = "Hm " + CALLS + CALL + "get_weather" + SEP + '{"city": "Pa'
    assert DS31.parse(cut) == Parsed(cut, ())  # cut short by max_tokens: shown, not lost
    whole = CALLS + CALL + "get_time" + SEP + "{}"
    assert DS31.parse(whole) == Parsed(None, (TIME,))  # left open but whole: a call


def test_deepseek_stream_never_sends_markup() -> None:
    text = "Sure. " + CALLS + _ds3_call("get_time", "{}") + CALLS_END
    stream = DS3.stream()
    sent = "".join(stream.feed(c).content for c in text) + stream.finish().content
    assert sent == "Sure. "


# ---------------------------------------------------------------- pythonic

PYTHONIC = get_parser("pythonic")


def test_pythonic_list_of_calls_with_literal_keyword_arguments() -> None:
    text = "[get_weather(city=\"Paris\", unit='C'), get_time()]"
    assert PYTHONIC.parse(text) == Parsed(None, (WEATHER, TIME))
    text = "[f(n=-1, x=[1, (2, 3)], y={'a': None, 'b': True}, s='''a\nb''')]"
    (call,) = PYTHONIC.parse(text).tool_calls
    assert json.loads(call.arguments) == {"n": -1, "x": [1, [2, 3]], "y": {"a": None, "b": True},
                                          "s": "a\nb"}  # fmt: skip


def test_pythonic_llama4_tags_are_dropped_and_text_after_is_content() -> None:
    text = " <|python_start|>[get_time()]<|python_end|> and done"
    assert PYTHONIC.parse(text) == Parsed("and done", (TIME,))


@pytest.mark.parametrize(
    "text",
    [
        "[1] Smith et al.",
        "The answer: [get_time()]",
        "[get_time(), 3]",
        "[get_time(1)]",  # positional arguments are refused, not dropped
        "[f(a=print)]",
        "[f(a={1, 2})]",
        "[f(a=1, a=2)]",
        "[get_time(",  # cut short by max_tokens
        "[]",
    ],
)
def test_pythonic_what_is_not_a_list_of_calls_is_content(text: str) -> None:
    assert PYTHONIC.parse(text) == Parsed(text, ())
    assert _streamed(PYTHONIC, list(text)) == (text, ())


def test_pythonic_stream_sends_prose_at_once_and_calls_when_the_list_closes() -> None:
    stream = PYTHONIC.stream()
    assert stream.feed("[1").content == "[1"  # no call opens with a digit
    stream = PYTHONIC.stream()
    assert stream.feed('[get_time(tz="]")').content == ""  # the bracket is in a string
    assert stream.feed("]").tool_calls == (ToolCall("get_time", '{"tz": "]"}'),)
    assert stream.feed(" ok").content == " ok"


# ---------------------------------------------------------------- markup and strict


def test_each_new_format_keeps_special_tokens_only_where_its_markup_is_one() -> None:
    deepseek_special = {CALLS, CALLS_END, CALL, CALL_END, SEP}
    for name in ("deepseek_v3", "deepseek_v31"):
        assert get_parser(name).markup_is_special(deepseek_special.__contains__)
        assert not get_parser(name).markup_is_special(lambda t: t == "<tool_call>")
    assert get_parser("glm45").markup_is_special(lambda t: t == "<arg_key>")
    assert get_parser("qwen3_coder").markup_is_special(lambda t: t == "</tool_call>")
    assert not get_parser("qwen3_coder").markup_is_special(lambda t: t == "<arg_key>")
    # Llama 4's <|python_start|> is special, but the calls read the same without it
    assert not get_parser("pythonic").markup_is_special(lambda t: True)


@pytest.mark.parametrize(
    "name", ["qwen3_coder", "glm45", "deepseek_v3", "deepseek_v31", "pythonic"]
)
def test_formats_without_a_structural_tag_say_so(name: str) -> None:
    """Their arguments are no one JSON object (or their markup special tokens): the gateway
    answers strict tools under auto with a 400 rather than ignore strict."""
    assert get_parser(name).structural_tag([("f", {"type": "object"})], parallel=True) is None


# ---------------------------------------------------------------- registry


def test_every_parser_is_registered_under_its_name() -> None:
    assert list(PARSERS) == [
        "hermes", "llama3_json", "mistral", "qwen3_coder", "glm45", "deepseek_v3",
        "deepseek_v31", "pythonic",
    ]  # fmt: skip
    assert all(get_parser(name).name == name for name in PARSERS)


def test_unknown_parser_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="deepseek_v3, deepseek_v31, glm45, hermes, llama3_json"):
        get_parser("kimi_k2")


# ---------------------------------------------------------------- streaming agrees with whole

_FRAGMENTS = {
    "hermes": [
        "<tool_call>",
        "</tool_call>",
        "<tool",
        '{"name": "f", "arguments": {"a": 1}}',
        '{"name": 3}',
        '<tool_call>\n{"name": "g", "arguments": "{\\"b\\": \\"é\\"}"}\n</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>',
        '<tool_call>{"name": "f"',
    ],
    "llama3_json": [
        "<|python_tag|>",
        "<|py",
        '{"name": "f", "parameters": {"a": 1}}',
        '{"name": "g", "arguments": "{}"}',
        '{"x": 1}',
        "; ",
    ],
    "mistral": [
        "[TOOL_CALLS]",
        "[TOOL",
        '[{"name": "f", "arguments": {"a": 1}}]',
        '[{"name"',
        '[TOOL_CALLS]f[ARGS]{"a": [1, "ü"]}',
        "[TOOL_CALLS]g[CALL_ID]x1[ARGS]",
        '{"a": [1, "ü"]}',
        "[ARGS]",
        "null",
    ],
    "qwen3_coder": [
        "<tool_call>",
        "</tool_call>",
        "<function=f>",
        "<function=get_weather>",
        "</function>",
        "<parameter=days>",
        "<parameter=a>\nx\n",
        "</parameter>",
        "\n3\n",
        _qwen_block("get_weather", city="Paris", opts="[1]"),
        "<tool_call>\n<function=f>\n</function>",
    ],
    "glm45": [
        "<tool_call>",
        "</tool_call>",
        "<tool_call>f\n",
        "<arg_key>a</arg_key>",
        "<arg_value>1</arg_value>",
        "<arg_key>",
        "</arg_value>",
        _glm_block("get_weather", city="Paris", days="3"),
    ],
    "deepseek_v3": [
        CALLS,
        CALLS_END,
        CALL,
        CALL_END,
        f"function{SEP}f\n```json\n",
        '{"a": 1}',
        "\n```",
        _ds3_call("g", '{"b": [1]}'),
        "<｜tool",
    ],
    "deepseek_v31": [
        CALLS,
        CALLS_END,
        CALL,
        CALL_END,
        f"f{SEP}",
        '{"a": 1}',
        _ds31_call("g", '{"b": [1]}'),
        "<｜tool",
    ],
    "pythonic": [
        "[",
        "]",
        "<|python_start|>",
        "<|python_end|>",
        "<|py",
        "get_time()",
        'f(a="]", b=[1, 2])',
        "g(x='''q",
        "'''",
        ", ",
        "(",
        ")",
        '"',
    ],
}
_ALPHABET = ' \n<>/[]{}";:,_"abc1=(\'`'


def _texts(name: str) -> st.SearchStrategy[str]:
    fragments = st.sampled_from(_FRAGMENTS[name])
    pieces = st.one_of(fragments, fragments, st.text(_ALPHABET, max_size=4))  # 2/3 markup
    return st.lists(pieces, max_size=10).map("".join)


@pytest.mark.parametrize("name", sorted(_FRAGMENTS))
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_streaming_any_split_agrees_with_the_whole_text(name: str, data: st.DataObject) -> None:
    """The calls are equal in order; the streamed content, concatenated and stripped, equals the
    whole-text content (parse strips it, the stream cannot know where the content ends)."""
    parser = get_parser(name)
    text = data.draw(_texts(name))
    whole = parser.parse(text)
    content, calls = _streamed(parser, random_split(data, text))
    assert calls == whole.tool_calls
    assert (content.strip() or None) == whole.content
    assert _streamed(parser, list(text)) == (content, calls)  # one character at a time


def test_each_format_says_how_its_strict_calls_are_held() -> None:
    """The structural tag of strict tools under auto: hermes' block on lines of its own,
    llama3_json's object with "parameters" (as Llama 3.1's template asks); mistral has none
    yet (the gateway answers 400 there rather than ignore strict)."""
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    functions = [("search", schema), ("ping", None)]
    hermes = get_parser("hermes").structural_tag(functions, parallel=True)
    assert hermes is not None
    fmt = hermes["format"]
    assert fmt["triggers"] == ["<tool_call>"] and fmt["stop_after_first"] is False
    assert [t["begin"] for t in fmt["tags"]] == [
        '<tool_call>\n{"name": "search", "arguments": ',
        '<tool_call>\n{"name": "ping", "arguments": ',
    ]
    assert {t["end"] for t in fmt["tags"]} == {"}\n</tool_call>"}
    assert [t["content"]["json_schema"] for t in fmt["tags"]] == [schema, {"type": "object"}]
    llama = get_parser("llama3_json").structural_tag(functions[:1], parallel=False)
    assert llama is not None and llama["format"]["stop_after_first"] is True
    assert llama["format"]["triggers"] == ['{"name": ']
    assert llama["format"]["tags"][0]["begin"] == '{"name": "search", "parameters": '
    assert get_parser("mistral").structural_tag(functions, parallel=True) is None
    # every begin starts with its trigger, and a parser reads the call the tag writes
    text = hermes["format"]["tags"][0]["begin"] + '{"q": "x"}' + "}\n</tool_call>"
    assert [c.name for c in get_parser("hermes").parse(text).tool_calls] == ["search"]
    text = llama["format"]["tags"][0]["begin"] + '{"q": "x"}}'
    assert [c.name for c in get_parser("llama3_json").parse(text).tool_calls] == ["search"]
