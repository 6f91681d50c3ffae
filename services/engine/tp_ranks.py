"""Rank 0's handle on the other tensor-parallel ranks of its engine: start them, send each step's
plan, notice when one dies, stop them.

Rank 0 is the engine's own process (it schedules and samples); ranks 1..N-1 are child processes
(``python -m services.engine.tp_follower``) that load their shard, take part in the start-up
agreement and then run every step rank 0 sends them. They meet over a TCPStore that rank 0
binds to a port the kernel picks (port 0), and die with rank 0 (PR_SET_PDEATHSIG, asked for by
the follower itself; the signal follows the thread that started them, which is the engine's).
A rank that dies makes rank 0's next collective fail: :meth:`Ranks.guard` turns that into a
``RankFailedError`` that names the rank and its exit status, and stops the others. On GPUs a
collective does not fail by itself (NCCL waits for a dead peer until its timeout): a monitor
thread polls the ranks' processes every ``MONITOR_S`` and, on a death, aborts the device group,
so that rank 0's step comes back, and what it computed after the death is refused: the guard
and every read of the step's tokens (``GpuReader.check``) raise ``RankFailedError``.

Start-up is watched rather than waited on: until every rank has reached the start-up agreement
(its shard loaded), rank 0 polls the other ranks' processes instead of blocking in a store or
Gloo wait, so a rank that exits there fails the start-up at once, naming the rank, its exit
status and the last lines it wrote on stderr. A rank that is alive but stuck is judged by its
progress, not by the wall time a big shard takes to load: no CPU time, page fault or read for
``START_STALL_S`` fails the start-up too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

import services
from protos.multimodal import ImageItem
from protos.sampling_params import SamplingParams
from services.config import ConfigError, EngineConfig
from services.engine.tp_group import TPGroup
from services.scheduling.outputs import ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)
PARENT_PID_ENV = "TANDEM_TP_PARENT_PID"
START_TIMEOUT_S = 300.0  # a store wait of a follower (rank 0 is alive: it killed it otherwise)
# A starting rank with no CPU time, page fault or byte read for this long is stuck (a shard read
# from a slow disk still faults pages in; a 70B shard takes minutes, but never a silent minute)
START_STALL_S = 60.0
FORM_TIMEOUT = timedelta(seconds=60)  # rank 0's Gloo rendezvous, entered once all ranks joined
STOP_TIMEOUT_S = 10.0
MONITOR_S = 0.1  # how often rank 0's monitor looks for a rank that died
TAIL_LINES = 20  # of a rank's stderr, kept for the error that names it
_PLAIN = SamplingParams()


class RankFailedError(RuntimeError):
    """A tensor-parallel rank died or failed; the engine cannot go on."""


@dataclass(frozen=True)
class RankStep:
    """One engine step as the other ranks run it: the same forward calls, in rank 0's order."""

    out: SchedulerOutput  # without what only sampling reads (prompts, outputs, parameters)
    graph: bool  # the forward replays the decode graph (rank 0's choice: every rank's too)
    eager: bool  # no graph, hidden states kept (prompt scoring, a KV hand-off)
    score: dict[str, int]  # requests whose prompt logprobs follow the forward

    @classmethod
    def of(cls, out: SchedulerOutput, graph: bool, eager: bool, score: dict[str, int]) -> RankStep:
        reqs = [_slim(r, r.request_id in score) for r in out.requests]
        return cls(replace(out, requests=reqs), graph, eager, score)


@dataclass(frozen=True)
class CaptureGraphs:
    """Sent once, at start-up, before rank 0 captures its decode graphs: every rank captures its
    own with it (``ModelRunner.capture_graphs``)."""


def _slim(r: ScheduledRequest, scored: bool) -> ScheduledRequest:
    """What the forward reads of a request (and, when it is scored, its prompt). Its images
    only when this step's tokens reach into them, and the bytes only of those the step's tokens
    overlap (every rank encodes them): a decode step carries no image."""
    prompt = r.prompt_token_ids if scored else []
    images: tuple[ImageItem, ...] = ()
    if r.before_image_end:
        lo, hi = r.start_pos, r.start_pos + r.num_new_tokens
        images = tuple(
            im if im.offset < hi and im.end > lo else replace(im, data=b"") for im in r.images
        )
    params = replace(_PLAIN, lora_name=r.sampling_params.lora_name)  # its adapter's rows
    return replace(
        r, sampling_params=params, output_token_ids=[], prompt_token_ids=prompt, images=images
    )


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
        self._tails: list[_Tail] = []  # each rank's last stderr lines, also passed through
        self._closing = threading.Event()
        self._aborted = threading.Event()  # a rank died: the device group's collectives aborted
        self._abort_lock = threading.Lock()  # the monitor's abort against close()
        self._store = dist.TCPStore(
            "127.0.0.1", 0, size, True, timeout=timedelta(seconds=START_TIMEOUT_S),
            wait_for_workers=False,
        )  # fmt: skip
        self.procs = [self._spawn(config, rank, size) for rank in range(1, size)]
        self._finalizer = weakref.finalize(self, _kill, list(self.procs))
        self._between_steps = False  # True: the ranks wait for a step, a stop message can go
        try:
            self._watch(lambda r: self._store.check([f"joined/{r}"]), "while starting")
            self.group = self._formed(size, device)
            self.group.start_watch = self._until_agreeing
        except BaseException:
            self.close(graceful=False)
            raise
        self._between_steps = True
        # the thread holds the Ranks weakly: one dropped unclosed is still collected, and its
        # finalizer still kills the ranks
        threading.Thread(
            target=_monitor, args=(weakref.ref(self), self._closing), name="tp-monitor",
            daemon=True,
        ).start()  # fmt: skip

    def _abort_if_dead(self) -> bool:
        """The monitor's check: a rank that died aborts the device group's collectives (rank 0
        may be waiting in one on the GPU, which would not end by itself). True once done."""
        with self._abort_lock:  # not once close() began: its own stopping is no death
            if self._closing.is_set() or not self.dead():
                return self._closing.is_set()
            self._aborted.set()
        log.error("tensor-parallel rank died: aborting the device group's collectives")
        self.group.abort_device()
        return True

    def raise_if_aborted(self, when: str = "during a step") -> None:
        """Raise RankFailedError (and stop the other ranks) if a rank died and the device
        group was aborted: what rank 0 computed since may be garbage."""
        if self._aborted.is_set():
            try:
                self.raise_if_dead(when)
            finally:
                self.close(graceful=False)

    def _spawn(self, config: EngineConfig, rank: int, size: int) -> subprocess.Popen[bytes]:
        root = str(Path(services.__file__).resolve().parents[1])
        env = {
            **os.environ,
            PARENT_PID_ENV: str(os.getpid()),
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        }
        argv = [sys.executable, "-m", "services.engine.tp_follower",
                str(rank), str(size), str(self._store.port)]  # fmt: skip
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert proc.stdin is not None and proc.stderr is not None
        tail = _Tail(proc.stderr)
        self._tails.append(tail)
        proc.stdin.write(pickle.dumps(config))
        proc.stdin.close()
        return proc

    def _formed(self, size: int, device: torch.device) -> TPGroup:
        """The group, formed on a thread while this one watches the ranks: a rank that dies in
        the rendezvous would hold rank 0 there for the whole Gloo timeout. The thread, if left
        behind, gives up after FORM_TIMEOUT."""
        got: list[TPGroup] = []
        failed: list[BaseException] = []
        done = threading.Event()

        def form() -> None:
            try:
                got.append(TPGroup(self._store, 0, size, device, FORM_TIMEOUT))
            except BaseException as exc:
                failed.append(exc)
            done.set()

        threading.Thread(target=form, name="tp-form", daemon=True).start()
        self._watch(lambda r: done.is_set(), "while forming the group")
        if failed:
            raise failed[0]
        return got[0]

    def _until_agreeing(self) -> None:
        """Until every rank has loaded its shard and entered the start-up agreement (which
        the runner's build runs under :meth:`guard`)."""
        self._watch(lambda r: self._store.check([f"agreeing/{r}"]), "while loading its shard")

    def _watch(self, ready: Callable[[int], bool], when: str) -> None:
        """Until ``ready(r)`` for every other rank r; one that exits first, or makes no progress
        for START_STALL_S before it is ready, fails the start-up (the caller stops the rest)."""
        seen: dict[int, tuple[tuple[int, ...] | None, float]] = {}
        while waiting := [r for r in range(1, len(self.procs) + 1) if not ready(r)]:
            self.raise_if_dead(when)
            now = time.monotonic()
            for r in waiting:
                mark = _progress(self.procs[r - 1].pid)
                last = seen.get(r)
                if last is None or mark is None or mark != last[0]:  # no /proc: never stuck
                    seen[r] = (mark, now)
                elif now - last[1] > START_STALL_S:
                    raise RankFailedError(
                        f"tensor-parallel rank {r} made no progress for {START_STALL_S:.0f} s "
                        f"{when} (no CPU time, page faults or reads); the engine stops"
                        + self._tails[r - 1].text()
                    )
            time.sleep(0.05)

    def dead(self) -> list[tuple[int, int]]:
        """(rank, exit status) of every rank that exited."""
        return [(r, p.returncode) for r, p in enumerate(self.procs, 1) if p.poll() is not None]

    def raise_if_dead(self, when: str) -> None:
        dead = self.dead()
        if dead:
            what = ", ".join(f"rank {r} exited with {_status(code)}" for r, code in dead)
            tail = self._tails[dead[0][0] - 1]
            tail.done.wait(1.0)  # its last lines are still in the pipe a moment after the exit
            raise RankFailedError(f"tensor-parallel {what} {when}; the engine stops" + tail.text())

    def send(self, step: RankStep | CaptureGraphs) -> None:
        self.group.broadcast(step)

    @contextlib.contextmanager
    def guard(self, when: str = "during a step") -> Iterator[None]:
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
                self.raise_if_dead(when)
            finally:
                self.close(graceful=False)
            raise
        self.raise_if_aborted(when)  # the step returned because its collectives were aborted
        self._between_steps = True

    def close(self, graceful: bool = True) -> None:
        """Stop the ranks: ``graceful`` and between two steps, by telling them (None as the
        step) and waiting a moment; then (or at once) by killing whatever is left."""
        with self._abort_lock:
            self._closing.set()
        if graceful and self._between_steps and not self.dead():
            with contextlib.suppress(RuntimeError):
                self.group.broadcast(None)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(deadline - time.monotonic(), 0.01))
        self._finalizer()


def _monitor(ranks: weakref.ref[Ranks], closing: threading.Event) -> None:
    """Rank 0's monitor thread: every MONITOR_S until the ranks are stopped or collected."""
    while not closing.wait(MONITOR_S):
        live = ranks()
        if live is None or live._abort_if_dead():
            return
        del live


class _Tail:
    """A rank's stderr, passed through to ours line by line; its last lines kept for errors."""

    def __init__(self, pipe: IO[bytes]) -> None:
        self.lines: deque[str] = deque(maxlen=TAIL_LINES)
        self.done = threading.Event()  # the rank's stderr closed (it exited)
        threading.Thread(target=self._pump, args=(pipe,), name="tp-stderr", daemon=True).start()

    def _pump(self, pipe: IO[bytes]) -> None:
        with pipe:
            for raw in pipe:
                line = raw.decode(errors="replace")
                self.lines.append(line.rstrip())
                with contextlib.suppress(OSError, ValueError):  # our stderr closed
                    sys.stderr.write(line)
                    sys.stderr.flush()
        self.done.set()

    def text(self) -> str:
        lines = [line for line in self.lines if line]
        return "; its last output:\n  " + "\n  ".join(lines) if lines else ""


def _status(code: int) -> str:
    if code >= 0:
        return f"status {code}"
    with contextlib.suppress(ValueError):
        return f"status {code} ({signal.Signals(-code).name})"
    return f"status {code}"


def _progress(pid: int) -> tuple[int, ...] | None:
    """What grows while a process does anything: its page faults, CPU time and bytes read
    (Linux /proc; None elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    io: list[str] = []
    with contextlib.suppress(OSError):  # some containers hide it; faults and CPU time remain
        io = Path(f"/proc/{pid}/io").read_text().split()
    # fields 10, 12, 14 and 15 of stat: minflt, majflt, utime, stime; rchar of io
    marks = [int(stat[i]) for i in (7, 9, 11, 12)]
    return (*marks, int(io[io.index("rchar:") + 1]) if "rchar:" in io else 0)


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
