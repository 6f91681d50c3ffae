"""POST /v1/completions and POST /v1/chat/completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.core.errors import invalid
from gateway.flows import reasoning, tool_parsers
from gateway.flows.chat_output import ChoiceOutput, OutputPlan
from gateway.flows.generation import Choice, Generation
from gateway.flows.image_fetch import ImageURL
from gateway.flows.images import check_images, images_in_prompt
from gateway.flows.prepare import (
    PromptIds,
    build_choices,
    check_vocab,
    keep_last,
    settle_max_tokens,
)
from gateway.flows.protocol import (
    ChatRequest,
    CommonOptions,
    CompletionRequest,
    parse_chat,
    parse_completion,
)
from gateway.flows.tokenizer import GatewayTokenizer
from gateway.http import formats
from gateway.http.state import GatewayState, gateway_state
from gateway.http.streaming import StreamInfo, stream_events
from gateway.http.transport import ClientGone, SSEResponse, read_json, until_disconnect
from gateway.observability.stats import combined
from gateway.observability.tracing import set_request_attributes, start_request_span
from gateway.workers.rpc_errors import UpstreamError
from protos.multimodal import ImageItem
from protos.sampling_params import StructuredOutput

COMPLETION_DEFAULT_MAX_TOKENS = 16


def _check_prompts(
    state: GatewayState, prompts: Sequence[PromptIds], common: CommonOptions
) -> tuple[int | None, int]:
    max_model_len, reported = state.registry.limits()
    vocab = reported or state.tokenizer.vocab_size
    for prompt in prompts:
        check_vocab(prompt.ids, vocab)
    for name in ("stop_token_ids", "allowed_token_ids"):
        check_vocab(getattr(common.sampling, name), vocab, name)
    check_vocab([token for token, _ in common.sampling.logit_bias], vocab, "logit_bias")
    return max_model_len, len(prompts)


def _start(
    state: GatewayState,
    request: Request,
    operation: str,
    prefix: str,
    prompts: Sequence[PromptIds],
    common: CommonOptions,
    default_max_tokens: int | None,
    fit_default: bool = False,
    response_id: str | None = None,
) -> Generation:
    """Settles max_tokens, checks capacity, and builds the Generation with its span.
    ``fit_default``: the default shrinks to the context left (the model's max_new_tokens)."""
    state.check_task("generate")
    state.check_priority(common.priority)
    response_id = response_id or formats.response_id(prefix, common.request_id, request.headers)
    max_model_len, count = _check_prompts(state, prompts, common)
    if count * common.n > state.config.max_fanout:
        raise invalid(
            f"n x number of prompts must be at most {state.config.max_fanout}, "
            f"got {count * common.n}",
            "n",
        )
    fields = ("messages" if operation == "chat" else "prompt", common.max_tokens_field)
    max_tokens = []
    for i, p in enumerate(prompts):
        which = f"{fields[0]}[{i}]" if count > 1 else None  # a batch's errors name the prompt
        max_tokens.append(settle_max_tokens(len(p.ids), common.max_tokens, default_max_tokens,
                                            max_model_len, fit_default, fields, which))  # fmt: skip
    state.check_serving()
    choices = build_choices(  # the workers' ids are the gateway's own (unique)
        f"{prefix}-{uuid.uuid4().hex}", prompts, common, max_tokens, state.config.request_timeout_s
    )
    span = start_request_span(state.tracer, operation, state.model_name, request.headers)
    sp = common.sampling
    set_request_attributes(
        span,
        {"max_tokens": max_tokens[0], "temperature": sp.temperature, "top_p": sp.top_p,
         "top_k": sp.top_k, "seed": sp.seed, "choice.count": common.n},
    )  # fmt: skip
    return Generation(response_id, operation, choices, state.dispatcher, state.telemetry, span)


async def _respond(
    state: GatewayState,
    request: Request,
    gen: Generation,
    info: StreamInfo,
    stream: bool,
    choice_json: Callable[[Choice], dict[str, Any]],
    top_level: Callable[[list[Choice]], dict[str, Any]] = lambda choices: {},
) -> Response:
    state.active.add(gen)
    if stream:

        def on_close() -> None:
            gen.close()
            state.active.discard(gen)

        return SSEResponse(stream_events(info, gen, state.metrics), on_close=on_close)
    try:
        choices: list[Choice] = await until_disconnect(request, gen.collect())
    except ClientGone:
        return Response(status_code=499)
    except UpstreamError as e:
        raise e.api_error from e
    finally:
        gen.close()
        state.active.discard(gen)
    obj = "text_completion" if info.object == "text_completion" else "chat.completion"
    body = formats.envelope(gen.response_id, obj, info.created, info.model,
                            [choice_json(c) for c in choices])  # fmt: skip
    body.update(top_level(choices))
    body["usage"] = formats.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
    timing = combined([c.stats for c in choices]).header()
    return JSONResponse(body, headers={"x-tandem-timing": timing})


def _completion_prompts(
    tok: GatewayTokenizer, req: CompletionRequest, max_model_len: int | None
) -> list[PromptIds]:
    """Each prompt's ids and the text echo shows (of what truncate_prompt_tokens keeps)."""
    keep = req.common.truncate_prompt_tokens
    out = []
    for p in req.prompts:
        ids = tuple(tok.encode(p, req.common.add_special_tokens)) if isinstance(p, str) else p
        kept = keep_last(ids, keep, max_model_len)
        text = p if isinstance(p, str) and len(kept) == len(ids) else tok.decode(kept)
        out.append(PromptIds(kept, text))
    return out


def with_adapter(common: CommonOptions, lora: str) -> CommonOptions:
    """The request runs under the LoRA adapter its model named ("" = the base model)."""
    return replace(common, sampling=replace(common.sampling, lora_name=lora)) if lora else common


async def completions(request: Request) -> Response:
    state = gateway_state(request)
    req = parse_completion(await read_json(request, state.config.max_body_bytes),
                           state.config.generation_defaults)  # fmt: skip
    lora = state.accepts(req.common.model)
    req = replace(req, common=with_adapter(req.common, lora))
    tok = state.tokenizer
    max_model_len = state.registry.limits()[0]
    prompts = await state.off_loop(_completion_prompts, tok, req, max_model_len)
    if any(not p.ids for p in prompts):
        raise invalid("prompt must not be empty (it has no tokens)", "prompt")
    if req.score_only and max_model_len is not None:
        at, longest = max(enumerate(len(p.ids) for p in prompts), key=lambda x: x[1])
        if longest >= max_model_len:  # the workers sample one token beside the prompt's scores
            which = f"prompt[{at}]" if len(prompts) > 1 else "this one"
            raise invalid(
                f"This model's maximum context length is {max_model_len} tokens: a prompt "
                f"scored with max_tokens 0 may have at most {max_model_len - 1} (the workers "
                f"compute one token beside its logprobs, then drop it); {which} has {longest}",
                "prompt", code="context_length_exceeded",
            )  # fmt: skip
    state.metrics.observe_structured(req.common.sampling.structured, None)
    gen = _start(state, request, "text_completion", "cmpl", prompts, req.common,
                 COMPLETION_DEFAULT_MAX_TOKENS)  # fmt: skip
    for choice in gen.choices:
        choice.score_only = req.score_only
    info = StreamInfo(gen.response_id, "text_completion", int(time.time()),
                      state.response_model(req.common.model, lora),
                      req.common.include_usage, req.logprobs is not None, req.echo,
                      prompt_logprobs=req.prompt_logprobs, logprobs_top=req.logprobs or 0,
                      continuous_usage=req.common.continuous_usage,
                      token_id_logprobs=req.common.token_id_logprobs,
                      token_bytes=tok.token_bytes, score_only=req.score_only)  # fmt: skip

    def choice_json(c: Choice) -> dict[str, Any]:
        if req.score_only:
            c.drop_generated()
        prefix = c.prompt_text if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            prompt = c.item.prompt_ids if req.echo else ()
            echoed = [tok.token_bytes(t) for t in prompt]
            scores = formats.top_of(c.prompt_logprobs, req.logprobs) if req.echo else []
            logprobs = formats.completion_logprobs(
                c.logprobs, 0, echoed, scores, req.common.token_id_logprobs, prompt
            )
        out = formats.completion_choice(
            c.index, prefix + "".join(c.text), logprobs, c.finish_reason, c.stop_reason
        )
        if req.prompt_logprobs is not None:
            out["prompt_logprobs"] = formats.prompt_logprobs(c.prompt_logprobs, req.prompt_logprobs)
        return out

    return await _respond(state, request, gen, info, req.common.stream, choice_json)


def _chat_prompt_logprobs(common: CommonOptions) -> Callable[[list[Choice]], dict[str, Any]]:
    """vLLM puts a chat's prompt_logprobs beside its choices (one prompt for all of them)."""
    asked = common.sampling.prompt_logprobs
    if asked is None:
        return lambda choices: {}
    return lambda choices: {
        "prompt_logprobs": formats.prompt_logprobs(choices[0].prompt_logprobs, asked)
    }


def _output_plan(state: GatewayState, req: ChatRequest) -> OutputPlan:
    """How the choices' text will be read: the tool choice, the gateway's parsers."""
    config = state.config
    tools = req.tools
    if tools is not None and tools.choice == "auto" and not config.enable_auto_tool_choice:
        raise invalid(
            'tool_choice "auto" (the default when tools are given) needs the server started with '
            '--enable-auto-tool-choice and --tool-call-parser; send tool_choice "required", '
            '"none" or a named function instead',
            "tool_choice",
        )
    parser = tool_parsers.get_parser(config.tool_call_parser) if config.tool_call_parser else None
    thinking = reasoning.get_parser(config.reasoning_parser) if config.reasoning_parser else None
    if thinking is not None:  # deepseek_v3 and glm45 think as chat_template_kwargs ask
        try:
            thinking = thinking.for_request(
                {**config.default_chat_template_kwargs, **req.template_kwargs}
            )
        except ValueError as e:
            raise invalid(str(e), "chat_template_kwargs") from None
    return OutputPlan(tools, parser, thinking)


def _thinking_free(common: CommonOptions, plan: OutputPlan, prompt_text: str) -> tuple[CommonOptions, OutputPlan]:  # fmt: skip
    """With a reasoning parser, a grammar constrains only the answer after the thinking block;
    a parser whose markers are special tokens (gpt-oss's harmony) reads the text with them."""
    thinking = plan.reasoning
    if thinking is None or not thinking.separates:
        return common, plan
    plan = replace(plan, prompt_open=thinking.prompt_opens(prompt_text))
    so = common.sampling.structured
    if thinking.keeps_special_tokens:
        if so is not None:
            raise invalid(
                f"a grammar (response_format, structured_outputs, or a tool_choice that "
                f"forces a call) is not supported beside the {thinking.name} reasoning parser "
                "yet (its answer has no one tag a grammar could start after): leave it out, or "
                "start the gateway without --reasoning-parser",
                "response_format",
            )
        sampling = replace(common.sampling, skip_special_tokens=False)
        return replace(common, sampling=sampling), plan
    if so is None:
        return common, plan
    so = replace(so, reasoning_start=thinking.start, reasoning_end=thinking.end,
                 reasoning_open=plan.prompt_open)  # fmt: skip
    return replace(common, sampling=replace(common.sampling, structured=so)), plan


def _strict_calls(
    common: CommonOptions, plan: OutputPlan, is_special: Callable[[str], bool]
) -> CommonOptions:
    """Strict functions under tool_choice "auto" (OpenAI's guarantee that a call matches its
    function's parameters; the openai client's pydantic_function_tool sets it): the calls the
    tool-call parser reads are held to their schemas by a structural tag, the text around them
    left free. A parser with no such tag, or whose markup is special tokens (which the grammar
    engine does not match as text), is a 400 rather than a strict flag quietly ignored."""
    tools, parser = plan.tools, plan.parser
    functions = tools.strict_calls() if tools is not None else None
    if tools is None or functions is None:
        return common
    tag = parser.structural_tag(functions, tools.parallel) if parser is not None else None
    special = parser is not None and parser.markup_is_special(is_special)
    if parser is None or tag is None or special:
        which = "none" if parser is None else parser.name
        raise invalid(
            'strict function tools under tool_choice "auto" are enforced with the hermes and '
            f"llama3_json tool-call parsers (this server's: {which}"
            f"{', whose markup is special tokens here' if special else ''}): send strict false, "
            'or tool_choice "required" or a named function, which are enforced with any parser',
            "tools",
        )
    if common.sampling.structured is not None:
        raise invalid(
            "a structured output format cannot be combined with strict function tools under "
            'tool_choice "auto" (the calls\' schemas are the format): send strict false or '
            "leave the format out",
            "response_format",
        )
    so = StructuredOutput("structural_tag", json.dumps(tag, ensure_ascii=False), source="tools")
    return replace(common, sampling=replace(common.sampling, structured=so))


def _markers_kept(
    common: CommonOptions, plan: OutputPlan, is_special: Callable[[str], bool]
) -> CommonOptions:
    """Under tool_choice "auto", the text keeps the special tokens when the tool-call parser's
    markup is one of them (Hermes 2 Pro's <tool_call>, Mistral's [TOOL_CALLS]): skipped, the
    calls would come back as bare JSON content."""
    parser, tools = plan.parser, plan.tools
    if parser is None or tools is None or tools.choice != "auto":
        return common
    if not parser.markup_is_special(is_special):
        return common
    return replace(common, sampling=replace(common.sampling, skip_special_tokens=False))


@dataclass(frozen=True)
class ChatRun:
    """A chat request started: its choices' generation and how their text will be read."""

    gen: Generation
    plan: OutputPlan
    common: CommonOptions  # as it runs (the adapter, the grammar, special tokens kept)
    model: str  # the served name or the adapter's, as responses show it


async def start_chat(
    state: GatewayState, request: Request, req: ChatRequest, response_id: str | None = None
) -> ChatRun:
    """Renders, checks and starts a parsed chat request (also the Responses API's); raises
    ClientGone where the client left while its images were fetched. ``response_id``: the id
    the response shows (None: chatcmpl- and the client's or a random one)."""
    lora = state.accepts(req.common.model)
    req = replace(req, common=with_adapter(req.common, lora))
    if req.reasoning_effort is not None and not state.tokenizer.template_reads("reasoning_effort"):
        raise invalid(
            "reasoning_effort: this model's chat template does not read a reasoning effort "
            "(gpt-oss's does), so it would change nothing: leave it out",
            "reasoning_effort",
        )
    plan = _output_plan(state, req)
    encoded: tuple[bytes, ...] = ()
    if req.images:
        check_images(len(req.images), state.vision, state.config.limit_mm_per_prompt,
                     state.model_name)  # fmt: skip
        fetch = state.image_fetcher.fetch_all(req.images)  # those given as URLs downloaded
        # a client that leaves cancels the downloads
        urls = any(isinstance(image, ImageURL) for image in req.images)
        encoded = await (until_disconnect(request, fetch) if urls else fetch)
    ids_list, text = await state.chat_prompt(
        req.messages, req.add_generation_prompt, req.common.add_special_tokens,
        continue_final_message=req.continue_final_message, variables=req.template_kwargs,
    )  # fmt: skip
    kept = keep_last(ids_list, req.common.truncate_prompt_tokens, state.registry.limits()[0])
    if len(kept) < len(ids_list):
        if encoded:
            raise invalid(
                "truncate_prompt_tokens would cut the front off a prompt with images: leave it "
                "out, or send fewer or shorter messages",
                "truncate_prompt_tokens",
            )
        ids_list = list(kept)
    images: tuple[ImageItem, ...] = ()
    if encoded and state.vision is not None:
        ids_list, images = await state.off_loop(images_in_prompt, ids_list, encoded, state.vision)
    ids = tuple(ids_list)
    if not ids:
        raise invalid("the messages render to an empty prompt", "messages")
    common = _strict_calls(req.common, plan, state.tokenizer.is_special)
    common, plan = _thinking_free(common, plan, text)
    common = _markers_kept(common, plan, state.tokenizer.is_special)
    state.metrics.observe_structured(
        common.sampling.structured, req.tools.choice if req.tools else None
    )
    prompt = PromptIds(ids, text, images)
    # the model's max_new_tokens (generation_config.json) when the request gives no max_tokens
    default = state.config.generation_defaults.get("max_new_tokens")
    gen = _start(state, request, "chat", "chatcmpl", [prompt], common,
                 None if default is None else int(default), fit_default=True,
                 response_id=response_id)  # fmt: skip
    return ChatRun(gen, plan, common, state.response_model(req.common.model, lora))


async def chat_completions(request: Request) -> Response:
    state = gateway_state(request)
    req = parse_chat(await read_json(request, state.config.max_body_bytes),
                     state.config.generation_defaults)  # fmt: skip
    try:
        run = await start_chat(state, request, req)
    except ClientGone:
        return Response(status_code=499)
    gen, plan, common = run.gen, run.plan, run.common
    final = req.messages[-1]
    echoed = ""
    if req.echo and final.get("role") == "assistant" and isinstance(final.get("content"), str):
        echoed = final["content"]
    info = StreamInfo(gen.response_id, "chat.completion.chunk", int(time.time()),
                      run.model, common.include_usage, req.logprobs, plan=plan,
                      prompt_logprobs=common.sampling.prompt_logprobs,
                      continuous_usage=common.continuous_usage,
                      token_id_logprobs=common.token_id_logprobs,
                      echoed=echoed)  # fmt: skip

    def choice_json(c: Choice) -> dict[str, Any]:
        by_id = req.common.token_id_logprobs
        logprobs = formats.chat_logprobs(c.logprobs, by_id) if req.logprobs else None
        if plan.plain:
            text = echoed + "".join(c.text)
            return formats.chat_choice(c.index, text, logprobs, c.finish_reason, c.stop_reason)
        out = ChoiceOutput(plan)
        message = out.message("".join(c.text))
        if echoed:
            message = {**message, "content": echoed + (message.get("content") or "")}
        return formats.chat_message_choice(
            c.index, message, logprobs, out.finish_reason(c.finish_reason), c.stop_reason
        )

    return await _respond(state, request, gen, info, common.stream, choice_json,
                          _chat_prompt_logprobs(common))  # fmt: skip
