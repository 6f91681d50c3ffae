"""Thinking split from the answer: qwen3, deepseek_r1, deepseek_v3 and glm45 (switched by the
request's chat_template_kwargs) and gpt-oss's harmony channels (openai_gptoss), whole and
streamed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.flows.reasoning import PARSERS, ReasoningParser, ReasoningStep, Split, get_parser
from tests.gateway.text_splits import random_split

QWEN3 = get_parser("qwen3")
R1 = get_parser("deepseek_r1")
BOTH = pytest.mark.parametrize("parser", [QWEN3, R1], ids=lambda p: p.name)


def _streamed(
    parser: ReasoningParser, pieces: list[str], prompt_open: bool, read_calls: bool = False
) -> Split:
    """What the client is sent, concatenated, feeding pieces one by one ("" -> None); with
    ``read_calls``, the calls read out as ``name(arguments)`` after the content."""
    stream = parser.stream(prompt_open, read_calls)
    steps = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    reasoning = "".join(s.reasoning for s in steps)
    content = "".join(s.content for s in steps)
    content += "".join(f"{c.name}({c.arguments})" for s in steps for c in s.calls)
    return Split(reasoning or None, content or None)


@BOTH
def test_thinking_opened_by_the_model(parser: ReasoningParser) -> None:
    text = "<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nIt is 4."
    expected = Split("The user wants 2+2.\nThat is 4.", "It is 4.")
    assert parser.split(text, prompt_open=False) == expected
    assert parser.split(text, prompt_open=True) == expected  # a repeated <think> is dropped too


@BOTH
def test_thinking_opened_by_the_prompt(parser: ReasoningParser) -> None:
    text = "Hmm, 2+2.\n</think>\n\nIt is 4.\n"
    assert parser.split(text, prompt_open=True) == Split("Hmm, 2+2.", "It is 4.\n")


@BOTH
def test_output_cut_off_while_thinking_is_all_reasoning(parser: ReasoningParser) -> None:
    assert parser.split("<think>\nStill think", prompt_open=False) == Split("Still think", None)
    assert parser.split("Still think", prompt_open=True) == Split("Still think", None)


@BOTH
def test_no_thinking_at_all_is_all_content(parser: ReasoningParser) -> None:
    assert parser.split("\nIt is 4.", prompt_open=False) == Split(None, "It is 4.")


@BOTH
def test_empty_block_gives_no_reasoning(parser: ReasoningParser) -> None:
    text = "<think>\n\n</think>\n\nIt is 4."
    assert parser.split(text, prompt_open=False) == Split(None, "It is 4.")
    assert parser.split("<think>\nhm</think>", prompt_open=False) == Split("hm", None)


def test_lone_end_tag_is_thinking_for_deepseek_r1_but_answer_for_qwen3() -> None:
    text = "Let me think.</think>It is 4."
    assert R1.split(text, prompt_open=False) == Split("Let me think.", "It is 4.")
    assert QWEN3.split(text, prompt_open=False) == Split(None, text)


def test_unicode_and_leading_whitespace_before_the_tag() -> None:
    text = "  \n<think>Überlegung: 世界</think>\n\nAntwort 👋"
    assert QWEN3.split(text, prompt_open=False) == Split("Überlegung: 世界", "Antwort 👋")


@BOTH
def test_prompt_opens_when_the_prompt_ends_inside_a_block(parser: ReasoningParser) -> None:
    assert parser.prompt_opens("<|Assistant|><think>\n")
    assert not parser.prompt_opens("<|im_start|>assistant\n")
    # Qwen3 with thinking switched off: the template closes an empty block itself
    assert not parser.prompt_opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert parser.prompt_opens("<think>a</think> ... <think>")


def test_qwen3_without_thinking_streams_content_at_once() -> None:
    stream = QWEN3.stream(prompt_open=False)
    assert stream.feed("\n<th") == ReasoningStep("", "")  # may still open a block
    assert stream.feed("ree") == ReasoningStep("", "<three")
    assert stream.feed(" apples") == ReasoningStep("", " apples")


def test_stream_splits_tags_across_deltas() -> None:
    stream = QWEN3.stream(prompt_open=False)
    steps = [stream.feed(piece) for piece in ["<", "think>\n", "Hmm", "\n</th", "ink>\n\n", "4"]]
    assert steps == [
        ReasoningStep("", ""),
        ReasoningStep("", ""),
        ReasoningStep("Hmm", ""),
        ReasoningStep("", ""),  # the newline is held: it may end the thinking
        ReasoningStep("", ""),
        ReasoningStep("", "4"),
    ]
    assert stream.finish() == ReasoningStep("", "")


def test_deepseek_r1_streams_thinking_at_once_when_the_prompt_opened_it() -> None:
    stream = R1.stream(prompt_open=True)
    assert stream.feed("Okay, so") == ReasoningStep("Okay, so", "")
    assert stream.feed(" 4.</think>\n\nFour.") == ReasoningStep(" 4.", "Four.")


def test_deepseek_r1_holds_unopened_output_until_it_is_decided() -> None:
    stream = R1.stream(prompt_open=False)
    assert stream.feed("Plain answer") == ReasoningStep("", "")  # a </think> may still come
    assert stream.finish() == ReasoningStep("", "Plain answer")


def test_every_parser_is_registered_under_its_name() -> None:
    assert sorted(PARSERS) == ["deepseek_r1", "deepseek_v3", "glm45", "openai_gptoss", "qwen3"]
    assert all(get_parser(name).name == name for name in PARSERS)
    for kwargs in ({}, {"thinking": True}, {"thinking": False}):  # the per-request variants too
        assert all(get_parser(name).for_request(kwargs).name == name for name in PARSERS)


def test_unknown_parser_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, deepseek_v3, glm45, openai_gptoss, qwen3"):
        get_parser("granite")


V3 = get_parser("deepseek_v3")
GLM = get_parser("glm45")
V3_THINKING = V3.for_request({"thinking": True})
GLM_OFF = GLM.for_request({"enable_thinking": False})


def test_deepseek_v3_thinks_only_when_the_request_asks() -> None:
    """vLLM's deepseek_v3: thinking (or enable_thinking) true in chat_template_kwargs reads the
    output as DeepSeek-R1; otherwise, or when false, it is all answer, tags and all."""
    text = "Let me think.\n</think>\n\nIt is 4."
    for kwargs in ({}, {"thinking": False}, {"enable_thinking": False}, {"thinking": None}):
        off = V3.for_request(kwargs)
        assert not off.separates and not off.prompt_opens("<|Assistant|><think>")
        assert off.split(text, prompt_open=True) == Split(None, text)
        assert off.split("\n", prompt_open=False) == Split(None, "\n")  # untouched
    for kwargs in ({"thinking": True}, {"enable_thinking": True},
                   {"thinking": False, "enable_thinking": True}):  # fmt: skip
        on = V3.for_request(kwargs)
        assert on.separates and on.prompt_opens("<｜Assistant｜><think>")  # V3.1's template
        assert on.split(text, prompt_open=True) == Split("Let me think.", "It is 4.")
        assert on.split("Still", prompt_open=True) == Split("Still", None)  # cut off
        assert on.split(text, prompt_open=False) == R1.split(text, prompt_open=False)
    assert V3.split(text, prompt_open=True) == Split(None, text)  # not per request: off


@pytest.mark.parametrize("parser", [V3, GLM], ids=lambda p: p.name)
@pytest.mark.parametrize("value", ["false", 1, 0, [], "yes"])
def test_a_thinking_switch_that_is_no_boolean_is_refused(
    parser: ReasoningParser, value: object
) -> None:
    for name in ("thinking", "enable_thinking"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs.{name} must be true or fal"):
            parser.for_request({name: value})


def test_glm45_thinks_unless_the_request_switches_it_off() -> None:
    """vLLM's glm45: thinking unless thinking/enable_thinking are given and neither is true."""
    text = "<think>\nHmm.\n</think>\n\nIt is 4."
    for kwargs in ({}, {"enable_thinking": True}, {"thinking": None},
                   {"thinking": False, "enable_thinking": True}):  # fmt: skip
        assert GLM.for_request(kwargs) is GLM
    assert GLM.split(text, prompt_open=False) == Split("Hmm.", "It is 4.")
    for kwargs in ({"enable_thinking": False}, {"thinking": False},
                   {"thinking": False, "enable_thinking": None}):  # fmt: skip
        off = GLM.for_request(kwargs)
        assert not off.separates and off.split(text, prompt_open=False) == Split(None, text)


def test_glm45_output_starts_inside_the_thinking() -> None:
    """The output is thinking until </think>, whether or not the model wrote <think>: one cut
    off, or never closed, is all reasoning (a grammar waits for the end tag: prompt_opens)."""
    assert GLM.prompt_opens("<|assistant|>")
    assert GLM.split("Hmm, 2+2.\n</think>\n\n4", prompt_open=False) == Split("Hmm, 2+2.", "4")
    assert GLM.split("<think>Still thinking\n", prompt_open=False) == Split("Still thinking", None)
    assert GLM.split("Plain answer", prompt_open=False) == Split("Plain answer", None)
    assert GLM.split("\n<think>\n\n</think>\n\n4", False) == Split(None, "4")  # empty block


def test_glm45_a_tool_call_ends_the_thinking() -> None:
    """A <tool_call> written while thinking ends it: the call, tag and all, is the answer's,
    for the tool-call parser; inside a call think tags are the call's text."""
    call = (
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>"
    )
    assert GLM.split(f"<think>I should check.\n{call}", False) == Split("I should check.", call)
    assert GLM.split(f"<think>Check.</think>\n{call}", False) == Split("Check.", call)
    odd = "<tool_call>f<arg_key>x</arg_key><arg_value></think></arg_value></tool_call>"
    assert GLM.split(f"<think>a</think>{odd}", False) == Split("a", odd)


def test_glm45_answer_may_open_thinking_again_and_drops_a_stray_end_tag() -> None:
    text = "<think>a</think>b</think>c<think>\nd\n</think>e"
    assert GLM.split(text, prompt_open=False) == Split("ad", "bce")


def test_glm45_streams_thinking_as_it_comes_and_holds_only_a_possible_tag() -> None:
    stream = GLM.stream(prompt_open=False)
    assert stream.feed("<think>\nI should") == ReasoningStep("I should", "")
    assert stream.feed(" check.\n<tool") == ReasoningStep(" check.", "")  # "<tool" held
    assert stream.feed("_call>get_weather") == ReasoningStep("", "<tool_call>get_weather")
    assert stream.feed("<arg_key>city</arg_key></tool_") == ReasoningStep(
        "", "<arg_key>city</arg_key>"
    )
    assert stream.feed("call>\nDone") == ReasoningStep("", "</tool_call>\nDone")
    assert stream.finish() == ReasoningStep("", "")


def test_deepseek_v3_without_thinking_streams_everything_at_once() -> None:
    stream = V3.stream(prompt_open=False)
    assert stream.feed("\n<thi") == ReasoningStep("", "\n<thi")
    assert stream.feed("nk>a</think>") == ReasoningStep("", "nk>a</think>")
    assert stream.finish() == ReasoningStep("", "")


_FRAGMENTS = ["<think>", "</think>", "<th", "</thi", "\n", "\n\n", "Hmm", "4", " ", "é",
              "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>", "<|call|>",
              "analysis", "final", "<|chan", "<|e", " to=functions.f", "{}", "<tool_call>",
              "</tool_call>", "<tool_", "</tool", "<arg_key>"]  # fmt: skip


def _texts() -> st.SearchStrategy[str]:
    pieces = st.sampled_from(_FRAGMENTS) | st.text(" \n<>/thinkab", max_size=4)
    return st.lists(pieces, max_size=10).map("".join)


HARMONY = get_parser("openai_gptoss")
# gpt-oss's answer to a question: its thinking, a preamble on the commentary channel, the answer
GPT_OSS = (
    "<|channel|>analysis<|message|>User asks 2+2. Answer 4.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Let me add.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is 4."
)


def test_harmony_analysis_is_the_reasoning_and_the_other_channels_the_answer() -> None:
    assert HARMONY.split(GPT_OSS, prompt_open=False) == Split(
        "User asks 2+2. Answer 4.", "Let me add.It is 4."
    )
    # the turn's end token when it is in the text, and a constrained header
    text = "<|channel|>final <|constrain|>json<|message|>{}<|return|>"
    assert HARMONY.split(text, prompt_open=False) == Split(None, "{}")


def test_harmony_cut_off_in_the_analysis_or_a_header_and_plain_text() -> None:
    assert HARMONY.split("<|channel|>analysis<|message|>Hmm", False) == Split("Hmm", None)
    cut = "<|channel|>analysis<|message|>Hmm<|end|><|start|>assistant<|chan"
    assert HARMONY.split(cut, False) == Split("Hmm", None)
    # a model that does not write harmony: all of it is the answer, markers and all
    assert HARMONY.split("4<|end|>", False) == Split(None, "4<|end|>")
    assert not HARMONY.prompt_opens("<|start|>assistant")


def test_a_prompt_that_primes_the_analysis_starts_the_output_in_it() -> None:
    primed = "<|start|>user<|message|>2+2?<|end|><|start|>assistant<|channel|>analysis<|message|>"
    assert HARMONY.prompt_opens(primed)
    assert not HARMONY.prompt_opens(primed + "Sum.<|end|>")
    assert not HARMONY.prompt_opens(primed.replace("analysis", "final"))  # a continued answer
    text = "Sum is 4.<|end|><|start|>assistant<|channel|>final<|message|>4"
    assert HARMONY.split(text, prompt_open=True) == Split("Sum is 4.", "4")


def test_harmony_streams_each_channel_as_it_comes() -> None:
    stream = HARMONY.stream(False)
    first = stream.feed("<|channel|>analysis<|message|>User asks")
    assert first == ReasoningStep("User asks", "")
    assert stream.feed(" 2+2.<|e") == ReasoningStep(" 2+2.", "")  # "<|e" may open <|end|>
    assert stream.feed("nd|><|start|>assistant<|channel|>final<|message|>4") == ReasoningStep(
        "", "4"
    )
    assert stream.finish() == ReasoningStep("", "")


# each registered parser, and the ones a request's chat_template_kwargs switch to
_VARIANTS = [(name, {}) for name in sorted(PARSERS)] + [
    ("deepseek_v3", {"thinking": True}),
    ("glm45", {"enable_thinking": False}),
]


@pytest.mark.parametrize(("name", "kwargs"), _VARIANTS, ids=lambda v: str(v))
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_streaming_any_split_agrees_with_the_whole_text(
    name: str, kwargs: dict[str, bool], data: st.DataObject
) -> None:
    """Exact equality: the stream drops the same newlines split does (it holds the thinking's
    trailing newlines back until more thinking follows), so nothing is compared stripped."""
    parser = get_parser(name).for_request(kwargs)
    text, prompt_open = data.draw(_texts()), data.draw(st.booleans())
    whole = parser.split(text, prompt_open)
    assert _streamed(parser, random_split(data, text), prompt_open) == whole
    assert _streamed(parser, list(text), prompt_open) == whole  # one character at a time
    calls = _streamed(parser, [text], prompt_open, read_calls=True)  # harmony's, read out
    assert _streamed(parser, random_split(data, text), prompt_open, read_calls=True) == calls
