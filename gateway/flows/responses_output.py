"""A chat choice's output as the Responses API's output items and stream events.

The chat pipeline reads the generated text (``ChoiceOutput``: reasoning, tool calls, content);
here its assistant message becomes items (a ``reasoning`` item, a ``message`` with one
``output_text`` part, a ``function_call`` per call) and its stream of deltas becomes OpenAI's
semantic events: an item is added, its content part added, its text streamed as deltas, then
each is done in reverse, and the response ends with ``response.completed`` (or
``response.incomplete``, ``response.failed``). Every event carries a ``sequence_number``.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.flows.responses_input import new_id

Event = dict[str, Any]
Delta = dict[str, Any]


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The response's status and incomplete_details for the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    if finish_reason == "abort":
        return "failed", None
    return "completed", None


def usage(prompt: int, completion: int, cached: int, reasoning: int) -> dict[str, Any]:
    """OpenAI's Responses usage. ``cache_write_tokens`` is 0: the prefix cache is implicit
    (OpenAI counts writes of explicit caching only)."""
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + completion,
    }


def response_object(
    response_id: str, model: str, params: dict[str, Any], created_at: int
) -> dict[str, Any]:
    """The response before any output: ``params`` are the request's, echoed."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": model,
        "output": [],
        "usage": None,
        **params,
    }


def finished(
    response: dict[str, Any],
    items: list[dict[str, Any]],
    finish_reason: str | None,
    usage_body: dict[str, Any],
) -> dict[str, Any]:
    status, details = status_of(finish_reason)
    error = None
    if status == "failed":
        error = {"code": "server_error",
                 "message": "the request was aborted before it finished (the gateway shut down)"}  # fmt: skip
    return {**response, "status": status, "incomplete_details": details, "error": error,
            "output": items, "usage": usage_body, "completed_at": int(time.time())}  # fmt: skip


def _reasoning_item(text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}  # fmt: skip


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def _message_item(part: dict[str, Any], status: str) -> dict[str, Any]:
    return {"type": "message", "id": new_id("msg"), "role": "assistant", "status": status,
            "content": [part]}  # fmt: skip


def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": new_id("fc"), "call_id": call["id"],
            "name": fn["name"], "arguments": fn["arguments"], "status": status}  # fmt: skip


def output_items(
    message: dict[str, Any], status: str, logprobs: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The items of a chat choice's whole assistant message: its reasoning, its text (also an
    empty one, where nothing else came), its calls. ``logprobs``: the output's, when asked."""
    item_status = "incomplete" if status == "incomplete" else "completed"
    items = []
    reasoning = message.get("reasoning_content")
    if reasoning:
        items.append(_reasoning_item(reasoning, item_status))
    content = message.get("content") or ""
    calls = message.get("tool_calls") or []
    if content or not (calls or reasoning):
        items.append(_message_item(_text_part(content, logprobs), item_status))
    items += [_call_item(call, item_status) for call in calls]
    return items


def output_text(items: list[dict[str, Any]]) -> str:
    """The text of the message items (what the client's ``output_text`` helper joins)."""
    return "".join(
        part["text"]
        for item in items
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


class EventWriter:
    """One response's stream events, from the chat deltas of its one choice.

    At most one text item (a message or a reasoning item) is open at a time: text of the other
    kind closes it and opens a new one. Function calls open when announced and take their
    argument deltas until the response ends."""

    def __init__(self, response: dict[str, Any], logprobs: bool) -> None:
        self.response = response
        self.items: list[dict[str, Any]] = []
        self._seq = 0
        self._text: int | None = None  # the open text item's output index
        self._calls: dict[int, int] = {}  # chat tool call index -> output index
        self._open_calls: list[int] = []
        self._logprobs = logprobs
        self._pending: list[dict[str, Any]] = []  # logprobs not yet sent with text
        self._all: list[dict[str, Any]] = []

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _lifecycle(self, kind: str, response: dict[str, Any]) -> Event:
        return self._event(kind, response=response)

    def start(self) -> list[Event]:
        return [self._lifecycle("response.created", self.response),
                self._lifecycle("response.in_progress", self.response)]  # fmt: skip

    def feed(self, deltas: list[Delta], logprobs: list[dict[str, Any]]) -> list[Event]:
        """Events for a chunk's deltas; ``logprobs`` (the chunk's, when asked) ride on the
        next text delta of the message."""
        self._pending += logprobs
        self._all += logprobs
        events: list[Event] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                events += self._text_delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text_delta("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
        return events

    def _ids(self, index: int) -> dict[str, Any]:
        return {"item_id": self.items[index]["id"], "output_index": index}

    def _open(self, item: dict[str, Any], part: dict[str, Any] | None) -> list[Event]:
        index = len(self.items)
        self.items.append(item)
        events = [self._event("response.output_item.added", output_index=index,
                              item={**item, "content": []} if part else dict(item))]  # fmt: skip
        if part is not None:
            events.append(self._event("response.content_part.added", **self._ids(index),
                                      content_index=0, part=part))  # fmt: skip
        return events

    def _text_delta(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self._text is not None and self.items[self._text]["type"] != kind:
            events += self._close_text("completed")
        if self._text is None:
            self._text = len(self.items)
            if kind == "message":
                part = _text_part("", [] if self._logprobs else None)
                item = _message_item(part, "in_progress")
            else:
                item = _reasoning_item("", "in_progress")
            events += self._open(item, dict(item["content"][0]))
        index = self._text
        part = self.items[index]["content"][0]
        part["text"] += text
        if kind == "reasoning":
            delta = self._event("response.reasoning_text.delta", **self._ids(index),
                                content_index=0, delta=text)  # fmt: skip
            return [*events, delta]
        sent, self._pending = self._pending, []
        if self._logprobs:
            part["logprobs"] += sent
        delta = self._event("response.output_text.delta", **self._ids(index), content_index=0,
                            delta=text, logprobs=sent)  # fmt: skip
        return [*events, delta]

    def _close_text(self, status: str) -> list[Event]:
        index, self._text = self._text, None
        assert index is not None
        item = self.items[index]
        part = item["content"][0]
        item["status"] = status
        if item["type"] == "message":
            done = self._event("response.output_text.done", **self._ids(index), content_index=0,
                               text=part["text"], logprobs=part.get("logprobs") or [])  # fmt: skip
        else:
            done = self._event("response.reasoning_text.done", **self._ids(index),
                               content_index=0, text=part["text"])  # fmt: skip
        return [done,
                self._event("response.content_part.done", **self._ids(index), content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=item)]  # fmt: skip

    def _call_delta(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        fn = call.get("function") or {}
        if call["index"] not in self._calls:  # announced: its id and name
            if self._text is not None:
                events += self._close_text("completed")
            self._calls[call["index"]] = len(self.items)
            self._open_calls.append(len(self.items))
            events += self._open(_call_item({**call, "function": {**fn, "arguments": ""}},
                                            "in_progress"), None)  # fmt: skip
        index = self._calls[call["index"]]
        arguments = fn.get("arguments") or ""
        if arguments:
            self.items[index]["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", **self._ids(index),
                                      delta=arguments))  # fmt: skip
        return events

    def finish(self, finish_reason: str | None, usage_body: dict[str, Any]) -> list[Event]:
        """Closes what is open and ends the response."""
        status, _ = status_of(finish_reason)
        item_status = "incomplete" if status == "incomplete" else "completed"
        events = []
        if not self.items:  # nothing was generated: an empty message, as a whole response's
            self._text = len(self.items)
            item = _message_item(_text_part("", [] if self._logprobs else None), "in_progress")
            events += self._open(item, dict(item["content"][0]))
        if self._text is not None:
            events += self._close_text(item_status)
        for index in self._open_calls:
            item = self.items[index]
            item["status"] = item_status
            events += [self._event("response.function_call_arguments.done", **self._ids(index),
                                   name=item["name"], arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=index, item=item)]  # fmt: skip
        self._open_calls = []
        if self._logprobs:  # the message holds all the output's logprobs, as a whole response's
            for item in self.items:
                if item["type"] == "message":
                    item["content"][0]["logprobs"] = self._all
                    break
        self.response = finished(self.response, self.items, finish_reason, usage_body)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
        return [*events, self._lifecycle(kind.get(status, "response.failed"), self.response)]

    def failed(self, error: dict[str, Any]) -> list[Event]:
        """An error mid-stream: an ``error`` event, then ``response.failed``."""
        self.response = {**self.response, "status": "failed", "output": self.items,
                         "error": {"code": "server_error" if error.get("type") == "server_error"
                                   else "invalid_prompt", "message": error["message"]}}  # fmt: skip
        return [self._event("error", code=error.get("code"), message=error["message"],
                            param=error.get("param")),
                self._lifecycle("response.failed", self.response)]  # fmt: skip
