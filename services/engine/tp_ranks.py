"""Rank 0's handle on the other tensor-parallel ranks of its engine: start them, send each step's
plan, notice when one dies, stop them.

Rank 0 is the engine's own process (it schedules and samples); ranks 1..N-1 are child processes
(``python -m services.engine.tp_follower``) that load their shard, take part in the start-up
agreement and then run every step rank 0 sends them. They meet over a TCPStore that rank 0
binds to a port the kernel picks (port 0), and die with rank 0 (PR_SET_PDEATHSIG, asked for by
the follower itself; the signal follows the thread that started them, which is the engine's).
A rank that dies makes rank 0's next collective fail: :meth:`Ranks.guard` turns that into a
``RankFailedError`` that names the rank and its exit status, and stops the others.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import services
from protos.sampling_params import SamplingParams
from services.config import ConfigError, EngineConfig
from services.engine.tp_group import TPGroup
from services.scheduling.outputs import ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)
PARENT_PID_ENV = "TANDEM_TP_PARENT_PID"
START_TIMEOUT_S = 300.0  # until every rank has joined the store (imports, not loading)
STOP_TIMEOUT_S = 10.0
_PLAIN = SamplingParams()


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot go on."""


@dataclass(frozen=True)
class RankStep:
    """One engine step as the other ranks run it: the same forward calls, in rank 0's order."""

    out: SchedulerOutput  # without what only sampling reads (prompts, outputs, parameters)
    graph: bool  # rank 0 tried the decode graphs first
    eager: bool  # no graph, hidden states kept (prompt scoring, a KV hand-off)
    score: dict[str, int]  # requests whose prompt logprobs follow the forward

    @classmethod
    def of(cls, out: SchedulerOutput, graph: bool, eager: bool, score: dict[str, int]) -> RankStep:
        reqs = [_slim(r, r.request_id in score) for r in out.requests]
        return cls(replace(out, requests=reqs), graph, eager, score)


def _slim(r: ScheduledRequest, scored: bool) -> ScheduledRequest:
    """What the forward reads of a request (and, when it is scored, its prompt)."""
    prompt = r.prompt_token_ids if scored else []
    return replace(r, sampling_params=_PLAIN, output_token_ids=[], prompt_token_ids=prompt)


def rank_device(config: EngineConfig, device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after the configured one, or the CPU."""
    if device.type != "cuda":
        return device
    base = device.index or 0
    size = config.tensor_parallel_size
    if torch.cuda.device_count() < base + size:
        raise ConfigError(
            f"--tensor-parallel-size {size} needs {size} GPUs (cuda:{base} to "
            f"cuda:{base + size - 1}) but {torch.cuda.device_count()} are visible"
        )
    return torch.device("cuda", base + rank)


class Ranks:
    """Ranks 1..N-1 of one engine, seen from rank 0."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        size = config.tensor_parallel_size
        for rank in range(size):  # too few GPUs: refused before anything starts
            rank_device(config, device, rank)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, size, True, timeout=timedelta(seconds=START_TIMEOUT_S),
            wait_for_workers=False,
        )  # fmt: skip
        self.procs = [self._spawn(config, rank, size) for rank in range(1, size)]
        self._finalizer = weakref.finalize(self, _kill, list(self.procs))
        self._between_steps = False  # True: the ranks wait for a step, a stop message can go
        try:
            self._wait_joined()
            self.group = TPGroup(self._store, 0, size, device)
        except BaseException:
            self.close(graceful=False)
            raise
        self._between_steps = True

    def _spawn(self, config: EngineConfig, rank: int, size: int) -> subprocess.Popen[bytes]:
        root = str(Path(services.__file__).resolve().parents[1])
        env = {
            **os.environ,
            PARENT_PID_ENV: str(os.getpid()),
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        }
        argv = [sys.executable, "-m", "services.engine.tp_follower",
                str(rank), str(size), str(self._store.port)]  # fmt: skip
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps(config))
        proc.stdin.close()
        return proc

    def _wait_joined(self) -> None:
        """Until every rank has said it is up (a rank that exits first is an error at once)."""
        keys = [f"joined/{p}" for p in range(1, len(self.procs) + 1)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._store.check(keys):
            self.raise_if_dead("while starting")
            if time.monotonic() > deadline:
                raise RankFailedError(f"tensor-parallel ranks not up after {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit status) of every rank that exited."""
        return [(r, p.returncode) for r, p in enumerate(self.procs, 1) if p.poll() is not None]

    def raise_if_dead(self, when: str) -> None:
        dead = self.dead()
        if dead:
            what = ", ".join(f"rank {r} exited with status {code}" for r, code in dead)
            raise RankFailedError(f"tensor-parallel {what} {when}; the engine stops")

    def send(self, step: RankStep) -> None:
        self.group.broadcast(step)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Collectives that fail because a rank died raise RankFailedError and stop the rest."""
        self._between_steps = False
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, RankFailedError) or not isinstance(exc, RuntimeError):
                self.close(graceful=False)
                raise
            for _ in range(50):  # its socket closes a moment before the exit is reported
                if self.dead():
                    break
                time.sleep(0.02)
            try:
                self.raise_if_dead("during a step")
            finally:
                self.close(graceful=False)
            raise
        self._between_steps = True

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: ``graceful`` and between two steps, by telling them (None as the
        step) and waiting a moment; then (or at once) by killing whatever is left."""
        if graceful and self._between_steps and not self.dead():
            with contextlib.suppress(RuntimeError):
                self.group.broadcast(None)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(deadline - time.monotonic(), 0.01))
        self._finalizer()


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
