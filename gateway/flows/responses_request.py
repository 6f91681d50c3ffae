"""A Responses API request (``POST /v1/responses``) checked and turned into the chat request
the chat pipeline runs: ``input`` and ``instructions`` become messages, the flat function tools
chat tools, ``text.format`` the ``response_format``, ``reasoning.effort`` the
``reasoning_effort``, ``max_output_tokens`` the ``max_completion_tokens``. The chat parser then
checks what they share, so both endpoints take and refuse the same values; an error it names
in chat terms (``messages[2]``, ``response_format``) is renamed into this request's.

Built-in tools, background runs, conversations, prompt templates and the other OpenAI fields
this server does not implement are a 400 naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.core.errors import APIError, invalid
from gateway.flows.fields import Fields, require_object
from gateway.flows.protocol import MAX_TOKENS_LIMIT, ChatRequest, parse_chat
from gateway.flows.responses_input import ChatMessages, continues_final, normal_input, to_messages
from gateway.flows.unsupported import CHAT, NEUTRAL, refuse_unknown, refuse_unsupported
from protos.sampling_params import MAX_LOGPROBS

LOGPROBS = "message.output_text.logprobs"
EFFORTS = ("low", "medium", "high")
MAX_INSTRUCTIONS = 1 << 20  # characters
MAX_RESPONSE_ID = 256
# vLLM's extensions of the Responses request, passed to the chat request as they are
PASSED = ("top_k", "min_p", "seed", "stop", "repetition_penalty", "ignore_eos", "logit_bias",
          "priority", "cache_salt", "skip_special_tokens", "include_stop_str_in_output")  # fmt: skip
_BUILT_IN = "built-in tools are not supported (only function tools)"
RESPONSES: dict[str, tuple[str, tuple[Any, ...]]] = {
    "background": ("background responses are not supported: send background false", NEUTRAL),
    "conversation": (
        "conversations are not supported: continue a response with previous_response_id",
        NEUTRAL,
    ),
    "prompt": ("prompt templates are not supported: send instructions and input", NEUTRAL),
    "truncation": (
        "only 'disabled' (an input past the context is a 400, never cut)",
        (None, "disabled"),
    ),
    "context_management": ("context management (compaction) is not supported", NEUTRAL),
    "image": ("image generation is not supported", NEUTRAL),
    "access_programs": ("programmatic tool calling is not supported", NEUTRAL),
    "background_options": ("background responses are not supported", NEUTRAL),
    "structured_outputs": ("send text.format for structured output", NEUTRAL),
    "service_tier": CHAT["service_tier"],
    "moderation": CHAT["moderation"],
    "prompt_cache_retention": CHAT["prompt_cache_retention"],
    "prompt_cache_options": CHAT["prompt_cache_options"],
}
# include values of OpenAI's, all about built-in tools or encrypted state but the one supported
_INCLUDES = {
    "reasoning.encrypted_content": "encrypted reasoning is not supported (reasoning items "
    "come back as text)",
    "message.input_image.image_url": "input image URLs are not echoed",
}


@dataclass(frozen=True)
class ResponsesRequest:
    chat: ChatRequest  # what the chat pipeline runs
    items: list[dict[str, Any]]  # this request's input items, in the normal form
    history: list[dict[str, Any]]  # the previous response's input and output items
    origins: list[str]  # where each chat message came from (errors name it)
    params: dict[str, Any]  # the request's parameters as the response object echoes them
    store: bool
    logprobs: bool  # include has message.output_text.logprobs

    @property
    def context(self) -> list[dict[str, Any]]:
        """Every item the model read (the instructions aside): history, then input."""
        return self.history + self.items


def previous_response_id(body: Any) -> str | None:
    """The response this one continues (looked up before the request is parsed)."""
    f = Fields(require_object(body))
    rid = f.get_str("previous_response_id", None, MAX_RESPONSE_ID)
    if rid == "":
        raise invalid("previous_response_id must be a non-empty string (or left out)",
                      "previous_response_id")  # fmt: skip
    return rid


def _tool(tool: Any, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Responses function tool as echoed and as the chat request's tool."""
    where = f"tools[{i}]"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise invalid(f"{where}.type {kind!r}: {_BUILT_IN}: send "
                      "{'type': 'function', 'name': ..., 'parameters': {...}}", "tools")  # fmt: skip
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise invalid(f"{where}.{unknown[0]} is not a field of a function tool (name, "
                      "description, parameters and strict sit beside type)", "tools")  # fmt: skip
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description must be a string", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    echoed = {"type": "function", "name": tool.get("name"), "description": description,
              "parameters": tool.get("parameters"), "strict": tool.get("strict")}  # fmt: skip
    return echoed, {"type": "function", "function": function}


def _tool_choice(f: Fields, chat_tools: list[dict[str, Any]]) -> Any:
    """The chat request's tool_choice for a Responses one. "auto" is the Responses API's
    default, echoed on every response, so it stays accepted without tools; the chat request
    refuses every other choice but "none" without tools."""
    choice = f.get("tool_choice")
    if choice == "auto" and not chat_tools:
        return None
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind != "function":
        raise invalid(f"tool_choice must be 'none', 'auto', 'required' or "
                      f"{{'type': 'function', 'name': ...}}, got type {kind!r}",
                      "tool_choice")  # fmt: skip
    if not isinstance(choice.get("name"), str) or set(choice) - {"type", "name"}:
        raise invalid("tool_choice {'type': 'function', 'name': ...} needs the name, and only "
                      "it, beside type", "tool_choice")  # fmt: skip
    return {"type": "function", "function": {"name": choice["name"]}}


def _text_format(f: Fields) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``text.format`` as echoed, and the chat request's response_format (None: free text)."""
    text = f.get_dict("text")
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise invalid(f"text.{unknown[0]} is not supported (text takes format)", "text")
    if text.get("verbosity") is not None:
        raise invalid(CHAT["verbosity"][0].replace("verbosity", "text.verbosity", 1), "text")
    fmt = text.get("format")
    if fmt is None:
        fmt = {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object") and isinstance(fmt, dict) and set(fmt) == {"type"}:
        return fmt, None if kind == "text" else {"type": "json_object"}
    if kind != "json_schema":
        raise invalid("text.format must be {'type': 'text'}, {'type': 'json_object'} or "
                      "{'type': 'json_schema', 'name': ..., 'schema': {...}}", "text.format")  # fmt: skip
    unknown = sorted(set(fmt) - {"type", "name", "schema", "strict", "description"})
    if unknown:
        raise invalid(f"text.format.{unknown[0]} is not a field of a json_schema format",
                      "text.format")  # fmt: skip
    schema = {k: v for k, v in fmt.items() if k != "type"}
    return fmt, {"type": "json_schema", "json_schema": schema}


def _reasoning(f: Fields) -> tuple[dict[str, Any] | None, str | None]:
    """``reasoning`` as echoed, and its effort (the chat request's reasoning_effort)."""
    value = f.get("reasoning")
    if value is None:
        return None, None
    reasoning = f.get_dict("reasoning")
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise invalid(f"reasoning.{unknown[0]} is not supported (reasoning takes effort)",
                      "reasoning")  # fmt: skip
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) is not None:
            raise invalid(f"reasoning.{name} is not supported: this server returns the model's "
                          "reasoning as it is, never a summary (leave it out)", "reasoning")  # fmt: skip
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"reasoning.effort must be one of {', '.join(EFFORTS)} (the chat "
                      f"template's reasoning_effort), got {effort!r}", "reasoning.effort")  # fmt: skip
    return {"effort": effort, "summary": None}, effort


def _include(f: Fields) -> bool:
    """``include``: only message.output_text.logprobs is supported; True when it is there."""
    value = f.get("include")
    if value is None:
        return False
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid("include must be a list of strings", "include")
    for v in value:
        if v != LOGPROBS:
            why = _INCLUDES.get(v, "it asks for the output of a built-in tool, which are not "
                                   "supported")  # fmt: skip
            raise invalid(f"include {v!r} is not supported: {why} (only {LOGPROBS!r} is)",
                          "include")  # fmt: skip
    return LOGPROBS in value


def _stream_options(f: Fields, stream: bool) -> None:
    options = f.get_dict("stream_options")
    if options and not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    for key, value in options.items():
        if key != "include_obfuscation" or not isinstance(value, bool | None):
            raise invalid("stream_options takes include_obfuscation (true or false) only",
                          "stream_options")  # fmt: skip
        if value:
            raise invalid("stream_options.include_obfuscation is not supported: no event is "
                          "padded here (send false, or leave it out)", "stream_options")  # fmt: skip


def _tools(f: Fields) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    value = f.get("tools")
    if value is None:
        return [], []
    if not isinstance(value, list):
        raise invalid("tools must be a list of function tools", "tools")
    pairs = [_tool(tool, i) for i, tool in enumerate(value)]
    return [echoed for echoed, _ in pairs], [chat for _, chat in pairs]


def _chat_body(f: Fields, messages: ChatMessages, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request's body; what it leaves out stays as the chat endpoint's default."""
    max_tokens = f.get_int("max_output_tokens", None, 1, MAX_TOKENS_LIMIT)
    continues = continues_final(items)
    body: dict[str, Any] = {
        "model": f.get_str("model", None),
        "messages": messages.messages,
        "max_completion_tokens": max_tokens,
        "stream": f.get_bool("stream", False),
        "user": f.get_str("user", None, 1024),
        "add_generation_prompt": not continues,
        "continue_final_message": continues,
    }
    for name in ("temperature", "top_p", "parallel_tool_calls", *PASSED):
        body[name] = f.get(name)
    return body


def parse_responses(
    raw: Any, defaults: Mapping[str, float] | None, history: list[dict[str, Any]]
) -> ResponsesRequest:
    """``history``: the items of the response ``previous_response_id`` names (its input
    items, then its output items), or none."""
    f = Fields(require_object(raw))
    refuse_unsupported(f.body, RESPONSES)
    items = normal_input(f.get("input"))
    instructions = f.get_str("instructions", None, MAX_INSTRUCTIONS)
    messages = to_messages(instructions, history, items)
    body = _chat_body(f, messages, items)
    tools, chat_tools = _tools(f)
    fmt, response_format = _text_format(f)
    reasoning, effort = _reasoning(f)
    logprobs = _include(f)
    top = f.get_int("top_logprobs", None, 0, MAX_LOGPROBS)
    if top and not logprobs:
        raise invalid(f"top_logprobs needs include [{LOGPROBS!r}]", "top_logprobs")
    _stream_options(f, body["stream"])
    max_tool_calls = f.get_int("max_tool_calls", None, 1, MAX_TOKENS_LIMIT)
    body.update({"tools": chat_tools or None, "tool_choice": _tool_choice(f, chat_tools),
                 "response_format": response_format, "reasoning_effort": effort,
                 "logprobs": logprobs, "top_logprobs": top if logprobs else None})  # fmt: skip
    try:
        chat = parse_chat({k: v for k, v in body.items() if v is not None}, defaults)
    except APIError as e:
        raise renamed(e, messages.origins) from None
    params = {
        "instructions": instructions,
        "max_output_tokens": body["max_completion_tokens"],
        "max_tool_calls": max_tool_calls,
        "metadata": f.get("metadata") or {},
        "parallel_tool_calls": f.get_bool("parallel_tool_calls", True),
        "previous_response_id": f.get_str("previous_response_id", None, MAX_RESPONSE_ID),
        "reasoning": reasoning,
        "text": {"format": fmt},
        "tool_choice": f.get("tool_choice") or "auto",  # OpenAI's default, tools or none
        "tools": tools,
        "top_logprobs": top,
        "truncation": "disabled",
        "user": body["user"],
        "background": False,
    }
    store = f.get_bool("store", True)
    for name in ("prompt_cache_key", "safety_identifier"):  # no effect here, echoed
        params[name] = f.get_str(name, None, 1024)
    refuse_unknown(f, RESPONSES)
    return ResponsesRequest(chat, items, history, messages.origins, params, store, logprobs)


# chat names -> this request's, longest first (in messages and params alike)
_NAMES = (
    ("response_format.json_schema.", "text.format."),
    ("response_format json_schema", "text.format json_schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("reasoning_effort", "reasoning.effort"),
    ("].function.", "]."),
    ("image_url parts", "input_image parts"),
    ("image_url.url", "image_url"),
    ("image_url.detail", "detail"),
)
_MESSAGE_AT = re.compile(r"messages\[(\d+)\]")


def renamed(e: APIError, origins: list[str]) -> APIError:
    """``e`` (from the chat request's parser or pipeline) in this request's terms: a chat
    message is named by the input item it came from, chat fields by their Responses names."""

    def rename(text: str) -> str:
        text = _MESSAGE_AT.sub(
            lambda m: origins[int(m[1])] if int(m[1]) < len(origins) else m[0], text
        )
        for old, new in _NAMES:
            text = text.replace(old, new)
        return text

    e.message = rename(e.message)
    if e.param is not None:
        e.param = "input" if e.param.startswith("messages") else rename(e.param)
    return e
