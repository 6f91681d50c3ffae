"""What streaming costs a worker on the CPU: the W6 path (issue 23) without a GPU.

A worker process runs the real colocated servicer (``WorkerService.GenerateStream``, the
multiplexed stream the gateway uses) and the real :class:`EngineDriver`, in front of a fake
engine whose step does ``--host-ms`` of pure-Python work holding the GIL, half of it before and
half after it "runs the GPU" by sleeping ``--gpu-ms`` with the GIL released, and emits one token
(and a short text piece) per running request. This process is the gateway: ``--requests``
requests of ``--max-tokens`` each go out at once through the gateway's own ``StreamMux``.

With nothing else in the worker, a step takes gpu + host ms (the ideal); every microsecond of
Python the event loop spends per token competes with the engine thread for the GIL and shows up
as slower steps. Reported (one JSON object): steps/s against the ideal, and the worker's CPU per
token over the run: all of it, the engine thread's inside steps (the fake host work), the rest
(serving: the event loop, grpc's threads, the driver's hand-off) and the event loop's alone; and
the client's (the gateway's ``StreamMux`` reading every request's chunks). Where the steps lost
time goes beside it: how late the engine thread got going again after the GPU's sleep (the GIL
held by the event loop, or no core free) and the driver's time between two steps.

    python -m services.worker.bench.stream_cost --requests 256 --max-tokens 64 \
        --gpu-ms 20 --host-ms 4 [--profile 30] [--switch-interval-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import grpc

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from protos.roles import Role
from protos.sampling_params import SamplingParams
from services.engine.outputs import RequestOutput


@dataclass(frozen=True)
class BenchConfig:
    requests: int = 256
    max_tokens: int = 64
    gpu_ms: float = 20.0
    host_ms: float = 4.0
    profile: int = 0  # lines of the event loop's cProfile to print (0: no profile)
    switch_interval_ms: float = 0.0  # the worker's TANDEM_SWITCH_INTERVAL_MS (0: Python's)

    def __post_init__(self) -> None:
        if self.requests < 1 or self.max_tokens < 1 or self.gpu_ms < 0 or self.host_ms < 0:
            raise ValueError("--requests and --max-tokens must be >= 1, the times >= 0")
        if not 0 <= self.switch_interval_ms <= 1000:
            raise ValueError("--switch-interval-ms must be in [0, 1000]")


@dataclass
class _Running:
    params: SamplingParams
    produced: int = 0


class FakeEngine:
    """The part of LLMEngine the driver and the colocated servicer use; a step is ``host_ms``
    of GIL-holding Python, then ``gpu_ms`` of sleep (the GIL released), then one token per
    running request."""

    def __init__(self, gpu_ms: float, host_ms: float) -> None:
        self.gpu_s, self.host_s = gpu_ms / 1000, host_ms / 1000
        self.running: dict[str, _Running] = {}
        self.steps = 0
        self.tokens = 0
        self.step_times: list[float] = []  # monotonic end of each step
        self.thread_cpu = 0.0  # the engine thread's CPU seconds inside steps
        # where steps lose time: the GIL (and a core) won back after the GPU's sleep, and the
        # driver's work between two steps (the hand-off, commands, hooks)
        self.wake_late_s = 0.0
        self.between_s = 0.0
        self._ended: float | None = None

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, prefill_only: bool = False, grammar: Any = None, images: Any = (),
        output_token_ids: Any = (),
    ) -> None:  # fmt: skip
        if output_token_ids:
            raise ValueError("the stand-in engine does not resume requests")
        if request_id in self.running:
            raise ValueError(f"request {request_id} is running")
        self.running[request_id] = _Running(params)

    def abort(self, request_id: str) -> RequestOutput | None:
        if self.running.pop(request_id, None) is None:
            return None
        return RequestOutput(request_id, [], "", True, "abort")

    def step(self) -> list[RequestOutput]:
        """Half the host work before the GPU (scheduling, inputs), half after it (sampling,
        detokenizing: the outputs built here count towards it)."""
        cpu0, t0 = time.thread_time(), time.perf_counter()
        if self._ended is not None and self.running:
            self.between_s += t0 - self._ended
        _busy_until(cpu0 + self.host_s / 2)
        slept = time.perf_counter()
        time.sleep(self.gpu_s)
        t1, cpu1 = time.perf_counter(), time.thread_time()
        self.wake_late_s += t1 - slept - self.gpu_s
        outputs = []
        for rid, req in list(self.running.items()):
            tok = req.produced % 1000
            req.produced += 1
            done = req.produced >= req.params.max_tokens
            outputs.append(RequestOutput(rid, [tok], f" w{tok}", done, "length" if done else None,
                                         num_prompt_tokens=16))  # fmt: skip
            if done:
                del self.running[rid]
        _busy_until(cpu1 + self.host_s / 2)
        self.steps += 1
        self.tokens += len(outputs)
        self.step_times.append(time.monotonic())
        self.thread_cpu += time.thread_time() - cpu0
        self._ended = time.perf_counter()
        return outputs


def _busy_until(end: float) -> None:
    """Pure-Python work (the GIL held, switchable like any bytecode) until this thread's CPU
    time reaches ``end``: a fixed amount of work, which the event loop holding the GIL delays
    as it would the engine's own (a wall-clock bound would absorb the time it took)."""
    x = 0
    while time.thread_time() < end:
        for i in range(50):
            x += i * i


# ---- the worker process ----------------------------------------------------------------------
def _worker_main(cfg: BenchConfig, conn: Connection) -> None:
    from services.common.runtime import SWITCH_INTERVAL_ENV, gil_switch_interval

    if cfg.switch_interval_ms:
        os.environ[SWITCH_INTERVAL_ENV] = str(cfg.switch_interval_ms)
    gil_switch_interval()  # as run_worker does
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()  # as run_worker does
    asyncio.run(_serve(cfg, conn))


async def _serve(cfg: BenchConfig, conn: Connection) -> None:
    from services.common.runtime import WorkerRuntime
    from services.config import EngineConfig, WorkerConfig
    from services.engine.driver import EngineDriver
    from services.worker.server import build

    engine = FakeEngine(cfg.gpu_ms, cfg.host_ms)
    runtime = WorkerRuntime(WorkerConfig(Role.COLOCATED, EngineConfig(device="cpu"), "bench"))
    driver = EngineDriver(engine)  # type: ignore[arg-type]
    runtime.driver = driver
    build(runtime)
    port = runtime.server.add_insecure_port("127.0.0.1:0")
    await runtime.server.start()
    driver.start()
    conn.send(port)
    loop = asyncio.get_running_loop()
    while (cmd := await loop.run_in_executor(None, conn.recv)) != "exit":
        if cmd == "start":
            base = (engine.steps, engine.tokens, engine.thread_cpu, len(engine.step_times),
                    engine.wake_late_s, engine.between_s)  # fmt: skip
            cpu0, loop0, wall0 = time.process_time(), time.thread_time(), time.monotonic()
            prof = cProfile.Profile() if cfg.profile else None
            if prof is not None:
                prof.enable()  # this thread only: the event loop's side
            conn.send("started")
        elif cmd == "stop":
            if prof is not None:
                prof.disable()
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            loop_cpu = time.thread_time() - loop0  # this thread runs the event loop
            steps, tokens = engine.steps - base[0], engine.tokens - base[1]
            times = engine.step_times[base[3] :]
            span = times[-1] - times[0] if len(times) > 1 else 0.0
            conn.send({
                "steps": steps, "tokens": tokens, "wall_s": wall, "cpu_s": cpu,
                "engine_cpu_s": engine.thread_cpu - base[2], "loop_cpu_s": loop_cpu,
                "wake_late_s": engine.wake_late_s - base[4], "between_s": engine.between_s - base[5],
                "steps_per_s": (len(times) - 1) / span if span > 0 else 0.0,
                "profile": _top(prof, cfg.profile) if prof is not None else "",
            })  # fmt: skip
    driver.stop()
    await runtime.server.stop(None)


def _top(prof: cProfile.Profile, lines: int) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(lines)
    return out.getvalue()


# ---- the gateway's side ----------------------------------------------------------------------
async def _drive(port: int, requests: int, max_tokens: int, tag: str) -> int:
    """All requests at once over one multiplexed stream; the tokens they streamed."""
    from gateway.workers.multiplex import StreamMux

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        mux = StreamMux(stub.GenerateStream, worker_pb2.GenerateStreamItem, "generate", "bench")
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)

        async def one(i: int) -> int:
            request = worker_pb2.GenerateRequest(
                request_id=f"{tag}-{i}", prompt_token_ids=list(range(16)), sampling=sampling
            )
            n = 0
            async for chunk in mux.start(request, (), 600.0):
                n += len(chunk.token_ids)
            return n

        counts = await asyncio.gather(*(one(i) for i in range(requests)))
        await mux.close()
    return sum(counts)


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Start a worker process, warm it up, measure one batch; the report."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker_main, args=(cfg, child), daemon=True)
    proc.start()
    try:
        port = parent.recv()
        asyncio.run(_drive(port, min(cfg.requests, 8), 4, "warm"))
        parent.send("start")
        parent.recv()
        t0, client0 = time.monotonic(), time.process_time()
        streamed = asyncio.run(_drive(port, cfg.requests, cfg.max_tokens, "run"))
        wall, client_cpu = time.monotonic() - t0, time.process_time() - client0
        parent.send("stop")
        got = parent.recv()
        parent.send("exit")
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)  # reaped: a failed run leaves no zombie behind
    ideal = 1000.0 / (cfg.gpu_ms + cfg.host_ms) if cfg.gpu_ms + cfg.host_ms > 0 else 0.0
    tokens = max(got["tokens"], 1)
    rest = got["cpu_s"] - got["engine_cpu_s"]
    return {
        **asdict(cfg),
        "streamed_tokens": streamed,
        "wall_s": round(wall, 3),
        "tok_per_s": round(streamed / wall, 1) if wall > 0 else 0.0,
        "steps": got["steps"],
        "steps_per_s": round(got["steps_per_s"], 2),
        "ideal_steps_per_s": round(ideal, 2),
        "ratio": round(got["steps_per_s"] / ideal, 3) if ideal else 0.0,
        "gpu_wake_late_ms_per_step": round(got["wake_late_s"] / max(got["steps"], 1) * 1e3, 3),
        "between_steps_ms": round(got["between_s"] / max(got["steps"], 1) * 1e3, 3),
        "worker_cpu_us_per_token": round(got["cpu_s"] / tokens * 1e6, 1),
        "engine_thread_cpu_us_per_token": round(got["engine_cpu_s"] / tokens * 1e6, 1),
        "serving_cpu_us_per_token": round(rest / tokens * 1e6, 1),
        "loop_thread_cpu_us_per_token": round(got["loop_cpu_s"] / tokens * 1e6, 1),
        "client_cpu_us_per_token": round(client_cpu / max(streamed, 1) * 1e6, 1),
        "profile": got["profile"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--gpu-ms", type=float, default=20.0, help="a step's sleep, GIL released")
    p.add_argument("--host-ms", type=float, default=4.0, help="a step's Python, GIL held")
    p.add_argument("--profile", type=int, default=0, metavar="LINES",
                   help="print the event loop thread's cProfile, top LINES by own time")  # fmt: skip
    p.add_argument("--switch-interval-ms", type=float, default=0.0,
                   help="the worker's TANDEM_SWITCH_INTERVAL_MS (0: Python's 5 ms)")  # fmt: skip
    p.add_argument("--json-out", default="", help="also write the report here")
    args = p.parse_args(argv)
    try:
        cfg = BenchConfig(args.requests, args.max_tokens, args.gpu_ms, args.host_ms, args.profile,
                          args.switch_interval_ms)  # fmt: skip
    except ValueError as exc:
        p.error(str(exc))
    report = run(cfg)
    profile = report.pop("profile")
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if profile:
        print(profile, file=sys.stderr)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(text + "\n")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "gateway"
    sys.exit(main())
