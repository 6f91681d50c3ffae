"""The Jinja environment behaves like Hugging Face's for the helpers templates use."""

from __future__ import annotations

import datetime

import pytest

from gateway.flows.chat_template import ChatTemplate, ChatTemplateError, pick_template

MSGS = [{"role": "user", "content": "hi"}]


def render(source: str, **kwargs: object) -> str:
    return ChatTemplate(source, {"bos_token": "<s>"}).render(MSGS, **kwargs)  # type: ignore[arg-type]


def test_raise_exception_becomes_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")


def test_tojson_keeps_unicode_and_honours_indent() -> None:
    assert render("{{ {'a': 'é'} | tojson }}") == '{"a": "é"}'
    assert render("{{ [1] | tojson(indent=2) }}") == "[\n  1\n]"


def test_trim_and_lstrip_blocks_like_hf() -> None:
    source = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}"
    assert render(source) == "    hi\n"


def test_generation_tag_and_loop_controls_are_accepted() -> None:
    source = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}"
    assert render(source) == "hi"


def test_strftime_now_and_special_tokens_and_kwargs() -> None:
    year = datetime.datetime.now().strftime("%Y")
    assert render("{{ strftime_now('%Y') }}") == year
    assert render("{{ bos_token }}{{ extra }}", extra="!") == "<s>!"


def test_variables_of_any_name_reach_the_template() -> None:
    """A request's chat_template_kwargs come as one mapping: names that are also parameters
    of the renderer (kwargs, variables, add_special_tokens) are the template's, and ``tools``
    there overrides the tools argument."""
    source = (
        "{{ kwargs }}|{{ variables }}|{{ add_special_tokens }}|{{ tools }}|{{ enable_thinking }}"
    )
    given = {
        "kwargs": 1,
        "variables": 2,
        "add_special_tokens": 3,
        "tools": [4],
        "enable_thinking": False,
    }
    assert render(source, variables=given) == "1|2|3|[4]|False"
    assert render("{{ tools }}", tools=[1], variables={"tools": [2]}) == "[2]"
    assert render("{{ tools }}", tools=[1]) == "[1]"


def test_sandbox_blocks_attribute_escape() -> None:
    with pytest.raises(ChatTemplateError):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_syntax_error_is_reported_at_load() -> None:
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}", {})


def test_pick_template() -> None:
    assert pick_template("x") == "x"
    assert (
        pick_template([{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}])
        == "d"
    )
    assert pick_template(None) is None


def test_the_variables_a_template_reads_are_known() -> None:
    """What ``GatewayTokenizer.template_reads`` answers from: the names the template reads but
    does not set itself (gpt-oss's reads reasoning_effort; its own loop variables do not
    count)."""
    source = (
        "{% set effort = reasoning_effort | default('medium') %}Reasoning: {{ effort }}\n"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert ChatTemplate(source, {}).variables == {"reasoning_effort", "messages"}
    assert "reasoning_effort" not in ChatTemplate("{{ messages[0].content }}", {}).variables
