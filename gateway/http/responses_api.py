"""OpenAI's Responses API: ``POST /v1/responses`` (whole or streamed), ``GET`` and ``DELETE
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``, ``GET
/v1/responses/{id}/input_items``.

A request becomes a chat request (``flows/responses_request.py``) started as the chat endpoint
starts one (``openai_api.start_chat``: template, tools, grammar, reasoning parser, limits,
metrics, span); its one choice's text is read by the same ``ChoiceOutput`` and made into output
items or stream events (``flows/responses_output.py``). A response with ``store`` (the default)
is kept in the gateway's ``ResponseStore`` from its start (``in_progress``) to its end
(``completed``, ``incomplete``, or ``cancelled`` where its client left; a failed one is not
kept).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.core.errors import APIError, invalid
from gateway.flows.chat_output import ChoiceOutput
from gateway.flows.generation import Choice
from gateway.flows.response_store import StoredResponse
from gateway.flows.responses_input import new_id
from gateway.flows.responses_output import (
    EventWriter,
    finished,
    output_items,
    response_object,
    status_of,
    usage,
)
from gateway.flows.responses_request import (
    ResponsesRequest,
    parse_responses,
    previous_response_id,
    renamed,
)
from gateway.http import formats
from gateway.http.openai_api import ChatRun, start_chat
from gateway.http.state import GatewayState, gateway_state
from gateway.http.transport import ClientGone, SSEResponse, read_json, until_disconnect
from gateway.observability.stats import combined
from gateway.workers.rpc_errors import UpstreamError

log = logging.getLogger(__name__)
MAX_LIST = 100  # input_items' limit


def _not_found(response_id: str) -> APIError:
    return APIError(
        404,
        f"Response with id {response_id!r} not found (this gateway keeps the responses it made "
        "with store true, the latest --responses-store-size of them; another gateway's are "
        "not here)",
        code="not_found",
    )


def _stored(state: GatewayState, response_id: str) -> StoredResponse:
    entry = state.responses.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry


def _previous(state: GatewayState, response_id: str) -> StoredResponse:
    """The response previous_response_id continues; one not held is OpenAI's 400
    previous_response_not_found (what clients such as Codex look for), not the GET's 404."""
    entry = state.responses.get(response_id)
    if entry is None:
        raise APIError(
            400,
            f"Previous response with id {response_id!r} not found (this gateway keeps the "
            "responses it made with store true, the latest --responses-store-size of them; "
            "another gateway's are not here): send the conversation as input instead",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if entry.response["status"] == "in_progress":
        raise invalid(f"Previous response with id {response_id!r} is still in progress: "
                      "continue it once it has ended", "previous_response_id")  # fmt: skip
    return entry


def _parse(state: GatewayState, body: Any) -> ResponsesRequest:
    previous = previous_response_id(body)
    history = _previous(state, previous).history if previous else []
    req = parse_responses(body, state.config.generation_defaults, history)
    if body.get("store") is True and not state.responses.enabled:
        raise invalid("store is not available: this gateway keeps no responses "
                      "(--responses-store-size 0); send store false", "store")  # fmt: skip
    return req


async def _reasoning_tokens(state: GatewayState, items: list[dict[str, Any]], most: int) -> int:
    """The output's reasoning tokens: its reasoning text tokenized again (the engine reports
    the output's tokens, not where the reasoning parser split them)."""
    text = "".join(
        part["text"] for item in items if item["type"] == "reasoning" for part in item["content"]
    )
    if not text:
        return 0
    ids = await state.off_loop(state.tokenizer.encode, text, False)
    return min(len(ids), most)


async def _usage(state: GatewayState, run: ChatRun, items: list[dict[str, Any]]) -> dict[str, Any]:
    gen = run.gen
    reasoning = await _reasoning_tokens(state, items, gen.completion_tokens)
    return usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, reasoning)


def _logprobs(run: ChatRun, choice_logprobs: Any) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = formats.chat_logprobs(
        choice_logprobs, run.common.token_id_logprobs
    )["content"]
    return content


def _settle(state: GatewayState, req: ResponsesRequest, response: dict[str, Any]) -> None:
    """A stored response's end state replaces its in_progress entry (a failed one goes)."""
    if response["store"]:
        state.responses.settle(response, req.context, keep=response["status"] != "failed")


def _cancelled(response: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
    """The response its client left before it ended: the output so far, unfinished items
    incomplete."""
    output = [{**item, "status": "incomplete"} if item.get("status") == "in_progress" else item
              for item in items]  # fmt: skip
    return {**response, "status": "cancelled", "output": output}


async def _whole(
    state: GatewayState, request: Request, req: ResponsesRequest, run: ChatRun,
    response: dict[str, Any],
) -> Response:  # fmt: skip
    gen = run.gen
    body = {**response, "status": "failed"}  # what is settled unless it ends otherwise
    try:
        choices: list[Choice] = await until_disconnect(request, gen.collect())
        (choice,) = choices
        message = ChoiceOutput(run.plan).message("".join(choice.text))
        logprobs = _logprobs(run, choice.logprobs) if req.logprobs else None
        items = output_items(message, status_of(choice.finish_reason)[0], logprobs)
        body = finished(response, items, choice.finish_reason, await _usage(state, run, items))
    except ClientGone:
        body = _cancelled(response, [])
        return Response(status_code=499)
    except UpstreamError as e:
        raise renamed(e.api_error, req.origins) from e
    except APIError as e:
        raise renamed(e, req.origins) from None
    finally:
        gen.close()
        state.active.discard(gen)
        _settle(state, req, body)
    timing = combined([choice.stats]).header()
    return JSONResponse(body, headers={"x-tandem-timing": timing})


def _frames(events: list[dict[str, Any]]) -> bytes:
    """Server-sent events as OpenAI sends them: the type as the event's name, then its data."""
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: "
        + json.dumps(e, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
        for e in events
    )  # fmt: skip


async def _stream(
    state: GatewayState, req: ResponsesRequest, run: ChatRun, writer: EventWriter
) -> AsyncGenerator[bytes, None]:
    """The events of one streamed response; it ends after its last event, as OpenAI's does
    (no ``[DONE]``). A client that leaves closes this generator, which aborts the work."""
    gen = run.gen
    out = ChoiceOutput(run.plan)
    try:
        yield _frames(writer.start())
        async for _, chunk in gen.events():
            deltas = out.feed(chunk.text) if chunk.text else []
            if chunk.finish_reason is not None:
                deltas += out.finish()
            logprobs = _logprobs(run, chunk.logprobs) if req.logprobs else []
            events = writer.feed(deltas, logprobs)
            if events:
                yield _frames(events)
        (choice,) = gen.choices
        events = writer.finish(choice.finish_reason, await _usage(state, run, writer.items))
        _settle(state, req, writer.response)
        yield _frames(events)
        yield b": x-tandem-timing " + combined([choice.stats]).header().encode() + b"\n\n"
    except (UpstreamError, APIError) as e:
        error = renamed(e.api_error if isinstance(e, UpstreamError) else e, req.origins)
        state.metrics.observe_error(error.status)
        failed = writer.failed(error.body()["error"])
        _settle(state, req, writer.response)
        yield _frames(failed)
    except Exception:
        log.exception("stream %s failed", gen.response_id)
        state.metrics.observe_error(500)
        failure = {"type": "server_error", "message": "internal error while streaming; see the "
                   "gateway log"}  # fmt: skip
        failed = writer.failed(failure)
        _settle(state, req, writer.response)
        yield _frames(failed)
    finally:
        gen.close()
        _settle(state, req, _cancelled(writer.response, writer.items))  # unless settled


async def create_response(request: Request) -> Response:
    state = gateway_state(request)
    req = _parse(state, await read_json(request, state.config.max_body_bytes))
    try:
        run = await start_chat(state, request, req.chat, new_id("resp"))
    except ClientGone:
        return Response(status_code=499)
    except APIError as e:
        raise renamed(e, req.origins) from None
    sampling = run.common.sampling
    params = {**req.params, "store": req.store and state.responses.enabled,
              "temperature": sampling.temperature, "top_p": sampling.top_p}  # fmt: skip
    response = response_object(run.gen.response_id, run.model, params, int(time.time()))
    if response["store"]:  # GET shows it while it runs
        state.responses.start(response, req.context)
    state.active.add(run.gen)
    if not run.common.stream:
        return await _whole(state, request, req, run, response)

    def on_close() -> None:
        run.gen.close()
        state.active.discard(run.gen)
        _settle(state, req, _cancelled(response, []))  # a stream closed before it began

    writer = EventWriter(response, req.logprobs)
    return SSEResponse(_stream(state, req, run, writer), on_close=on_close)


def _refuse_query(request: Request, allowed: tuple[str, ...]) -> None:
    """Query parameters of OpenAI's these endpoints do not implement: a 400, never ignored."""
    for name, value in request.query_params.multi_items():
        if name in ("stream", "include_obfuscation") and value.lower() in ("false", "0", ""):
            continue
        if name not in allowed:
            raise invalid(f"the query parameter {name}={value!r} is not supported here "
                          f"(known: {', '.join(allowed) or 'none'})", name)  # fmt: skip


async def get_response(request: Request) -> Response:
    state = gateway_state(request)
    _refuse_query(request, ())
    return JSONResponse(_stored(state, request.path_params["response_id"]).response)


async def delete_response(request: Request) -> Response:
    state = gateway_state(request)
    response_id = request.path_params["response_id"]
    if not state.responses.delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


async def cancel_response(request: Request) -> Response:
    """OpenAI cancels only background responses; this gateway runs none, so a response it
    holds is OpenAI's 400 for a synchronous one (closing the request stops it), one it does
    not hold a 404."""
    state = gateway_state(request)
    _refuse_query(request, ())
    response_id = request.path_params["response_id"]
    _stored(state, response_id)
    raise invalid("Cannot cancel a synchronous response: only background responses can be "
                  "cancelled (this gateway runs none); close the request's connection to stop "
                  "it", "response_id")  # fmt: skip


def _limit(request: Request) -> int:
    text = request.query_params.get("limit", "20")
    if not text.isdigit() or not 1 <= int(text) <= MAX_LIST:
        raise invalid(f"limit must be an integer from 1 to {MAX_LIST}, got {text!r}", "limit")
    return int(text)


async def input_items(request: Request) -> Response:
    """The items the response read (the earlier responses' it continued too), newest first
    unless ``order=asc``; ``after`` an item id, ``limit`` at most 100."""
    state = gateway_state(request)
    _refuse_query(request, ("limit", "order", "after"))
    items = _stored(state, request.path_params["response_id"]).context
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid(f"order must be asc or desc, got {order!r}", "order")
    items = items[::-1] if order == "desc" else list(items)
    after = request.query_params.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise invalid(f"after: no input item {after!r} in this response", "after")
        items = items[ids.index(after) + 1 :]
    limit = _limit(request)
    page = items[:limit]
    return JSONResponse({
        "object": "list", "data": page, "has_more": len(items) > limit,
        "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
    })  # fmt: skip
