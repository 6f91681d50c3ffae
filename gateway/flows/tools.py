"""Tool calling: the ``tools`` a chat request offers and the ``tool_choice`` it makes.

``required`` and a named function are enforced by a grammar, so the model's output always is a
valid call: a named choice makes the output the function's arguments (an object that matches its
``parameters`` schema); ``required`` makes it a JSON array of ``{"name", "arguments"}`` objects,
one per call, each matching its function's schema. ``auto`` leaves the model free and parses its
text with the gateway's ``--tool-call-parser`` (``gateway.flows.tool_parsers``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.core.errors import invalid
from gateway.flows.fields import Fields
from protos.sampling_params import StructuredOutput

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]  # its JSON schema (the empty object's when not given)


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[Function, ...]
    choice: str  # none | auto | required | function
    function: str | None = None  # the named function (choice "function")
    parallel: bool = True

    def constraint(self) -> StructuredOutput | None:
        """The grammar that enforces the choice (required, a named function), else None."""
        if self.choice == "function":
            schema = next(f.parameters for f in self.functions if f.name == self.function)
            return StructuredOutput("json", json.dumps(schema, ensure_ascii=False))
        if self.choice != "required":
            return None
        calls, defs = [], {}
        for i, f in enumerate(self.functions):
            # nested in the array, a function's "#/$defs/X" would point at the array's root:
            # its definitions move there, under names of their own
            parameters, own = _lift_defs(f.parameters, f"f{i}_")
            defs.update(own)
            calls.append({
                "type": "object",
                "properties": {"name": {"enum": [f.name]}, "arguments": parameters},
                "required": ["name", "arguments"],
            })  # fmt: skip
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        if defs:
            array["$defs"] = defs
        return StructuredOutput("json", json.dumps(array, ensure_ascii=False))


def _lift_defs(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``schema`` without its ``$defs``/``definitions`` and with its local refs renamed, and
    those definitions under ``prefix``ed names (their own refs renamed too)."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not defs:
        return schema, {}
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}

    def rename(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rename(v) for k, v in node.items()}
            ref = node.get("$ref")
            for root in ("#/$defs/", "#/definitions/"):
                if isinstance(ref, str) and ref.startswith(root):
                    out["$ref"] = "#/$defs/" + prefix + ref[len(root) :]
            return out
        if isinstance(node, list):
            return [rename(v) for v in node]
        return node

    return rename(body), {prefix + name: rename(d) for name, d in defs.items()}


def _function(tool: Any, i: int) -> Function:
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise invalid(f"{param} must be a function tool: {{'type': 'function', 'function': ...}}",
                      "tools")  # fmt: skip
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise invalid(f"{param}.function must be an object with a name", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(
            f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
            "tools",
        )
    params = fn.get("parameters")
    if params is None:  # the OpenAI API: "omitting parameters defines an empty parameter list"
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, dict):
        raise invalid(f"{param}.function.parameters must be a JSON schema object", "tools")
    # the arguments are an object (OpenAI's function.arguments): a schema that names no type
    # ({} allows any value) or several (["object", "null"]) is held to one, one that names
    # no object type is refused
    return Function(name, _object_schema(params, f"{param}.function.parameters"))


def _object_schema(
    schema: dict[str, Any],
    where: str,
    root: dict[str, Any] | None = None,
    trail: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """``schema`` held to objects: ``type`` set to "object" where it names none (or several,
    one of them "object"), also in each top-level ``anyOf``/``oneOf`` branch and through a
    top-level local ``$ref`` (a grammar backend reads the branches and the schema a reference
    names alone, not the type beside them); a type without "object" is a 400. ``trail``: the
    references inlined on the way here (one met again is a loop)."""
    root = schema if root is None else root
    schema, trail = _inline_ref(schema, root, where, trail)
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise invalid(
            f"{where} must describe an object (type 'object'), got type {kind!r}", "tools"
        )
    out = {**schema, "type": "object"}
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            out[key] = [
                _object_schema(b, f"{where}.{key}[{i}]", root, trail) if isinstance(b, dict) else b
                for i, b in enumerate(branches)
            ]
    return out


# keywords beside a $ref that constrain nothing (a grammar backend drops the others unread)
_REF_NEIGHBOURS = {"$ref", "$defs", "definitions", "$schema", "$id", "$comment", "title",
                   "description", "type"}  # fmt: skip


def _inline_ref(
    schema: dict[str, Any], root: dict[str, Any], where: str, trail: frozenset[str]
) -> tuple[dict[str, Any], frozenset[str]]:
    """``schema`` with a ``$ref`` of its own replaced by the schema it names in ``root``
    (``#/$defs/X``, ``#/definitions/X``, any local JSON pointer), the root's definitions kept
    for the references within (a ``type`` beside the reference must allow an object too, and
    so must the named schema's). A reference that leaves the
    document, names nothing, loops, or has constraints beside it (which the grammar would
    drop) is a 400. Returns the schema and ``trail`` with the references it followed."""
    while "$ref" in schema:
        ref = schema["$ref"]
        beside = sorted(set(schema) - _REF_NEIGHBOURS)
        if beside:
            raise invalid(
                f"{where}: keywords beside $ref ({', '.join(beside)}) are not supported; "
                "move them into the schema it names",
                "tools",
            )
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise invalid(f"{where}.$ref must be a local reference ('#/$defs/...'), got {ref!r}",
                          "tools")  # fmt: skip
        if ref in trail:
            raise invalid(f"{where}.$ref {ref!r} refers to itself", "tools")
        trail |= {ref}
        target = _pointer(root, ref[1:])
        if not isinstance(target, dict):
            raise invalid(f"{where}.$ref {ref!r} names no schema in the document", "tools")
        if "type" in schema:  # beside the reference: it must allow an object too
            _object_schema({"type": schema["type"]}, where)
        schema = {**target, **{k: schema[k] for k in ("$defs", "definitions") if k in schema}}
    return schema, trail


def _pointer(doc: Any, pointer: str) -> Any:
    """The value at a JSON pointer (RFC 6901: ``/a/0/b``, ``~1`` for '/', ``~0`` for '~') in
    ``doc``, or None where it names nothing."""
    if pointer == "":
        return doc
    if not pointer.startswith("/"):
        return None
    node = doc
    for part in pointer[1:].split("/"):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _functions(value: Any) -> tuple[Function, ...]:
    if not isinstance(value, list):
        raise invalid("tools must be a list of function tools", "tools")
    if len(value) > MAX_TOOLS:
        raise invalid(f"at most {MAX_TOOLS} tools, got {len(value)}", "tools")
    functions = tuple(_function(t, i) for i, t in enumerate(value))
    names = [f.name for f in functions]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise invalid(f"tools name the function {dup!r} twice", "tools")
    return functions


def _named(choice: dict[str, Any], functions: tuple[Function, ...]) -> str:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise invalid(
            "tool_choice must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in {f.name for f in functions}:
        known = ", ".join(f.name for f in functions) or "none"
        raise invalid(f"tool_choice names the function {name!r}, which is not in tools "
                      f"(tools offer: {known})", "tool_choice")  # fmt: skip
    return name


def parse_tools(f: Fields) -> ToolPlan | None:
    """The request's tools and choice; None when it offers no tools (or an empty list)."""
    functions = _functions(f.get("tools")) if f.get("tools") is not None else ()
    choice = f.get("tool_choice")
    parallel = f.get_bool("parallel_tool_calls", True)
    if not functions:
        if choice not in (None, "none", "auto"):  # auto with nothing to call asks for nothing
            raise invalid("tool_choice needs tools to choose from", "tool_choice")
        return None
    if isinstance(choice, dict):
        return ToolPlan(functions, "function", _named(choice, functions), parallel)
    if choice is None:
        choice = "auto"  # OpenAI's default when tools are given
    if choice not in CHOICES:
        raise invalid(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
            "tool_choice",
        )
    return ToolPlan(functions, choice, None, parallel)
