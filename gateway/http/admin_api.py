"""Everything besides generation: health, metrics, models, tokenize, version, workers, spec."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.core.errors import APIError, invalid
from gateway.flows.embeddings import EMBEDDING
from gateway.flows.fields import Fields, require_object
from gateway.flows.prepare import check_vocab
from gateway.flows.protocol import parse_tokenize
from gateway.flows.unsupported import (
    CHAT,
    COMPLETION,
    SAMPLING,
    TOKENIZE,
    document_fields,
    refuse_unknown,
)
from gateway.http.state import gateway_state
from gateway.http.transport import read_json

SPEC_PATH = os.path.join(os.path.dirname(__file__), "openapi.json")


# the request schemas of openapi.json and the tables of the fields their parsers take only with
# a value that asks for nothing (each also takes unsupported.NO_EFFECT's)
REQUEST_TABLES: dict[str, tuple[dict[str, tuple[str, tuple[Any, ...]]], ...]] = {
    "CompletionRequest": (SAMPLING, COMPLETION),
    "ChatCompletionRequest": (SAMPLING, CHAT),
    "EmbeddingRequest": (EMBEDDING,),
    "TokenizeRequest": (TOKENIZE,),  # with messages (a prompt takes none of them)
}


def openapi_document() -> dict[str, Any]:
    """openapi.json, its request schemas completed from gateway.flows.unsupported's tables
    (written once there, not again in the document)."""
    with open(SPEC_PATH, "rb") as f:
        document: dict[str, Any] = json.load(f)
    schemas = document["components"]["schemas"]
    for name, tables in REQUEST_TABLES.items():
        document_fields(schemas[name]["properties"], *tables)
    return document


@functools.cache
def _spec() -> bytes:
    return json.dumps(openapi_document(), indent=1).encode()


def version() -> str:
    try:
        return importlib.metadata.version("tandem-serve")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0"


async def health(request: Request) -> Response:
    state = gateway_state(request)
    try:
        state.check_serving()
    except APIError as e:
        return e.response()
    clients = state.registry.clients
    down = [c.name for c in clients if not c.healthy]  # names only: /health is open
    workers = {"healthy": len(clients) - len(down), "total": len(clients), "down": down}
    return JSONResponse({"status": "ok", "workers": workers})


async def metrics(request: Request) -> Response:
    return Response(gateway_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _card(request: Request, name: str | None = None) -> dict[str, Any]:
    """vLLM's model card: its fields, ``parent`` null for the base model, and the one
    ``permission`` entry vLLM lists (sampling, logprobs and viewing allowed to anyone).
    ``name``: which of the served names (None: the first)."""
    state = gateway_state(request)
    name = name or state.model_name
    max_model_len, _ = state.registry.limits()
    created = int(state.started_at)
    permission = {
        "id": f"modelperm-{name}", "object": "model_permission", "created": created,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
        "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
        "organization": "*", "group": None, "is_blocking": False,
    }  # fmt: skip
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "tandem",
        "root": state.config.model,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [permission],
    }


def _adapter_card(request: Request, name: str, path: str | None) -> dict[str, Any]:
    """A LoRA adapter's card, as vLLM lists one: its root the directory it was loaded from
    (its name where the workers did not report one), its parent the base model."""
    base = _card(request)
    return {**base, "id": name, "root": path or name, "parent": base["id"]}


async def models(request: Request) -> Response:
    state = gateway_state(request)
    registry = state.registry
    adapters, paths = sorted(registry.lora_names()), registry.lora_paths()
    cards = [_card(request, name) for name in state.config.model_names]  # vLLM lists each
    cards += [_adapter_card(request, name, paths.get(name)) for name in adapters]
    return JSONResponse({"object": "list", "data": cards})


async def model(request: Request) -> Response:
    """``GET /v1/models/{model}``: the served model by its name (or its path), or one of its
    LoRA adapters; 404 otherwise."""
    state = gateway_state(request)
    asked = request.path_params["model"]
    lora = state.accepts(asked)
    if not lora:
        return JSONResponse(_card(request, asked if asked in state.config.model_names else None))
    return JSONResponse(_adapter_card(request, lora, state.registry.lora_paths().get(lora)))


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: a prompt's ids, or a chat's as its template renders it; with
    ``return_token_strs`` the tokens' strings too (``token_strs``, null otherwise, as vLLM)."""
    state = gateway_state(request)
    body = await read_json(request, state.config.max_body_bytes)
    req = parse_tokenize(body, state.config.max_body_bytes)
    state.accepts(req.model)
    tok = state.tokenizer
    if req.prompt is None:
        ids, _ = await state.chat_prompt(
            req.messages, req.add_generation_prompt, req.add_special_tokens,
            continue_final_message=req.continue_final_message, variables=req.template_kwargs,
        )  # fmt: skip
    else:
        ids = await state.off_loop(tok.encode, req.prompt, req.add_special_tokens)
    max_model_len, _ = state.registry.limits()
    if len(ids) <= _INLINE_TOKENS:
        strs = [tok.id_to_token(i) for i in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                             "token_strs": strs})  # fmt: skip
    # a million ids take ~0.1 s to render: on the text pool, in slices the event loop can
    # interleave with (one json.dumps would hold the GIL, and so every stream, all along)
    strings = tok.id_to_token if req.return_token_strs else None
    body = await state.off_loop(_tokens_json, ids, max_model_len, strings)
    return Response(body, media_type="application/json")


_INLINE_TOKENS = 8192
_SLICE = 1 << 14


def _tokens_json(
    ids: list[int], max_model_len: int | None, strings: Callable[[int], str | None] | None
) -> bytes:
    """The tokenize response; ``strings``: each token's string (vLLM's convert_ids_to_tokens,
    for ``token_strs``), None for ``token_strs: null``."""
    slices = range(0, len(ids), _SLICE)
    listed = ",".join(",".join(map(str, ids[i : i + _SLICE])) for i in slices)
    head = f'{{"count":{len(ids)},"max_model_len":{json.dumps(max_model_len)},"tokens":['
    strs = "null"
    if strings is not None:
        pieces = (json.dumps([strings(t) for t in ids[i : i + _SLICE]])[1:-1] for i in slices)
        strs = "[" + ",".join(pieces) + "]"
    return (head + listed + '],"token_strs":' + strs + "}").encode()


async def detokenize(request: Request) -> Response:
    state = gateway_state(request)
    f = Fields(require_object(await read_json(request, state.config.max_body_bytes)))
    state.accepts(f.get_str("model", None))
    if f.get("tokens") is None:
        raise invalid("tokens (a list of token ids) is required", "tokens")
    ids = f.int_list("tokens", max_items=1 << 20)
    refuse_unknown(f)
    _, vocab = state.registry.limits()
    check_vocab(ids, vocab or state.tokenizer.vocab_size, "tokens")
    return JSONResponse({"prompt": await state.off_loop(state.tokenizer.decode, ids)})


async def version_info(request: Request) -> Response:
    return JSONResponse({"version": version()})


async def workers(request: Request) -> Response:
    state = gateway_state(request)
    body: dict[str, Any] = {
        "draining": state.draining,
        "workers": [c.describe() for c in state.registry.clients],
    }
    return JSONResponse(body)


async def openapi(request: Request) -> Response:
    return Response(_spec(), media_type="application/json")
