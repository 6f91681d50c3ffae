"""Transfers a receiver expects: registration, claiming by a pair, cancellation and deadlines.

Life of one expectation: ``expect`` registers it (pending) -> a pair thread ``claim``s it when
the header arrives (receiving) -> the pair issues writes into the blocks chunk by chunk ->
``complete`` waits for them and resolves it ok, or ``fail`` resolves it with an error.
``cancel`` (or its deadline passing, where one was given) resolves it at any time before that. Writes are issued
only under the expectation's write lock and only while it is not cancelled, and resolving it
waits (``Expectation.flush``) for the writes already issued: once ``cancel`` returns, its blocks
are the caller's again.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from kvtransfer.grants import Grant
from kvtransfer.results import CounterBox, TransferResult

Callback = Callable[[TransferResult], None]
_TOMBSTONES = 4096  # recently finished ids remembered, so late senders get a precise error


class TransferHandle:
    """The receiver's view of one expected transfer (thread-safe).

    ``wait(timeout)`` returns the :class:`TransferResult` once the transfer has ended (ok or
    not) or None if ``timeout`` passes first. ``add_done_callback(fn)`` runs ``fn(result)`` on
    the thread that ends the transfer (at once if it already ended); from asyncio, wrap it with
    ``loop.call_soon_threadsafe``.
    """

    def __init__(
        self,
        transfer_id: str,
        block_ids: tuple[int, ...],
        cancel: Callable[[], bool],
        grant: Grant | None = None,
    ) -> None:
        self.transfer_id = transfer_id
        self.block_ids = block_ids
        # the blocks granted ahead to a sender on the same GPU (pass it to KvSender.submit)
        self.grant = grant
        self._cancel = cancel
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._result: TransferResult | None = None
        self._callbacks: list[Callback] = []

    def done(self) -> bool:
        return self._event.is_set()

    @property
    def result(self) -> TransferResult | None:
        return self._result

    def wait(self, timeout: float | None = None) -> TransferResult | None:
        self._event.wait(timeout)
        return self._result

    def cancel(self) -> bool:
        """Same as ``receiver.cancel(transfer_id)``; True if this call ended the transfer."""
        return self._cancel()

    def add_done_callback(self, fn: Callback) -> None:
        with self._lock:
            if self._result is None:
                self._callbacks.append(fn)
                return
        fn(self._result)

    def _set(self, result: TransferResult) -> bool:
        """Record the outcome; the first call wins. Callbacks run in :meth:`_fire`."""
        with self._lock:
            if self._result is not None:
                return False
            self._result = result
        self._event.set()
        return True

    def _fire(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        assert self._result is not None
        for fn in callbacks:
            fn(self._result)


class Expectation:
    """Registry-internal state of one transfer."""

    def __init__(
        self, handle: TransferHandle, deadline: float, settle: Callable[[], None] | None = None
    ) -> None:
        self.handle = handle
        self.deadline = deadline
        self.receiving = False
        self.cancel_reason = ""
        self.write_lock = threading.Lock()  # held while issuing writes into the blocks
        # waits for writes issued (set by the writer); with a grant, until then: takes the
        # grant back or waits for the copy that claimed it (kvtransfer.grants)
        self.flush: Callable[[], None] | None = settle
        # whether flush would wait on another process (a sender still copying into the blocks
        # on a shared GPU): a cancel then resolves on a thread of its own (set by the writer;
        # with a grant, taking it back is a GPU round trip: off the cancelling thread)
        self.busy: Callable[[], bool] | None = (lambda: True) if settle is not None else None

    @property
    def grant(self) -> Grant | None:
        return self.handle.grant

    @property
    def transfer_id(self) -> str:
        return self.handle.transfer_id

    def issue_write(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` (which issues writes into the blocks) unless cancelled; False if it was."""
        with self.write_lock:
            if self.cancel_reason:
                return False
            fn()
            return True


class ExpectationRegistry:
    """All expectations of one receiver, with a thread that fails those past their deadline."""

    def __init__(self, counters: CounterBox) -> None:
        self._counters = counters
        self._cond = threading.Condition()
        self._pending: dict[str, Expectation] = {}
        self._tombstones: OrderedDict[str, str] = OrderedDict()
        self._deadlines: list[tuple[float, int, Expectation]] = []
        self._order = itertools.count()
        self._closed = False
        self._janitor = threading.Thread(target=self._expire_loop, name="kv-deadlines", daemon=True)
        self._janitor.start()

    def expect(
        self,
        transfer_id: str,
        block_ids: list[int],
        deadline_s: float | None = None,
        grant: Grant | None = None,
        settle: Callable[[], None] | None = None,
    ) -> TransferHandle:
        """``deadline_s`` None: no deadline here; whoever owns the blocks cancels it. With a
        ``grant``, ``settle`` makes sure no copy of it writes any more (it is the flush until a
        pair takes the transfer over)."""
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s}")
        handle = TransferHandle(
            transfer_id, tuple(block_ids), lambda: self.cancel(transfer_id), grant
        )
        deadline = float("inf") if deadline_s is None else time.monotonic() + deadline_s
        exp = Expectation(handle, deadline, settle if grant is not None else None)
        with self._cond:
            if self._closed:
                raise RuntimeError("the KV receiver is closed")
            if transfer_id in self._pending:
                raise ValueError(f"transfer {transfer_id!r} is already expected")
            self._tombstones.pop(transfer_id, None)
            self._pending[transfer_id] = exp
            if deadline_s is not None:
                heapq.heappush(self._deadlines, (exp.deadline, next(self._order), exp))
            self._cond.notify_all()
        return handle

    def cancel(
        self,
        transfer_id: str,
        reason: str = "cancelled by the receiver",
        on_free: Callable[[], None] | None = None,
    ) -> bool:
        """End a pending or in-flight transfer; idempotent. True if this call ended it.

        Without ``on_free`` it returns once nothing writes the blocks any more. With it, it
        returns at once and ``on_free()`` runs when nothing writes them any more: right here in
        the usual case, on a thread of its own when a sender on the same GPU is still copying
        (it is told to stop, and the copies it queued finish first)."""
        with self._cond:
            exp = self._pending.get(transfer_id)
        if exp is None:
            if on_free is not None:
                on_free()
            return False
        if on_free is None or exp.busy is None or not exp.busy():
            ended = self._cancel_exact(exp, reason)
            if on_free is not None:
                on_free()
            return ended
        ended = self._withdraw(exp, reason)

        def resolve() -> None:
            try:
                if ended:
                    self._resolve(exp, TransferResult(exp.transfer_id, False, reason))
                else:  # someone else is ending it: wait for its writes all the same
                    with exp.write_lock:
                        if exp.flush is not None:
                            exp.flush()
            finally:
                on_free()

        threading.Thread(target=resolve, name="kv-cancel", daemon=True).start()
        return ended

    def claim(self, transfer_id: str, grace_s: float) -> Expectation | str:
        """Take an expectation for an arriving header, waiting up to ``grace_s`` for ``expect``.

        Returns the expectation or the reason it cannot be received.
        """
        end = time.monotonic() + grace_s
        with self._cond:
            while True:
                exp = self._pending.get(transfer_id)
                if exp is not None:
                    if exp.receiving:
                        return f"transfer {transfer_id!r} is already being received"
                    exp.receiving = True
                    return exp
                if self._closed:
                    return "the KV receiver is closed"
                if transfer_id in self._tombstones:
                    reason = self._tombstones[transfer_id]
                    return f"transfer {transfer_id!r} is no longer expected: {reason}"
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return f"transfer {transfer_id!r} is not expected by this receiver"
                self._cond.wait(remaining)

    def complete(
        self, exp: Expectation, write: Callable[[], None], result: TransferResult
    ) -> TransferResult:
        """Unless cancelled, run ``write`` (issuing or finishing the block writes), then resolve
        with ``result``; returns the final result (a cancellation may have won)."""
        with exp.write_lock:
            if exp.cancel_reason:
                return exp.handle.result or TransferResult(
                    exp.transfer_id, False, exp.cancel_reason
                )
            write()
            won = exp.handle._set(replace(result, finished=time.monotonic()))
        self._forget(exp, "already received")
        if won:
            exp.handle._fire()
        return exp.handle.result or result

    def fail(self, exp: Expectation, result: TransferResult) -> TransferResult:
        self._forget(exp, result.error)
        self._resolve(exp, replace(result, finished=time.monotonic()))
        return exp.handle.result or result

    def pending_count(self) -> int:
        with self._cond:
            return len(self._pending)

    def close(self, reason: str = "the KV receiver closed") -> None:
        """Fail everything still pending and stop the deadline thread."""
        with self._cond:
            self._closed = True
            ids = list(self._pending)
            self._cond.notify_all()
        for tid in ids:
            self.cancel(tid, reason)
        self._janitor.join(timeout=5)

    def _cancel_exact(self, exp: Expectation, reason: str) -> bool:
        if not self._withdraw(exp, reason):
            return False
        return self._resolve(exp, TransferResult(exp.transfer_id, False, reason))

    def _withdraw(self, exp: Expectation, reason: str) -> bool:
        """Mark ``exp`` cancelled and stop expecting it; False if it already ended."""
        with self._cond:
            if self._pending.get(exp.transfer_id) is not exp:
                return False
            del self._pending[exp.transfer_id]
            exp.cancel_reason = reason
            self._bury(exp.transfer_id, reason)
            return True

    def _forget(self, exp: Expectation, reason: str) -> None:
        with self._cond:
            if self._pending.get(exp.transfer_id) is exp:
                del self._pending[exp.transfer_id]
                self._bury(exp.transfer_id, reason)

    def _bury(self, transfer_id: str, reason: str) -> None:
        self._tombstones[transfer_id] = reason
        self._tombstones.move_to_end(transfer_id)
        while len(self._tombstones) > _TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _resolve(self, exp: Expectation, result: TransferResult) -> bool:
        with exp.write_lock:  # waits for writes being issued, then for those issued to finish
            if exp.flush is not None:
                exp.flush()
            won = exp.handle._set(result)
        if won:
            exp.handle._fire()
        return won

    def _expire_loop(self) -> None:
        while True:
            expired: list[Expectation] = []
            with self._cond:
                while not self._closed and not expired:
                    now = time.monotonic()
                    while self._deadlines and self._deadlines[0][0] <= now:
                        exp = heapq.heappop(self._deadlines)[2]
                        if self._pending.get(exp.transfer_id) is exp:
                            expired.append(exp)
                    if not expired:
                        wait = self._deadlines[0][0] - now if self._deadlines else None
                        self._cond.wait(wait)
                if self._closed:
                    return
            for exp in expired:
                if self._cancel_exact(exp, "deadline exceeded: the KV did not arrive in time"):
                    self._counters.add_failure()
