"""The request forms that ask for structured output, read into one ``StructuredOutput``.

OpenAI's ``response_format`` (json_object, json_schema), vLLM's ``structured_outputs`` object
(json, regex, choice, grammar, json_object) and its older ``guided_*`` fields. A request may ask
in one way only. The shape of each value is checked here, and a schema's keywords that the
grammar engine would drop unread are refused (``schema_support``); whether a schema, regex or
grammar compiles is the workers' to say (they hold the tokenizer and the grammar library), and
their INVALID_ARGUMENT comes back as a 400 with the library's message.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

from gateway.core.errors import invalid
from gateway.flows.fields import Fields, check_keys
from gateway.flows.schema_support import check_regex, check_schema
from protos.sampling_params import StructuredOutput

MAX_SPEC_CHARS = 1 << 20
BACKENDS = (None, "", "auto", "xgrammar")
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_SO_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what OpenAI takes as a json_schema name
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema given as an object (or as JSON text of one), as compact JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise invalid(f"{param} is not valid JSON: {e}", param) from e
    if not isinstance(value, dict | bool):
        raise invalid(f"{param} must be a JSON schema (an object)", param)
    check_schema(value, param)
    return json.dumps(value, ensure_ascii=False)


def _spec(kind: str, value: Any, param: str) -> str:
    if kind == "json":
        spec = _schema_text(value, param)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid(f"{param} must be a non-empty list of strings", param)
        if any(c == "" for c in value):
            raise invalid(f"{param} must not contain empty strings", param)
        spec = json.dumps(value, ensure_ascii=False)
    else:
        if not isinstance(value, str) or not value:
            raise invalid(f"{param} must be a non-empty string", param)
        spec = value
        if kind == "regex":
            check_regex(spec, param, param)
    if len(spec) > MAX_SPEC_CHARS:
        raise invalid(f"{param} must be at most {MAX_SPEC_CHARS} characters", param)
    return spec


def _response_format(f: Fields) -> StructuredOutput | None:
    fmt = f.get_dict("response_format")
    check_keys(fmt, ("type", "json_schema"), "response_format", "response_format")
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise invalid(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format",
        )
    body = fmt.get("json_schema")
    if not isinstance(body, dict):
        raise invalid(
            "response_format json_schema needs a json_schema object: "
            '{"name": ..., "schema": {...}}',
            "response_format",
        )
    check_keys(body, ("name", "description", "schema", "strict"), "response_format.json_schema",
               "response_format.json_schema")  # fmt: skip
    name = body.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise invalid(  # as OpenAI: the name is required
            "response_format json_schema needs a name: 1 to 64 letters, digits, '_' or '-' "
            f"(got {name!r})",
            "response_format.json_schema.name",
        )
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(
            f"response_format.json_schema.strict must be a boolean, got {strict!r}",
            "response_format.json_schema.strict",
        )
    if body.get("schema") is None:  # OpenAI: the schema is optional; then any JSON object
        return StructuredOutput("json_object")
    return StructuredOutput("json", _schema_text(body["schema"], "response_format.json_schema"))


def _structured_outputs(f: Fields) -> StructuredOutput | None:
    so = f.get_dict("structured_outputs")
    if not so:
        return None
    unknown = sorted(set(so) - set(_SO_KINDS) - set(_SO_OPTIONS))
    if unknown:
        raise invalid(
            f"structured_outputs.{unknown[0]} is not supported; it takes one of "
            f"{', '.join(_SO_KINDS)} and the options {', '.join(_SO_OPTIONS)}",
            "structured_outputs",
        )
    kinds = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise invalid(
            f"structured_outputs must hold exactly one of {', '.join(_SO_KINDS)}, "
            f"got {kinds or 'none'}",
            "structured_outputs",
        )
    for option in _SO_OPTIONS:
        if not isinstance(so.get(option, False), bool):
            raise invalid(f"structured_outputs.{option} must be true or false", option)
    kind = kinds[0]
    # compact JSON is the default; an explicit false asks for free whitespace
    free = so.get("disable_any_whitespace") is False
    if kind == "json_object":
        return StructuredOutput("json_object", any_whitespace=free)
    spec = _spec(kind, so[kind], f"structured_outputs.{kind}")
    if kind == "json" and so.get("disable_additional_properties"):
        spec = json.dumps(_closed(json.loads(spec)), ensure_ascii=False)
    return StructuredOutput(kind, spec, any_whitespace=free)


def _closed(node: Any) -> Any:
    """disable_additional_properties: every object of the schema takes only its properties."""
    if isinstance(node, list):
        return [_closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {
        # maps of names to schemas: the names are not schema keywords
        k: {name: _closed(s) for name, s in v.items()} if k in _SCHEMA_MAPS and isinstance(v, dict)
        else _closed(v)
        for k, v in node.items()
    }  # fmt: skip
    if "properties" in node or node.get("type") == "object":
        out["additionalProperties"] = False
    return out


def _guided(f: Fields) -> StructuredOutput | None:
    backend = f.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise invalid(
            f"guided_decoding_backend {backend!r} is not available: this server uses xgrammar",
            "guided_decoding_backend",
        )
    # an empty guided_choice, guided_regex or guided_grammar asks for a constraint it does not
    # give: a 400 (as structured_outputs' empty ones), never free output
    given = [(name, kind) for name, kind in _GUIDED.items() if f.get(name) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise invalid(f"give one of {', '.join(_GUIDED)}, not {given[0][0]} and {given[1][0]}",
                      given[1][0])  # fmt: skip
    name, kind = given[0]
    return StructuredOutput(kind, _spec(kind, f.get(name), name), source=name)


def parse_structured(f: Fields) -> StructuredOutput | None:
    """The request's constraint, or None; a 400 for a malformed one or for two at once."""
    found = [
        (name, so)
        for name, so in (
            ("response_format", _response_format(f)),
            ("structured_outputs", _structured_outputs(f)),
            ("guided_*", _guided(f)),
        )
        if so is not None
    ]
    if len(found) > 1:
        raise invalid(
            f"ask for structured output one way: {found[0][0]} and {found[1][0]} were both given",
            found[1][0],
        )
    if not found:
        return None
    name, so = found[0]
    return so if so.source else replace(so, source=name)  # _guided names its own field
