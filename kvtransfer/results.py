"""Plain results of KV transfers: errors, per-transfer stats and cumulative counters."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


class TransferError(RuntimeError):
    """A transfer did not complete; the message says why (and names the peer)."""


@dataclass(frozen=True)
class TransferStats:
    """What one successful :meth:`KvSender.send` moved: acknowledged bytes and wall seconds."""

    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TransferResult:
    """How an expected transfer ended on the receiver.

    ``ok`` is True only if every byte arrived, validated and was written into the registered
    blocks (and, on CUDA, the writes were synchronized). ``seconds`` runs from the header's
    arrival to completion (0 if no header ever arrived).
    """

    transfer_id: str
    ok: bool
    error: str = ""
    bytes: int = 0
    seconds: float = 0.0
    sender_id: str = ""
    # when it ended: time.monotonic(), one clock for every process of a host (so a sender on
    # the same host can tell how long after its last write the KV was in place); 0: unknown
    finished: float = field(default=0.0, compare=False)


@dataclass(frozen=True)
class TransferCounters:
    """Cumulative totals for metrics (kv_transfer_bytes / _seconds / _failures)."""

    bytes: int = 0
    seconds: float = 0.0
    transfers: int = 0
    failures: int = 0
    granted: int = 0  # of ``transfers``: copied into blocks granted ahead (kvtransfer.grants)


class CounterBox:
    """Thread-safe accumulator behind ``stats()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0
        self._seconds = 0.0
        self._transfers = 0
        self._failures = 0
        self._granted = 0

    def add_ok(self, nbytes: int, seconds: float, granted: bool = False) -> None:
        with self._lock:
            self._bytes += nbytes
            self._seconds += seconds
            self._transfers += 1
            self._granted += granted

    def add_failure(self) -> None:
        with self._lock:
            self._failures += 1

    def snapshot(self) -> TransferCounters:
        with self._lock:
            return TransferCounters(
                self._bytes, self._seconds, self._transfers, self._failures, self._granted
            )
