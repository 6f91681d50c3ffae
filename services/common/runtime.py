"""What every worker role shares: the gRPC server, health, reflection, model loading,
the ready file, and draining on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import ipaddress
import json
import logging
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos import common_pb2
from protos.auth import server_interceptors
from protos.ports import check_port_free
from protos.roles import Role
from services.common.convert import stats_to_load
from services.common.leases import Leases
from services.config import ConfigError, WorkerConfig
from services.engine.driver import EngineDriver
from services.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)
RANK_CHECK_S = 0.5  # how often a tensor-parallel worker looks for ranks that died
ENGINE_CHECK_S = 0.5  # how often the worker looks at how long the engine's step has taken
STOP_HOOK_S = 30.0  # a stop hook (a KV channel's shutdown) when draining
FATAL_STOP_HOOK_S = 5.0  # the same after a fatal engine error

SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # a second worker on a port already served fails to bind, not shares the port (and the
    # gateway's requests) with the first, as gRPC's default SO_REUSEPORT would let it
    ("grpc.so_reuseport", 0),
]


def open_addresses(config: WorkerConfig) -> list[str]:
    """The addresses beyond this machine's loopback that the worker's gRPC port or its KV
    rendezvous (decode) bind with no internal token, so that anyone who reaches them may
    reserve KV blocks, run prompts or send KV (the README: "keep the ports on loopback then");
    empty when a token is set or everything stays on loopback."""
    if config.internal_token:
        return []
    hosts = [config.host] + ([config.kv_host] if config.role is Role.DECODE else [])
    return [h for h in dict.fromkeys(hosts) if h and not _is_loopback(h)]


def _is_loopback(host: str) -> bool:
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare).is_loopback
    except ValueError:  # a name (a compose service, a pod's): reachable from elsewhere
        return False


class WorkerRuntime:
    """Owns the engine and the server's lifecycle; servicers ask it for the driver."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.role = config.role
        self.worker_id = config.worker_id
        self.instance = uuid.uuid4().hex  # this process's run (WorkerLoad.instance)
        self.driver: EngineDriver | None = None
        self.engine: LLMEngine | None = None
        self.draining = False
        self.inflight = 0
        self.health = health.aio.HealthServicer()
        self.internal_token = config.internal_token
        self.server = grpc.aio.server(
            options=SERVER_OPTIONS, interceptors=server_interceptors(self.internal_token)
        )
        self.port = 0
        self.extra_load: Callable[[], dict[str, Any]] = dict
        self.num_queued: Callable[[], int] = int  # requests waiting outside the engine (admission)
        self.on_ready: list[Callable[[], Any]] = []
        self.on_stop: list[Callable[[], Any]] = []
        self.on_drain: list[Callable[[], None]] = []  # on the event loop, as draining starts
        self.leases = Leases(config.lease_timeout_s)
        self.ready_extra: Callable[[], dict[str, Any]] = dict
        self.fatal = ""  # why the engine cannot go on (a tensor-parallel rank died)
        self.hung = False  # a stop hook did not return while draining
        self.lora_names: list[str] = []  # the adapters served, as of the last update
        self.lora_paths: list[str] = []  # the directory of each, in lora_names' order
        # seconds the engine has been in one step, once past --engine-stall-timeout (0: not)
        self.engine_stalled_s = 0.0

    # ---- for servicers -----------------------------------------------------------------------
    async def ready_driver(self, context: grpc.aio.ServicerContext) -> EngineDriver:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is draining")
        if self.driver is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{self.worker_id} is loading its model"
            )
        assert self.driver is not None
        return self.driver

    def load(self) -> common_pb2.WorkerLoad:
        if self.engine is None or self.driver is None:
            return common_pb2.WorkerLoad(
                worker_id=self.worker_id, instance=self.instance, role=self.role,
                draining=self.draining,
                task=self.config.engine.task,
                scheduling_policy=self.config.engine.scheduler.policy,
            )  # fmt: skip
        e = self.engine
        load = stats_to_load(
            self.driver.stats(), worker_id=self.worker_id, role=self.role, model=e.model_name,
            max_model_len=e.max_model_len, block_size=e.config.cache.block_size,
            vocab_size=e.vocab_size, draining=self.draining, task=e.task,
            scheduling_policy=self.config.engine.scheduler.policy, **self.extra_load(),
        )  # fmt: skip
        load.num_waiting += self.num_queued()
        load.instance = self.instance
        load.lora_names.extend(self.lora_names)
        load.lora_paths.extend(self.lora_paths)
        lora = self.config.engine.lora
        load.lora_runtime_updating = lora is not None and lora.allow_runtime_updating
        load.engine_stalled_s = self.engine_stalled_s
        return load

    # ---- lifecycle ---------------------------------------------------------------------------
    def _write_ready(self, extra: dict[str, Any]) -> None:
        path = self.config.ready_file
        if not path:
            return
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(
                {"port": self.port, "pid": os.getpid(), "worker_id": self.worker_id, **extra}, fh
            )
        os.replace(tmp, path)

    async def serve(self, service_names: list[str]) -> int:
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.config.grpc_reflection:  # off unless asked: it maps the API
            reflection.enable_server_reflection(
                [*service_names, reflection.SERVICE_NAME, "grpc.health.v1.Health"], self.server
            )
        host, port = self.config.host, self.config.port
        check_port_free(host, port)
        bare = host.strip("[]")
        try:  # an IPv6 address in brackets, as gRPC reads HOST:PORT
            self.port = self.server.add_insecure_port(
                f"[{bare}]:{port}" if ":" in bare else f"{host}:{port}"
            )
        except RuntimeError as e:  # taken since the check
            raise ConfigError(f"cannot listen on {host}:{port}: check --host and --port") from e
        await self.server.start()
        for address in open_addresses(self.config):
            log.warning(
                "%s: listening on %s with no internal token: anyone who reaches it may use this "
                "worker (reserve KV, run prompts, send KV); set --internal-token or "
                "TANDEM_INTERNAL_TOKEN on the workers and the gateway, or bind 127.0.0.1",
                self.worker_id, address,
            )  # fmt: skip
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING, service_names)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info("%s: loading the model on %s ...", self.worker_id, self.config.engine.device)
        t0 = time.monotonic()
        try:
            self.engine = await asyncio.to_thread(LLMEngine, self.config.engine)
            self.driver = EngineDriver(self.engine)
            self.driver.on_fatal.append(lambda exc: self._fatal(loop, stop, str(exc)))
            self.lora_names = self.engine.lora_names()
            self.lora_paths = self.engine.lora_paths()
            self.driver.start()
            for hook in self.on_ready:
                await asyncio.to_thread(hook)
            # what start-up built lives as long as the worker: out of the collector's sight,
            # a full collection no longer walks it (at 256 running requests those walks added
            # 0.2-1 ms to a decode step on average; bench/host_step --no-gc-freeze)
            gc.collect()
            gc.freeze()
        except BaseException:  # a bad configuration: stop serving before the loop goes away
            await self.server.stop(None)
            if self.driver is not None:
                self.driver.stop()
            raise
        await self._set_health(health_pb2.HealthCheckResponse.SERVING, service_names)
        memory = self.engine.device_memory() if self.engine is not None else {}
        self._write_ready({**memory, **self.ready_extra()})
        print(f"{self.worker_id} ({self.role}) serving on {self.config.host}:{self.port} "
              f"after {time.monotonic() - t0:.1f}s", flush=True)  # fmt: skip
        watch = asyncio.create_task(self._watch_ranks(loop, stop))
        engine_watch = asyncio.create_task(self._watch_engine(service_names))
        await stop.wait()
        watch.cancel()
        engine_watch.cancel()
        if self.fatal:
            await self._die(service_names)
            return 1
        await self.drain(service_names)
        return 0

    def _fatal(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event, why: str) -> None:
        """The engine cannot go on (a tensor-parallel rank died): the worker exits (status 1),
        and whoever started it (``tandem up``) starts it again. Any thread."""
        self.fatal = self.fatal or why
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(stop.set)

    async def _watch_ranks(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
        """A rank that dies between steps (an idle worker) is noticed here, not at the next
        request; one that dies during a step fails the step first (``EngineDriver.on_fatal``)."""
        ranks = self.engine.runner.ranks if self.engine is not None else None
        while ranks is not None:
            await asyncio.sleep(RANK_CHECK_S)
            dead = ranks.dead()
            if dead:
                await asyncio.sleep(RANK_CHECK_S)  # a step in progress fails and says so first
                what = ", ".join(f"rank {r} exited with status {c}" for r, c in dead)
                self._fatal(loop, stop, f"tensor-parallel {what}")
                return

    async def _watch_engine(self, service_names: list[str]) -> None:
        limit = self.config.engine_stall_timeout_s
        if limit <= 0:
            return
        while True:
            await asyncio.sleep(min(ENGINE_CHECK_S, limit / 4))
            await self.check_engine(service_names)

    async def check_engine(self, service_names: list[str]) -> None:
        """A step (or command) past ``--engine-stall-timeout`` (a hung kernel, collective or
        lock) stops the worker serving: its health says NOT_SERVING while the event loop goes
        on answering, so the gateway ends or moves the requests on it, as a dead worker's, and
        sends none until the step returns; then it serves again. The engine thread's stack is
        logged once a stall, to tell what it waits for."""
        limit = self.config.engine_stall_timeout_s
        if self.driver is None or limit <= 0:
            return
        busy = self.driver.busy_for()
        if busy >= limit:
            if not self.engine_stalled_s:
                log.error(
                    "%s: the engine has been in one step for %.1f s (--engine-stall-timeout "
                    "%g): not serving until it returns. The engine thread is at:\n%s",
                    self.worker_id, busy, limit, self._engine_stack(),
                )  # fmt: skip
                if not self.draining:
                    await self._set_health(
                        health_pb2.HealthCheckResponse.NOT_SERVING, service_names
                    )
            self.engine_stalled_s = busy
        elif self.engine_stalled_s:
            log.warning("%s: the engine's step returned after %.1f s or more: serving again",
                        self.worker_id, self.engine_stalled_s)  # fmt: skip
            self.engine_stalled_s = 0.0
            if not self.draining and not self.fatal:
                await self._set_health(health_pb2.HealthCheckResponse.SERVING, service_names)

    def _engine_stack(self) -> str:
        ident = self.driver.thread_ident if self.driver is not None else None
        frame = sys._current_frames().get(ident) if ident is not None else None
        return "".join(traceback.format_stack(frame)) if frame is not None else "(not running)"

    async def _die(self, service_names: list[str]) -> None:
        """After a fatal engine error: every request was failed; stop at once, no draining."""
        log.error("%s: %s; the worker exits", self.worker_id, self.fatal)
        print(f"{self.worker_id}: {self.fatal}; the worker exits", flush=True)
        self.draining = True
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING, service_names)
        await self.server.stop(grace=1.0)
        await self._run_stop_hooks(FATAL_STOP_HOOK_S)
        if self.engine is not None:
            self.engine.close(graceful=False)

    async def _run_stop_hooks(self, timeout_s: float) -> None:
        """Each stop hook on a thread, for ``timeout_s`` at most: one that does not return
        marks the worker ``hung`` (its thread would hold Python's teardown: leave without it)."""
        for hook in self.on_stop:
            try:
                await asyncio.wait_for(asyncio.to_thread(hook), timeout_s)
            except TimeoutError:
                log.error("%s: a stop hook did not return in %.0f s", self.worker_id, timeout_s)
                self.hung = True
            except Exception:
                log.exception("%s: a stop hook failed", self.worker_id)

    async def _set_health(self, status: int, names: list[str]) -> None:
        for name in ["", *names]:
            await self.health.set(name, status)

    async def drain(self, service_names: list[str]) -> None:
        """No new requests; in-flight ones get the grace period, then end with "abort"."""
        self.draining = True
        for hook in self.on_drain:
            hook()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING, service_names)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.driver is not None:  # on the engine thread, which owns the streams
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.wrap_future(self.driver.abort_all()), 5.0)
        await self.server.stop(grace=2.0)
        await self._run_stop_hooks(STOP_HOOK_S)
        if self.driver is not None:
            self.driver.stop()
        if self.engine is not None:  # the other tensor-parallel ranks, told to stop
            self.engine.close()


class WorkerRpcs:
    """``Abort`` and ``GetLoad``, the same for every role (mixed into each servicer)."""

    rt: WorkerRuntime

    async def Abort(
        self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.AbortResponse:
        if self.rt.driver is None:
            return common_pb2.AbortResponse(found=False)
        found = await asyncio.wrap_future(self.rt.driver.abort(request.request_id))
        return common_pb2.AbortResponse(found=found)

    async def GetLoad(
        self, request: common_pb2.LoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerLoad:
        self.rt.leases.renew(request.owner)  # the owner's poll is its heartbeat
        return self.rt.load()

    async def LoadLoRA(
        self, request: common_pb2.LoadLoRARequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoRAUpdateResponse:
        name, path = request.lora_name, request.lora_path
        return await self._update_lora(context, name, lambda e: e.load_lora(name, path))

    async def UnloadLoRA(
        self, request: common_pb2.UnloadLoRARequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LoRAUpdateResponse:
        name = request.lora_name
        return await self._update_lora(context, name, lambda e: e.unload_lora(name))

    async def _update_lora(
        self, context: grpc.aio.ServicerContext, name: str,
        update: Callable[[LLMEngine], list[str]],
    ) -> common_pb2.LoRAUpdateResponse:  # fmt: skip
        """A runtime adapter update on the engine thread (between steps)."""
        lora = self.rt.config.engine.lora
        if lora is None or not lora.allow_runtime_updating:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "runtime LoRA updates are off: start the workers with --enable-lora "
                "--allow-runtime-lora-updating",
            )
        if not name:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name is empty")
        driver = await self.rt.ready_driver(context)
        try:
            names, paths = await driver.acall(lambda e: (update(e), e.lora_paths()))
        except KeyError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {name!r} is not loaded")
        except ConfigError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.rt.lora_names, self.rt.lora_paths = names, paths
        return common_pb2.LoRAUpdateResponse(lora_names=names, lora_paths=paths)


def fewer_malloc_arenas(device: str) -> None:
    """On the CPU, cap glibc's heap arenas at two (MALLOC_ARENA_MAX=2).

    glibc gives each allocating thread an arena of its own, up to eight per core, and memory
    freed into one stays resident there: with two, a default CPU worker holds about 20 MB less
    (docs/benchmarks.md, "First run on the CPU"). A GPU worker keeps glibc's default, where its
    host threads (engine, gRPC, grammar) never wait on each other's arena. Nothing happens off
    glibc or when MALLOC_ARENA_MAX is set."""
    if os.environ.get("MALLOC_ARENA_MAX") or device not in ("cpu", "auto"):
        return
    if device == "auto":
        import torch

        if torch.cuda.is_available():
            return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-8, 2)  # M_ARENA_MAX


SWITCH_INTERVAL_ENV = "TANDEM_SWITCH_INTERVAL_MS"


def gil_switch_interval() -> None:
    """``TANDEM_SWITCH_INTERVAL_MS`` (unset: Python's 5 ms): how long a thread that wants the GIL
    lets the one holding it run before asking for it.

    A worker is an engine thread and an event loop sharing one GIL. The engine's host work runs
    between its waits for the GPU (where it releases the GIL); a host phase longer than the
    interval gets preempted by the loop, and the GPU waits for that time. An interval longer than
    those phases leaves the loop the GPU waits (``services.worker.bench.stream_cost``: 6 ms
    phases, 0.87-0.94 of the ideal step rate at 5 ms, 0.99 at 20 ms). Other Python threads (KV
    receivers, grammar compiles) may wait that long for the GIL too. ConfigError if not a
    positive number."""
    raw = os.environ.get(SWITCH_INTERVAL_ENV, "")
    if not raw:
        return
    try:
        ms = float(raw)
    except ValueError:
        ms = 0.0
    if not 0 < ms <= 1000:
        raise ConfigError(f"{SWITCH_INTERVAL_ENV} must be milliseconds in (0, 1000], got {raw!r}")
    sys.setswitchinterval(ms / 1000)


def exit_now(code: int) -> NoReturn:
    """Leave after a fatal engine error (a tensor-parallel rank died), skipping Python's own
    teardown. The engine thread may still wait on the device in a collective whose peer is gone
    (NCCL does not notice a dead peer), and a stop hook (a KV channel's shutdown) on it: the
    teardown would then wait too, ``asyncio.run`` joining its executor's threads (for ever on
    Python 3.11, five minutes on 3.12) and the CUDA and NCCL destructors the device. By now
    every request was answered, the server stopped and the other ranks were killed."""
    from services.common.tracing import flush_tracing

    flush_tracing()  # the failed requests' spans, which atexit would have exported
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_worker(
    args: argparse.Namespace, build: Callable[[WorkerRuntime], list[str]], role: Role
) -> int:
    """Entry point shared by ``tandem prefill|decode|worker``: the flags are read into a frozen
    WorkerConfig (bad ones end here with a one-line error and exit status 2)."""
    fewer_malloc_arenas(str(getattr(args, "device", "auto")))
    from services.common.tracing import setup_tracing

    setup_tracing(f"tandem-{role}")
    logging.basicConfig(level=os.environ.get("TANDEM_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    from services.config import ConfigError
    from services.engine.tp_ranks import RankFailedError
    from services.model_files import ModelNotFoundError

    async def main(config: WorkerConfig) -> int:  # the server is created on the loop that runs it
        runtime = WorkerRuntime(config)
        code = await runtime.serve(build(runtime))
        if runtime.fatal or runtime.hung:  # a thread may still wait on the device: see exit_now
            exit_now(code or 1)
        return code

    try:
        from services.engine.llm import config_from_args

        config = WorkerConfig.from_args(args, role, config_from_args(args))
        gil_switch_interval()
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
        return asyncio.run(main(config))
    except (ConfigError, ModelNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except RankFailedError as exc:  # a tensor-parallel rank died or hung starting: no traceback
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
