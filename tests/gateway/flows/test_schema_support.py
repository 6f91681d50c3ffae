"""Schema keywords the grammar engine would drop are a 400 naming them; what pydantic and the
official client's strict schemas hold passes; and each refusal is still needed (the installed
xgrammar lets through a value the schema forbids)."""

from __future__ import annotations

import datetime
import enum
import json
import uuid
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

from gateway.core.errors import APIError
from gateway.flows.fields import Fields
from gateway.flows.schema_support import check_regex, check_schema
from gateway.flows.structured import parse_structured
from gateway.flows.tools import parse_tools


class Unit(enum.StrEnum):
    c = "c"
    f = "f"


class Place(BaseModel):
    city: str = Field(max_length=20, description="the city")
    code: str | None = Field(pattern="^[A-Z]{2}$")


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=0, le=9, multiple_of=1)


class Dog(BaseModel):
    kind: Literal["dog"]
    barks: bool


class Report(BaseModel):
    place: Place
    other: Place | None
    unit: Unit
    days: list[Annotated[int, Field(ge=1)]] = Field(min_length=1, max_length=7)
    pet: Annotated[Cat | Dog, Field(discriminator="kind")]
    when: datetime.datetime
    id: uuid.UUID
    blob: bytes
    score: float = Field(gt=0, le=1)


class Tree(BaseModel):
    value: int
    children: list[Tree]


def _strict(model: type[BaseModel]) -> dict[str, Any]:
    """The schema the official client sends for ``parse(response_format=model)``."""
    from openai.lib._pydantic import to_strict_json_schema

    return to_strict_json_schema(model)


@pytest.mark.parametrize("model", [Report, Tree, Place, Cat])
def test_what_pydantic_and_the_client_emit_passes(model: type[BaseModel]) -> None:
    check_schema(model.model_json_schema(), "p")
    check_schema(_strict(model), "p")


# (schema, the keyword named, where, a value the schema forbids that xgrammar would let through)
DROPPED = [
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
      "uniqueItems": True}}}, "uniqueItems", "#/properties/tags", '{"tags": ["a", "a"]}'),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "contains", "#",
     "[1]"),
    ({"not": {"type": "string"}}, "not", "#", '"a"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, "if", "#",
     '{"a": 1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired", "#", '{"a": 1}'),
    ({"$ref": "https://example.com/schema.json"}, "$ref", "#", '"anything"'),
    ({"$defs": {"S": {"type": "string"}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/S", "maxLength": 2}}}, "maxLength", "#/properties/a",
     '{"a": "long"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "properties", "#", '{"c": 1}'),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf", "#", "1"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "maxLength", "#", '"aaaa"'),
    ({"type": "string", "format": "email", "maxLength": 5}, "maxLength", "#", '"aaaa@b.co"'),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "#", "1.3"),
    ({"type": "number", "multipleOf": 5}, "multipleOf", "#", "7"),
    ({"type": "object", "properties": {"n": {"maxLength": 2}}}, "maxLength", "#/properties/n",
     '{"n": "long"}'),
    ({"$defs": {"A": {"minimum": 3}}, "$ref": "#/$defs/A"}, "minimum", "#/$defs/A", "1"),
    # an anchor reference: xgrammar reads only JSON pointers, and makes this one any value
    ({"$defs": {"x": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, "$ref", "#",
     '"anything"'),
    # required names the grammar's closed object could never hold
    ({"type": "object", "required": ["name"]}, "required", "#", "{}"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]},
     "required", "#", '{"a": 1}'),
    # values of another type than the schema's: the output would break its type
    ({"type": "integer", "const": "x"}, "const", "#", '"x"'),
    ({"type": "string", "enum": ["a", 1]}, "enum", "#", "1"),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "keyword", "where", "_forbidden"), DROPPED)
def test_a_keyword_the_grammar_drops_is_a_400_naming_it(
    schema: dict[str, Any], keyword: str, where: str, _forbidden: str
) -> None:
    with pytest.raises(APIError) as e:
        check_schema(schema, "response_format.json_schema")
    assert e.value.status == 400 and e.value.param == "response_format.json_schema"
    assert f"'{keyword}' at {where} is not supported" in e.value.message


@pytest.mark.parametrize(("schema", "keyword", "where", "forbidden"), DROPPED)
def test_each_refusal_is_still_needed(
    schema: dict[str, Any], keyword: str, where: str, forbidden: str
) -> None:
    """The installed xgrammar compiles the schema and accepts a value it forbids: were it to
    enforce the keyword one day, this fails and the refusal can go."""
    xgr = pytest.importorskip("xgrammar")
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
    assert xgr.testing._is_grammar_accept_string(grammar, forbidden)


@pytest.mark.parametrize(
    ("schema", "forbidden"),
    [
        ({"type": "integer", "multipleOf": 5}, "7"),
        ({"type": "string", "maxLength": 2}, '"long"'),
        ({"type": "string", "format": "email"}, '"nope"'),
        ({"type": ["string", "null"], "maxLength": 2}, '"long"'),
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1, 2]"),
        ({"type": "object", "patternProperties": {"^x": {"type": "integer"}},
          "additionalProperties": False}, '{"y": 1}'),
        ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
        ({"allOf": [{"type": "integer", "minimum": 3}]}, "1"),
        ({"$defs": {"S": {"type": "string", "maxLength": 2}}, "$ref": "#/$defs/S",
          "description": "annotations beside a reference are fine"}, '"long"'),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, '["a"]'),
    ],
)  # fmt: skip
def test_what_the_grammar_enforces_passes(schema: dict[str, Any], forbidden: str) -> None:
    check_schema(schema, "p")
    xgr = pytest.importorskip("xgrammar")
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
    assert not xgr.testing._is_grammar_accept_string(grammar, forbidden)


def test_every_structured_output_form_names_its_field() -> None:
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    bodies = {
        "response_format.json_schema": {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": schema},
            }
        },
        "structured_outputs.json": {"structured_outputs": {"json": json.dumps(schema)}},
        "guided_json": {"guided_json": schema},
    }
    for param, body in bodies.items():
        with pytest.raises(APIError) as e:
            parse_structured(Fields(body))
        assert e.value.param == param and "'uniqueItems' at #" in e.value.message


def test_enforced_tool_parameters_are_checked_and_free_ones_are_not() -> None:
    loose = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    tools = [
        {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "loose", "parameters": loose}},
    ]
    for choice in ("required", {"type": "function", "function": {"name": "loose"}}):
        with pytest.raises(APIError) as e:
            parse_tools(Fields({"tools": tools, "tool_choice": choice}))
        assert e.value.param == "tools[1].function.parameters"
        assert "'uniqueItems' at #/properties/t" in e.value.message
    # auto and none constrain nothing, and a named choice only its function
    for choice in ("auto", "none", {"type": "function", "function": {"name": "ok"}}):
        assert parse_tools(Fields({"tools": tools, "tool_choice": choice})) is not None


@pytest.mark.parametrize(
    ("pattern", "construct", "forbidden"),
    [
        ("^(?=a)[a-z]{3}$", "a lookahead or lookbehind", '"bcd"'),
        ("(?!x)[a-z]{2}", "a lookahead or lookbehind", '"xa"'),
        ("ab^cd", "an anchor '^' between characters", '"abcd"'),
        ("a$b", "an anchor '$' between characters", '"ab"'),
    ],
)
def test_a_pattern_construct_the_grammar_drops_is_a_400(
    pattern: str, construct: str, forbidden: str
) -> None:
    """In a schema's pattern (xgrammar only warns and drops the construct) and as a regex."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    with pytest.raises(APIError) as e:
        check_schema(schema, "response_format.json_schema")
    assert f"'pattern' at #/properties/s holds {construct}" in e.value.message
    with pytest.raises(APIError) as e:
        parse_structured(Fields({"structured_outputs": {"regex": pattern}}))
    assert f"structured_outputs.regex holds {construct}" in e.value.message
    xgr = pytest.importorskip("xgrammar")  # the refusal is still needed
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema["properties"]["s"]))
    assert xgr.testing._is_grammar_accept_string(grammar, forbidden)


@pytest.mark.parametrize(
    "pattern",
    ["^[A-Z]{2}$", "^a$|^b$", "(^a|b$)", r"\^x\$y", "[$^]+", "[^^$]a", "[]^]b", r"a\\1"],
)
def test_patterns_whose_anchors_and_escapes_a_whole_match_reads_pass(pattern: str) -> None:
    check_regex(pattern, "p", "p")
    check_schema({"type": "object", "patternProperties": {pattern: {"type": "integer"}}}, "p")


def test_values_of_the_schemas_type_pass() -> None:
    for schema in ({"type": ["string", "null"], "enum": ["a", None]}, {"type": "integer",
                   "const": 2.0}, {"type": "number", "enum": [1, 2.5]}, {"enum": [1, "a"]},
                   {"type": "boolean", "const": False}, {"type": "object", "const": {"a": 1}}):  # fmt: skip
        check_schema(schema, "p")
