"""The choices of one HTTP request, run concurrently and merged into one event stream.

Each choice runs in its own task through the dispatcher; the consumer reads (choice, chunk)
pairs from a queue. Closing the stream cancels the tasks, which aborts the work on the workers.
Metrics and the request span are recorded here, once per choice and once per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from gateway.core.errors import APIError
from gateway.core.events import Chunk
from gateway.observability.stats import RequestStats
from gateway.observability.telemetry import Telemetry
from gateway.observability.tracing import end_request_span
from gateway.workers.dispatch import Dispatcher
from gateway.workers.rpc_errors import UpstreamError
from gateway.workers.work import WorkItem
from protos.logprobs import PositionLogprobs

log = logging.getLogger(__name__)


@dataclass
class Choice:
    index: int
    item: WorkItem
    prompt_text: str = ""  # for echo
    counts_prompt: bool = True  # the first choice of each prompt counts its prompt tokens
    n: int = 1  # choices of its prompt (the request's n): choice i is of prompt i // n
    # max_tokens 0 with echo: the one token the workers generate is neither shown nor counted
    score_only: bool = False
    stats: RequestStats = field(default_factory=RequestStats)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)  # positions 1..
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def __post_init__(self) -> None:
        # counted once per prompt, as usage counts them
        self.stats.num_prompt_tokens = len(self.item.prompt_ids) if self.counts_prompt else 0
        self.stats.max_tokens = self.item.sampling.max_tokens

    def drop_generated(self) -> None:
        """``max_tokens: 0`` with echo: the one token the workers generated is not shown."""
        self.text.clear()
        self.token_ids.clear()
        self.logprobs.clear()
        self.finish_reason, self.stop_reason = "length", None

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason


class Generation:
    def __init__(
        self,
        response_id: str,
        operation: str,
        choices: list[Choice],
        dispatcher: Dispatcher,
        telemetry: Telemetry,
        span: Span,
    ) -> None:
        self.response_id = response_id
        self.operation = operation
        self.choices = choices
        self._dispatcher, self._telemetry, self._span = dispatcher, telemetry, span
        self._metrics = telemetry.metrics
        self._queue: asyncio.Queue[tuple[Choice, Chunk | BaseException]] = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._error: str | None = None
        self._closed = False
        self._recorded: set[int] = set()  # the choices whose metrics were recorded

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.item.prompt_ids) for c in self.choices if c.counts_prompt)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        return sum(c.stats.num_cached_tokens for c in self.choices if c.counts_prompt)

    async def _run(self, choice: Choice) -> None:
        try:
            stream = self._dispatcher.stream(choice.item, self._span)
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    for gap in choice.stats.on_chunk(chunk):
                        self._metrics.observe_gap(gap)
                    self._queue.put_nowait((choice, chunk))
                    if chunk.finish_reason is not None:
                        return
            raise RuntimeError("the request's stream ended without a finish reason")
        except (UpstreamError, APIError) as e:
            _attribute(e, choice.item)
            self._queue.put_nowait((choice, e))
        except Exception as e:  # a bug: reported as a 500, logged with its traceback
            log.exception("request %s failed", choice.item.request_id)
            self._queue.put_nowait((choice, e))

    async def events(self) -> AsyncGenerator[tuple[Choice, Chunk], None]:
        """(choice, chunk) as they arrive; raises the first UpstreamError/APIError."""
        for choice in self.choices:
            self._tasks[choice.index] = asyncio.create_task(self._run(choice))
        pending = len(self.choices)
        try:
            while pending:
                choice, event = await self._queue.get()
                if choice.finish_reason is not None:
                    continue  # aborted by a drain while its last chunk was queued
                if isinstance(event, BaseException):
                    raise event
                choice.add(event)
                if event.finish_reason is not None:
                    pending -= 1
                    self._finished(choice)
                yield choice, event
        except BaseException as e:
            self._error = _message(e)
            raise
        finally:
            self.close()

    async def collect(self) -> list[Choice]:
        async for _ in self.events():
            pass
        return self.choices

    def _finished(self, choice: Choice, reason: str | None = None) -> None:
        """Records a choice that ended (``reason``: its finish reason; None: the choice's own)."""
        stats = choice.stats
        reason = reason or choice.finish_reason or "abort"
        if stats.finished is None:
            stats.on_chunk(Chunk(finish_reason=reason))
        if choice.score_only:  # the metrics' tokens are usage's
            stats.num_output_tokens = 0
        self._telemetry.finished(self.operation, stats, reason)
        self._recorded.add(choice.index)
        prompt = choice.index // choice.n
        siblings = [c for c in self.choices if c.index // c.n == prompt]
        if all(c.index in self._recorded for c in siblings):  # the prompt's last choice
            most = max(c.stats.num_output_tokens for c in siblings)
            self._metrics.observe_prompt_finished(choice.n, most)

    def abort(self) -> None:
        """Ends every unfinished choice with finish_reason "abort" (shutdown after the grace)."""
        for choice in self.choices:
            task = self._tasks.get(choice.index)
            if choice.finish_reason is None and task is not None and not task.done():
                task.cancel()
                self._queue.put_nowait((choice, Chunk(finish_reason="abort")))

    def close(self) -> None:
        """Synchronous: cancels what still runs (the flows abort their workers) and ends the span."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks.values():
            task.cancel()
        if self._error is None and any(c.finish_reason is None for c in self.choices):
            self._error = "cancelled"
        if self._error == "cancelled":
            # the client went away (or the request was cancelled): vLLM counts each of its
            # unfinished choices as finished with "abort", with the tokens generated so far
            for choice in self.choices:
                if choice.finish_reason is None and choice.index in self._tasks:
                    self._finished(choice, "abort")
        end_request_span(
            self._span,
            self.response_id,
            self._metrics.model_name,
            [c.finish_reason or "error" for c in self.choices],
            self.prompt_tokens,
            self.completion_tokens,
            self._error,
        )


def _attribute(e: UpstreamError | APIError, item: WorkItem) -> None:
    """A worker's refusal of the request's constraint names ``structured_outputs`` (all it
    gets is the constraint): the client's 400 names the field it sent instead
    (``response_format``, a ``guided_*`` field, ``tools``)."""
    api = e.api_error if isinstance(e, UpstreamError) else e
    constraint = item.sampling.structured
    if api.param == "structured_outputs" and constraint is not None and constraint.source:
        api.param = constraint.source


def _message(e: BaseException) -> str:
    if isinstance(e, UpstreamError):
        return e.api_error.message
    if isinstance(e, APIError):
        return e.message
    if isinstance(e, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    return f"{type(e).__name__}: {e}"
