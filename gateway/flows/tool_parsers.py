"""Tool calls parsed out of generated text, whole or streamed (OpenAI ``tool_choice: "auto"``).

Each format is one incremental scanner and ``parse(text)`` is that scanner fed the whole text at
once, so a streamed choice and a non-streamed one cannot disagree about what is a call. Markup
that does not turn out to be a call (malformed JSON, a block cut off inside its JSON) is given
back as content: the user sees what the model wrote rather than losing it, and nothing here
raises. A hermes block the output leaves open after a whole call is that call (as vLLM reads it).

A call is final once its JSON value is complete, so text after valid calls that is not another
call (llama3_json, mistral) is content; the calls before it stay calls.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
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


def as_tool_call(obj: object) -> ToolCall | None:
    """``{"name": ..., "arguments"|"parameters": {...}}`` as a call; None when it is not one."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = _arguments(obj["arguments"] if "arguments" in obj else obj.get("parameters"))
    return None if arguments is None else ToolCall(name, arguments)


class ToolStream(TextStream[StreamStep]):
    """One generated choice's text, fed piece by piece; one per choice."""

    def __init__(self) -> None:
        super().__init__()
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


class _HermesStream(ToolStream):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Qwen2.5/3, Hermes, SmolLM3."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._inside = False

    def _advance(self, final: bool) -> bool:
        if self._inside:
            return self._block(final)
        self._inside = self._up_to(self.START, final)
        return self._inside

    def _block(self, final: bool) -> bool:
        end = self._buf.find(self.END)
        if end < 0:
            if final:  # ended inside a block: a whole call still is one (vLLM's), else content
                self._read(self._buf, "")
                self._buf, self._inside = "", False
            return False
        inner = self._buf[:end]
        self._buf, self._inside = self._buf[end + len(self.END) :], False
        self._read(inner, self.END)
        return True

    def _read(self, inner: str, end: str) -> None:
        body = inner.strip()
        decoded = _decode(body)
        call = as_tool_call(decoded[0]) if decoded and decoded[1] == len(body) else None
        if call is None:
            self._content.append(self.START + inner + end)
        else:
            self._calls.append(call)


class _Llama3Stream(ToolStream):
    """``<|python_tag|>{"name": ..., "parameters": {...}}; {...}``: Llama 3.1/3.2 JSON calls."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._mode = "start"
        self._head = ""  # what preceded the first call: content again if it is not one

    def _advance(self, final: bool) -> bool:
        if self._mode == "start":
            return self._start(final)
        if self._mode == "calls":
            return self._next_call(final)
        self._content.append(self._buf)
        self._buf = ""
        return False

    def _start(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(self.TAG):
            rest = rest[len(self.TAG) :].lstrip()
        elif not final and self.TAG.startswith(rest):
            return False
        if not rest and not final:
            return False
        self._mode = "calls" if rest.startswith("{") else "text"
        if self._mode == "calls":
            self._head, self._buf = self._buf[: len(self._buf) - len(rest)], rest
        return True

    def _next_call(self, final: bool) -> bool:
        rest = self._buf.lstrip(_SEPARATORS)
        if not rest:
            if final:  # trailing separators are no content
                self._buf = ""
            return False
        decoded = _decode(rest) if rest.startswith("{") else None
        if decoded is None and rest.startswith("{") and not final:
            return False
        call = as_tool_call(decoded[0]) if decoded else None
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

    def __init__(self) -> None:
        super().__init__()
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

    @staticmethod
    def _array(rest: str) -> tuple[list[ToolCall], int] | None:
        """``[{"name": ..., "arguments": {...}}, ...]``: the calls and the length they take."""
        decoded = _decode(rest)
        if decoded is None:
            return None
        items = decoded[0] if isinstance(decoded[0], list) else []
        calls = [call for call in map(as_tool_call, items) if call is not None]
        if not calls or len(calls) != len(items):
            raise _NotACall
        return calls, decoded[1]

    def _named(self, rest: str) -> tuple[list[ToolCall], int] | None:
        """``name[ARGS]{...}`` (or ``name[CALL_ID]id[ARGS]{...}``) and the length it takes."""
        bracket = rest.find("[")
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
    def stream(self) -> ToolStream: ...

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

    def parse(self, text: str) -> Parsed:
        """The whole output at once: the stream fed all of it, content stripped."""
        stream = self.stream()
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
        stream: Callable[[], ToolStream],
        markers: tuple[str, ...] = (),
        call_id: Callable[[], str] = new_call_id,
        tagging: Tagging | None = None,
    ) -> None:
        self.name = name
        self._stream = stream
        self.markers = markers
        self._call_id = call_id
        self._tagging = tagging

    def stream(self) -> ToolStream:
        return self._stream()

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
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]
    except KeyError:
        choices = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; choose one of: {choices}") from None
