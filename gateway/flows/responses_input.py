"""The Responses API's ``input`` items, checked and made into the chat messages the chat
pipeline renders.

An item is a message (``role`` user, system, developer or assistant; ``content`` a string or
parts: ``input_text`` and, in a user message, ``input_image``; an assistant's ``output_text`` or
``refusal``), a ``function_call`` (an assistant turn's tool call), a ``function_call_output``
(the tool's answer, a ``tool`` message) or a ``reasoning`` item (the assistant turn's
``reasoning_content``, which templates such as Qwen3's render). Items are kept in one normal
form, each with an id, as ``GET /v1/responses/{id}/input_items`` lists them; the output items of
a stored response are in that form already, so a conversation continued with
``previous_response_id`` converts its history the same way.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.core.errors import invalid

INPUT_ROLES = ("user", "system", "developer")
ROLES = (*INPUT_ROLES, "assistant")
STATUSES = ("in_progress", "completed", "incomplete")
MAX_ITEMS = 4096
# item types of OpenAI's that ask for a built-in tool or a server-side feature
_REFUSED_TYPES = {
    "item_reference": "item references are not supported: send the item itself",
    "computer_call": "built-in tools (computer use) are not supported",
    "computer_call_output": "built-in tools (computer use) are not supported",
    "web_search_call": "built-in tools (web search) are not supported",
    "file_search_call": "built-in tools (file search) are not supported",
    "code_interpreter_call": "built-in tools (code interpreter) are not supported",
    "image_generation_call": "built-in tools (image generation) are not supported",
    "local_shell_call": "built-in tools (shell) are not supported",
    "local_shell_call_output": "built-in tools (shell) are not supported",
    "shell_call": "built-in tools (shell) are not supported",
    "shell_call_output": "built-in tools (shell) are not supported",
    "apply_patch_call": "built-in tools (apply_patch) are not supported",
    "apply_patch_call_output": "built-in tools (apply_patch) are not supported",
    "custom_tool_call": "custom (free-form) tools are not supported: use function tools",
    "custom_tool_call_output": "custom (free-form) tools are not supported: use function tools",
    "mcp_list_tools": "MCP tools are not supported",
    "mcp_approval_request": "MCP tools are not supported",
    "mcp_approval_response": "MCP tools are not supported",
    "mcp_call": "MCP tools are not supported",
    "compaction": "compaction items are not supported",
}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"{where} must be a string", "input")
    return value


def _status(item: dict[str, Any], where: str) -> str:
    status = item.get("status") or "completed"
    if status not in STATUSES:
        raise invalid(f"{where}.status must be one of {', '.join(STATUSES)}, got {status!r}",
                      "input")  # fmt: skip
    return str(status)


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    if part.get("file_id") is not None:
        raise invalid(f"{where}.file_id: files are not supported: send image_url as a data: URL "
                      "(or an https URL where the gateway fetches images)", "input")  # fmt: skip
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise invalid(f"{where} needs image_url (a data: URL, or an https URL where the gateway "
                      "fetches images)", "input")  # fmt: skip
    out = {"type": "input_image", "image_url": url, "detail": part.get("detail") or "auto"}
    return out


_TAKES = {"assistant": "output_text and refusal parts", "user": "input_text and input_image parts"}


def _parts(content: Any, role: str, where: str) -> list[dict[str, Any]]:
    """A message's content as its parts, in the normal form."""
    if isinstance(content, str):
        text_kind = "output_text" if role == "assistant" else "input_text"
        content = [{"type": text_kind, "text": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if role == "assistant" and kind in ("output_text", "input_text"):
            parts.append({"type": "output_text", "text": _text(part.get("text"), f"{at}.text"),
                          "annotations": []})  # fmt: skip
        elif role == "assistant" and kind == "refusal":
            parts.append(
                {"type": "refusal", "refusal": _text(part.get("refusal"), f"{at}.refusal")}
            )
        elif role != "assistant" and kind == "input_text":
            parts.append({"type": "input_text", "text": _text(part.get("text"), f"{at}.text")})
        elif role == "user" and kind == "input_image":
            parts.append(_image_part(part, at))
        else:
            takes = _TAKES.get(role, "input_text parts")
            raise invalid(f"{at}: a {role} message takes {takes}, got {kind!r}",
                          "input")  # fmt: skip
    return parts


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "input")
    parts = _parts(item.get("content"), role, where)
    return {"type": "message", "id": item.get("id") or new_id("msg"), "role": role,
            "status": _status(item, where), "content": parts}  # fmt: skip


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str) or (name != "arguments" and not item[name]):
            raise invalid(f"{where}.{name} must be a non-empty string", "input")
    return {"type": "function_call", "id": item.get("id") or new_id("fc"),
            "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"],
            "status": _status(item, where)}  # fmt: skip


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.call_id must be a non-empty string", "input")
    output = item.get("output")
    if isinstance(output, list):
        output = [
            {"type": "input_text", "text": _text(p.get("text"), f"{where}.output[{j}].text")}
            if isinstance(p, dict) and p.get("type") == "input_text"
            else _no_part(p, f"{where}.output[{j}]")
            for j, p in enumerate(output)
        ]
    elif not isinstance(output, str):
        raise invalid(f"{where}.output must be a string or a list of input_text parts", "input")
    return {"type": "function_call_output", "id": item.get("id") or new_id("fco"),
            "call_id": call_id, "output": output, "status": _status(item, where)}  # fmt: skip


def _no_part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    raise invalid(f"{where}: a function_call_output takes input_text parts (the chat endpoint "
                  f"takes images in user messages only), got {kind!r}", "input")  # fmt: skip


def _reasoning(item: dict[str, Any], where: str) -> dict[str, Any]:
    if item.get("encrypted_content") is not None:
        raise invalid(f"{where}.encrypted_content: encrypted reasoning is not supported (this "
                      "server returns its reasoning as text): send content instead", "input")  # fmt: skip
    out: dict[str, Any] = {"type": "reasoning", "id": item.get("id") or new_id("rs")}
    for key, kind in (("summary", "summary_text"), ("content", "reasoning_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)
            for p in parts
        ):
            raise invalid(f"{where}.{key} must be a list of {kind} parts", "input")
        out[key] = [{"type": kind, "text": p["text"]} for p in parts]
    out["status"] = _status(item, where)
    return out


def normal_item(item: Any, where: str) -> dict[str, Any]:
    """One input item in the normal form (ids given where the client sent none)."""
    if not isinstance(item, dict):
        raise invalid(f"{where} must be an object (a message or an item)", "input")
    if not isinstance(item.get("id", ""), str):
        raise invalid(f"{where}.id must be a string", "input")
    kind = item.get("type", "message")
    if kind == "message":
        return _message(item, where)
    if kind == "function_call":
        return _function_call(item, where)
    if kind == "function_call_output":
        return _call_output(item, where)
    if kind == "reasoning":
        return _reasoning(item, where)
    why = _REFUSED_TYPES.get(str(kind))
    if why is not None:
        raise invalid(f"{where}.type {kind!r}: {why}", "input")
    raise invalid(f"{where}.type must be message, function_call, function_call_output or "
                  f"reasoning, got {kind!r}", "input")  # fmt: skip


def normal_input(value: Any) -> list[dict[str, Any]]:
    """``input``: a string (one user message) or a list of items, in the normal form."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input is required: a string or a non-empty list of items", "input")
    if len(value) > MAX_ITEMS:
        raise invalid(f"input may hold at most {MAX_ITEMS} items, got {len(value)}", "input")
    return [normal_item(item, f"input[{i}]") for i, item in enumerate(value)]


@dataclass
class ChatMessages:
    """Chat messages and, for each, where it came from (``instructions``, ``input[3]``, the
    previous response's items): an error about ``messages[k]`` names that place instead."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)

    def add(self, message: dict[str, Any], origin: str) -> None:
        self.messages.append(message)
        self.origins.append(origin)

    def _open_assistant(self) -> dict[str, Any] | None:
        last = self.messages[-1] if self.messages else None
        return last if last is not None and last["role"] == "assistant" else None

    def add_item(self, item: dict[str, Any], origin: str) -> None:
        """One normal item; an assistant turn's reasoning, text and calls join one message."""
        kind = item["type"]
        turn = self._open_assistant()
        if kind == "message":
            content = _chat_content(item)
            if item["role"] != "assistant":
                self.add({"role": item["role"], "content": content}, origin)
            elif turn is not None and not turn["content"] and "tool_calls" not in turn:
                turn["content"] = content  # the text after its reasoning
            else:
                self.add({"role": "assistant", "content": content}, origin)
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if turn is not None:
                turn.setdefault("tool_calls", []).append(call)
            else:
                self.add({"role": "assistant", "content": "", "tool_calls": [call]}, origin)
        elif kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else "".join(p["text"] for p in output)
            self.add({"role": "tool", "tool_call_id": item["call_id"], "content": text}, origin)
        else:  # reasoning: a new assistant turn begins with it
            parts = item["content"] or item["summary"]
            text = "".join(p["text"] for p in parts)
            self.add({"role": "assistant", "content": "", "reasoning_content": text}, origin)


def _chat_content(item: dict[str, Any]) -> str | list[dict[str, Any]]:
    parts = item["content"]
    if not any(p["type"] == "input_image" for p in parts):
        return "".join(p.get("text", p.get("refusal", "")) for p in parts)
    out: list[dict[str, Any]] = []
    for p in parts:
        if p["type"] == "input_image":
            url = {"url": p["image_url"], "detail": p["detail"]}
            out.append({"type": "image_url", "image_url": url})
        else:
            out.append({"type": "text", "text": p["text"]})
    return out


def check_call_outputs(items: list[dict[str, Any]], where: list[str]) -> None:
    """Each function_call_output answers a function_call before it, and each function_call
    has its output after it (both as OpenAI checks)."""
    calls: dict[str, str] = {}  # call_id -> where the call is, while it has no output
    answered: set[str] = set()
    for item, at in zip(items, where, strict=True):
        if item["type"] == "function_call":
            calls.setdefault(item["call_id"], at)
        elif item["type"] == "function_call_output":
            if item["call_id"] not in calls:
                raise invalid(
                    f"{at}: no function_call found for function_call_output with call_id "
                    f"{item['call_id']!r} (send the call before its output, or continue the "
                    "response that made it with previous_response_id)",
                    "input",
                )
            answered.add(item["call_id"])
    for call_id, at in calls.items():
        if call_id not in answered:
            raise invalid(
                f"{at}: no tool output found for function call {call_id!r}: send a "
                "function_call_output item with this call_id after it (the function's result)",
                "input",
            )


def to_messages(
    instructions: str | None,
    history: list[dict[str, Any]],
    items: list[dict[str, Any]],
) -> ChatMessages:
    """The chat messages: the instructions as a system message first, then the previous
    response's items (its input and output: ``history``), then this request's ``input``."""
    out = ChatMessages()
    if instructions:
        out.add({"role": "system", "content": instructions}, "instructions")
    where = [f"previous_response_id's item {i}" for i in range(len(history))]
    where += [f"input[{i}]" for i in range(len(items))]
    check_call_outputs(history + items, where)
    for item, at in zip(history + items, where, strict=True):
        out.add_item(item, at)
    return out


def continues_final(items: list[dict[str, Any]]) -> bool:
    """The input ends with an assistant message the client began (status in_progress or
    incomplete): the model goes on with it (vLLM's partial completion), no new turn."""
    last = items[-1] if items else None
    return (
        last is not None
        and last["type"] == "message"
        and last["role"] == "assistant"
        and last["status"] in ("in_progress", "incomplete")
    )
