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
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e}") from e
        self._special_tokens = dict(special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Any] | None = None,
        **kwargs: Any,
    ) -> str:
        variables = {**self._special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e


def pick_template(value: Any) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string or a list of named templates."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None
