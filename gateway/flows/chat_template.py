"""Chat templates rendered the way transformers' ``apply_chat_template`` renders them.

A sandboxed Jinja environment with the same switches (trim_blocks, lstrip_blocks, loop controls)
and helpers (raise_exception, strftime_now, tojson) as Hugging Face, so the ids the gateway builds
match what the model was trained on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or could not render."""


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts HF's ``{% generation %}...{% endgeneration %}`` marker and renders its body."""

    tags = {"generation"}  # noqa: RUF012 (a Jinja extension attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled template; ``render`` returns the prompt text."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        env = _environment()
        try:
            self._template = env.from_string(source)
            # the names it reads that its caller may give (messages, tools, a request's kwargs)
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e}") from e
        self._special_tokens = dict(special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        continue_final_message: bool = False,
        *,
        variables: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """``continue_final_message``: the text ends inside the final message, so that the
        model goes on with it (an assistant turn the client began: "prefill"). ``variables``:
        the template's own (a request's chat_template_kwargs, any names, ``tools`` among them
        overriding ``tools``), with ``kwargs`` on top."""
        given = {**(variables or {}), **kwargs}
        tools = given.pop("tools", tools)
        final = _final_text(messages[-1]) if continue_final_message else None
        rendered = self._render(messages, add_generation_prompt, tools, given)
        return rendered if final is None else open_final_message(rendered, final)

    def _render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool,
        tools: list[Any] | None, kwargs: dict[str, Any],
    ) -> str:  # fmt: skip
        variables = {**self._special_tokens, **kwargs}
        try:
            return self._template.render({
                **variables,
                "messages": messages,
                "tools": tools,
                "documents": None,
                "add_generation_prompt": add_generation_prompt,
            })  # fmt: skip
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e


def _final_text(message: Mapping[str, Any]) -> str:
    """The text of the final message that a continuation extends: its content, or the last
    of its text parts."""
    content = message.get("content")
    if isinstance(content, list):
        texts = [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError(
            "continue_final_message needs a final message with text to continue"
        )
    return content


def open_final_message(rendered: str, text: str) -> str:
    """``rendered`` cut right after the final message's ``text``, dropping what the template
    closes the turn with (an end-of-turn token, a newline, a generation prompt). The text is
    looked for from the end; its trailing whitespace is kept where the template kept it (the
    prompt then ends as transformers' ``continue_final_message`` ends it)."""
    core = text.strip()
    at = rendered.rfind(core)
    if at < 0:
        raise ChatTemplateError(
            "the chat template does not keep the final message's text as it is, so it cannot "
            "be continued"
        )
    kept = text.lstrip()
    return rendered[: at + (len(kept) if rendered.startswith(kept, at) else len(core))]


def pick_template(value: Any) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string or a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None
