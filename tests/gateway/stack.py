"""A live test stack: fake gRPC workers and the real gateway (uvicorn on a free port), all in
one background thread with its own event loop, so sync and async clients can both use it."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import uvicorn
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tokenizers import Tokenizer

from gateway.core.config import GatewayConfig, WorkerSpec
from gateway.http.app import build_app
from gateway.http.server import DrainingServer
from gateway.http.state import GatewayState
from tests.gateway.fake_workers import FakeWorker

T = TypeVar("T")


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``cond`` holds within ``timeout`` seconds (polled every 20 ms; checked once more
    at the end)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def dead_address() -> str:
    """A loopback address where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


class Stack:
    def __init__(
        self,
        tokenizer_dir: str,
        roles: list[str],
        dead: list[WorkerSpec] | None = None,
        list_workers: bool = True,  # False: the gateway finds them some other way (--discover)
        **config: Any,
    ) -> None:
        self.list_workers = list_workers
        self.tokenizer_dir = tokenizer_dir
        self.roles = roles
        self.dead = dead or []
        self.config_overrides = {"health_interval_s": 0.2, "drain_timeout_s": 1.0, **config}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-stack", daemon=True)
        self.exporter = InMemorySpanExporter()
        self.workers: list[FakeWorker] = []
        self.base_url = ""

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> Stack:
        self.thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        tok = Tokenizer.from_file(os.path.join(self.tokenizer_dir, "tokenizer.json"))
        self.workers = [FakeWorker(role, tok) for role in self.roles]
        for w in self.workers:
            await w.start()
        listed = self.workers if self.list_workers else []
        specs = [WorkerSpec(w.role, w.address) for w in listed] + self.dead
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        config = GatewayConfig(
            tokenizer=self.tokenizer_dir, workers=tuple(specs), **self.config_overrides
        )
        self.metric_reader = InMemoryMetricReader()
        meters = MeterProvider(metric_readers=[self.metric_reader])
        self.app = build_app(config, tracer_provider=provider, meter_provider=meters)
        uv = uvicorn.Config(self.app, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
        self.server = DrainingServer(uv, self.state, config.drain_timeout_s)
        self.serve_task = asyncio.create_task(self.server.serve())
        while not self.server.started:
            await asyncio.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{self.server.port}"
        if self.list_workers:
            await self._until_the_workers_are_healthy()

    async def _until_the_workers_are_healthy(self, timeout_s: float = 30.0) -> None:
        """The gateway's first poll may time out on a loaded machine (CI runs two test processes
        beside each other), leaving a live fake worker unhealthy until the next poll: a test that
        sent its request at once then met a 503. Every test starts from healthy live workers."""
        live = {w.address for w in self.workers}
        registry = self.state.registry
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not all(c.healthy for c in registry.clients if c.address in live):
            if asyncio.get_running_loop().time() > deadline:
                down = [c.last_error for c in registry.clients if c.address in live]
                raise RuntimeError(f"the fake workers did not become healthy: {down}")
            await asyncio.sleep(0.02)
            await registry.poll_all()

    @property
    def state(self) -> GatewayState:
        state: GatewayState = self.app.state.gateway
        return state

    def role(self, role: str) -> list[FakeWorker]:
        return [w for w in self.workers if w.role == role]

    def reset(self) -> None:
        """Default behaviour, empty records, every worker polled healthy again."""
        self.run(self.state.registry.settle())  # aborts of the last test land before the reset
        for w in self.workers:
            w.reset()
        self.exporter.clear()
        self.run(self.state.registry.poll_all())

    def drain(self) -> None:
        """What SIGTERM does."""
        self.loop.call_soon_threadsafe(self.server.begin_shutdown)

    def stop(self) -> None:
        async def _stop() -> None:
            self.server.should_exit = True
            await self.serve_task
            for w in self.workers:
                await w.stop()
            # what the stopped servers left (an RPC a stop cut, a health poll in flight) ends
            # here: destroyed pending with the loop, it logged into whichever test ran next
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

        try:
            self.run(_stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


def started(tokenizer_dir: str, roles: list[str], **config: Any) -> Iterator[Stack]:
    """A started stack for a fixture to yield from, stopped when the fixture ends."""
    stack = Stack(tokenizer_dir, roles, **config).start()
    try:
        yield stack
    finally:
        stack.stop()
