"""The JSON-schema keywords the workers' grammar engine (xgrammar) would drop unread, refused.

xgrammar compiles a schema it cannot fully enforce without a word: ``uniqueItems``, ``not``,
``if``/``then``/``else``, a remote ``$ref`` or one to a ``#name`` anchor, the lengths beside a
``pattern``, the constraints beside an ``anyOf``, a lookahead or a mid-string anchor in a
``pattern`` are left out of the grammar, and a ``required`` name that ``properties`` does not
define can never appear in the object it closes to its properties, so the output can
break the schema the client relies on. A request whose schema holds one is a 400 that names the
keyword and where it is (as vLLM refuses a schema xgrammar cannot enforce), never a silently
looser grammar. What is read here was checked against xgrammar 0.2.9
(tests/gateway/flows/test_schema_support.py keeps the list honest against the installed one).

``oneOf`` is compiled as ``anyOf``: exact for disjoint branches (pydantic's discriminated unions),
so it is taken.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.core.errors import invalid

# constrain nothing: allowed anywhere, also beside a $ref, anyOf or oneOf
ANNOTATIONS = frozenset({
    "$schema", "$id", "$anchor", "$comment", "$defs", "definitions", "title", "description",
    "default", "examples", "deprecated", "readOnly", "writeOnly", "discriminator",
    "contentEncoding", "contentMediaType", "contentSchema",
})  # fmt: skip
# xgrammar drops the type beside a branch list; harmless where every branch has it, and
# gateway.flows.tools holds a function's branches to objects itself
_BESIDE_BRANCHES = ANNOTATIONS | {"type"}

_IGNORED = {
    "uniqueItems": "unique array items",
    "contains": "an array that contains a match",
    "minContains": "a count of contained matches",
    "maxContains": "a count of contained matches",
    "not": "negation",
    "if": "conditional schemas",
    "then": "conditional schemas",
    "else": "conditional schemas",
    "dependentRequired": "dependent properties",
    "dependentSchemas": "dependent schemas",
    "dependencies": "dependent properties",
    "$dynamicRef": "dynamic references",
    "$recursiveRef": "recursive references",
}
# the formats xgrammar generates; any other is read as a plain string, which JSON Schema allows
# (a format is an annotation unless a validator opts in; pydantic's binary, path, password)
FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})  # fmt: skip
# read only where the schema names its type (xgrammar drops them from an untyped schema)
_TYPED = {
    "minLength": "string", "maxLength": "string", "pattern": "string", "format": "string",
    "minimum": "number", "maximum": "number", "exclusiveMinimum": "number",
    "exclusiveMaximum": "number", "multipleOf": "number", "minItems": "array",
    "maxItems": "array", "minProperties": "object", "maxProperties": "object",
}  # fmt: skip
_ONE_SCHEMA = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items",
               "unevaluatedItems", "additionalItems")  # fmt: skip
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def check_schema(schema: Any, param: str) -> None:
    """A 400 naming ``param`` and the first keyword of ``schema`` the grammar would drop."""
    _check(schema, "#", param, 0)


def _refuse(where: str, keyword: str, why: str, param: str) -> None:
    raise invalid(
        f"{param}: {keyword!r} at {where} is not supported: {why}, which the grammar engine "
        "(xgrammar) cannot enforce; remove it (and check it after the call if it matters)",
        param,
    )


def _check(node: Any, where: str, param: str, depth: int) -> None:
    if not isinstance(node, dict) or depth > 256:  # a bool schema, or nesting xgrammar refuses
        return
    for keyword, why in _IGNORED.items():
        if keyword in node and not (keyword == "uniqueItems" and node[keyword] is False):
            _refuse(where, keyword, why, param)
    _check_here(node, where, param)
    for key in _ONE_SCHEMA:
        _check(node.get(key), f"{where}/{key}", param, depth + 1)
    for key in _SCHEMA_LISTS:
        items = node.get(key)
        for i, item in enumerate(items if isinstance(items, list) else []):
            _check(item, f"{where}/{key}/{i}", param, depth + 1)
    for key in _SCHEMA_MAPS:
        entries = node.get(key)
        for name, item in entries.items() if isinstance(entries, dict) else ():
            _check(item, f"{where}/{key}/{name}", param, depth + 1)


def _types(node: dict[str, Any]) -> set[str]:
    kind = node.get("type")
    return set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()


# the Python values json.loads gives for each JSON Schema type ("integer" also a whole float)
_PY_TYPES: dict[str, tuple[type, ...]] = {
    "null": (type(None),), "boolean": (bool,), "number": (int, float), "integer": (int,),
    "string": (str,), "array": (list,), "object": (dict,),
}  # fmt: skip


def _is(value: Any, kind: str) -> bool:
    """Whether ``value`` is of JSON Schema type ``kind`` (an unknown kind: yes)."""
    if isinstance(value, bool) and kind != "boolean":  # bool is an int in Python, not in JSON
        return kind not in _PY_TYPES
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _PY_TYPES.get(kind, object))


def _check_here(node: dict[str, Any], where: str, param: str) -> None:
    """The keywords of this one schema that xgrammar reads only in some company."""
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
        _refuse(where, "$ref", "a reference other than a JSON pointer into this schema (only "
                "'#' and '#/...' ones are read: not remote ones, nor '#name' anchors)",
                param)  # fmt: skip
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list):
        defined = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if name not in defined]
        if missing:
            _refuse(where, "required", f"a required property that properties does not define "
                    f"({missing[0]!r}: the grammar closes the object to its properties); "
                    "define it in properties", param)  # fmt: skip
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"], f"{param}: 'pattern' at {where}", param)
    patterns = node.get("patternProperties")
    for key in patterns if isinstance(patterns, dict) else ():
        check_regex(key, f"{param}: a 'patternProperties' key at {where}", param)
    for key, why in (("$ref", "constraints beside a reference"),
                     ("anyOf", "constraints beside a list of branches"),
                     ("oneOf", "constraints beside a list of branches")):  # fmt: skip
        beside = sorted(k for k in node if k not in _BESIDE_BRANCHES | {key}
                        and not k.startswith("x-"))  # fmt: skip
        if key in node and beside:
            _refuse(where, beside[0], f"{why} ({key}); move it into the schema(s) named", param)
    all_of = node.get("allOf")
    if isinstance(all_of, list) and (len(all_of) > 1 or set(node) - ANNOTATIONS - {"allOf"}):
        _refuse(where, "allOf", "an intersection of schemas (one allOf entry alone is read)",
                param)  # fmt: skip
    if "type" not in node:
        for keyword, kind in _TYPED.items():
            if keyword in node:
                _refuse(where, keyword, f"a {kind} constraint on a schema that names no type "
                        f"(give it 'type': {kind!r})", param)  # fmt: skip
    generative = "pattern" in node or node.get("format") in FORMATS
    if generative and ("minLength" in node or "maxLength" in node):
        _refuse(where, "minLength" if "minLength" in node else "maxLength",
                "a length beside a pattern or format (put the length into the pattern)",
                param)  # fmt: skip
    declared = _types(node)
    values = [node["const"]] if "const" in node else node.get("enum")
    for value in values if declared and isinstance(values, list) else ():
        if not any(_is(value, kind) for kind in declared):
            keyword = "const" if "const" in node else "enum"
            _refuse(where, keyword, f"a value ({json.dumps(value)}) that is not of the schema's "
                    f"type ({', '.join(sorted(declared))}): the output would break the type; "
                    "make them agree", param)  # fmt: skip
    step = node.get("multipleOf")
    whole = isinstance(step, int | float) and float(step).is_integer()
    if step is not None and not ("integer" in declared and "number" not in declared and whole):
        _refuse(where, "multipleOf", "a step on numbers that are not integers (the grammar "
                "steps integers only)", param)  # fmt: skip


_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def check_regex(pattern: str, what: str, param: str) -> None:
    """A 400 for a regex construct the grammar engine would drop (xgrammar only warns in a
    schema's ``pattern``): a lookahead or lookbehind, a backreference, an anchor (``^``, ``$``)
    between characters. Escapes and character classes are skipped over."""
    i, n, in_class = 0, len(pattern), False
    while i < n:
        c = pattern[i]
        if c == "\\":
            if not in_class and i + 1 < n and pattern[i + 1] in "123456789":
                _refuse_regex(what, f"the backreference {pattern[i : i + 2]!r}", param)
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 2 if pattern[i + 1 : i + 2] == "^" else 1  # a leading ^ negates
            if pattern[i : i + 1] == "]":  # a ] first is a literal
                i += 1
            continue
        elif pattern.startswith(_LOOKAROUND, i):
            _refuse_regex(what, "a lookahead or lookbehind", param)
        elif pattern.startswith("(?P=", i):
            _refuse_regex(what, "a backreference", param)
        elif (c == "^" and pattern[i - 1 : i] not in ("", "(", "|", "^")) or (
            c == "$" and pattern[i + 1 : i + 2] not in ("", ")", "|", "$")
        ):
            # one at either end of the whole or of an alternative is what a whole match
            # does anyway; one between characters could never match (xgrammar drops it)
            _refuse_regex(what, f"an anchor {c!r} between characters (only at the start or "
                          "end of the pattern or of an alternative)", param)  # fmt: skip
        i += 1


def _refuse_regex(what: str, construct: str, param: str) -> None:
    raise invalid(
        f"{what} holds {construct}, which the grammar engine (xgrammar) cannot enforce; "
        "rewrite the pattern without it",
        param,
    )
