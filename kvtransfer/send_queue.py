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
receiver starts a new one.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvtransfer.grants import Grant
from kvtransfer.ready import LayerReady
from kvtransfer.results import TransferError, TransferStats
from kvtransfer.sender_pair import SenderPair

log = logging.getLogger(__name__)


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
            if not job.future.set_running_or_notify_cancel():
                continue  # its caller gave up while it waited: nothing was sent
            try:
                job.future.set_result(self._run(self.pair, job))
            except ReceiverUnreachable as exc:
                job.future.set_exception(exc)
                self._fail_waiting(exc)
            except BaseException as exc:
                job.future.set_exception(exc)
        self.pair.close(farewell=True)
        if self._retired:
            self._on_retired(self)

    def _next(self) -> SendJob | None:
        with self._cond:
            while not self._jobs and not self._closed:
                if not self._cond.wait(self._idle_s) and not self._jobs:
                    self._closed = self._retired = True  # idle: put() now refuses
                    log.info(
                        "KV pair to %s idle for %.0f s: closed", self.pair.endpoint, self._idle_s
                    )
            return None if self._closed else self._jobs.popleft()

    def _fail_waiting(self, exc: TransferError) -> None:
        with self._cond:
            jobs = list(self._jobs)
            self._jobs.clear()
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                self._on_dropped()
                job.future.set_exception(
                    TransferError(f"KV transfer {job.transfer_id!r} not sent: {exc}")
                )
