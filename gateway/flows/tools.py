"""Tool calling: the ``tools`` a chat request offers and the ``tool_choice`` it makes.

``required`` and a named function are enforced by a grammar, so the model's output always is a
valid call: a named choice makes the output the function's arguments (an object that matches its
``parameters`` schema); ``required`` makes it a JSON array of ``{"name", "arguments"}`` objects,
one per call, each matching its function's schema. ``auto`` leaves the model free and parses its
text with the gateway's ``--tool-call-parser`` (``gateway.flows.tool_parsers``); where a function
is ``strict`` (OpenAI's guarantee that its calls match its parameters), the calls that parser
reads are held to their schemas by a structural tag (``ToolPlan.strict_calls``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from gateway.core.errors import invalid
from gateway.flows.fields import Fields, check_keys
from gateway.flows.schema_support import check_schema
from protos.sampling_params import StructuredOutput

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")
# OpenAI's words for a tool_choice other than "none" with no tools (absent or an empty list)
NEEDS_TOOLS = (
    "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are specified."
)
FUNCTION_FIELDS = ("name", "description", "parameters", "strict")  # of tools[i].function


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]  # its JSON schema (the empty object's when not given)
    strict: bool = False  # its calls must match parameters (OpenAI's function.strict)


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[Function, ...]
    choice: str  # none | auto | required | function
    function: str | None = None  # the named function (choice "function")
    parallel: bool = True

    def strict_calls(self) -> list[tuple[str, dict[str, Any] | None]] | None:
        """Under "auto" with a strict function: every function's name and the schema its
        calls are held to (None: any object, a function not strict); else None."""
        if self.choice != "auto" or not any(f.strict for f in self.functions):
            return None
        return [(f.name, f.parameters if f.strict else None) for f in self.functions]

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
    check_keys(tool, ("type", "function"), param, "tools")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise invalid(f"{param}.function must be an object with a name", "tools")
    check_keys(fn, FUNCTION_FIELDS, f"{param}.function", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise invalid(
            f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
            "tools",
        )
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{param}.function.strict must be true or false", "tools")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{param}.function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is None:  # the OpenAI API: "omitting parameters defines an empty parameter list"
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, dict):
        raise invalid(f"{param}.function.parameters must be a JSON schema object", "tools")
    # the arguments are an object (OpenAI's function.arguments): a schema that names no type
    # ({} allows any value) or several (["object", "null"]) is held to one, one that names
    # no object type is refused
    return Function(name, _hold_parameters(params, f"{param}.function.parameters"), bool(strict))


# a function's parameters: references followed on one path, branches nested, and definitions
# held to objects at most (a 400 beyond: the walk runs on the gateway's event loop)
MAX_REF_PATH = 32
MAX_BRANCH_DEPTH = 32
MAX_HELD = 128
HELD_PREFIX = "tandem_object_"  # the names of the held definitions in $defs


@dataclass
class _Walk:
    """One function's parameters held to objects: the document its references point into, the
    definitions made of the branch targets held to objects, and which reference each became."""

    root: dict[str, Any]
    where: str
    held: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> schema
    names: dict[str, str] = field(default_factory=dict)  # reference -> name


def _hold_parameters(params: dict[str, Any], where: str) -> dict[str, Any]:
    """``params`` held to objects: ``type`` set to "object" where it names none (or several,
    one of them "object"), a type without "object" a 400, through what a grammar backend reads
    alone (xgrammar takes the branches of a top-level ``anyOf``/``oneOf`` and the schema a
    ``$ref`` names, not the type beside them): a top-level local ``$ref`` is inlined; a branch
    that is a reference points at a copy of its target held to objects, made once however many
    branches share it (no copy per path: shared references would grow it exponentially)."""
    walk = _Walk(params, where)
    out = _object_schema(params, where, walk, frozenset(), 0)
    if walk.held:
        out["$defs"] = {**out.get("$defs", {}), **walk.held}
    return out


def _object_schema(
    schema: dict[str, Any], where: str, walk: _Walk, trail: frozenset[str], depth: int
) -> dict[str, Any]:
    """``schema`` held to objects (``_hold_parameters``); ``trail``: the references followed on
    the way here (one met again is a loop), ``depth``: the branches nested."""
    if depth > MAX_BRANCH_DEPTH:
        raise invalid(f"{where} nests anyOf/oneOf more than {MAX_BRANCH_DEPTH} deep", "tools")
    schema, trail = _inline_ref(schema, where, walk, trail)
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
                _branch(b, f"{where}.{key}[{i}]", walk, trail, depth + 1)
                if isinstance(b, dict)
                else b
                for i, b in enumerate(branches)
            ]
    return out


def _branch(
    branch: dict[str, Any], where: str, walk: _Walk, trail: frozenset[str], depth: int
) -> dict[str, Any]:
    """A top-level branch held to objects: a reference becomes one to its target's held copy."""
    if "$ref" not in branch:
        return _object_schema(branch, where, walk, trail, depth)
    ref = _checked_ref(branch, where, trail)
    if ref not in walk.names:
        if len(walk.names) >= MAX_HELD:
            raise invalid(f"{walk.where} refers to more than {MAX_HELD} schemas", "tools")
        name = walk.names[ref] = f"{HELD_PREFIX}{len(walk.names)}"
        target = _pointer(walk.root, ref[1:])
        if not isinstance(target, dict):
            raise invalid(f"{where}.$ref {ref!r} names no schema in the document", "tools")
        walk.held[name] = _object_schema(target, where, walk, trail | {ref}, depth)
    return {"$ref": f"#/$defs/{walk.names[ref]}"}


# keywords beside a $ref that constrain nothing (a grammar backend drops the others unread)
_REF_NEIGHBOURS = {"$ref", "$defs", "definitions", "$schema", "$id", "$anchor", "$comment",
                   "title", "description", "type", "default", "examples", "deprecated",
                   "readOnly", "writeOnly"}  # fmt: skip


def _checked_ref(schema: dict[str, Any], where: str, trail: frozenset[str]) -> str:
    """``schema``'s ``$ref``, if it is local, has only annotations (and a ``type`` that allows
    an object) beside it, is no loop and leaves the path short enough; else a 400."""
    ref = schema["$ref"]
    beside = sorted(k for k in set(schema) - _REF_NEIGHBOURS if not k.startswith("x-"))
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
        raise invalid(f"{where}.$ref {ref!r} loops back to a schema that refers to it", "tools")
    if len(trail) >= MAX_REF_PATH:
        raise invalid(f"{where} follows more than {MAX_REF_PATH} references", "tools")
    if "type" in schema:  # beside the reference: it must allow an object too
        _object_schema({"type": schema["type"]}, where, _Walk({}, where), frozenset(), 0)
    return ref


def _inline_ref(
    schema: dict[str, Any], where: str, walk: _Walk, trail: frozenset[str]
) -> tuple[dict[str, Any], frozenset[str]]:
    """``schema`` with a ``$ref`` of its own replaced by the schema it names in the document
    (``#/$defs/X``, ``#/definitions/X``, any local JSON pointer), the definitions beside the
    reference kept for the references within. A reference that leaves the document, names
    nothing, loops, or has constraints beside it (which the grammar would drop) is a 400.
    Returns the schema and ``trail`` with the references it followed."""
    while "$ref" in schema:
        ref = _checked_ref(schema, where, trail)
        trail |= {ref}
        target = _pointer(walk.root, ref[1:])
        if not isinstance(target, dict):
            raise invalid(f"{where}.$ref {ref!r} names no schema in the document", "tools")
        schema = {**target, **{k: schema[k] for k in ("$defs", "definitions") if k in schema}}
    return schema, trail


_INDEX = re.compile(r"^(0|[1-9][0-9]*)$")


def _pointer(doc: Any, pointer: str) -> Any:
    """The value at a URI-fragment JSON pointer (RFC 6901: ``/a/0/b``, percent-decoded, then
    ``~1`` for '/', ``~0`` for '~') in ``doc``, or None where it names nothing."""
    pointer = unquote(pointer)
    if pointer == "":
        return doc
    if not pointer.startswith("/"):
        return None
    node = doc
    for part in pointer[1:].split("/"):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and _INDEX.match(key) and int(key) < len(node):
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
    check_keys(choice, ("type", "function"), "tool_choice", "tool_choice")
    fn = choice.get("function")
    if isinstance(fn, dict):
        check_keys(fn, ("name",), "tool_choice.function", "tool_choice")
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
        if choice not in (None, "none"):  # OpenAI's and vLLM's 400, auto included
            raise invalid(NEEDS_TOOLS, "tool_choice")
        return None
    if isinstance(choice, dict):
        plan = ToolPlan(functions, "function", _named(choice, functions), parallel)
    else:
        if choice is None:
            choice = "auto"  # OpenAI's default when tools are given
        if choice not in CHOICES:
            raise invalid(
                "tool_choice must be 'none', 'auto', 'required' or a named function, "
                f"got {choice!r}",
                "tool_choice",
            )
        plan = ToolPlan(functions, choice, None, parallel)
    _check_enforced(plan)
    return plan


def _check_enforced(plan: ToolPlan) -> None:
    """The parameters a grammar will enforce (required, a named function, a strict function
    under auto) hold no keyword the grammar engine would drop unread (``schema_support``)."""
    for i, f in enumerate(plan.functions):
        if (
            plan.choice == "required"
            or f.name == plan.function
            or (plan.choice == "auto" and f.strict)
        ):
            check_schema(f.parameters, f"tools[{i}].function.parameters")
