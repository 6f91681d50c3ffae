"""What OpenAI and vLLM clients send that Tandem does not do yet: refused, never ignored.

A request field listed here that asks for something (a value other than its neutral ones: null,
false, an empty string, list or object, or the field's documented default) is a 400 that names
the field and says it is not supported, since a 200 that quietly behaves otherwise is worse than
an error. Fields the parsers implement are validated there. A field in neither place, and not one
of the few that change nothing a response says (:data:`NO_EFFECT`), is refused too, as OpenAI
refuses it ("Unrecognized request argument supplied"): a misspelt ``max_token`` or a vLLM
extension Tandem does not know must not quietly do nothing. A row goes when its feature lands.
"""

from __future__ import annotations

from typing import Any

from gateway.core.errors import invalid
from gateway.flows.fields import Fields

_TOOLS = "the deprecated functions API is not supported: send tools and tool_choice"

NEUTRAL: tuple[Any, ...] = (None, False, "", [], {})

# field -> (why it is refused, the values that ask for nothing)
SAMPLING: dict[str, tuple[str, tuple[Any, ...]]] = {
    "guided_whitespace_pattern": (
        "a custom whitespace pattern is not supported (structured_outputs takes "
        "disable_any_whitespace)",
        NEUTRAL,
    ),
    "structural_tag": ("structural tags are not supported; use structured_outputs", NEUTRAL),
    "use_beam_search": ("beam search is not implemented", NEUTRAL),
    "length_penalty": (
        "length_penalty applies to beam search, which is not implemented",
        (None, 1, 1.0),
    ),
    "logits_processors": ("custom logits processors are not supported", NEUTRAL),
    "kv_transfer_params": ("external KV transfer parameters are not supported", NEUTRAL),
    "vllm_xargs": ("vLLM extension arguments are not supported", NEUTRAL),
    "mm_processor_kwargs": (
        "per-request image processor options are not supported (send images as image_url "
        "content parts; they are processed as the model's processor config says)",
        NEUTRAL,
    ),
    "lora_request": (
        "an adapter is chosen by its name in 'model' (one of --lora-modules or loaded with "
        "POST /v1/load_lora_adapter), not by a lora_request",
        NEUTRAL,
    ),
}
CHAT: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": (_TOOLS, NEUTRAL),
    "function_call": (_TOOLS, (*NEUTRAL, "none")),
    "chat_template": ("a per-request chat template is not supported (use the gateway's)", NEUTRAL),
    "documents": ("documents (RAG templates) are not supported", NEUTRAL),
    "audio": ("audio output is not supported", NEUTRAL),
    "modalities": ("only text output is supported", (*NEUTRAL, ["text"])),
    "prediction": ("predicted outputs are not supported", NEUTRAL),
    # an empty object asks for web search too (with its default options): only null is neutral
    "web_search_options": ("web search is not supported", (None,)),
    "media_io_kwargs": (
        "per-request media loading options are not supported (send images as image_url "
        "content parts)",
        NEUTRAL,
    ),
    "store": ("stored completions are not supported", NEUTRAL),
    "verbosity": ("verbosity is not supported (ask for brevity in the messages)", NEUTRAL),
    "service_tier": ("service tiers are not supported", (None, "auto", "default")),
    "moderation": ("moderation of the input and output is not supported", NEUTRAL),
    # a maximum: the prefix cache keeps blocks in memory (GPU, --kv-offloading-size host RAM)
    "prompt_cache_retention": (
        "only in_memory: the prefix cache keeps its blocks in memory while space allows",
        (None, "in_memory"),
    ),
    "prompt_cache_options": (
        "the prefix cache is implicit (any shared prefix hits), with no breakpoints and no "
        "guaranteed lifetime: send {'mode': 'implicit'} or leave it out",
        (*NEUTRAL, {"mode": "implicit"}),
    ),
}
COMPLETION: dict[str, tuple[str, tuple[Any, ...]]] = {
    "prompt_embeds": ("prompt embeddings are not supported", NEUTRAL),
}
# the fields of vLLM's TokenizeChatRequest that /tokenize cannot honour
TOKENIZE: dict[str, tuple[str, tuple[Any, ...]]] = {
    "chat_template": CHAT["chat_template"],
    "media_io_kwargs": ("/tokenize takes no images, so no media loading options", NEUTRAL),
    "mm_processor_kwargs": ("/tokenize takes no images, so no image processor options", NEUTRAL),
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # type-strict: 0 asks for something (prompt_logprobs=0) where False does not
    return any(value == v and type(value) is type(v) for v in neutral)


# OpenAI fields that change nothing the response says, so that honouring them is doing nothing:
# routing hints and labels for OpenAI's own storage and abuse tracking; with their schemas in
# the request schemas of /openapi.json (``document_fields``)
NO_EFFECT_SCHEMAS: dict[str, dict[str, Any]] = {
    "metadata": {
        "type": "object",
        "nullable": True,
        "maxProperties": 16,
        "additionalProperties": {"type": "string", "maxLength": 512},
        "description": "OpenAI's labels (keys of at most 64 characters); checked, then unused",
    },
    "prompt_cache_key": {
        "type": "string",
        "nullable": True,
        "description": "OpenAI's cache routing hint; unused (any shared prefix hits the cache)",
    },
    "safety_identifier": {
        "type": "string",
        "nullable": True,
        "description": "OpenAI's end-user label for abuse tracking; unused",
    },
}
NO_EFFECT = frozenset(NO_EFFECT_SCHEMAS)


def _json_values(values: tuple[Any, ...]) -> list[Any]:
    """``values`` once each as JSON tells them apart (1 and 1.0 are one number; false and 0
    are not)."""
    out: list[Any] = []
    for v in values:
        if not any(v == o and _number(v) == _number(o) for o in out):
            out.append(v)
    return out


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def document_fields(
    properties: dict[str, Any], *tables: dict[str, tuple[str, tuple[Any, ...]]]
) -> None:
    """Adds to a request schema's ``properties`` (/openapi.json's) the fields of ``tables`` it
    does not describe (each taken only with a value that asks for nothing) and those of
    :data:`NO_EFFECT`: the tables are the one list of what is accepted besides what the
    parsers read, so that the document lists every field the server accepts."""
    for table in tables:
        for name, (why, neutral) in table.items():
            properties.setdefault(name, {
                "enum": _json_values(neutral),
                "nullable": None in neutral,
                "description": f"not supported ({why}): only a value that asks for nothing",
            })  # fmt: skip
    for name, schema in NO_EFFECT_SCHEMAS.items():
        properties.setdefault(name, schema)


def refuse_unknown(f: Fields, *tables: dict[str, tuple[str, tuple[Any, ...]]]) -> None:
    """A 400 naming the first field of the body that no parser read, no table lists and that
    is not one of :data:`NO_EFFECT`. Call it after the whole body was parsed."""
    listed = set().union(*tables)
    _check_metadata(f.body.get("metadata"))
    for name in f.body:
        if name not in f.read and name not in listed and name not in NO_EFFECT:
            raise invalid(
                f"Unrecognized request argument supplied: {name} (this server refuses the "
                "fields it does not implement rather than ignore them; drop it)",
                name,
            )


def _check_metadata(value: Any) -> None:
    """OpenAI's ``metadata``: at most 16 string values under keys of at most 64 characters,
    values of at most 512 (null: none). It changes nothing here, but a body the API would
    refuse gets the 400 it would."""
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > 16:
        raise invalid("metadata must be an object of at most 16 string values", "metadata")
    for key, v in value.items():
        if len(key) > 64 or not isinstance(v, str) or len(v) > 512:
            raise invalid(
                "metadata keys must be at most 64 characters and its values strings of at most "
                f"512 (key {key[:70]!r})",
                "metadata",
            )


def refuse_unsupported(body: dict[str, Any], table: dict[str, tuple[str, tuple[Any, ...]]]) -> None:
    """A 400 naming the first field of ``table`` in ``body`` that asks for something."""
    for name, (why, neutral) in table.items():
        if name in body and not _neutral(body[name], neutral):
            raise invalid(f"{name} is not supported by this server: {why}", name)


# Endpoints of OpenAI's and vLLM's APIs that Tandem does not serve yet: a 404 that says so.
ENDPOINTS: dict[str, str] = {
    "/v1/rerank": "reranking is not implemented",
    "/rerank": "reranking is not implemented",
    "/v2/rerank": "reranking is not implemented",
    "/v1/score": "scoring is not implemented",
    "/score": "scoring is not implemented",
    "/pooling": "pooling models are not supported",
    "/classify": "classification models are not supported",
    "/ping": "use GET /health",
    "/v1/audio/transcriptions": "audio is not supported",
    "/v1/audio/translations": "audio is not supported",
    "/v1/images/generations": "images are not supported",
    "/v1/moderations": "moderation is not supported",
    # beside /v1/responses/{response_id}: without these rows the router's 405 claimed them
    "/v1/responses/input_tokens": (
        "input token counts are not implemented (POST /tokenize counts a prompt's or messages' "
        "tokens)"
    ),
    "/v1/responses/compact": "compaction is not implemented",
}
SERVED = (
    "/v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings, /v1/models, "
    "/tokenize, /detokenize, /health, /metrics, /version, /workers, /openapi.json"
)


def unsupported_endpoint(path: str) -> bool:
    """``path`` is one of :data:`ENDPOINTS`: a 404 that says so, whatever the method."""
    return (path.rstrip("/") or "/") in ENDPOINTS


def not_found_message(method: str, path: str) -> str:
    why = ENDPOINTS.get(path.rstrip("/") or "/")
    if why is not None:
        return f"{method} {path} is not supported by this server: {why}"
    return f"{method} {path} does not exist on this server; it serves {SERVED}"
