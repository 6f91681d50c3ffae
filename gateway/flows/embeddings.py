"""OpenAI's embeddings request parsed and checked, and its vectors encoded for the response.

``input`` is a string, a list of strings, a list of token ids or a list of such lists (OpenAI's
four shapes), or, as vLLM's chat-style embeddings request, ``messages`` rendered by the chat
template (``add_generation_prompt`` and ``add_special_tokens`` then default to false, as there);
``encoding_format`` float or base64 (the ``openai`` client asks for base64 unless
told otherwise: little-endian float32 bytes). As on the other routes, unknown fields are ignored
and the fields of ``EMBEDDING`` that ask for something not implemented are a 400 naming them.
"""

from __future__ import annotations

import array
import base64
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.core.errors import invalid
from gateway.flows.fields import INT32_MAX, Fields, check_int, require_object
from gateway.flows.prepare import check_vocab
from gateway.flows.protocol import (
    parse_messages,
    parse_request_id,
    parse_truncation,
    template_options,
)
from gateway.flows.unsupported import CHAT, NEUTRAL, refuse_unknown, refuse_unsupported

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
ENCODING_FORMATS = ("float", "base64")
Input = str | tuple[int, ...]

EMBEDDING: dict[str, tuple[str, tuple[Any, ...]]] = {
    "dimensions": (
        "this model does not support dimensions: its embeddings have the size of its hidden "
        "state (drop the field)",
        (None,),
    ),
    "embed_dtype": ("embeddings are float32", (None, "float32")),
    "encoding_type": ("embeddings are float32", (None, "float32")),
    "mm_processor_kwargs": ("embeddings take text or token ids only, no images", NEUTRAL),
    "lora_request": ("embeddings come from the base model; no adapter applies", NEUTRAL),
    "cache_salt": ("per-request prefix-cache salts are not implemented", NEUTRAL),
    "chat_template": CHAT["chat_template"],
    "media_io_kwargs": ("embeddings take text only, so no media loading options", NEUTRAL),
}


@dataclass(frozen=True)
class EmbeddingChat:
    """vLLM's chat-style input: messages for the chat template, and how to render them."""

    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    template_kwargs: dict[str, Any]


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    inputs: tuple[Input, ...]
    encoding_format: str  # float | base64
    normalize: bool | None  # vLLM's per-request override of the worker's --pooler-config
    add_special_tokens: bool
    priority: int
    user: str | None
    truncate_prompt_tokens: int | None = None  # protocol.parse_truncation's
    request_id: str | None = None  # protocol.parse_request_id's
    chat: EmbeddingChat | None = None  # messages given instead of input (inputs is empty)


def _inputs(value: Any) -> tuple[Input, ...]:
    shapes = (
        "input must be a non-empty string, a list of strings, a list of token ids or a list of "
        "lists of token ids"
    )
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise invalid(shapes, "input")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        value = [value]
    if len(value) > MAX_INPUTS:
        raise invalid(f"at most {MAX_INPUTS} inputs per request, got {len(value)}", "input")
    out: list[Input] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            out.append(tuple(check_int(t, f"input[{i}]", 0, INT32_MAX) for t in item))
        else:
            raise invalid(shapes, "input")
        if len(out[-1]) == 0:
            raise invalid(f"input[{i}] is empty: every input needs at least one token", "input")
    if len({type(x) for x in out}) > 1:
        raise invalid("input must not mix strings and token ids in one list", "input")
    return tuple(out)


# the chat-style request's own fields: beside input they are a 400 when they ask for something
# (true, a non-empty object); null, false or {} ask for nothing there
CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


def _chat(f: Fields) -> EmbeddingChat | None:
    if f.get("messages") is None:
        if f.get("input") is None:
            raise invalid("input is required (or messages, as vLLM's chat-style embeddings)",
                          "input")  # fmt: skip
        for name in CHAT_ONLY:
            if f.get(name):
                raise invalid(f"{name} applies to messages (vLLM's chat-style embeddings), "
                              "not to input: drop it", name)  # fmt: skip
        return None
    if f.get("input") is not None:
        raise invalid("send input or messages, not both", "messages")
    messages = parse_messages(f.get("messages"))
    add_generation_prompt, continue_final, kwargs = template_options(f, False)
    return EmbeddingChat(messages, add_generation_prompt, continue_final, kwargs)


def parse_embedding(body: Any) -> EmbeddingRequest:
    f = Fields(require_object(body))
    refuse_unsupported(f.body, EMBEDDING)
    chat = _chat(f)
    fmt = f.get_str("encoding_format", "float")
    if fmt not in ENCODING_FORMATS:
        raise invalid(f"encoding_format must be float or base64, got {fmt!r}", "encoding_format")
    normalize = f.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise invalid("normalize must be true or false", "normalize")
    request = EmbeddingRequest(
        model=f.get_str("model", None),
        inputs=() if chat else _inputs(f.get("input")),
        encoding_format=fmt or "float",
        normalize=normalize,
        add_special_tokens=f.get_bool("add_special_tokens", chat is None),
        priority=f.get_int("priority", 0, -INT32_MAX, INT32_MAX) or 0,
        user=f.get_str("user", None, 1024),
        truncate_prompt_tokens=parse_truncation(f),
        request_id=parse_request_id(f),
        chat=chat,
    )
    refuse_unknown(f, EMBEDDING)
    return request


def check_inputs(ids: Sequence[Sequence[int]], max_model_len: int | None, vocab_size: int) -> None:
    """Each tokenized input: not empty, in the vocabulary, within the context (400s)."""
    for i, one in enumerate(ids):
        if not one:
            raise invalid(f"input[{i}] has no tokens", "input")
        check_vocab(one, vocab_size, "input")
        if max_model_len is not None and len(one) > max_model_len:
            raise invalid(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"input[{i}] has {len(one)} tokens. Please reduce the length of the input.",
                "input",
                code="context_length_exceeded",
            )


def encode_vector(values: Sequence[float], encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: numbers, or base64 of little-endian float32."""
    if encoding_format == "float":
        return list(values)
    packed = array.array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")
