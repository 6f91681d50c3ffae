"""A chat choice's generated text turned into the assistant message: thinking split off
(``--reasoning-parser``), tool calls taken out (by the tool choice's grammar, or by
``--tool-call-parser`` under ``auto``), the rest as content. The same rules serve a whole
response (``message``) and a stream (``feed`` then ``finish``, which yield OpenAI deltas).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.flows import reasoning, tool_parsers
from gateway.flows.reasoning import ReasoningParser, ReasoningStep
from gateway.flows.text_stream import TextStream
from gateway.flows.tool_parsers import ToolCall, ToolParser, ToolStream, new_call_id
from gateway.flows.tools import ToolPlan
from protos.errors import ConfigError

Delta = dict[str, Any]


@dataclass(frozen=True)
class OutputPlan:
    """How to read a chat request's output; ``plain`` when there is nothing to read out."""

    tools: ToolPlan | None = None
    parser: ToolParser | None = None  # the auto tool-call parser
    reasoning: ReasoningParser | None = None
    prompt_open: bool = False  # the prompt ends inside an open thinking block

    @property
    def plain(self) -> bool:
        return self.reasoning is None and (self.tools is None or self.tools.choice == "none")


def _call_json(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


class _ArrayCalls:
    """``tool_choice: required``: the grammar makes the output a JSON array of
    ``{"name", "arguments"}`` objects. A call is announced as soon as its name has been read, and
    its arguments stream as they are generated (their JSON text as the model wrote it, as a named
    function's do), so a stream and the whole message agree, also for an output cut short inside
    a call (max_tokens, a stop string): each call whose name was read is a call, its arguments
    what was generated of them. The array itself is never content, not even a fragment cut short
    before any name. :meth:`feed` returns ``("call", name)`` and ``("arguments", text)`` events;
    :attr:`closed` tells a whole array from one cut short."""

    def __init__(self) -> None:
        self._depth = 0  # arrays and objects open: 1 in the array, 2 in a call object
        self._in_string = False
        self._escaped = False
        self._token: list[str] | None = None  # a string read at depth 2 (a key or the name)
        self._expect_key = False
        self._key: str | None = None  # the key whose value is read at depth 2
        self._named = False  # the current call's name was read (and announced)
        self._in_arguments = False
        self._arguments_begun = False
        self._held: list[str] = []  # arguments' whitespace outside strings, until more follows
        self._pending: list[str] = []  # arguments read before the name
        self.closed = False  # the array's closing bracket was read

    def feed(self, delta: str) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        for ch in delta:
            if self._in_arguments and self._argument_char(ch, events):
                continue
            self._structure_char(ch, events)
        return events

    def _string_char(self, ch: str) -> None:
        if self._escaped:
            self._escaped = False
        elif ch == "\\":
            self._escaped = True
        elif ch == '"':
            self._in_string = False

    def _argument_char(self, ch: str, events: list[tuple[str, str]]) -> bool:
        """Take ``ch`` into the arguments; False when it ends them (a comma or the call's brace)."""
        if self._in_string:
            self._string_char(ch)
        elif ch.isspace():
            if self._arguments_begun:
                self._held.append(ch)
            return True
        elif self._depth == 2 and ch in ",}":
            self._in_arguments = False
            self._held.clear()
            return False
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
        elif ch == '"':
            self._in_string = True
        self._arguments_begun = True
        text = "".join(self._held) + ch
        self._held.clear()
        if not self._named:
            self._pending.append(text)
        elif events and events[-1][0] == "arguments":  # one event a feed, not one a character
            events[-1] = ("arguments", events[-1][1] + text)
        else:
            events.append(("arguments", text))
        return True

    def _structure_char(self, ch: str, events: list[tuple[str, str]]) -> None:
        if self._in_string:
            self._string_char(ch)
            if self._token is not None:
                if self._in_string:
                    self._token.append(ch)
                else:
                    self._string_read(json.loads('"' + "".join(self._token) + '"'), events)
                    self._token = None
            return
        if ch == '"':
            self._in_string = True
            self._token = [] if self._depth == 2 else None
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2 and ch == "{":  # a call begins
                self._expect_key, self._key, self._named = True, None, False
                self._pending.clear()
        elif ch in "}]":
            self._depth -= 1
            self.closed = self.closed or self._depth == 0
        elif self._depth == 2 and ch == ",":
            self._expect_key = True
        elif self._depth == 2 and ch == ":" and self._key == "arguments":
            self._in_arguments, self._arguments_begun = True, False

    def _string_read(self, value: str, events: list[tuple[str, str]]) -> None:
        if self._expect_key:
            self._key, self._expect_key = value, False
        elif self._key == "name" and not self._named:
            self._named = True
            events.append(("call", value))
            if self._pending:
                events.append(("arguments", "".join(self._pending)))
                self._pending.clear()


class ChoiceOutput:
    """One choice's output, read as it streams or all at once."""

    def __init__(self, plan: OutputPlan) -> None:
        self.plan = plan
        self.tool_calls: list[dict[str, Any]] = []
        choice = plan.tools.choice if plan.tools is not None else "none"
        self._choice = choice
        self._thinking: TextStream[ReasoningStep] | None = (
            plan.reasoning.stream(plan.prompt_open, read_calls=choice == "auto")
            if plan.reasoning is not None
            else None
        )
        self._auto: ToolStream | None = None
        if choice == "auto" and plan.parser is not None and plan.tools is not None:
            # the formats that write arguments as text type them by the functions' schemas
            schemas = {f.name: f.parameters for f in plan.tools.functions}
            self._auto = plan.parser.stream(schemas)
        self._array = _ArrayCalls() if choice == "required" else None
        self._array_full = False
        self._named_id: str | None = None
        self._named = choice == "function"
        self._content: list[str] = []
        self._held = ""  # auto: whitespace not streamed yet (see _content_delta)
        self._reasoning: list[str] = []

    def _call_id(self) -> str:
        """The gateway's parser names the model family, whose ids a history must carry (any
        tool choice: the client sends them all back)."""
        return self.plan.parser.call_id() if self.plan.parser is not None else new_call_id()

    # ---- streaming ---------------------------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        if self._thinking is None:
            return self._answer(text)
        return self._with_reasoning(self._thinking.feed(text))

    def finish(self) -> list[Delta]:
        deltas: list[Delta] = []
        if self._thinking is not None:
            deltas = self._with_reasoning(self._thinking.finish())
        if self._auto is not None:
            end = self._auto.finish()
            deltas += self._content_delta(end.content) + self._calls(end.tool_calls)
            if self._held and not self.tool_calls:  # plain text after all: all of it
                deltas.append({"content": self._held})
            self._held = ""
        # required: an array cut short before a call's name has no call and no content (the
        # array is the grammar's wrapper, never text for the client)
        return deltas

    def _with_reasoning(self, step: ReasoningStep) -> list[Delta]:
        deltas: list[Delta] = []
        if step.reasoning:
            self._reasoning.append(step.reasoning)
            deltas.append({"reasoning_content": step.reasoning})
        deltas += self._answer(step.content) if step.content else []
        return deltas + self._calls(step.calls)  # a format's own calls (harmony's)

    def _answer(self, text: str) -> list[Delta]:
        if self._choice == "function":
            return self._named_arguments(text)
        if self._array is not None:
            return self._array_deltas(self._array.feed(text))
        if self._auto is not None:
            step = self._auto.feed(text)
            return self._content_delta(step.content) + self._calls(step.tool_calls)
        return self._content_delta(text)

    def _content_delta(self, text: str) -> list[Delta]:
        """Under auto tool parsing, trailing whitespace waits for what follows it: text after
        it sends it along, and at the end it is dropped if the turn called tools, as the whole
        message strips its content then (the newlines around and between calls are no content).
        Leading whitespace before text is sent: a stream cannot know yet that calls will come."""
        if not text:
            return []
        self._content.append(text)
        if self._auto is None:
            return [{"content": text}]
        text = self._held + text
        kept = text.rstrip()
        self._held = text[len(kept) :]
        return [{"content": kept}] if kept else []

    def _named_arguments(self, text: str) -> list[Delta]:
        """A named function's arguments stream as they are generated, as OpenAI sends them."""
        deltas: list[Delta] = []
        if self._named_id is None:
            assert self.plan.tools is not None and self.plan.tools.function is not None
            self._named_id = self._call_id()
            call = ToolCall(self.plan.tools.function, "")
            self.tool_calls.append(_call_json(call, self._named_id))
            deltas.append({"tool_calls": [{"index": 0, **_call_json(call, self._named_id)}]})
        if text:
            self.tool_calls[0]["function"]["arguments"] += text
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return deltas

    def _array_deltas(self, events: list[tuple[str, str]]) -> list[Delta]:
        deltas: list[Delta] = []
        for kind, value in events:
            if self._array_full:
                break
            if kind == "call":
                announced = self._calls([ToolCall(value, "")])
                if not announced:  # parallel_tool_calls false: the first call only
                    self._array_full = True
                    break
                deltas += announced
            else:
                self.tool_calls[-1]["function"]["arguments"] += value
                index = len(self.tool_calls) - 1
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": value}}]})
        return deltas

    def _calls(self, calls: tuple[ToolCall, ...] | list[ToolCall]) -> list[Delta]:
        deltas = []
        for call in calls:
            if self.tool_calls and self.plan.tools is not None and not self.plan.tools.parallel:
                break  # parallel_tool_calls false: the first call only
            call_id = self._call_id()
            deltas.append(
                {"tool_calls": [{"index": len(self.tool_calls), **_call_json(call, call_id)}]}
            )
            self.tool_calls.append(_call_json(call, call_id))
        return deltas

    # ---- the whole message -------------------------------------------------------------------
    def message(self, text: str) -> dict[str, Any]:
        """The assistant message for the whole output ``text`` (a fresh ChoiceOutput)."""
        self.feed(text)
        self.finish()
        content = "".join(self._content)
        if self._choice in ("required", "function", "auto") and self.tool_calls:
            content = content.strip()
        out: dict[str, Any] = {"role": "assistant", "content": content or None}
        if not self.tool_calls and not content:
            out["content"] = ""
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.plan.reasoning is not None:
            out["reasoning_content"] = "".join(self._reasoning) or None
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: a turn that ends by calling tools ends with "tool_calls", but a named
        function's call with the engine's reason ("stop" when the grammar ended it), as OpenAI
        and vLLM report it. Under required, a stop string that cut the array short keeps "stop"
        (as max_tokens keeps "length"): its last call may be incomplete."""
        if self._named or (self._array is not None and not self._array.closed):
            return reason
        return "tool_calls" if reason == "stop" and self.tool_calls else reason


class ParserFlags(Protocol):
    """The output-parser flags, as a GatewayConfig or `tandem up`'s parsed arguments hold them."""

    @property
    def enable_auto_tool_choice(self) -> bool: ...
    @property
    def tool_call_parser(self) -> str | None: ...
    @property
    def reasoning_parser(self) -> str | None: ...


def check_parser_flags(flags: ParserFlags) -> None:
    """The output-parser flags name parsers that exist, and a tool-call parser has the flag that
    uses it (checked at start, with the other flags: the gateway's and `tandem up`'s)."""
    # harmony marks its calls itself: its reasoning parser reads them
    own_calls = flags.reasoning_parser in reasoning.CALLS_READ
    if flags.enable_auto_tool_choice and not flags.tool_call_parser and not own_calls:
        raise ConfigError(
            "--enable-auto-tool-choice needs --tool-call-parser "
            f"({', '.join(tool_parsers.PARSERS)})"
        )
    for flag, name, known in (
        ("--tool-call-parser", flags.tool_call_parser, tool_parsers.PARSERS),
        ("--reasoning-parser", flags.reasoning_parser, reasoning.PARSERS),
    ):
        if name is not None and name not in known:
            raise ConfigError(f"{flag} must be one of {', '.join(known)}, got {name!r}")
    if flags.tool_call_parser and not flags.enable_auto_tool_choice:
        # the parser reads calls only under tool_choice "auto", which that flag turns on
        raise ConfigError("--tool-call-parser is used only with --enable-auto-tool-choice")
