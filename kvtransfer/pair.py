"""One 2-rank process group between a sender (rank 0) and a receiver (rank 1).

Built directly from a store (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` constructors), never
through ``init_process_group``: no global default group exists, and a broken pair is simply
dropped and rebuilt under a new store prefix.

Every wait is bounded by a deadline (``time.monotonic()`` seconds). A Gloo wait that times out
leaves the group unusable, so any failure here means: close the channel, build a new one.
NCCL works are polled instead of waited on, and a stuck NCCL group is aborted on close.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.device import GLOO, NCCL, gloo_device

SENDER_RANK = 0
RECEIVER_RANK = 1
_TAG = 17  # one ordered stream per pair; chunk k of a transfer uses _TAG + k
# NCCL completion polling: fine-grained for as long as a streamed chunk may take to come (the
# receiver notices the last chunk that much later), then backing off
POLL_S = 10e-6
_POLL_FINE_S = 0.05
_POLL_MAX_S = 1e-3
# a wait whose end nothing is waiting on (a streamed chunk before the last): each wake takes
# the GIL from the engine thread of the same process, and 10 us sleeps all through a prefill
# made a Python loop beside it much slower (kvtransfer/bench/poll_cost.py). 0.1 ms: a chunk
# still arriving as the last layer is computed is noticed at most that late
COARSE_POLL_S = 0.1e-3
_ALIVE_CHECK_S = 0.01
_PR_SET_TIMERSLACK = 29


class ChannelError(RuntimeError):
    """The pair's byte stream broke (peer gone, timeout): the channel must be closed."""


def _tidy(message: str) -> str:
    """Gloo's message without its source location and its chatty advice."""
    message = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", message)
    return message.split(". This is typically caused", 1)[0].strip()


def _remaining(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def precise_sleeps() -> None:
    """Let this thread's short sleeps last what they ask (Linux only; best effort).

    Linux stretches a thread's timed sleeps by its timer slack, 50 us by default, so each 10 us
    NCCL poll would last ~60 us and the receiver would notice a landed chunk that much later.
    """
    if sys.platform != "linux":
        return
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)  # 1 us


class PairChannel:
    """The data path of one pair: ordered, byte-exact ``send``/``recv`` of 1-D uint8 tensors."""

    def __init__(self, pg: Any, backend: str, rank: int, device: torch.device) -> None:
        self._pg: Any = pg
        self.backend = backend
        self.rank = rank
        self.peer = RECEIVER_RANK if rank == SENDER_RANK else SENDER_RANK
        self.device = device  # where this end's caches live

    @classmethod
    def open(
        cls,
        store: dist.Store,
        rank: int,
        backend: str,
        device: torch.device,
        deadline: float,
        *,
        gloo_address: str = "",
        gloo_interface: str = "",
        nccl_watchdog_s: float = 600.0,
    ) -> PairChannel:
        """Build the group (blocks until the peer builds its side) and exchange one warm-up byte.

        ``gloo_address``/``gloo_interface`` pick the local interface Gloo listens on. The NCCL
        watchdog timeout is kept long: our own deadlines fire first and abort the group.
        """
        if backend == NCCL:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=nccl_watchdog_s)
            pg: Any = dist.ProcessGroupNCCL(store, rank, 2, opts)
        else:
            gloo_opts: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            gloo_opts._timeout = timedelta(seconds=_remaining(deadline))
            gloo_opts._threads = 1  # only point-to-point traffic: no collective workers needed
            gloo_opts._devices = [gloo_device(gloo_address, gloo_interface)]
            pg = dist.ProcessGroupGloo(store, rank, 2, gloo_opts)
        channel = cls(pg, backend, rank, device)
        try:
            channel._warm_up(deadline)
        except BaseException:
            channel.close()
            raise
        return channel

    @property
    def wire_device(self) -> torch.device:
        """Where buffers handed to send/recv must live: the GPU for NCCL, host memory for Gloo."""
        return self.device if self.backend == NCCL else torch.device("cpu")

    def post_send(self, buf: torch.Tensor, tag: int = 0) -> Any:
        """Start sending ``buf`` (keep it alive until the peer has it); returns the work."""
        return self._group().send([buf], self.peer, _TAG + tag)

    def post_recv(self, buf: torch.Tensor, tag: int = 0) -> Any:
        """Start receiving into ``buf``; returns the work to :meth:`wait` on."""
        return self._group().recv([buf], self.peer, _TAG + tag)

    def wait(
        self,
        work: Any,
        deadline: float,
        what: str = "recv",
        alive: Callable[[], bool] | None = None,
        pause: float = POLL_S,
    ) -> None:
        """Wait for a posted work; raises ChannelError if it failed, the deadline passed or
        (NCCL, checked every few ms) ``alive()`` turned False: NCCL never notices a dead peer.
        ``pause``: the first polls' sleep (NCCL): short where the wait's end is on the critical
        path, ``COARSE_POLL_S`` where it is not."""
        self._complete(work, deadline, what, alive, pause)

    def send(self, buf: torch.Tensor, deadline: float) -> None:
        self._complete(self.post_send(buf), deadline, "send")

    def recv(self, buf: torch.Tensor, deadline: float) -> None:
        self._complete(self.post_recv(buf), deadline, "recv")

    def close(self) -> None:
        """Drop the group; the peer's pending and future operations on it fail promptly."""
        pg, self._pg = self._pg, None
        if pg is not None and self.backend == NCCL:
            with contextlib.suppress(Exception):
                pg.abort()  # a healthy or stuck communicator alike: never blocks on the peer

    @property
    def closed(self) -> bool:
        return self._pg is None

    def _group(self) -> Any:
        if self._pg is None:
            raise RuntimeError("pair channel is closed")
        return self._pg

    def _warm_up(self, deadline: float) -> None:
        # NCCL creates its communicator on the first operation: do it here, not in a transfer
        byte = torch.zeros(1, dtype=torch.uint8, device=self.wire_device)
        if self.rank == SENDER_RANK:
            self.send(byte, deadline)
        else:
            self.recv(byte, deadline)

    def _complete(
        self, work: Any, deadline: float, what: str, alive: Callable[[], bool] | None = None,
        pause: float = POLL_S,
    ) -> None:  # fmt: skip
        error = ""
        try:
            self._wait(work, deadline, alive, pause)
        except Exception as e:
            error = f"{self.backend} {what} failed: {_tidy(str(e))}"
        if error:
            # raised outside the handler, and without the work: a traceback that kept the work
            # alive would keep the group's connections open, hiding the failure from the peer
            del work
            raise ChannelError(error)

    def _wait(
        self, work: Any, deadline: float, alive: Callable[[], bool] | None, pause: float
    ) -> None:
        if self.backend == GLOO:
            work.wait(timedelta(seconds=_remaining(deadline)))  # Gloo notices a dead peer
            return
        start = next_check = time.monotonic()
        while not work.is_completed():
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"NCCL operation with rank {self.peer} timed out")
            if alive is not None and now >= next_check:
                if not alive():
                    raise ConnectionError(f"peer rank {self.peer} gave up or is gone")
                next_check = now + _ALIVE_CHECK_S
            time.sleep(pause)
            if now - start > _POLL_FINE_S:
                pause = min(pause * 2, _POLL_MAX_S)
        work.wait()  # raises the work's error, if any; orders the current stream after it
