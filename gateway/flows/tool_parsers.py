"""Tool calls parsed out of generated text, whole or streamed (OpenAI ``tool_choice: "auto"``).

The formats, by ``--tool-call-parser`` name: hermes (``<tool_call>`` JSON), llama3_json, mistral
(``[TOOL_CALLS]``), qwen3_coder (``<tool_call><function=NAME><parameter=ARG>``), glm45
(``<tool_call>NAME<arg_key>..</arg_key><arg_value>..</arg_value>``), deepseek_v3 and deepseek_v31
(``<｜tool▁calls▁begin｜>`` special-token markup) and pythonic (``[f(a=1), g(b="x")]``). The
formats that write arguments as text (qwen3_coder, glm45) type each value by the schema of the
offered function's parameter, as vLLM's parsers do.

Each format is one incremental scanner and ``parse(text)`` is that scanner fed the whole text at
once, so a streamed choice and a non-streamed one cannot disagree about what is a call. Markup
that does not turn out to be a call (malformed JSON, a block cut off inside its JSON) is given
back as content: the user sees what the model wrote rather than losing it, and nothing here
raises. A hermes block the output leaves open after a whole call is that call (as vLLM reads it).

A call is final once its JSON value is complete, so text after valid calls that is not another
call (llama3_json, mistral) is content; the calls before it stay calls.
"""

from __future__ import annotations

import ast
import json
import math
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.flows.text_stream import TextStream, held_back

_DECODER = json.JSONDecoder()
_SEPARATORS = " \t\r\n;"  # between llama3_json calls
_NAME_EXTRA = "_-.:"  # allowed in a bare mistral function name besides letters and digits


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments as JSON text (an object), as OpenAI's function.arguments


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text that is not a tool call; None when empty or whitespace only
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class StreamStep:
    content: str  # content text safe to send to the client now ("" = none)
    tool_calls: tuple[ToolCall, ...]  # calls completed by this step, each sent once, in order


class _NotACall(Exception):
    """The text at hand can no longer become a call, whatever follows."""


def _decode(text: str) -> tuple[object, int] | None:
    """The JSON value text starts with and where it ends; None while incomplete or invalid."""
    try:
        return _DECODER.raw_decode(text)
    except (ValueError, RecursionError):
        return None


def _arguments(value: object) -> str | None:
    """OpenAI's ``function.arguments`` text; None when value is not an object."""
    if value is None or value == "":
        return "{}"
    if isinstance(value, str):  # some models emit the arguments object as a JSON string
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def as_tool_call(obj: object, tools: Mapping[str, object]) -> ToolCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` as a call; None when it is not one.
    Without either key it is a call (with no arguments) only to one of the offered ``tools``:
    a JSON answer that has a ``name`` (``{"name": "Alice", "age": 30}``) is content, as in
    vLLM's parsers (which fail on the missing key and give the text back)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if key is None and name not in tools:
        return None
    arguments = _arguments(obj[key] if key is not None else None)
    return None if arguments is None else ToolCall(name, arguments)


# the offered functions' parameters (JSON schemas) by name: how the formats that write arguments
# as text (qwen3_coder, glm45) type each value
Schemas = Mapping[str, Mapping[str, Any]]
_NO_TOOLS: Schemas = {}


class ToolStream(TextStream[StreamStep]):
    """One generated choice's text, fed piece by piece; one per choice."""

    def __init__(self, tools: Schemas = _NO_TOOLS) -> None:
        super().__init__()
        self._tools = tools
        self._content: list[str] = []
        self._calls: list[ToolCall] = []

    def _take(self) -> StreamStep:
        step = StreamStep("".join(self._content), tuple(self._calls))
        self._content.clear()
        self._calls.clear()
        return step

    def _text(self, final: bool, marker: str) -> None:
        """Emits the buffer as content but for an end that may be the start of marker."""
        cut = len(self._buf) - (0 if final else held_back(self._buf, marker))
        self._content.append(self._buf[:cut])
        self._buf = self._buf[cut:]

    def _up_to(self, marker: str, final: bool) -> bool:
        """Content up to ``marker``, which is consumed: True; without it the buffer is content
        but for a possible start of the marker: False."""
        at = self._buf.find(marker)
        if at < 0:
            self._text(final, marker)
            return False
        self._content.append(self._buf[:at])
        self._buf = self._buf[at + len(marker) :]
        return True


class _BlockStream(ToolStream):
    """Calls in blocks between ``START`` and ``END``, content around them. A block that holds no
    call is given back as content; one the output leaves open is read as calls if it holds
    whole ones (``_calls_in`` with ``closed`` false), else given back."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, tools: Schemas = _NO_TOOLS) -> None:
        super().__init__(tools)
        self._inside = False

    def _advance(self, final: bool) -> bool:
        if self._inside:
            return self._block(final)
        self._inside = self._up_to(self.START, final)
        return self._inside

    def _block(self, final: bool) -> bool:
        end = self._buf.find(self.END)
        if end < 0:
            if final:  # ended inside a block: whole calls still are (vLLM's), else content
                self._read(self._buf, "")
                self._buf, self._inside = "", False
            return False
        inner = self._buf[:end]
        self._buf, self._inside = self._buf[end + len(self.END) :], False
        self._read(inner, self.END)
        return True

    def _read(self, inner: str, end: str) -> None:
        calls = self._calls_in(inner, closed=bool(end))
        if calls:
            self._calls.extend(calls)
        else:
            self._content.append(self.START + inner + end)

    @abstractmethod
    def _calls_in(self, inner: str, closed: bool) -> list[ToolCall] | None:
        """The calls a block holds; None (or none) when it is not calls."""


class _HermesStream(_BlockStream):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Qwen2.5/3, Hermes, SmolLM3."""

    def _calls_in(self, inner: str, closed: bool) -> list[ToolCall] | None:
        body = inner.strip()
        decoded = _decode(body)
        if decoded is None or decoded[1] != len(body):
            return None
        call = as_tool_call(decoded[0], self._tools)
        return None if call is None else [call]


class _LeadingCallsStream(ToolStream):
    """Calls that open the output, after an optional ``TAG``: the output starts with
    ``OPENER`` (after the tag and white space) or it is all content."""

    TAG: str
    OPENER: str

    def __init__(self, tools: Schemas = _NO_TOOLS) -> None:
        super().__init__(tools)
        self._mode = "start"  # then "calls" or "text" (and what a subclass adds)
        self._head = ""  # what preceded the calls: content again if they are none

    def _start(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(self.TAG):
            rest = rest[len(self.TAG) :].lstrip()
        elif not final and self.TAG.startswith(rest):
            return False
        if not rest and not final:
            return False
        self._mode = "calls" if rest.startswith(self.OPENER) else "text"
        if self._mode == "calls":
            self._head, self._buf = self._buf[: len(self._buf) - len(rest)], rest
        return True


class _Llama3Stream(_LeadingCallsStream):
    """``<|python_tag|>{"name": ..., "parameters": {...}}; {...}``: Llama 3.1/3.2 JSON calls."""

    TAG, OPENER = "<|python_tag|>", "{"

    def _advance(self, final: bool) -> bool:
        if self._mode == "start":
            return self._start(final)
        if self._mode == "calls":
            return self._next_call(final)
        self._content.append(self._buf)
        self._buf = ""
        return False

    def _next_call(self, final: bool) -> bool:
        rest = self._buf.lstrip(_SEPARATORS)
        if not rest:
            if final:  # trailing separators are no content
                self._buf = ""
            return False
        decoded = _decode(rest) if rest.startswith("{") else None
        if decoded is None and rest.startswith("{") and not final:
            return False
        call = as_tool_call(decoded[0], self._tools) if decoded else None
        if decoded is None or call is None:
            self._content.append(self._head)
            self._buf, self._mode = rest, "text"
            return True
        self._calls.append(call)
        self._buf, self._head = rest[decoded[1] :], ""
        return True


class _MistralStream(ToolStream):
    """``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` entries."""

    MARK = "[TOOL_CALLS]"
    BARE = '[{"name"'  # the calls array with its marker already stripped as a special token
    ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"

    def __init__(self, tools: Schemas = _NO_TOOLS) -> None:
        super().__init__(tools)
        self._mode = "start"
        self._head = ""  # the marker in front of the calls: content again if they are not calls

    def _advance(self, final: bool) -> bool:
        if self._mode == "start":
            rest = self._buf.lstrip()
            if not final and self.BARE.startswith(rest):
                return False
            self._mode = "calls" if rest.startswith(self.BARE) else "text"
            return True
        if self._mode == "calls":
            return self._calls_here(final)
        if not self._up_to(self.MARK, final):
            return False
        self._head, self._mode = self.MARK, "calls"
        return True

    def _calls_here(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        try:
            found = self._array(rest) if rest.startswith("[") else self._named(rest)
            if found is None and final:
                raise _NotACall
        except _NotACall:
            self._content.append(self._head)
            self._mode = "text"
            return True
        if found is None:
            return False
        calls, used = found
        self._calls.extend(calls)
        self._buf, self._mode = rest[used:], "text"
        return True

    def _array(self, rest: str) -> tuple[list[ToolCall], int] | None:
        """``[{"name": ..., "arguments": {...}}, ...]``: the calls and the length they take."""
        decoded = _decode(rest)
        if decoded is None:
            return None
        items = decoded[0] if isinstance(decoded[0], list) else []
        calls = [call for item in items if (call := as_tool_call(item, self._tools)) is not None]
        if not calls or len(calls) != len(items):
            raise _NotACall
        return calls, decoded[1]

    def _named(self, rest: str) -> tuple[list[ToolCall], int] | None:
        """``name[ARGS]{...}``, ``name[CALL_ID]id[ARGS]{...}`` or ``name{...}`` (the v11+
        tokenizers' form, ``[TOOL_CALLS]add{"a": 3.5}``) and the length it takes."""
        bracket = rest.find("[")
        brace = rest.find("{")
        if brace >= 0 and (bracket < 0 or brace < bracket):
            return self._name_then_object(rest, brace)
        name = rest if bracket < 0 else rest[:bracket]
        if not all(c.isalnum() or c in _NAME_EXTRA for c in name):
            raise _NotACall
        tail = rest[max(bracket, 0) :]
        if bracket < 0 or self.ARGS.startswith(tail) or self.CALL_ID.startswith(tail):
            return None
        if tail.startswith(self.CALL_ID):
            args_at = tail.find(self.ARGS)
            if args_at < 0:
                return None
        elif tail.startswith(self.ARGS):
            args_at = 0
        else:
            raise _NotACall
        start = bracket + args_at + len(self.ARGS)
        value = rest[start:].lstrip()
        decoded = _decode(value) if value else None
        if decoded is None:
            return None
        arguments = _arguments(decoded[0])
        if arguments is None:
            raise _NotACall
        return [ToolCall(name, arguments)], len(rest) - len(value) + decoded[1]

    @staticmethod
    def _name_then_object(rest: str, brace: int) -> tuple[list[ToolCall], int] | None:
        """``name{...}``: the name up to the object's brace, then the object."""
        name = rest[:brace]
        if not name or not all(c.isalnum() or c in _NAME_EXTRA for c in name):
            raise _NotACall
        decoded = _decode(rest[brace:])
        if decoded is None:
            return None
        arguments = _arguments(decoded[0])
        if arguments is None:
            raise _NotACall
        return [ToolCall(name, arguments)], brace + decoded[1]


# ---------------------------------------------------------------- arguments written as text


class _Untyped:
    """A value that is no JSON value (a set, NaN, bytes): the text it came from stays a string."""


_UNTYPED = _Untyped()


def _jsonable(value: object) -> object:
    """``value`` as JSON data (tuples as lists), or _UNTYPED where it cannot be one."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _UNTYPED
    if isinstance(value, list | tuple):
        items = [_jsonable(v) for v in value]
        return _UNTYPED if any(v is _UNTYPED for v in items) else items
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return _UNTYPED
        pairs = {k: _jsonable(v) for k, v in value.items()}
        return _UNTYPED if any(v is _UNTYPED for v in pairs.values()) else pairs
    return _UNTYPED


def _literal(text: str) -> object:
    """A Python literal's value as JSON data (``True``, ``(1, 2)``, ``{'a': 1}``), else
    _UNTYPED."""
    try:
        return _jsonable(ast.literal_eval(text))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNTYPED


def _json_or_literal(text: str) -> object:
    """``text`` read as JSON, else as a Python literal; else _UNTYPED."""
    decoded = _decode(text)
    if decoded is not None and decoded[1] == len(text):
        value = _jsonable(decoded[0])
        if value is not _UNTYPED:
            return value
    return _literal(text)


def _property_type(tools: Schemas, function: str, name: str) -> str | None:
    """The ``type`` the function's schema gives the parameter (lower case; of a list of types,
    the one that is not "null"); "" where the parameter has no single type, None where the
    schema does not name the parameter."""
    properties = tools.get(function, {}).get("properties")
    schema = properties.get(name) if isinstance(properties, dict) else None
    if not isinstance(schema, dict):
        return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if len(kinds) == 1 else None
    return kind.strip().lower() if isinstance(kind, str) else ""


_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def _qwen_value(text: str, kind: str | None) -> object:
    """A qwen3_coder parameter's text as the value its schema type asks for (vLLM's rules):
    "null" is null; a string type, no type or a parameter the schema does not name keep the
    text; a number or boolean type reads it as one (text that is none stays a string; a
    boolean that is not "true" is false); an object or array type reads JSON, then a Python
    literal; any other type a Python literal; what cannot be read stays a string."""
    if text.lower() == "null":
        return None
    if kind is None or kind == "" or kind in _STRING_TYPES:
        return text
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(text)
        except ValueError:
            return text
    if kind.startswith(("num", "float")):
        try:
            number = float(text)
        except ValueError:
            return text
        if not math.isfinite(number):
            return text
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        value = _json_or_literal(text)
    else:
        value = _literal(text)
    return text if value is _UNTYPED else value


def _glm_value(text: str, kind: str | None) -> object:
    """A glm45 argument's text: as written for a "string" parameter, else read as JSON, then a
    Python literal, else the text stripped (vLLM's rules)."""
    if kind == "string":
        return text
    value = _json_or_literal(text.strip())
    return text.strip() if value is _UNTYPED else value


class _Qwen3CoderStream(_BlockStream):
    """``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>\\n</function>
    \\n</tool_call>``: Qwen3-Coder (and Qwen3.5's) XML-ish calls, several functions in a block
    read in order. In a closed block the last function's ``</function>`` (and a parameter's
    ``</parameter>`` before the next one) may be missing, as vLLM reads them; a block the output
    leaves open is calls only where each function in it is closed."""

    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"

    def __init__(self, tools: Schemas = _NO_TOOLS) -> None:
        super().__init__(tools)
        self._bare = False  # inside a ``<function=`` the model wrote without ``<tool_call>``

    def _advance(self, final: bool) -> bool:
        """As a block stream, and a ``<function=...</function>`` outside any block is a call
        too (Qwen3-Coder models drop the wrapper at times; vLLM's parser reads them so)."""
        if self._inside:
            return self._block(final)
        if self._bare:
            return self._bare_function(final)
        found = [(at, m) for m in (self.START, self.FUNCTION) if (at := self._buf.find(m)) >= 0]
        if not found:
            held = 0 if final else max(held_back(self._buf, self.START),
                                       held_back(self._buf, self.FUNCTION))  # fmt: skip
            self._content.append(self._buf[: len(self._buf) - held])
            self._buf = self._buf[len(self._buf) - held :]
            return False
        at, marker = min(found)
        self._content.append(self._buf[:at])
        if marker == self.START:
            self._buf, self._inside = self._buf[at + len(marker) :], True
        else:
            self._buf, self._bare = self._buf[at:], True
        return True

    def _bare_function(self, final: bool) -> bool:
        """A wrapper-less function up to its ``</function>``: its call, or content if it is
        none; one the output leaves open is content."""
        end = self._buf.find(self.FUNCTION_END)
        if end < 0:
            if final:
                self._content.append(self._buf)
                self._buf, self._bare = "", False
            return False
        text = self._buf[: end + len(self.FUNCTION_END)]
        self._buf, self._bare = self._buf[len(text) :], False
        calls = self._calls_in(text, closed=True)
        if calls:
            self._calls.extend(calls)
        else:
            self._content.append(text)
        return True

    def _calls_in(self, inner: str, closed: bool) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        rest = inner.strip()
        while rest:
            if not rest.startswith(self.FUNCTION):
                return None
            end = rest.find(self.FUNCTION_END)
            if end < 0 and not closed:
                return None
            body = rest[len(self.FUNCTION) : end if end >= 0 else len(rest)]
            call = self._function(body)
            if call is None:
                return None
            calls.append(call)
            rest = rest[end + len(self.FUNCTION_END) :].strip() if end >= 0 else ""
        return calls

    def _function(self, body: str) -> ToolCall | None:
        """``NAME>`` then its parameters, as one call; None when it is not one."""
        name, gt, params = body.partition(">")
        name = name.strip()
        if not gt or not name or any(c in name for c in "<\n"):
            return None
        arguments: dict[str, object] = {}
        pieces = params.split(self.PARAMETER)
        if pieces[0].strip():
            return None
        for piece in pieces[1:]:
            key, gt, value = piece.partition(">")
            key = key.strip()
            if not gt or not key or key in arguments:
                return None
            end = value.find(self.PARAMETER_END)
            if end >= 0:
                if value[end + len(self.PARAMETER_END) :].strip():
                    return None
                value = value[:end]
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = _qwen_value(value, _property_type(self._tools, name, key))
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


class _Glm45Stream(_BlockStream):
    """``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>``:
    GLM-4.5/4.6. A block the output leaves open is given back (its last argument may be cut)."""

    KEY, KEY_END = "<arg_key>", "</arg_key>"
    VALUE, VALUE_END = "<arg_value>", "</arg_value>"

    def _calls_in(self, inner: str, closed: bool) -> list[ToolCall] | None:
        if not closed:
            return None
        cut = min((i for i in (inner.find("\n"), inner.find(self.KEY)) if i >= 0),
                  default=len(inner))  # fmt: skip
        name, rest = inner[:cut].strip(), inner[cut:]
        if not name or "<" in name:
            return None
        arguments: dict[str, object] = {}
        while rest.strip():
            rest = rest.lstrip()
            key, rest = _between(rest, self.KEY, self.KEY_END)
            if key is None:
                return None
            rest = rest.lstrip()
            value, rest = _between(rest, self.VALUE, self.VALUE_END)
            key = key.strip()
            if value is None or not key or key in arguments:
                return None
            arguments[key] = _glm_value(value, _property_type(self._tools, name, key))
        return [ToolCall(name, json.dumps(arguments, ensure_ascii=False))]


def _between(text: str, start: str, end: str) -> tuple[str | None, str]:
    """What ``text`` holds between its leading ``start`` and the first ``end``, and the rest
    after it; (None, text) where it does not open with start or end is missing."""
    if not text.startswith(start):
        return None, text
    at = text.find(end, len(start))
    if at < 0:
        return None, text
    return text[len(start) : at], text[at + len(end) :]


# ---------------------------------------------------------------- deepseek


class _DeepSeekStream(ToolStream):
    """``<｜tool▁calls▁begin｜>`` then calls ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``
    (each read by ``_call``), then ``<｜tool▁calls▁end｜>``; content before and after. Markup
    that does not turn out to be calls is given back as content; a call the output leaves open
    is read if it is whole (its JSON complete), else given back."""

    CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    SEP = "<｜tool▁sep｜>"

    def __init__(self, tools: Schemas = _NO_TOOLS) -> None:
        super().__init__(tools)
        self._inside = False
        self._head = ""  # the section's opening marker: content again if no call follows

    def _advance(self, final: bool) -> bool:
        if not self._inside:
            self._inside = self._up_to(self.CALLS, final)
            self._head = self.CALLS if self._inside else ""
            return self._inside
        rest = self._buf.lstrip()
        if rest.startswith(self.CALLS_END):
            self._buf, self._inside, self._head = rest[len(self.CALLS_END) :], False, ""
            return True
        if rest.startswith(self.CALL):
            return self._one_call(rest, final)
        if not final and (not rest or self.CALL.startswith(rest)
                          or self.CALLS_END.startswith(rest)):  # fmt: skip
            return False
        self._content.append(self._head)  # not calls: the section's text is content
        self._inside, self._head = False, ""
        return True

    def _one_call(self, rest: str, final: bool) -> bool:
        end = rest.find(self.CALL_END)
        if end < 0 and not final:
            return False
        inner = rest[len(self.CALL) : end if end >= 0 else len(rest)]
        call = self._call(inner)
        if call is None:  # given back as written
            raw = rest if end < 0 else rest[: end + len(self.CALL_END)]
            self._content.append(self._head + raw)
        else:
            self._calls.append(call)
        self._head = ""
        self._buf = "" if end < 0 else rest[end + len(self.CALL_END) :]
        return True

    def _call(self, inner: str) -> ToolCall | None:
        """DeepSeek-V3's ``function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```````."""
        kind, sep, rest = inner.partition(self.SEP)
        fence = rest.find("```")
        if not sep or kind.strip() != "function" or fence < 0:
            return None
        body = rest[fence + 3 :]
        if not body.startswith("json"):
            return None
        body = body[4:].strip()
        if body.endswith("```"):
            body = body[:-3].rstrip()
        return _named_arguments(rest[:fence], body)


class _DeepSeekV31Stream(_DeepSeekStream):
    """DeepSeek-V3.1's calls: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``."""

    def _call(self, inner: str) -> ToolCall | None:
        name, sep, body = inner.partition(self.SEP)
        return _named_arguments(name, body.strip()) if sep else None


def _named_arguments(name: str, body: str) -> ToolCall | None:
    """A call of ``name`` (stripped) whose arguments are all of ``body``, a JSON object."""
    name = name.strip()
    decoded = _decode(body)
    if not name or any(c.isspace() or c in "<>" for c in name) or decoded is None:
        return None
    arguments = _arguments(decoded[0]) if decoded[1] == len(body) else None
    return None if arguments is None else ToolCall(name, arguments)


# ---------------------------------------------------------------- pythonic


def _python_list_end(text: str) -> int | None:
    """Where the list ``text`` opens with (``[``) closes, past Python strings; None while open."""
    depth, i, n = 0, 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            quote = c * 3 if text.startswith(c * 3, i) else c
            i += len(quote)
            while not text.startswith(quote, i):
                if i >= n or (len(quote) == 1 and text[i] == "\n"):
                    return None if i >= n else i  # an unclosed one-line string: no list
                i += 2 if text[i] == "\\" else 1
            i += len(quote)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _may_open_calls(text: str) -> bool:
    """Whether ``text`` (``[`` and what followed) can still be ``[name(``: the calls' opening."""
    rest = text[1:].lstrip()
    if not rest:
        return True
    if not (rest[0].isalpha() or rest[0] == "_"):
        return False
    name_end = next((i for i, c in enumerate(rest) if not (c.isalnum() or c == "_")), len(rest))
    rest = rest[name_end:].lstrip()
    return not rest or rest[0] == "("


def _python_calls(source: str) -> list[ToolCall] | None:
    """``[f(a=1), g(b="x")]``: calls with keyword arguments of literal values, else None."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args:
            return None
        arguments: dict[str, object] = {}
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in arguments:
                return None
            try:
                value = _jsonable(ast.literal_eval(keyword.value))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
            if value is _UNTYPED:
                return None
            arguments[keyword.arg] = value
        calls.append(ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False)))
    return calls


class _PythonicStream(_LeadingCallsStream):
    """``[get_weather(city="Paris"), get_time()]``: Llama 3.2/4's calls, a Python list at the
    start of the output (Llama 4's ``<|python_start|>``/``<|python_end|>`` around it dropped);
    text after the list is content. Keyword arguments only, of literal values (strings, numbers,
    True/False/None, lists, dicts); anything else makes it content."""

    TAG, OPENER, END = "<|python_start|>", "[", "<|python_end|>"

    def _advance(self, final: bool) -> bool:
        if self._mode == "start":
            return self._start(final)
        if self._mode == "calls":
            return self._list(final)
        if self._mode == "after":
            rest = self._buf.lstrip()
            if not final and (not rest or (self.END.startswith(rest) and rest != self.END)):
                return False
            if rest.startswith(self.END):
                self._buf = rest[len(self.END) :]
            self._mode = "text"
            return True
        self._content.append(self._buf)
        self._buf = ""
        return False

    def _list(self, final: bool) -> bool:
        end = _python_list_end(self._buf) if _may_open_calls(self._buf) else None
        if end is None and _may_open_calls(self._buf) and not final:
            return False
        calls = _python_calls(self._buf[:end]) if end is not None else None
        if calls is None:
            self._content.append(self._head)
            self._mode = "text"
            return True
        self._calls.extend(calls)
        self._buf, self._head, self._mode = self._buf[end:], "", "after"
        return True


# what a format's calls are held to: each function's name and the schema of its arguments
# (None: any JSON object, a function not marked strict)
StrictFunctions = Sequence[tuple[str, dict[str, Any] | None]]


def triggered_calls(
    trigger: str, begin: Callable[[str], str], end: str, functions: StrictFunctions, parallel: bool
) -> dict[str, Any]:
    """An xgrammar structural tag: the text is free until ``trigger``; from there the output is
    one of the functions' ``begin(name)``, its arguments as a JSON object (held to the schema
    of a strict function), then ``end``; then free text again (or the end of the output, one
    call only, without ``parallel``)."""
    tags = [
        {
            "type": "tag",
            "begin": begin(name),
            "content": {"type": "json_schema", "json_schema": schema or {"type": "object"}},
            "end": end,
        }
        for name, schema in functions
    ]
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
                   "at_least_one": False, "stop_after_first": not parallel},
    }  # fmt: skip


class ToolParser(ABC):
    """One model family's tool-call format."""

    name: str
    # the markup the format is read by: where a tokenizer has one as a special token (Hermes 2
    # Pro's <tool_call>, Mistral's [TOOL_CALLS]), the text is decoded with special tokens kept,
    # else the markup is skipped and the call read as content (vLLM's adjust_request does too)
    markers: tuple[str, ...] = ()

    @abstractmethod
    def stream(self, tools: Schemas = _NO_TOOLS) -> ToolStream:
        """A choice's scanner; ``tools``: the offered functions' parameters by name."""

    def markup_is_special(self, is_special: Callable[[str], bool]) -> bool:
        """Whether any of its markers is a special token of the tokenizer ``is_special`` asks
        (decoding must keep special tokens to read the calls; a grammar cannot match them)."""
        return any(is_special(marker) for marker in self.markers)

    def call_id(self) -> str:
        """A new call's ``id`` (OpenAI's form), which the client sends back as the assistant
        turn's ``tool_calls[].id`` and the tool message's ``tool_call_id``."""
        return new_call_id()

    def structural_tag(self, functions: StrictFunctions, parallel: bool) -> dict[str, Any] | None:
        """The structural tag that holds the calls this format writes to their schemas, left
        free elsewhere (strict functions under tool_choice "auto"); None where the format has
        none yet."""
        return None

    def parse(self, text: str, tools: Schemas = _NO_TOOLS) -> Parsed:
        """The whole output at once: the stream fed all of it, content stripped."""
        stream = self.stream(tools)
        fed, rest = stream.feed(text), stream.finish()
        content = (fed.content + rest.content).strip()
        return Parsed(content or None, fed.tool_calls + rest.tool_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """Nine letters and digits: Mistral's chat templates (and mistral_common) refuse a history
    whose tool call ids are anything else, so the ids it is given back must be such (vLLM's)."""
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


# a format's calls as a structural tag: the trigger, each call's opening text by its name, and
# its closing text
Tagging = tuple[str, Callable[[str], str], str]


class _Parser(ToolParser):
    def __init__(
        self,
        name: str,
        stream: Callable[[Schemas], ToolStream],
        markers: tuple[str, ...] = (),
        call_id: Callable[[], str] = new_call_id,
        tagging: Tagging | None = None,
    ) -> None:
        self.name = name
        self._stream = stream
        self.markers = markers
        self._call_id = call_id
        self._tagging = tagging

    def stream(self, tools: Schemas = _NO_TOOLS) -> ToolStream:
        return self._stream(tools)

    def call_id(self) -> str:
        return self._call_id()

    def structural_tag(self, functions: StrictFunctions, parallel: bool) -> dict[str, Any] | None:
        if self._tagging is None:
            return None
        trigger, begin, end = self._tagging
        return triggered_calls(trigger, begin, end, functions, parallel)


def _named_call(key: str) -> Callable[[str], str]:
    """``{"name": "NAME", "KEY": `` (the arguments follow): the JSON call a format writes."""
    return lambda name: '{"name": ' + json.dumps(name) + f', "{key}": '


def _hermes_begin(name: str) -> str:
    return _HermesStream.START + "\n" + _named_call("arguments")(name)


_GLM_MARKERS = (_Glm45Stream.START, _Glm45Stream.END, _Glm45Stream.KEY, _Glm45Stream.KEY_END,
                _Glm45Stream.VALUE, _Glm45Stream.VALUE_END)  # fmt: skip
_DEEPSEEK_MARKERS = (
    _DeepSeekStream.CALLS,
    _DeepSeekStream.CALLS_END,
    _DeepSeekStream.CALL,
    _DeepSeekStream.CALL_END,
    _DeepSeekStream.SEP,
)

PARSERS: dict[str, ToolParser] = {
    # strict calls as Qwen's and Hermes' templates ask for them: a block on lines of its own
    "hermes": _Parser(
        "hermes",
        _HermesStream,
        (_HermesStream.START, _HermesStream.END),
        tagging=(_HermesStream.START, _hermes_begin, "}\n" + _HermesStream.END),
    ),
    # <|python_tag|> may go: a call is read from a JSON object at the start as well. Strict
    # calls: the JSON object Llama 3.1's template asks for ({"name": ..., "parameters": ...})
    "llama3_json": _Parser(
        "llama3_json", _Llama3Stream, tagging=('{"name": ', _named_call("parameters"), "}")
    ),
    "mistral": _Parser(
        "mistral",
        _MistralStream,
        (_MistralStream.MARK, _MistralStream.ARGS, _MistralStream.CALL_ID),
        mistral_call_id,
    ),
    # the formats below have no structural tag (their arguments are not one JSON object, or
    # their markup is special tokens): strict functions under auto are a 400 with them
    "qwen3_coder": _Parser(
        "qwen3_coder", _Qwen3CoderStream, (_Qwen3CoderStream.START, _Qwen3CoderStream.END)
    ),
    "glm45": _Parser("glm45", _Glm45Stream, _GLM_MARKERS),
    "deepseek_v3": _Parser("deepseek_v3", _DeepSeekStream, _DEEPSEEK_MARKERS),
    "deepseek_v31": _Parser("deepseek_v31", _DeepSeekV31Stream, _DEEPSEEK_MARKERS),
    # Llama 4's <|python_start|> is a special token, but its calls read the same without it:
    # the text is decoded as usual
    "pythonic": _Parser("pythonic", _PythonicStream),
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]
    except KeyError:
        choices = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; choose one of: {choices}") from None
