"""tools and tool_choice: what is accepted, and the grammar a forced choice becomes (its schema
accepts exactly the calls the tools allow)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from gateway.core.errors import APIError
from gateway.flows.fields import Fields
from gateway.flows.tools import ToolPlan, parse_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "ping"}}


def _plan(**body: Any) -> ToolPlan | None:
    return parse_tools(Fields(body))


def _schema(plan: ToolPlan | None) -> dict[str, Any]:
    assert plan is not None
    so = plan.constraint()
    assert so is not None and so.kind == "json"
    schema: dict[str, Any] = json.loads(so.spec)
    return schema


def test_defaults_follow_openai() -> None:
    assert _plan() is None and _plan(tools=[]) is None
    assert _plan(tool_choice="none") is None and _plan(tools=[], tool_choice="none") is None
    plan = _plan(tools=[WEATHER])
    assert plan is not None and plan.choice == "auto" and plan.constraint() is None
    assert _plan(tools=[WEATHER], tool_choice="none").choice == "none"  # type: ignore[union-attr]


def test_a_named_choice_constrains_to_that_functions_arguments() -> None:
    schema = _schema(_plan(tools=[WEATHER, NOARGS], tool_choice={"type": "function",
                                                                  "function": {"name": "get_weather"}}))  # fmt: skip
    jsonschema.validate({"city": "Oslo"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({}, schema)
    # a function declared without parameters takes the empty object (OpenAI: "an empty
    # parameter list"), not any object
    noargs = _schema(_plan(tools=[NOARGS], tool_choice={"type": "function", "function": {"name": "ping"}}))  # fmt: skip
    jsonschema.validate({}, noargs)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "ping"}, noargs)


def test_parameters_that_name_no_type_still_take_an_object() -> None:
    """``parameters: {}`` allows any JSON value as a schema; OpenAI's arguments are an object,
    so the grammar holds a forced call to one (the rest of the schema kept)."""
    anything = {"type": "function", "function": {"name": "f", "parameters": {}}}
    nullable = {"type": "function", "function": {"name": "h", "parameters": {"type": ["object", "null"]}}}  # fmt: skip
    schema = _schema(_plan(tools=[nullable], tool_choice={"type": "function", "function": {"name": "h"}}))  # fmt: skip
    jsonschema.validate({}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(None, schema)
    sized = {"type": "function", "function": {"name": "g", "parameters": {"minProperties": 1}}}
    named = _schema(_plan(tools=[anything], tool_choice={"type": "function", "function": {"name": "f"}}))  # fmt: skip
    jsonschema.validate({"x": [1]}, named)
    required = _schema(_plan(tools=[anything, sized], tool_choice="required"))
    jsonschema.validate([{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"a": 1}}], required)  # fmt: skip
    for schema, bad in ((named, None), (named, 5), (named, "{}"), (named, [1]),
                        (required, [{"name": "f", "arguments": None}]),
                        (required, [{"name": "g", "arguments": {}}])):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_top_level_branches_are_held_to_objects_too() -> None:
    """A grammar backend reads a top-level anyOf's branches and not the type beside them
    (xgrammar: {"type": "object", "anyOf": [{}]} accepts 5): each branch gets the type too, and
    one of another type is a 400 that names it."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    either = {"anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": either}}
    schema = _schema(_plan(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}))  # fmt: skip
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
    assert accepts(grammar, '{"a": 1}') and accepts(grammar, "{}")
    assert not any(accepts(grammar, bad) for bad in ("5", '"x"', "null", "[1]"))
    bad = {"type": "function", "function": {"name": "f", "parameters": {"oneOf": [{}, {"type": "string"}]}}}  # fmt: skip
    with pytest.raises(APIError, match=r"parameters.oneOf\[1\] must describe an object"):
        _plan(tools=[bad])


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"anyOf": [schema]}
    return schema


def _chain(hops: int) -> dict[str, Any]:
    defs = {f"D{i}": {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"}]} for i in range(hops)}
    return {"$ref": "#/$defs/D0", "$defs": {**defs, f"D{hops}": {"type": "object"}}}


def test_a_top_level_reference_is_held_to_objects_too() -> None:
    """A grammar backend follows a top-level $ref and drops the type beside it (xgrammar:
    {"type": "object", "$ref": "#/$defs/A", "$defs": {"A": {}}} accepts 5): the named schema
    is inlined and held to objects, named and required calls alike."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string as accepts

    args = {"properties": {"a": {"$ref": "#/definitions/Int"}}, "required": ["a"]}
    cases = (
        {"type": "object", "$ref": "#/$defs/Any", "$defs": {"Any": {}}},
        {"$ref": "#/$defs/Args", "$defs": {"Args": args}, "definitions": {"Int": {"type": "integer"}}},
        {"anyOf": [{"$ref": "#/$defs/Args"}], "$defs": {"Args": args}, "definitions": {"Int": {"type": "integer"}}},
        {"$ref": "#/$defs/Next", "$defs": {"Next": {"$ref": "#/$defs/Any"}, "Any": {}}},  # a chain
    )  # fmt: skip
    for i, parameters in enumerate(cases):
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        named = _schema(_plan(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}))  # fmt: skip
        required = _schema(_plan(tools=[tool], tool_choice="required"))
        args_text = '{"a": 1}' if i in (1, 2) else "{}"  # xgrammar: no properties, no keys
        for schema, good, bads in (
            (named, args_text, ("5", '"x"', "null", "[1]")),
            (required, f'[{{"name": "f", "arguments": {args_text}}}]', ('[{"name": "f", "arguments": 5}]',)),
        ):  # fmt: skip
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
            assert accepts(grammar, good), (i, schema)
            assert not any(accepts(grammar, bad) for bad in bads), (i, schema)
        if i in (1, 2):  # the named schema's constraints hold: "a" is required, an integer
            grammar = xgr.Grammar.from_json_schema(json.dumps(named))
            assert not accepts(grammar, "{}") and not accepts(grammar, '{"a": "x"}')


def test_annotations_beside_a_reference_and_percent_encoded_pointers_are_accepted() -> None:
    defs = {"a b": {"properties": {"x": {"type": "integer"}}}}
    for parameters in (
        {"$ref": "#/$defs/a%20b", "$defs": defs, "default": {}, "examples": [{}], "x-note": 1},
        {"$ref": "#/%24defs/a%20b", "$defs": defs, "deprecated": False},
    ):
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        schema = _schema(_plan(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}))  # fmt: skip
        assert schema["properties"] == defs["a b"]["properties"] and schema["type"] == "object"


def test_branches_that_share_references_are_held_once_not_per_path() -> None:
    """Two branches at each of 30 levels, both pointing at the next level's definition: held
    per path, that is 2^30 copies (a 1 KB request stalling the gateway); held once per
    reference, 30 definitions."""
    levels = 30
    defs = {f"D{i}": {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"}] * 2} for i in range(levels)}
    defs[f"D{levels}"] = {"properties": {"a": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/D0", "$defs": defs}}}  # fmt: skip
    schema = _schema(_plan(tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}}))  # fmt: skip
    assert len(json.dumps(schema)) < 20_000
    held = {k: v for k, v in schema["$defs"].items() if k.startswith("tandem_object_")}
    assert len(held) == levels  # one per definition, each branch a reference to one of them
    assert all(b["$ref"].removeprefix("#/$defs/") in held for b in schema["anyOf"])
    assert held["tandem_object_28"]["anyOf"] == [{"$ref": "#/$defs/tandem_object_29"}] * 2
    jsonschema.validate({"a": 1}, schema)  # (a value it refuses would try all 2^30 paths)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"$ref": "#/$defs/S", "$defs": {"S": {"type": "string"}}},
         r"parameters must describe an object \(type 'object'\), got type 'string'"),
        ({"type": "string", "$ref": "#/$defs/O", "$defs": {"O": {"type": "object"}}},
         "got type 'string'"),
        ({"oneOf": [{"$ref": "#/$defs/S"}], "$defs": {"S": {"type": "array"}}},
         r"parameters.oneOf\[0\] must describe an object"),
        ({"$ref": "https://example.com/schema.json"}, "must be a local reference"),
        ({"$ref": "#/$defs/Nope", "$defs": {}}, "names no schema"),
        ({"$ref": "#"}, "loops back"),
        ({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}, "loops back"),
        ({"anyOf": [{"$ref": "#"}]}, "loops back"),
        ({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}},
         "loops back"),
        # a pointer's array index is ASCII digits (int() would take "²" and fail: a 500)
        ({"$ref": "#/$defs/A/anyOf/\u00b2", "$defs": {"A": {"anyOf": [{}]}}}, "names no schema"),
        # deep nesting and long chains stop at a bound (a RecursionError would be a 500)
        (_nested(200), "nests anyOf/oneOf more than"),
        (_chain(200), "follows more than"),
        ({"$ref": "#/$defs/A", "$defs": {"A": {}}, "required": ["x"]},
         r"keywords beside \$ref \(required\)"),
    ],
)  # fmt: skip
def test_a_top_level_reference_that_cannot_be_held_is_a_400(
    parameters: dict[str, Any], message: str
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(APIError, match=message):
        _plan(tools=[tool])


def test_required_is_a_non_empty_array_of_calls_to_the_offered_functions() -> None:
    schema = _schema(_plan(tools=[WEATHER, NOARGS], tool_choice="required"))
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Rome"}},
                         {"name": "ping", "arguments": {}}], schema)  # fmt: skip
    for bad in (
        [],
        [{"name": "nope", "arguments": {}}],
        [{"name": "get_weather", "arguments": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = _schema(_plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False))
    assert single["maxItems"] == 1


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": "x"}, "tools", "tools must be a list"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools", "must be a function tool"),
        ({"tools": [{"type": "function"}]}, "tools", "function must be an object"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "1 to 64"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
         "tools", "parameters must be a JSON schema object"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools", "parameters must describe an object (type 'object'), got type 'string'"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": 5}}]},
         "tools", "tools[0].function.description must be a string"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools' are specified"),
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when 'tools' are specified"),
        ({"tool_choice": "auto", "tools": []}, "tool_choice", "only allowed when 'tools'"),
        ({"tool_choice": "required", "tools": []}, "tool_choice", "only allowed when 'tools'"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
         "only allowed when 'tools' are specified"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "got 'always'"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "tools offer: get_weather"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    ],
)  # fmt: skip
def test_malformed_tools_are_400s_that_say_what_to_fix(
    body: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(APIError) as err:
        _plan(**body)
    assert err.value.status == 400 and err.value.param == param
    assert words in err.value.message


def test_required_keeps_each_functions_definitions_reachable() -> None:
    """A pydantic-style schema refers to its $defs from the root: nested in the array, the
    definitions move to the array's root under names of their own."""
    city = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    trip = {
        "type": "function",
        "function": {"name": "plan", "parameters": {
            "type": "object", "properties": {"to": {"$ref": "#/$defs/City"}}, "required": ["to"],
            "$defs": {"City": city},
        }},
    }  # fmt: skip
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"c": {"$ref": "#/definitions/City"}},
        "definitions": {"City": {"type": "integer"}},
    }}}  # fmt: skip
    schema = _schema(_plan(tools=[trip, other], tool_choice="required"))
    assert set(schema["$defs"]) == {"f0_City", "f1_City"}
    jsonschema.validate([{"name": "plan", "arguments": {"to": {"name": "Oslo"}}},
                         {"name": "other", "arguments": {"c": 3}}], schema)  # fmt: skip
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "plan", "arguments": {"to": {}}}], schema)
