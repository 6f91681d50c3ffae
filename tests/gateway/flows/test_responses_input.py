"""Responses input items become the chat messages the chat pipeline renders: roles, parts,
an assistant turn's reasoning, text and calls as one message, tool outputs as tool messages;
items the chat history cannot hold are a 400 naming where they are."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.core.errors import APIError
from gateway.flows.responses_input import continues_final, normal_input, to_messages

PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="  # fmt: skip


def chat(value: Any, instructions: str | None = None, history: Any = ()) -> list[dict[str, Any]]:
    items = normal_input(value)
    return to_messages(instructions, list(history), items).messages


def test_a_string_is_one_user_message_after_the_instructions() -> None:
    assert chat("hi", "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
    ]


def test_roles_and_text_parts() -> None:
    messages = chat([
        {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "x"},
                                          {"type": "refusal", "refusal": "no"}]},
    ])  # fmt: skip
    # developer is the chat endpoint's too (its parser makes it system)
    assert messages == [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "xno"},
    ]


def test_an_image_part_becomes_an_image_url_part() -> None:
    (message,) = chat([{"role": "user", "content": [
        {"type": "input_text", "text": "what is it?"},
        {"type": "input_image", "image_url": PNG, "detail": "auto"}]}])  # fmt: skip
    assert message["content"] == [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": PNG, "detail": "auto"}},
    ]


def test_a_turns_reasoning_text_and_calls_are_one_assistant_message() -> None:
    messages = chat([
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "look it up"}]},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Let me check.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "noon"}]},
    ])  # fmt: skip
    assert messages[1] == {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "look it up",
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}},
        ],
    }  # fmt: skip
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    ]


def test_a_call_without_text_is_an_assistant_message_with_empty_content() -> None:
    messages = chat([
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "42"},
    ])  # fmt: skip
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["id"] == "c"


def test_the_history_comes_before_the_input_and_after_the_instructions() -> None:
    history = normal_input([
        {"role": "user", "content": "first"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    ])  # fmt: skip
    messages = chat(
        [{"type": "function_call_output", "call_id": "c", "output": "42"}], "sys", history
    )
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]


def test_a_call_the_history_left_unanswered_needs_its_output() -> None:
    history = normal_input([
        {"role": "user", "content": "first"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
    ])  # fmt: skip
    with pytest.raises(APIError) as e:  # OpenAI's 400: a new message, the call unanswered
        chat([{"role": "user", "content": "never mind"}], None, history)
    assert e.value.status == 400 and e.value.param == "input"
    assert "previous_response_id's item 1: no tool output found for function call 'c'" in str(
        e.value.message
    )


def test_items_get_ids_and_a_normal_form() -> None:
    items = normal_input([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "id": "msg_given"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "x"},
    ])  # fmt: skip
    assert items[0]["id"].startswith("msg_")
    assert items[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert items[1]["id"] == "msg_given"
    assert items[1]["content"] == [{"type": "output_text", "text": "hello", "annotations": []}]
    assert items[2]["id"].startswith("fc_") and items[3]["id"].startswith("fco_")
    assert all(i["status"] == "completed" for i in items)


def test_a_final_assistant_message_in_progress_is_continued() -> None:
    done = normal_input([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}])
    begun = normal_input([{"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "a", "status": "incomplete"}])  # fmt: skip
    assert not continues_final(done) and continues_final(begun)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ([], "input is required"),
        (None, "input is required"),
        ([3], "input[0] must be an object"),
        ([{"role": "tool", "content": "x"}], "input[0].role must be one of"),
        ([{"role": "user", "content": 3}], "input[0].content must be a string or a list"),
        ([{"role": "user", "content": [{"type": "output_text", "text": "x"}]}],
         "a user message takes input_text and input_image parts"),
        ([{"role": "system", "content": [{"type": "input_image", "image_url": PNG}]}],
         "a system message takes input_text parts"),
        ([{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],
         "files are not supported"),
        ([{"role": "user", "content": [{"type": "input_file", "file_data": "x"}]}],
         "got 'input_file'"),
        ([{"role": "user", "content": [{"type": "input_text", "text": 3}]}],
         "input[0].content[0].text must be a string"),
        ([{"role": "user", "content": "x", "status": "done"}], "status must be one of"),
        ([{"type": "function_call", "call_id": "c", "name": "", "arguments": "{}"}],
         "input[0].name must be a non-empty string"),
        ([{"type": "function_call_output", "call_id": "nope", "output": "x"}],
         "no function_call found for function_call_output with call_id 'nope'"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
          {"type": "function_call_output", "call_id": "c",
           "output": [{"type": "input_image", "image_url": PNG}]}],
         "takes input_text parts"),
        ([{"role": "user", "content": "x"},
          {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
          {"type": "function_call", "call_id": "d", "name": "f", "arguments": "{}"},
          {"type": "function_call_output", "call_id": "c", "output": "1"}],
         "input[2]: no tool output found for function call 'd'"),
        ([{"type": "reasoning", "summary": [], "encrypted_content": "abc"}],
         "encrypted reasoning is not supported"),
        ([{"type": "reasoning", "summary": [{"type": "summary_text"}]}],
         "input[0].summary must be a list of summary_text parts"),
        ([{"type": "item_reference", "id": "msg_1"}], "item references are not supported"),
        ([{"type": "web_search_call", "id": "ws_1"}], "built-in tools (web search)"),
        ([{"type": "file_search_call", "id": "fs_1"}], "built-in tools (file search)"),
        ([{"type": "mystery"}], "input[0].type must be message, function_call"),
        ([{"role": "user", "content": "x", "id": 7}], "input[0].id must be a string"),
    ],
)  # fmt: skip
def test_bad_input_is_a_400_naming_where(value: Any, words: str) -> None:
    with pytest.raises(APIError) as e:
        chat(value)
    assert e.value.status == 400 and e.value.param == "input"
    assert words in e.value.message
