"""Runs an LLMEngine on its own thread and connects it to asyncio callers.

Callers never touch the engine directly: every call is a command executed on the engine
thread between steps, and each request's outputs come back on an asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from protos.multimodal import ImageItem
from protos.pooling_params import PoolingParams
from protos.sampling_params import SamplingParams
from services.engine.kv_handoff import FinalChunk, FinalChunkHook, LayerSink
from services.engine.llm_engine import EngineStats, LLMEngine
from services.engine.outputs import RequestOutput
from services.engine.structured import CompiledOutput
from services.engine.tp_ranks import RankFailedError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Reserved:
    """What a reservation got: its blocks (None: they did not fit) and the pool's free blocks."""

    blocks: list[int] | None
    free_blocks: int


@dataclass
class Stream:
    """One request's outputs, delivered on the caller's event loop: into ``queue``, or, once a
    consumer has attached a sink, straight to it."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    sink: Callable[[RequestOutput], None] | None = None

    def put(self, out: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.take, out)

    def take(self, out: RequestOutput) -> None:
        """On the loop: one output to the sink, or into the queue."""
        if self.sink is None:
            self.queue.put_nowait(out)
        else:
            self.sink(out)

    def attach(self, sink: Callable[[RequestOutput], None] | None) -> None:
        """On the loop: from now on every output goes to ``sink`` (None: to the queue again),
        the ones queued already first. A sink must not raise. It spares a consumer that takes
        each output as it comes an ``asyncio.Queue`` hand-off and a task wake-up per token."""
        if sink is not None:
            while not self.queue.empty():
                sink(self.queue.get_nowait())
        self.sink = sink


def _put_all(batch: list[tuple[Stream, RequestOutput]]) -> None:
    for stream, out in batch:
        try:
            stream.take(out)
        except Exception:  # a broken sink must not cost the other requests their outputs
            log.exception("delivering an output of %s failed", stream.request_id)


class EngineDriver:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.steps = 0
        # run on the engine thread after each batch of commands and each step (blocks may
        # have been freed): cheap, and they must not raise
        self.after_work: list[Callable[[LLMEngine], None]] = []
        # called (on the engine thread) when a step fails in a way the engine cannot go on from
        # (a tensor-parallel rank died): every request has been failed, the thread ends
        self.on_fatal: list[Callable[[BaseException], None]] = []
        self.fatal: BaseException | None = None
        self._gate = threading.Lock()  # no command is queued once ``fatal`` is set
        # when the engine thread entered the step or command it is in (None: between them,
        # waiting for work): a step that never returns is seen by the worker's watchdog
        self._busy_since: float | None = None

    def start(self) -> None:
        # a step's outputs are made while the next step's forward runs: streamed from there
        self.engine.deliver_early = self._deliver
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout)

    # ---- calls from other threads ------------------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run ``fn`` on the engine thread. It runs even if the caller gives up (an awaiting
        task cancelled, which cancels the future): an abort must never be skipped."""
        fut: Future[T] = Future()

        def run() -> None:
            wanted = fut.set_running_or_notify_cancel()  # False: the caller is gone
            try:
                result = fn(self.engine)
            except BaseException as exc:
                if wanted:
                    fut.set_exception(exc)  # handed to the caller
                return
            if wanted:
                fut.set_result(result)

        with self._gate:
            if self.fatal is None:
                self._commands.put(run)
                return fut
        fut.set_exception(RuntimeError(f"the engine stopped: {self.fatal}"))
        return fut

    async def acall(self, fn: Callable[[LLMEngine], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    async def submit(
        self, request_id: str, prompt: list[int], params: SamplingParams,
        priority: int = 0, prefill_only: bool = False, images: Sequence[ImageItem] = (),
        outputs: Sequence[int] = (),
    ) -> Stream:  # fmt: skip
        """Queue a request (``outputs``: its tokens made elsewhere, see
        ``LLMEngine.add_request``); raises InvalidRequestError for bad input."""
        grammar = await self._compile(params)
        if images:  # resized and patched on a pool thread: never inside an engine step
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.engine.prepare_images, images)
        stream = Stream(request_id, asyncio.get_running_loop())
        added: list[bool] = []

        def add(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, priority, prefill_only, grammar,
                               images, output_token_ids=outputs)  # fmt: skip
            self._streams[request_id] = stream
            added.append(True)

        await self._until_done(add, request_id, added)
        return stream

    async def submit_embedding(
        self, request_id: str, prompt: list[int], pooling: PoolingParams | None = None,
        priority: int = 0,
    ) -> Stream:  # fmt: skip
        """Queue an embedding; its one output carries the vector. InvalidRequestError for bad
        input (or an engine that serves generation)."""
        stream = Stream(request_id, asyncio.get_running_loop())
        added: list[bool] = []

        def add(engine: LLMEngine) -> None:
            engine.add_embedding(request_id, prompt, pooling, priority)
            self._streams[request_id] = stream
            added.append(True)

        await self._until_done(add, request_id, added)
        return stream

    async def _compile(self, params: SamplingParams) -> CompiledOutput | None:
        """A structured-output grammar, compiled on a pool thread: never inside an engine step."""
        if params.structured is None:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self.engine.compile_grammar, params)

    async def _until_done(
        self, fn: Callable[[LLMEngine], None], request_id: str, added: list[bool]
    ) -> None:
        """Await ``fn``; a caller cancelled meanwhile leaves no request behind (nobody would
        read its outputs or free its blocks): what ``fn`` added is aborted."""
        try:
            await self.acall(fn)
        except asyncio.CancelledError:
            self.call(lambda e: self._abort_now(request_id) if added else None)
            raise

    async def activate(
        self, request_id: str, prompt: list[int], outputs: list[int], params: SamplingParams,
        images: Sequence[ImageItem] = (),
    ) -> Stream:  # fmt: skip
        grammar = await self._compile(params)
        stream = Stream(request_id, asyncio.get_running_loop())
        added: list[bool] = []

        def act(engine: LLMEngine) -> None:
            self._streams[request_id] = stream
            try:
                done = engine.activate(request_id, prompt, outputs, params, grammar, images)
            except BaseException:
                self._streams.pop(request_id, None)
                raise
            added.append(True)
            if done is not None:
                self._streams.pop(request_id, None)
                stream.put(done)

        await self._until_done(act, request_id, added)
        return stream

    # ---- KV reservations (the hand-off): the servicers' one way to the engine's blocks --------
    async def reserve(
        self, request_id: str, num_prompt_tokens: int, params: SamplingParams
    ) -> Reserved:
        """Blocks for a prompt whose KV another worker will send (None if they do not fit).
        A caller cancelled meanwhile keeps nothing: the cancel is queued behind the reserve."""

        def reserve(engine: LLMEngine) -> Reserved:
            blocks = engine.reserve_for(request_id, num_prompt_tokens, params)
            return Reserved(blocks, engine.kv.num_free_blocks)

        try:
            return await self.acall(reserve)
        except asyncio.CancelledError:
            self.cancel_reservation(request_id)
            raise

    def cancel_reservation(self, request_id: str) -> Future[bool]:
        """Free a reservation that has not become a request (idempotent)."""
        return self.call(lambda e: e.cancel_reservation(request_id))

    async def block_ids(self, request_id: str) -> list[int]:
        """The KV blocks a request holds, in order (a prefill worker ships these)."""
        return await self.acall(lambda e: e.block_ids(request_id))

    def on_final_chunks(self, hook: FinalChunkHook) -> Future[None]:
        """Before the forward of each step that computes the last prompt chunk of prefill-only
        requests, ``hook`` gets their blocks on the engine thread and answers where that
        forward records each layer's KV write (``services.engine.kv_handoff``). A hook that
        raises is logged and records nothing: its caller falls back to waiting for the token."""

        def guarded(finals: list[FinalChunk]) -> LayerSink | None:
            try:
                return hook(finals)
            except Exception:  # the step itself must go on
                log.exception("final-chunk hook failed")
                return None

        return self.call(lambda e: setattr(e, "on_final_chunks", guarded))

    def release(self, request_id: str) -> Future[bool]:
        """A finished or failed request's blocks back to the pool (into the prefix cache), or
        its work stopped if it still runs: what a prefill worker does once its KV has left."""
        return self.abort(request_id)

    def abort(self, request_id: str) -> Future[bool]:
        return self.call(lambda e: self._abort_now(request_id))

    def abort_all(self) -> Future[int]:
        """Abort every request that still streams (a drain's grace period is over)."""
        return self.call(lambda e: sum(self._abort_now(rid) for rid in list(self._streams)))

    def _abort_now(self, request_id: str) -> bool:
        """On the engine thread: end the request (or free what it holds), tell its stream."""
        out = self.engine.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            stream.put(out)
        return out is not None

    def stats(self) -> EngineStats:
        return self.engine.stats()  # plain counters: a racy read is fine for load reports

    def busy_for(self) -> float:
        """Seconds the engine thread has been in its current step or command (0: idle). Any
        thread."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    @property
    def thread_ident(self) -> int | None:
        return self._thread.ident

    # ---- the engine thread -------------------------------------------------------------------
    def _drain_commands(self, block: bool) -> bool:
        """Run the queued commands; False if there were none."""
        try:
            cmd = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        self._run(cmd)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
            self._run(cmd)

    def _after_work(self) -> None:
        for hook in self.after_work:
            try:
                hook(self.engine)
            except Exception:
                log.exception("after-work hook failed")

    def _run(self, cmd: Callable[[], None]) -> None:
        self._busy_since = time.monotonic()
        try:
            cmd()
        except Exception:  # a bug in a command must not stop the engine thread
            log.exception("engine command failed")
        finally:
            self._busy_since = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._drain_commands(block=not self.engine.has_unfinished):
                self._after_work()
            if self._stop.is_set() or not self.engine.has_unfinished:
                continue
            self._busy_since = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug or a device error: fail what was running, go on
                self._busy_since = None
                log.exception("engine step failed")
                self._fail_all(f"engine step failed: {exc}")
                if isinstance(exc, RankFailedError):  # the ranks are gone: nothing can run
                    self._die(exc)
                    return
                self._after_work()
                continue
            self._busy_since = None
            self.steps += 1
            self._deliver(outputs)
            self._after_work()

    def _die(self, exc: BaseException) -> None:
        with self._gate:
            self.fatal = exc
        self._stop.set()
        while True:  # the commands queued before: their callers are answered, not left waiting
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            self._run(cmd)
        self._fail_all(f"engine step failed: {exc}")
        for hook in self.on_fatal:
            try:
                hook(exc)
            except Exception:
                log.exception("fatal-error hook failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop, not per output
        (a batch of 256 decodes would otherwise wake the loop 256 times a step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            by_loop.setdefault(stream.loop, []).append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, message: str) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream.put(RequestOutput(rid, [], "", True, "error", error=message))
        self._streams.clear()
