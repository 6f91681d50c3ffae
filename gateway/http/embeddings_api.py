"""POST /v1/embeddings: OpenAI's embeddings API on workers started with ``--task embed``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.core.errors import invalid
from gateway.core.events import EmbedWork
from gateway.flows.embeddings import EmbeddingRequest, check_inputs, encode_vector, parse_embedding
from gateway.flows.prepare import keep_last
from gateway.flows.tokenizer import GatewayTokenizer
from gateway.http import formats
from gateway.http.state import gateway_state
from gateway.http.transport import ClientGone, read_json, until_disconnect
from gateway.observability.tracing import end_span, start_request_span
from gateway.workers.rpc_errors import UpstreamError


def _input_ids(
    tok: GatewayTokenizer, req: EmbeddingRequest, max_model_len: int | None
) -> tuple[tuple[int, ...], ...]:
    keep = req.truncate_prompt_tokens
    encoded = [
        tok.encode(x, req.add_special_tokens) if isinstance(x, str) else x for x in req.inputs
    ]
    return tuple(keep_last(x, keep, max_model_len) for x in encoded)


async def embeddings(request: Request) -> Response:
    state = gateway_state(request)
    req = parse_embedding(await read_json(request, state.config.max_body_bytes))
    if state.accepts(req.model):
        raise invalid("LoRA adapters serve completions and chats, not embeddings", "model")
    state.check_task("embed")
    state.check_priority(req.priority)
    response_id = formats.response_id("embd", req.request_id, request.headers)
    max_model_len, vocab = state.registry.limits()
    if req.chat is None:
        ids = await state.off_loop(_input_ids, state.tokenizer, req, max_model_len)
    else:
        chat = req.chat
        rendered, _ = await state.chat_prompt(
            chat.messages, chat.add_generation_prompt, req.add_special_tokens,
            continue_final_message=chat.continue_final_message, variables=chat.template_kwargs,
        )  # fmt: skip
        ids = (keep_last(rendered, req.truncate_prompt_tokens, max_model_len),)
    check_inputs(ids, max_model_len, vocab or state.tokenizer.vocab_size)
    state.check_serving()
    started = time.monotonic()
    deadline = started + state.config.request_timeout_s
    work = EmbedWork(f"embd-{uuid.uuid4().hex}", ids, req.normalize, req.priority, deadline)
    prompt_tokens = sum(len(x) for x in ids)
    span = start_request_span(state.tracer, "embeddings", state.model_name, request.headers)
    span.set_attribute("gen_ai.request.encoding_formats", [req.encoding_format])
    span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
    error: str | None = None
    try:
        vectors = await until_disconnect(request, state.dispatcher.embed(work, span))
    except ClientGone:
        error = "the client went away"
        return Response(status_code=499)
    except UpstreamError as e:
        error = e.api_error.message
        raise e.api_error from e
    finally:
        end_span(span, error)
    state.metrics.observe_embeddings(len(ids), prompt_tokens, time.monotonic() - started)
    data: list[dict[str, Any]] = [
        {"object": "embedding", "index": i,
         "embedding": encode_vector(v.values, req.encoding_format)}
        for i, v in enumerate(vectors)
    ]  # fmt: skip
    body = {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": state.response_model(req.model),
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return JSONResponse(body)
