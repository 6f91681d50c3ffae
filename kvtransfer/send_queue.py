"""Transfers to one receiver: a FIFO served by a thread of its own, which owns the pair.

Why a queue and not a lock: transfers to one receiver share one pair (one group, one control
connection) and go one at a time, so a burst of requests queues behind each other. Waiting for
the pair is not the peer being stuck, so a transfer's deadline starts when its turn comes; a
stuck peer still fails the transfer in its turn within that transfer's own timeout. A caller that
gives up while its transfer waits cancels the future, and the transfer never starts (its blocks
are the caller's again at once). When the receiver cannot be reached, every transfer queued for
it fails at once instead of each waiting out its own timeout against a dead peer. A queue that
has had nothing to send for ``idle_s`` retires: its thread says goodbye to the receiver and
exits (decode workers come and go; each restart is a new endpoint), and the next transfer to that
receiver starts a new one. An idle queue whose receiver hung up (its process died) retires within
``HANG_UP_CHECK_S``: its group, sockets and thread are not kept for ``idle_s`` by a peer that is
gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.grants import Grant
from kvtransfer.ready import LayerReady
from kvtransfer.results import TransferError, TransferStats
from kvtransfer.sender_pair import SenderPair

log = logging.getLogger(__name__)

HANG_UP_CHECK_S = 1.0  # how often an idle queue looks whether its receiver hung up


class ReceiverUnreachable(TransferError):
    """The pair could not be (re)built: every transfer queued for that receiver fails too."""


class QueueClosed(TransferError):
    """The queue was closed (or retired when idle) before the job could join it."""


@dataclass
class SendJob:
    transfer_id: str
    block_ids: list[int]
    timeout_s: float  # counted from the start of its turn, not from submission
    ready: LayerReady | None = None
    computed: torch.cuda.Event | None = None  # CUDA: the KV is written once this event is
    grant: Grant | None = None  # the receiver's blocks, granted ahead (kvtransfer.grants)
    # started on the submitting thread (PairQueue.run_inline): what that start returned, or the
    # exception it raised; the pair's thread finishes the job from there
    inline: Any = None
    future: Future[TransferStats] = field(default_factory=Future)


Runner = Callable[[SenderPair, SendJob], TransferStats]


class PairQueue:
    """Runs ``run(pair, job)`` for each job in submission order on its own thread."""

    def __init__(
        self,
        pair: SenderPair,
        run: Runner,
        on_dropped: Callable[[], None],
        idle_s: float = 300.0,
        on_retired: Callable[[PairQueue], None] = lambda queue: None,
    ) -> None:
        self.pair = pair
        self._run = run
        self._on_dropped = on_dropped  # counts a queued job failed without its turn
        self._idle_s = idle_s
        self._on_retired = on_retired  # the owner forgets a queue that retired when idle
        self._cond = threading.Condition()
        self._jobs: deque[SendJob] = deque()
        self._running = False  # the thread is running a job
        self._inline = False  # a submitting thread is starting one (run_inline)
        self._closed = False
        self._retired = False
        self._thread = threading.Thread(
            target=self._loop, name=f"kv-send {pair.endpoint}", daemon=True
        )
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, job: SendJob) -> None:
        with self._cond:
            if self._closed:
                raise QueueClosed("the KV sender is closed" if not self._retired else "retired")
            self._jobs.append(job)
            self._cond.notify()

    def run_inline(self, job: SendJob, start: Callable[[SenderPair], Any]) -> bool:
        """Start ``job`` on the calling thread when the pair is idle (no job running or
        waiting): ``job.inline = start(pair)`` (or the exception it raised; None: it could not
        start here), then the job joins the queue first and the thread finishes it. Saves the
        hand-off to the thread on the way out. False, with nothing run, when not idle."""
        with self._cond:
            if self._closed or self._running or self._inline or self._jobs:
                return False
            if not job.future.set_running_or_notify_cancel():
                return True  # cancelled already: nothing to do
            self._inline = True
        try:
            job.inline = start(self.pair)
        except BaseException as e:  # the thread fails the job and rebuilds the pair
            job.inline = e
        with self._cond:
            self._inline = False
            self._jobs.appendleft(job)  # before any job put meanwhile: it started first
            self._cond.notify()
        return True

    def close(self, timeout_s: float) -> None:
        """Fail what waits, let the transfer in flight end (within its deadline), then the
        thread says goodbye to the receiver and exits."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._fail_waiting(TransferError("the KV sender is closed"))
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            started = job.future.running()  # run_inline set it running
            if not started and not job.future.set_running_or_notify_cancel():
                self._idle()
                continue  # its caller gave up while it waited: nothing was sent
            # idle before the caller hears: its next submit may start on its own thread
            try:
                result = self._run(self.pair, job)
            except ReceiverUnreachable as exc:
                self._fail_waiting(exc)
                self._idle()
                job.future.set_exception(exc)
                continue
            except BaseException as exc:
                self._idle()
                job.future.set_exception(exc)
                continue
            self._idle()
            job.future.set_result(result)
        self.pair.close(farewell=True)
        if self._retired:
            self._on_retired(self)

    def _idle(self) -> None:
        with self._cond:
            self._running = False

    def _next(self) -> SendJob | None:
        with self._cond:
            idle_until = time.monotonic() + self._idle_s
            while (not self._jobs or self._inline) and not self._closed:
                self._cond.wait(min(self._idle_s, HANG_UP_CHECK_S))
                if self._jobs or self._inline:
                    continue
                if self.pair.hung_up():  # the pair is ours while idle: nobody else reads it
                    self._closed = self._retired = True  # put() now refuses
                    log.info("KV receiver at %s hung up: pair closed", self.pair.endpoint)
                elif time.monotonic() >= idle_until:
                    self._closed = self._retired = True
                    log.info(
                        "KV pair to %s idle for %.0f s: closed", self.pair.endpoint, self._idle_s
                    )
            if self._closed and not (self._jobs and self._jobs[0].future.running()):
                return None  # (a job started by run_inline is in flight: it still finishes)
            self._running = True
            return self._jobs.popleft()

    def _fail_waiting(self, exc: TransferError) -> None:
        """Fail every job that has not started (one started by run_inline stays: in flight)."""
        with self._cond:
            jobs = [job for job in self._jobs if not job.future.running()]
            started = [job for job in self._jobs if job.future.running()]
            self._jobs = deque(started)
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                self._on_dropped()
                job.future.set_exception(
                    TransferError(f"KV transfer {job.transfer_id!r} not sent: {exc}")
                )
