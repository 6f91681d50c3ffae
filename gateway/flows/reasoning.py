"""A reasoning model's output split into its thinking and its answer, whole or streamed:
``<think>`` blocks (Qwen3, DeepSeek-R1, DeepSeek-V3.1, GLM-4.5/4.6), and gpt-oss's harmony
channels (``openai_gptoss``).

The thinking sits in a ``<think> ... </think>`` block, opened either by the model (the output
starts with ``<think>``) or by the chat template (the rendered prompt ends inside an open block,
``prompt_opens``). The two parsers differ only where no block was opened: DeepSeek-R1 still
counts everything before a ``</think>`` as thinking, so its stream must hold such output back
until the end tag or the end of the output decides; Qwen3, whose thinking can be switched off,
takes an unopened output as all answer and streams it at once.

Normalised the same way whole or streamed: the tags are dropped, the thinking loses its
surrounding newlines, the answer its leading ones (``</think>`` is usually followed by two).

Two parsers follow the request's ``chat_template_kwargs`` (``for_request``), as vLLM's do:
``deepseek_v3`` thinks only when ``thinking`` (or ``enable_thinking``) is true, else the whole
output is the answer; ``glm45`` thinks unless they are given and both false, and then starts
the output inside its thinking (GLM's template opens none: the model writes ``<think>``).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.flows.text_stream import TextStream, held_back
from gateway.flows.tool_parsers import ToolCall

_NEWLINES = "\r\n"


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # the thinking; None if there was none
    content: str | None  # the answer; None if empty


@dataclass(frozen=True)
class ReasoningStep:
    reasoning: str  # reasoning text safe to send now
    content: str  # answer text safe to send now
    calls: tuple[ToolCall, ...] = ()  # tool calls read out whole (harmony's)


class _SplitStream(TextStream[ReasoningStep]):
    """A stream whose advances sort text into reasoning and content, handed out by ``_take``."""

    def __init__(self) -> None:
        super().__init__()
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []

    def _take(self) -> ReasoningStep:
        step = ReasoningStep("".join(self._reasoning), "".join(self._content), tuple(self._calls))
        self._reasoning.clear()
        self._content.clear()
        self._calls.clear()
        return step


class _TrimmedSplit(_SplitStream):
    """Sorts text as a ``<think>`` model writes it: the newlines that open the answer and a
    thinking block dropped, and those that end a block when it closes."""

    def __init__(self) -> None:
        super().__init__()
        self._fresh = True  # nothing of this thinking block sent yet: its newlines dropped
        self._newlines = ""  # the block's trailing newlines: dropped if it ends here
        self._answered = False  # whether any answer text was sent yet

    def _think(self, text: str, closed: bool) -> None:
        text = self._newlines + text
        if self._fresh:
            text = text.lstrip(_NEWLINES)
        body = text.rstrip(_NEWLINES)
        self._newlines = "" if closed else text[len(body) :]
        if body:
            self._reasoning.append(body)
            self._fresh = False

    def _answer(self, text: str) -> None:
        if not self._answered:
            text = text.lstrip(_NEWLINES)
        if text:
            self._content.append(text)
            self._answered = True


class ReasoningStream(_TrimmedSplit):
    """One generated choice's text, fed piece by piece (one thinking block, at the start)."""

    def __init__(self, start: str, end: str, prompt_open: bool, end_alone_closes: bool) -> None:
        super().__init__()
        self._start, self._end = start, end
        self._prompt_open = prompt_open
        self._end_alone_closes = end_alone_closes
        self._mode = "start"  # then "think", "unsure" (a lone end tag may come) or "answer"

    def _advance(self, final: bool) -> bool:
        """Consumes what is decided at the front of the buffer; True while there may be more."""
        if self._mode == "start":
            return self._opening(final)
        if self._mode == "answer":
            self._answer(self._buf)
            self._buf = ""
            return False
        at = self._buf.find(self._end)
        if at >= 0:
            self._think(self._buf[:at], closed=True)
            self._buf, self._mode = self._buf[at + len(self._end) :], "answer"
            return True
        if self._mode == "unsure":
            self._mode = "answer" if final else "unsure"
            return final
        cut = len(self._buf) - (0 if final else held_back(self._buf, self._end))
        self._think(self._buf[:cut], closed=final)
        self._buf = self._buf[cut:]
        return False

    def _opening(self, final: bool) -> bool:
        rest = self._buf.lstrip()
        if rest.startswith(self._start):
            self._buf, self._mode = rest[len(self._start) :], "think"
            return True
        if not final and self._start.startswith(rest):
            return False
        if self._prompt_open:
            self._mode = "think"
        else:
            self._mode = "unsure" if self._end_alone_closes else "answer"
        return True


class ReasoningParser(ABC):
    """One model family's way of marking its thinking."""

    name: str
    start: str = "<think>"
    end: str = "</think>"
    # its markers are special tokens: requests keep them in the text it reads (then drops)
    keeps_special_tokens: bool = False
    # False: the request asked for no thinking, the whole output is the answer (no grammar
    # waits for a thinking block to end)
    separates: bool = True

    def split(self, text: str, prompt_open: bool) -> Split:
        """A whole output's reasoning and answer: by default what its stream sorts, fed at
        once (so the two always agree)."""
        stream = self.stream(prompt_open)
        steps = [stream.feed(text), stream.finish()]
        reasoning = "".join(s.reasoning for s in steps)
        content = "".join(s.content for s in steps)
        return Split(reasoning or None, content or None)

    @abstractmethod
    def stream(self, prompt_open: bool, read_calls: bool = False) -> TextStream[ReasoningStep]:
        """``read_calls``: the request lets the model call its tools (tool_choice auto); a
        parser whose format marks calls (harmony) then reads them out."""

    def prompt_opens(self, prompt_text: str) -> bool:
        """Whether the rendered prompt ends inside an open block (a start after the last end)."""
        return prompt_text.rfind(self.start) > prompt_text.rfind(self.end)

    def for_request(self, template_kwargs: Mapping[str, Any]) -> ReasoningParser:
        """The parser for one request, whose ``chat_template_kwargs`` may switch the thinking
        on or off (ValueError: a switch that is not a boolean)."""
        return self


def _thinking_asked(template_kwargs: Mapping[str, Any]) -> bool | None:
    """The request's thinking switch, as vLLM reads it: ``thinking`` or ``enable_thinking``
    true in ``chat_template_kwargs``; None when neither is given (or both are null)."""
    given = []
    for name in ("thinking", "enable_thinking"):
        value = template_kwargs.get(name)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise ValueError(f"chat_template_kwargs.{name} must be true or false, not {value!r}")
        given.append(value)
    return any(given) if given else None


class _AllContent(_SplitStream):
    """Everything is the answer, sent as it comes."""

    def _advance(self, final: bool) -> bool:
        if self._buf:
            self._content.append(self._buf)
            self._buf = ""
        return False


class _NoThinking(ReasoningParser):
    """A request that asked for no thinking: the output is all answer, untouched (vLLM's
    identity parser)."""

    separates = False

    def __init__(self, name: str) -> None:
        self.name = name

    def split(self, text: str, prompt_open: bool) -> Split:
        return Split(None, text or None)

    def stream(self, prompt_open: bool, read_calls: bool = False) -> TextStream[ReasoningStep]:
        return _AllContent()

    def prompt_opens(self, prompt_text: str) -> bool:
        return False


class _ThinkTags(ReasoningParser):
    end_alone_closes: bool  # whether an end tag makes thinking of an output never opened

    def split(self, text: str, prompt_open: bool) -> Split:
        rest = text.lstrip()
        opened = rest.startswith(self.start)
        body = rest[len(self.start) :] if opened else text
        at = body.find(self.end)
        if not (opened or prompt_open or (self.end_alone_closes and at >= 0)):
            return Split(None, text.lstrip(_NEWLINES) or None)
        if at < 0:  # cut off while thinking
            return Split(body.strip(_NEWLINES) or None, None)
        answer = body[at + len(self.end) :].lstrip(_NEWLINES)
        return Split(body[:at].strip(_NEWLINES) or None, answer or None)

    def stream(self, prompt_open: bool, read_calls: bool = False) -> ReasoningStream:
        return ReasoningStream(self.start, self.end, prompt_open, self.end_alone_closes)


class _Qwen3(_ThinkTags):
    name = "qwen3"
    end_alone_closes = False


class _DeepSeekR1(_ThinkTags):
    name = "deepseek_r1"
    end_alone_closes = True


class _DeepSeekV3Thinking(_DeepSeekR1):
    """DeepSeek-V3.1 asked to think: read as DeepSeek-R1 (its template then ends the prompt
    with ``<think>``)."""

    name = "deepseek_v3"


class _DeepSeekV3(_NoThinking):
    """DeepSeek-V3.1 (vLLM's ``deepseek_v3``): it thinks only when ``chat_template_kwargs``
    sets ``thinking`` (or ``enable_thinking``) true; otherwise the output is all answer."""

    def __init__(self) -> None:
        super().__init__("deepseek_v3")
        self._thinking = _DeepSeekV3Thinking()

    def for_request(self, template_kwargs: Mapping[str, Any]) -> ReasoningParser:
        return self._thinking if _thinking_asked(template_kwargs) else self


_GLM_CALL_START, _GLM_CALL_END = "<tool_call>", "</tool_call>"


class GlmStream(_TrimmedSplit):
    """GLM-4.5/4.6's output with its thinking on (as vLLM's ``glm45`` reads it): the output
    starts inside the thinking, whether or not the model writes ``<think>`` (a ``<think>``
    in the thinking is dropped); ``</think>`` ends it, and so does a ``<tool_call>``, which
    begins the answer (for the tool-call parser). Without either, everything is thinking. In
    the answer a ``<think>`` opens thinking again and a stray ``</think>`` is dropped; inside a
    ``<tool_call> ... </tool_call>`` the text is the call's, tags and all."""

    def __init__(self, start: str, end: str) -> None:
        super().__init__()
        self._start, self._end = start, end
        self._mode = "think"  # then "answer" or "call"

    def _advance(self, final: bool) -> bool:
        if self._mode == "call":
            at = self._buf.find(_GLM_CALL_END)
            if at >= 0:
                cut = at + len(_GLM_CALL_END)
                self._answer(self._buf[:cut])
                self._buf, self._mode = self._buf[cut:], "answer"
                return True
            keep = 0 if final else held_back(self._buf, _GLM_CALL_END)
            self._answer(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        markers = (self._start, self._end, _GLM_CALL_START)
        found = [(at, m) for m in markers if (at := self._buf.find(m)) >= 0]
        if not found:
            keep = 0 if final else max(held_back(self._buf, m) for m in markers)
            text = self._buf[: len(self._buf) - keep]
            if self._mode == "think":
                self._think(text, closed=final)
            else:
                self._answer(text)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        at, marker = min(found)
        before, after = self._buf[:at], self._buf[at + len(marker) :]
        if marker == _GLM_CALL_START:  # the call's text, its tag included, is the answer's
            after = self._buf[at:]
        if self._mode == "think":
            self._think(before, closed=marker != self._start)
            if marker != self._start:
                self._mode = "answer" if marker == self._end else "call"
        else:
            self._answer(before)
            if marker == self._start:
                self._mode, self._fresh = "think", True
            elif marker == _GLM_CALL_START:
                self._mode = "call"
        self._buf = after
        return True


class _Glm45(ReasoningParser):
    """GLM-4.5/4.6 (vLLM's ``glm45``): thinking unless ``chat_template_kwargs`` gives
    ``thinking``/``enable_thinking`` and neither is true (its template then closes an empty
    block itself, and the output is all answer)."""

    name = "glm45"

    def __init__(self) -> None:
        self._off = _NoThinking(self.name)

    def stream(self, prompt_open: bool, read_calls: bool = False) -> TextStream[ReasoningStep]:
        return GlmStream(self.start, self.end)

    def prompt_opens(self, prompt_text: str) -> bool:
        """Always: the output is read as starting inside the thinking (a grammar waits for
        its ``</think>``)."""
        return True

    def for_request(self, template_kwargs: Mapping[str, Any]) -> ReasoningParser:
        return self._off if _thinking_asked(template_kwargs) is False else self


# gpt-oss's harmony format: messages ``[<|start|>assistant]<|channel|>NAME[ header]<|message|>BODY``
# each ended by ``<|end|>`` (``<|return|>`` or ``<|call|>`` end the turn); special tokens all,
# so its requests keep them in the text (``keeps_special_tokens``)
_H_START, _H_CHANNEL, _H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
_H_ENDS = ("<|end|>", "<|return|>", "<|call|>")
_H_OPENERS = (_H_START, _H_CHANNEL)
_H_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _harmony_channel(header: str) -> str:
    """The channel a harmony message header names (its last ``<|channel|>``'s first word;
    "" if none)."""
    words = header.rpartition(_H_CHANNEL)[2].split("<|")[0].split()
    return words[0] if words else ""


class HarmonyStream(_SplitStream):
    """One choice's harmony text: the ``analysis`` channel's bodies are the reasoning, every
    other message's body (``final``, ``commentary``) the content, the markers and headers
    dropped. An output that does not open with a message header is all content. With
    ``read_calls``, a message to ``functions.NAME`` is a call of NAME whose arguments are its
    body, read out whole when the message ends (or the output does)."""

    def __init__(self, read_calls: bool = False, in_analysis: bool = False) -> None:
        super().__init__()
        self._read_calls = read_calls
        # "next" (a header may open), "header", "body" or "plain"; a prompt that ends inside
        # an analysis message (a server or client that primes the thinking) starts in its body
        self._mode = "body" if in_analysis else "next"
        self._to_reasoning = in_analysis  # the current body's channel is analysis
        self._call: str | None = None  # the function the current body calls
        self._arguments: list[str] = []

    def _advance(self, final: bool) -> bool:
        if self._mode == "next":
            if self._buf.startswith(_H_OPENERS):
                self._mode = "header"
                return True
            if not final and any(m.startswith(self._buf) for m in _H_OPENERS):
                return False  # "" or the start of a marker: not decided yet
            self._mode = "plain"
            return True
        if self._mode == "plain":
            self._emit(self._buf, reasoning=False)
            self._buf = ""
            return False
        if self._mode == "header":
            at = self._buf.find(_H_MESSAGE)
            if at < 0:
                if final:  # cut off inside a header: nothing of it is text
                    self._buf = ""
                return False
            self._open(self._buf[:at])
            self._buf, self._mode = self._buf[at + len(_H_MESSAGE) :], "body"
            return True
        ends = [(at, m) for m in _H_ENDS if (at := self._buf.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self._emit(self._buf[:at], self._to_reasoning)
            self._buf, self._mode = self._buf[at + len(marker) :], "next"
            self._close()
            return True
        keep = 0 if final else max(held_back(self._buf, m) for m in _H_ENDS)
        self._emit(self._buf[: len(self._buf) - keep], self._to_reasoning)
        self._buf = self._buf[len(self._buf) - keep :]
        if final:
            self._close()
        return False

    def _open(self, header: str) -> None:
        """A message's header read: where its body goes (``<|start|>assistant to=functions.f
        <|channel|>commentary <|constrain|>json``: the recipient may sit either side)."""
        self._to_reasoning = _harmony_channel(header) == "analysis"
        recipient = _H_RECIPIENT.search(header)
        name = recipient.group(1) if recipient else ""
        if self._read_calls and name.startswith("functions."):
            self._call, self._to_reasoning = name.removeprefix("functions."), False

    def _close(self) -> None:
        if self._call is not None:
            self._calls.append(ToolCall(self._call, "".join(self._arguments).strip()))
            self._call = None
            self._arguments.clear()

    def _emit(self, text: str, reasoning: bool) -> None:
        if self._call is not None:
            self._arguments.append(text)
        elif text:
            (self._reasoning if reasoning else self._content).append(text)


class _Harmony(ReasoningParser):
    """gpt-oss (vLLM's ``openai_gptoss``): the analysis channel is the reasoning, the final
    (and commentary) channels the answer. Its chat template ends the prompt at
    ``<|start|>assistant``; one that ends inside an analysis message starts the output in it.
    The format has no one tag a grammar could start after, so structured outputs are refused
    beside it."""

    name = "openai_gptoss"
    start = _H_CHANNEL
    end = _H_MESSAGE
    keeps_special_tokens = True

    def stream(self, prompt_open: bool, read_calls: bool = False) -> TextStream[ReasoningStep]:
        return HarmonyStream(read_calls, in_analysis=prompt_open)

    def prompt_opens(self, prompt_text: str) -> bool:
        """Whether the prompt ends inside an analysis message (``...<|channel|>analysis
        <|message|>``): the output then begins with thinking, no header before it."""
        body = prompt_text.rfind(_H_MESSAGE)
        if body < 0 or any(prompt_text.rfind(m) > body for m in _H_ENDS):
            return False
        return _harmony_channel(prompt_text[:body]) == "analysis"


# reasoning parsers that read tool calls out of their own format (no --tool-call-parser)
CALLS_READ = ("openai_gptoss",)
PARSERS: dict[str, ReasoningParser] = {
    p.name: p for p in (_Qwen3(), _DeepSeekR1(), _DeepSeekV3(), _Glm45(), _Harmony())
}


def get_parser(name: str) -> ReasoningParser:
    try:
        return PARSERS[name]
    except KeyError:
        choices = ", ".join(sorted(PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: {choices}") from None
