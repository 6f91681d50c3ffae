"""Everything the handlers share: config, tokenizer, workers, metrics, tracer, drain state,
stored responses."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from opentelemetry.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from starlette.requests import Request

from gateway.core.config import GatewayConfig
from gateway.core.errors import APIError, invalid, unavailable
from gateway.flows.chat_output import check_parser_flags
from gateway.flows.chat_template import ChatTemplateError
from gateway.flows.generation import Generation
from gateway.flows.image_fetch import FetchPolicy, ImageFetcher
from gateway.flows.response_store import ResponseStore
from gateway.flows.tokenizer import GatewayTokenizer, SpecialTokenInMessage
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.otel_metrics import GenAiMetrics, build_meter_provider
from gateway.observability.telemetry import Slo, Telemetry
from gateway.observability.tracing import build_tracer_provider, get_tracer, shutdown_bounded
from gateway.workers.dispatch import Dispatcher
from gateway.workers.registry import WorkerRegistry
from gateway.workers.work import FlowContext
from protos.multimodal import VisionSpec

log = logging.getLogger(__name__)
T = TypeVar("T")
TEXT_THREADS = 4


class GatewayState:
    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: GatewayTokenizer | None = None,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        check_parser_flags(config)
        self.config = config
        self.tokenizer = tokenizer or GatewayTokenizer(config.tokenizer, config.chat_template)
        # how images become placeholder tokens (None: a text-only model)
        self.vision = VisionSpec.of_model_dir(Path(config.tokenizer))
        self.image_fetcher = ImageFetcher(FetchPolicy.of(config))  # image_url parts' http(s) URLs
        self._own_provider = tracer_provider is None
        self.tracer_provider = tracer_provider or build_tracer_provider(config.otlp_endpoint)
        self.tracer = get_tracer(self.tracer_provider)
        self.registry = WorkerRegistry(
            config.workers, config.health_interval_s, config.health_timeout_s,
            config.internal_token, owner=f"gateway-{uuid.uuid4().hex}",
            discover=config.discover, discover_interval_s=config.discover_interval_s,
            stall_timeout_s=config.worker_stall_timeout_s,
        )  # fmt: skip
        self.dispatcher = Dispatcher(FlowContext(self.registry, self.tracer, config))
        self.metrics = GatewayMetrics(
            config.model_name, lambda: self.registry.clients, config.metrics_prefix
        )
        self._own_meter = meter_provider is None
        self._meter_provider = meter_provider or build_meter_provider(config.otlp_endpoint)
        slo = Slo(config.slo_ttft_ms / 1000.0, config.slo_tpot_ms / 1000.0)
        genai = GenAiMetrics(config.model_name, self._meter_provider)
        self.telemetry = Telemetry(self.metrics, genai, slo)
        self.started_at = time.time()
        self.draining = False
        self.active: set[Generation] = set()
        # the Responses API's stored responses (per gateway)
        self.responses = ResponseStore(
            config.responses_store_size, config.responses_store_max_bytes
        )
        # tokenization and chat templating, off the event loop (bounded: at most this many
        # prompts at once; more wait their turn without blocking streams or health checks)
        self._text_pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="tokenize")

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the text thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._text_pool, functools.partial(fn, *args, **kwargs))

    async def chat_prompt(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool,
        add_special_tokens: bool, *, continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], str]:  # fmt: skip
        """A chat's prompt ids and text, rendered and tokenized off the event loop; special tokens
        typed in messages stay text unless the gateway allows them. ``variables``: the
        template's (chat_template_kwargs, ``tools``), passed as one mapping so that no name of
        theirs meets a parameter's."""
        # the server's default variables (--default-chat-template-kwargs) under the request's
        variables = {**self.config.default_chat_template_kwargs, **(variables or {})}
        try:
            return await self.off_loop(
                self.tokenizer.chat_ids, messages, add_generation_prompt, add_special_tokens,
                self.config.allow_special_tokens_in_messages,
                continue_final_message=continue_final_message, variables=variables,
            )  # fmt: skip
        except SpecialTokenInMessage as e:
            raise invalid(str(e), "messages") from e
        except ChatTemplateError as e:
            raise invalid(f"cannot apply the chat template: {e}", "messages") from e

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def response_model(self, model: str | None, lora: str = "") -> str:
        """The name a response gives: the adapter's, else the served name the request asked
        for (vLLM echoes any of its --served-model-name names), else the first."""
        if lora:
            return lora
        return model if model in self.config.model_names else self.model_name

    def accepts(self, model: str | None) -> str:
        """The LoRA adapter ``model`` names ("" for the base model, which a request without
        a model or with "" asks for, as in vLLM); 404 for a model this gateway does not serve
        (the adapters are the ones its workers report)."""
        if not model or model in (*self.config.model_names, self.config.model):
            return ""
        adapters = self.registry.lora_names()
        if model in adapters:
            return model
        also = f" and the LoRA adapters {', '.join(f'`{a}`' for a in sorted(adapters))}"
        raise APIError(
            404,
            f"The model `{model}` does not exist. This gateway serves "
            f"{', '.join(f'`{n}`' for n in self.config.model_names)}"
            f"{also if adapters else ''}.",
            param="model",
            code="model_not_found",
        )

    def check_task(self, task: str) -> None:
        """A 400 when the workers serve the other task (``--task``): nothing here could run it."""
        tasks = self.registry.tasks()
        if not tasks or task in tasks:
            return  # no healthy worker: check_serving's 503
        if task == "embed":
            raise invalid(
                "this model is served for generation; start it with --task embed to serve "
                "/v1/embeddings", "model", code="wrong_task"
            )  # fmt: skip
        raise invalid(
            "this model is served for embeddings (--task embed): use /v1/embeddings, or start it "
            "with --task generate for completions and chats", "model", code="wrong_task"
        )  # fmt: skip

    def check_priority(self, priority: int) -> None:
        """A 400 for a priority other than 0 where a worker serves first come, first served:
        it would refuse the request (after a stream had begun) rather than ignore it."""
        if priority and "fcfs" in self.registry.scheduling_policies():
            raise invalid(
                f"priority {priority} needs workers started with --scheduling-policy priority "
                "(these serve first come, first served): leave priority out or 0",
                "priority",
            )

    def check_serving(self) -> None:
        """Raises 503 while draining or when no topology has healthy workers."""
        if self.draining:
            raise unavailable("the gateway is shutting down", code="draining")
        reason = self.dispatcher.unavailable_reason()
        if reason:
            raise unavailable(reason)

    async def start(self) -> None:
        await self.registry.start()

    async def drain(self, grace_s: float) -> None:
        """Stops taking requests, gives in-flight ones ``grace_s``, then ends them with abort."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.active:
            log.warning("aborting %d requests still running after the grace", len(self.active))
            for generation in list(self.active):
                generation.abort()
        end = time.monotonic() + 5.0
        while self.active and time.monotonic() < end:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.registry.close()
        await self.image_fetcher.aclose()
        self._text_pool.shutdown(wait=False, cancel_futures=True)
        # each bounded: an unreachable collector held the gateway's exit ~14 s
        if self._own_provider:
            await asyncio.to_thread(
                shutdown_bounded, self.tracer_provider.shutdown, "trace exporter"
            )
        shutdown = getattr(self._meter_provider, "shutdown", None)
        if self._own_meter and shutdown is not None:
            await asyncio.to_thread(shutdown_bounded, shutdown, "metrics exporter")


def gateway_state(request: Request) -> GatewayState:
    """The state the app was built with (``build_app`` puts it on ``app.state.gateway``)."""
    state: GatewayState = request.app.state.gateway
    return state
