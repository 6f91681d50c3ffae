"""OpenAI request bodies parsed into plain, validated dataclasses.

Every known field with a wrong type or value is a 400 that names it, and so is a field of
``gateway.flows.unsupported``'s tables that asks for something not implemented, an unknown field
of the body (``unsupported.refuse_unknown``) and one of a message (``messages[0].foo``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from gateway.core.errors import invalid
from gateway.flows.fields import (
    INT32_MAX,
    INT64_MAX,
    Fields,
    check_int,
    check_keys,
    kind_of,
    require_object,
)
from gateway.flows.image_fetch import ImageURL
from gateway.flows.images import image_from_part
from gateway.flows.structured import parse_structured
from gateway.flows.tools import ToolPlan, parse_tools
from gateway.flows.unsupported import (
    CHAT,
    COMPLETION,
    SAMPLING,
    TOKENIZE,
    refuse_unknown,
    refuse_unsupported,
)
from protos.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    InvalidRequestError,
    SamplingParams,
    logit_bias_pairs,
)

MAX_N = 128
MAX_TOKENS_LIMIT = 1 << 24  # beyond any context length; the context check is stricter
MAX_PROMPTS = 256
MAX_CACHE_SALT = 1024  # characters
MAX_REQUEST_ID = 256  # characters
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# The fields a message of each role may have: OpenAI's message params and vLLM's (its
# reasoning_content and reasoning on an assistant turn, a name on a tool result). An assistant
# turn also takes what a response's message carries (annotations, audio, the deprecated
# function_call), so that a client can send an answer back as it got it.
_PLAIN_FIELDS = frozenset({"role", "content", "name"})
_ASSISTANT_FIELDS = frozenset({"tool_calls", "refusal", "reasoning_content", "reasoning",
                               "function_call", "annotations", "audio"})  # fmt: skip
MESSAGE_FIELDS: dict[str, frozenset[str]] = {
    "system": _PLAIN_FIELDS,
    "developer": _PLAIN_FIELDS,
    "user": _PLAIN_FIELDS,
    "assistant": _PLAIN_FIELDS | _ASSISTANT_FIELDS,
    "tool": _PLAIN_FIELDS | {"tool_call_id"},
}
# the optional fields of a message that are text (null: not given)
_TEXT_FIELDS = ("name", "tool_call_id", "refusal", "reasoning_content", "reasoning")

Prompt = str | tuple[int, ...]


@dataclass(frozen=True)
class CommonOptions:
    model: str | None
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool  # vLLM's stream_options.continuous_usage_stats
    max_tokens: int | None  # None: the endpoint's default
    sampling: SamplingParams  # max_tokens still to be set per prompt
    priority: int
    user: str | None
    add_special_tokens: bool
    truncate_prompt_tokens: int | None = None  # parse_truncation's
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N" (any token, even one
    # that is part of a character, is then told apart)
    token_id_logprobs: bool = False
    request_id: str | None = None  # parse_request_id's
    max_tokens_field: str = "max_tokens"  # or max_completion_tokens: the one the client sent


@dataclass(frozen=True)
class CompletionRequest:
    common: CommonOptions
    prompts: tuple[Prompt, ...]
    echo: bool
    logprobs: int | None
    score_only: bool = False  # max_tokens 0 with echo: the prompt's logprobs, nothing generated
    # vLLM's prompt_logprobs: the alternatives asked for (None: not asked; echo with logprobs
    # widens what the workers compute, not what this field shows)
    prompt_logprobs: int | None = None


@dataclass(frozen=True)
class ChatRequest:
    common: CommonOptions
    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    logprobs: bool
    top_logprobs: int
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    continue_final_message: bool = False  # the prompt ends inside the final message
    # vLLM's echo: the reply's content starts with the final message's, when that message is
    # the assistant's (an answer the client began)
    echo: bool = False
    tools: ToolPlan | None = None  # None: no tools offered
    # OpenAI's reasoning_effort, a variable of the chat template (gpt-oss's reads it)
    reasoning_effort: str | None = None
    # of the image_url parts, in order: encoded bytes, or an http(s) URL still to fetch
    images: tuple[bytes | ImageURL, ...] = ()


# OpenAI's include_usage and vLLM's continuous_usage_stats (usage so far in every chunk);
# OpenAI's include_obfuscation only as false (no chunk is padded here: true is a 400)
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats", "include_obfuscation")


def _sampling(
    f: Fields, max_tokens: int | None, logprobs: int | None, defaults: Mapping[str, float]
) -> SamplingParams:
    """``defaults``: the model's generation config (GatewayConfig.generation_defaults), for the
    fields the request leaves out; else vLLM's neutral values."""
    min_tokens = f.get_int("min_tokens", 0, 0, INT32_MAX) or 0
    # vLLM's spaces_between_special_tokens changes only a slow tokenizer's text: the fast
    # tokenizers served here (and vLLM's with them) join special tokens as their decoder does
    # either way, so both values are the same request (read, so checked as a bool)
    f.get_bool("spaces_between_special_tokens", True)
    try:
        return SamplingParams(
            # OpenAI's range, which vLLM (0.24 on) holds requests to as well
            temperature=f.get_float("temperature", defaults.get("temperature", 1.0), 0.0, 2.0),
            top_p=f.get_float("top_p", defaults.get("top_p", 1.0), -1e9, 1e9),
            top_k=f.get_int("top_k", int(defaults.get("top_k", 0)), -1, INT32_MAX) or 0,
            min_p=f.get_float("min_p", defaults.get("min_p", 0.0), -1e9, 1e9),
            seed=_seed(f),
            presence_penalty=f.get_float("presence_penalty", 0.0, -1e9, 1e9),
            frequency_penalty=f.get_float("frequency_penalty", 0.0, -1e9, 1e9),
            repetition_penalty=f.get_float(
                "repetition_penalty", defaults.get("repetition_penalty", 1.0), -1e9, 1e9
            ),
            max_tokens=max_tokens if max_tokens is not None else max(1, min_tokens),
            min_tokens=min_tokens,
            stop=f.str_list("stop", MAX_STOP_STRINGS, 1024),
            stop_token_ids=f.int_list("stop_token_ids", 256),
            ignore_eos=f.get_bool("ignore_eos", False),
            logprobs=logprobs,
            include_stop_str_in_output=f.get_bool("include_stop_str_in_output", False),
            skip_special_tokens=f.get_bool("skip_special_tokens", True),
            logit_bias=logit_bias_pairs(_logit_bias(f)),
            structured=parse_structured(f),
            prompt_logprobs=f.get_int("prompt_logprobs", None, 0, MAX_LOGPROBS),
            cache_salt=_cache_salt(f),
            allowed_token_ids=_allowed_token_ids(f),
            bad_words=f.str_list("bad_words", MAX_BAD_WORDS, 256),
        )
    except InvalidRequestError as e:
        raise invalid(str(e), e.param) from e


def _seed(f: Fields) -> int | None:
    """The request's ``seed``; -1 asks for none, as vLLM reads it (a fresh draw each time)."""
    seed = f.get_int("seed", None, -INT64_MAX, INT64_MAX)
    return None if seed == -1 else seed


def _allowed_token_ids(f: Fields) -> tuple[int, ...]:
    """vLLM's ``allowed_token_ids``: a non-empty list when given (null: any token)."""
    if f.get("allowed_token_ids") == []:
        raise invalid(
            "allowed_token_ids must list at least one token id (or be left out)",
            "allowed_token_ids",
        )
    return f.int_list("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS)


def _cache_salt(f: Fields) -> str:
    """vLLM's ``cache_salt``: a non-empty string when given (null: none)."""
    salt = f.get_str("cache_salt", None, MAX_CACHE_SALT)
    if salt == "":
        raise invalid("cache_salt must be a non-empty string (or left out)", "cache_salt")
    return salt or ""


def _logit_bias(f: Fields) -> dict[str, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys) to numbers in [-100, 100]; the
    ranges are SamplingParams' to check."""
    bias = f.get_dict("logit_bias")
    for token, value in bias.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise invalid(f"logit_bias[{token!r}] must be a number, got {value!r}", "logit_bias")
    return bias


def _common(
    f: Fields,
    max_tokens_field: str,
    logprobs: int | None,
    special: bool,
    defaults: Mapping[str, float],
) -> CommonOptions:
    max_tokens = f.get_int(max_tokens_field, None, 1, MAX_TOKENS_LIMIT)
    stream = f.get_bool("stream", False)
    options = f.get_dict("stream_options")
    if f.get("stream_options") is not None and not stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise invalid(f"stream_options.{key} is not supported (known: "
                          f"{', '.join(STREAM_OPTIONS)})", "stream_options")  # fmt: skip
        if not isinstance(value, bool | None):
            raise invalid(f"stream_options.{key} must be true or false", "stream_options")
    if options.get("include_obfuscation"):
        raise invalid(
            "stream_options.include_obfuscation is not supported: this server pads no chunk "
            "with an obfuscation field (send false, or leave it out)",
            "stream_options",
        )
    include_usage = options.get("include_usage")
    return CommonOptions(
        model=f.get_str("model", None),
        n=f.get_int("n", 1, 1, MAX_N) or 1,
        stream=stream,
        include_usage=bool(include_usage),
        # vLLM's: the usage in every chunk only beside include_usage (alone, no usage at all)
        continuous_usage=bool(include_usage) and bool(options.get("continuous_usage_stats")),
        max_tokens=max_tokens,
        sampling=_sampling(f, max_tokens, logprobs, defaults),
        priority=f.get_int("priority", 0, -INT32_MAX, INT32_MAX) or 0,
        user=f.get_str("user", None, 1024),
        add_special_tokens=f.get_bool("add_special_tokens", special),
        truncate_prompt_tokens=parse_truncation(f),
        token_id_logprobs=f.get_bool("return_tokens_as_token_ids", False),
        request_id=parse_request_id(f),
        max_tokens_field=max_tokens_field,
    )


def parse_request_id(f: Fields) -> str | None:
    """vLLM's ``request_id``: the response's id is the endpoint's prefix and it
    (``chatcmpl-ID``), so a client finds its request in traces and logs (None: a random id)."""
    rid = f.get_str("request_id", None, MAX_REQUEST_ID)
    if rid == "":
        raise invalid("request_id must be a non-empty string (or left out)", "request_id")
    return rid


def parse_truncation(f: Fields) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: keep only the prompt's last N tokens (-1: as many as
    the model's context length holds); None: the prompt as it is (prepare.keep_last)."""
    keep = f.get_int("truncate_prompt_tokens", None, -1, INT32_MAX)
    if keep == 0:
        raise invalid(
            "truncate_prompt_tokens must be at least 1 (the prompt's last N tokens are kept), "
            "or -1 (as many as the model's context length holds)",
            "truncate_prompt_tokens",
        )
    return keep


def _prompts(value: Any) -> tuple[Prompt, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid(
            "prompt must be a non-empty string, a list of strings, a list of token ids "
            "or a list of lists of token ids",
            "prompt",
        )
    if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
        value = [value]
    elif not (all(isinstance(p, str) for p in value) or all(isinstance(p, list) for p in value)):
        raise invalid(  # OpenAI's four forms; a list mixing them is none of them
            "prompt must be a string, a list of strings, a list of token ids or a list of lists "
            "of token ids, not a list mixing them",
            "prompt",
        )
    if len(value) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}", "prompt")
    prompts: list[Prompt] = []
    for p in value:
        if isinstance(p, str):
            prompts.append(p)
        elif isinstance(p, list):
            prompts.append(tuple(check_int(t, "prompt", 0, INT32_MAX) for t in p))
        else:
            raise invalid("each prompt must be a string or a list of token ids", "prompt")
        if len(prompts[-1]) == 0:
            raise invalid("prompt must not be empty", "prompt")
    return tuple(prompts)


def _check_unsupported_completion(f: Fields, n: int) -> None:
    """``suffix`` (insertion) and ``best_of`` (server-side ranking) would be silently ignored:
    refuse them. An empty suffix and best_of 1 ask for nothing and pass."""
    suffix = f.get_str("suffix", None, 1 << 20)
    if suffix:
        raise invalid("suffix is not supported (no insertion/fill-in-the-middle)", "suffix")
    best_of = f.get_int("best_of", None, 1, INT32_MAX)
    if best_of is not None and best_of > 1:
        raise invalid(
            "best_of is not supported (only 1): ask for n choices and rank them yourself",
            "best_of",
        )
    if best_of is not None and best_of < n:
        raise invalid(f"best_of must be at least n ({n}), got {best_of}", "best_of")


def parse_completion(body: Any, defaults: Mapping[str, float] | None = None) -> CompletionRequest:
    f = Fields(require_object(body))
    refuse_unsupported(f.body, SAMPLING)
    refuse_unsupported(f.body, COMPLETION)
    if f.get("prompt") is None:
        raise invalid("prompt is required", "prompt")
    logprobs = f.get_int("logprobs", None, 0, MAX_LOGPROBS)
    echo = f.get_bool("echo", False)
    score_only = f.get("max_tokens") == 0 and not isinstance(f.get("max_tokens"), bool)
    if score_only and not echo:
        raise invalid("max_tokens 0 needs echo: it scores the prompt without generating",
                      "max_tokens")  # fmt: skip
    if score_only:  # one token is generated and dropped: the workers always sample one
        f = f.updated(max_tokens=1)
    common = _common(f, "max_tokens", logprobs, special=True, defaults=defaults or {})
    prompt_logprobs = common.sampling.prompt_logprobs
    if echo and logprobs is not None:  # the echoed prompt's tokens get their logprobs too
        wanted = max(logprobs, common.sampling.prompt_logprobs or 0)
        common = replace(common, sampling=replace(common.sampling, prompt_logprobs=wanted))
    _check_unsupported_completion(f, common.n)
    request = CompletionRequest(
        common=common,
        prompts=_prompts(f.get("prompt")),
        echo=echo,
        logprobs=logprobs,
        score_only=score_only,
        prompt_logprobs=prompt_logprobs,
    )
    refuse_unknown(f, SAMPLING, COMPLETION)
    return request


def _content(
    message: dict[str, Any], index: int, role: str, images: list[bytes | ImageURL]
) -> str | list[dict[str, Any]]:
    """The content as templates read it: a string, or (with images) the parts with each image
    as ``{"type": "image"}``; the images' bytes are appended to ``images``."""
    content = message.get("content")
    param = f"messages[{index}].content"
    if (content is None or content == []) and (
        role != "assistant" or not message.get("tool_calls")
    ):
        # only an assistant turn carrying tool calls may come without content (as OpenAI)
        what = (
            "an assistant message without tool_calls"
            if role == "assistant"
            else f"a {role} message"
        )
        raise invalid(f"{param} is required for {what} (a string or text parts)", param)
    if content is None:  # an assistant turn with tool calls only; templates expect a string
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param} must be a string or a list of text and image_url parts", param)
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url" and role == "user":
            images.append(image_from_part(part, param))
            parts.append({"type": "image"})
            continue
        # OpenAI's refusal part of an earlier answer is read as its text (as vLLM reads it)
        key = "refusal" if kind == "refusal" and role == "assistant" else "text"
        if kind != key:
            raise invalid(f"{param}: only text parts (image_url parts in a user message, "
                          "refusal parts in an assistant one) are supported", param)  # fmt: skip
        if not isinstance(part.get(key), str):
            raise invalid(f"{param}: a {key} part needs a '{key}' string", param)
        parts.append({"type": "text", "text": part[key]})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def parse_messages(value: Any) -> list[dict[str, Any]]:
    """The messages of a request that takes no images (a 400 if they hold any)."""
    messages, images = parse_chat_messages(value)
    if images:
        raise invalid("this endpoint does not take images: send text parts only", "messages")
    return messages


def parse_chat_messages(
    value: Any,
) -> tuple[list[dict[str, Any]], tuple[bytes | ImageURL, ...]]:
    """The messages as chat templates read them, and the images of their image_url parts."""
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    images: list[bytes | ImageURL] = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"messages[{i}].role must be a non-empty string", "messages")
        if role not in CHAT_ROLES:
            raise invalid(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                "messages",
            )
        _check_message_fields(message, i, role)
        content = _content(message, i, role, images)
        # OpenAI's newer name for system; chat templates only know system
        role = "system" if role == "developer" else role
        out.append(_tool_call_message({**message, "role": role, "content": content}, i))
    return out, tuple(images)


def _check_message_fields(message: dict[str, Any], index: int, role: str) -> None:
    """A 400 for a field the message's role does not have (as for an unknown field of the
    request: a misspelt one must not quietly do nothing) and for a text field that is no text."""
    what = f"{'an' if role == 'assistant' else 'a'} {role} message"
    for name in message:
        if name not in MESSAGE_FIELDS[role]:
            param = f"messages[{index}].{name}"
            raise invalid(
                f"Unrecognized field in {what}: {param} ({what} takes "
                f"{', '.join(sorted(MESSAGE_FIELDS[role]))}; drop it)",
                param,
            )
    for name in _TEXT_FIELDS:
        value = message.get(name)
        if value is not None and not isinstance(value, str):
            param = f"messages[{index}].{name}"
            raise invalid(f"{param} must be a string, got {kind_of(value)}", param)
    call = message.get("function_call")
    if call is not None and not isinstance(call, dict):
        param = f"messages[{index}].function_call"
        raise invalid(f"{param} must be an object, got {kind_of(call)}", param)


def _tool_call_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """An assistant turn's ``tool_calls`` as chat templates read them: each call's arguments as
    an object (OpenAI sends them as JSON text)."""
    calls = message.get("tool_calls")
    if calls is None:
        return message
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise invalid(f"{param} must be a list of tool calls", param)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{param}: each call needs a function with a name", param)
        # a streamed call's deltas carry an index, which clients keep when they put it back
        check_keys(call, ("id", "type", "function", "index"), f"{param}[{j}]", param)
        check_keys(fn, ("name", "arguments"), f"{param}[{j}].function", param)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise invalid(f"{param}: function.arguments is not valid JSON: {e}", param) from e
        out.append({**call, "function": {**fn, "arguments": args}})
    return {**message, "tool_calls": out}


def _with_tools(f: Fields, common: CommonOptions) -> tuple[CommonOptions, ToolPlan | None]:
    """The tools offered; a required or named tool choice becomes the request's grammar."""
    plan = parse_tools(f)
    constraint = plan.constraint() if plan is not None else None
    if constraint is None:
        return common, plan
    if common.sampling.structured is not None:
        raise invalid(
            "a structured output format cannot be combined with tool_choice 'required' or a "
            "named function (the tool call's schema is the format)",
            "tool_choice",
        )
    # what the workers compile came from the tools: a refusal of it names them
    constraint = replace(constraint, source="tools")
    return replace(common, sampling=replace(common.sampling, structured=constraint)), plan


def _template_flag(f: Fields, kwargs: dict[str, Any], name: str, default: bool) -> bool:
    """A flag of the template given as a field, or (as vLLM lets it) in chat_template_kwargs;
    both, with different values, is a 400."""
    field = f.get(name)
    value = f.get_bool(name, default)
    if name not in kwargs:
        return value
    given = kwargs.pop(name)
    if not isinstance(given, bool):
        raise invalid(f"chat_template_kwargs.{name} must be true or false", "chat_template_kwargs")
    if field is not None and field != given:
        raise invalid(
            f"{name} is {str(field).lower()} but chat_template_kwargs.{name} is "
            f"{str(given).lower()}: give it once",
            "chat_template_kwargs",
        )
    return given


def template_options(
    f: Fields, add_generation_default: bool = True
) -> tuple[bool, bool, dict[str, Any]]:
    """``add_generation_prompt``, vLLM's ``continue_final_message`` and the remaining
    ``chat_template_kwargs``. The first starts a new assistant turn after the messages, the
    second leaves the final message open for the model to go on with (an answer the client
    began). As in vLLM the first defaults to true and both true is a 400, so a continuation
    sends ``add_generation_prompt: false`` (vLLM's check sees only fields given, but its
    template renderer then refuses the default true beside ``continue_final_message``). Either
    may come in chat_template_kwargs; ``messages`` and ``documents`` there are a 400 (the
    messages are the request's own; documents are not supported). vLLM's chat-style embeddings
    request defaults ``add_generation_prompt`` to false (``add_generation_default``)."""
    kwargs = dict(f.get_dict("chat_template_kwargs"))
    for name, why in (
        ("messages", "the template's messages are the request's messages field"),
        ("documents", "documents (RAG templates) are not supported"),
    ):
        if name in kwargs:
            raise invalid(f"chat_template_kwargs.{name}: {why}", "chat_template_kwargs")
    continue_final = _template_flag(f, kwargs, "continue_final_message", False)
    add_generation_prompt = _template_flag(
        f, kwargs, "add_generation_prompt", add_generation_default
    )
    if continue_final and add_generation_prompt:
        raise invalid(
            "continue_final_message and add_generation_prompt cannot both be true: the first "
            "continues the final message, the second starts a new one (and defaults to true, "
            "as in vLLM); send add_generation_prompt: false with continue_final_message: true",
            "add_generation_prompt",
        )
    return add_generation_prompt, continue_final, kwargs


def parse_chat(body: Any, defaults: Mapping[str, float] | None = None) -> ChatRequest:
    f = Fields(require_object(body))
    messages, images = parse_chat_messages(f.get("messages"))
    refuse_unsupported(f.body, SAMPLING)
    refuse_unsupported(f.body, CHAT)
    logprobs = f.get_bool("logprobs", False)
    top = f.get_int("top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and top > 0 and not logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    # max_completion_tokens wins over the deprecated max_tokens; both are checked
    given = [name for name in ("max_completion_tokens", "max_tokens") if f.get(name) is not None]
    for name in given:
        f.get_int(name, None, 1, MAX_TOKENS_LIMIT)
    max_field = given[0] if given else "max_tokens"
    add_generation_prompt, continue_final, kwargs = template_options(f)
    effort = _reasoning_effort(f, kwargs)
    common, tools = _with_tools(
        f,
        _common(
            f, max_field, (top or 0) if logprobs else None, special=False, defaults=defaults or {}
        ),
    )
    request = ChatRequest(
        common=common,
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        echo=f.get_bool("echo", False),
        logprobs=logprobs,
        top_logprobs=top or 0,
        template_kwargs=_with_tools_variable(f, tools, kwargs),
        tools=tools,
        images=images,
        reasoning_effort=effort,
    )
    refuse_unknown(f, SAMPLING, CHAT)
    return request


REASONING_EFFORTS = ("low", "medium", "high")  # vLLM's (gpt-oss's template renders each)


def _reasoning_effort(f: Fields, kwargs: dict[str, Any]) -> str | None:
    """OpenAI's ``reasoning_effort``, as vLLM serves it: the chat template's
    ``reasoning_effort`` variable (gpt-oss's system message says "Reasoning: high"). Given in
    chat_template_kwargs too, the two must agree. Whether the template reads it at all is
    checked where the template is known (a 400 there, not a field quietly ignored)."""
    effort = f.get_str("reasoning_effort", None)
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise invalid(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
            "reasoning_effort",
        )
    if kwargs.get("reasoning_effort", effort) != effort:
        raise invalid(
            f"reasoning_effort is {effort!r} but chat_template_kwargs.reasoning_effort is "
            f"{kwargs['reasoning_effort']!r}: give it once",
            "reasoning_effort",
        )
    kwargs["reasoning_effort"] = effort
    return effort


def _with_tools_variable(
    f: Fields, tools: ToolPlan | None, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The template's variables with the ``tools`` offered (as the request sent them), where
    it offers any; a ``tools`` in chat_template_kwargs wins."""
    return {"tools": f.get("tools"), **kwargs} if tools is not None else kwargs


@dataclass(frozen=True)
class TokenizeRequest:
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``)."""

    model: str | None
    prompt: str | None  # None: a chat, its messages rendered with the chat template
    messages: list[dict[str, Any]]
    add_special_tokens: bool  # default: true for a prompt, false for a chat (as vLLM)
    return_token_strs: bool = False  # vLLM's: the tokens' strings too (token_strs)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # with the tools offered


def parse_tokenize(body: Any, max_prompt_chars: int) -> TokenizeRequest:
    """``/tokenize``: a prompt (``model``, ``prompt``, ``add_special_tokens``,
    ``return_token_strs``) or a chat (and ``add_generation_prompt``, ``continue_final_message``,
    ``chat_template_kwargs``, ``tools``, validated and passed to the template as a chat
    completion's are); the fields of vLLM's TokenizeChatRequest Tandem cannot honour
    (``chat_template``, ``media_io_kwargs``, ``mm_processor_kwargs``) are a 400 unless neutral."""
    f = Fields(require_object(body))
    model = f.get_str("model", None)
    token_strs = f.get_bool("return_token_strs", False)
    if "messages" not in f.body:
        prompt = f.get_str("prompt", None, max_len=max_prompt_chars)
        if prompt is None:
            raise invalid("send prompt (a string) or messages", "prompt")
        request = TokenizeRequest(model, prompt, [], f.get_bool("add_special_tokens", True),
                                  token_strs)  # fmt: skip
        refuse_unknown(f)
        return request
    if f.get("prompt") is not None:  # vLLM's two requests: one or the other (as embeddings')
        raise invalid("send prompt or messages, not both", "messages")
    messages = parse_messages(f.get("messages"))
    refuse_unsupported(f.body, TOKENIZE)
    add_generation_prompt, continue_final, kwargs = template_options(f)
    # tool_choice is no field of vLLM's tokenize request: only the tools, checked as a chat's
    tools = parse_tools(Fields({"tools": f.get("tools")}))
    request = TokenizeRequest(
        model=model,
        prompt=None,
        messages=messages,
        add_special_tokens=f.get_bool("add_special_tokens", False),
        return_token_strs=token_strs,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
        template_kwargs=_with_tools_variable(f, tools, kwargs),
    )
    refuse_unknown(f, TOKENIZE)
    return request
