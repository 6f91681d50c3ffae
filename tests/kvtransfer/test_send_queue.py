"""Transfers to one receiver queue in order: waiting for the pair never counts against a
transfer's timeout, a queued transfer can be cancelled before it reads its blocks, and an
unreachable receiver fails the whole queue at once."""

from __future__ import annotations

import threading
import time

import pytest

from kvtransfer import KvReceiver, KvSender, ReceiverOptions, SenderOptions, TransferError
from kvtransfer.results import TransferStats
from kvtransfer.send_queue import PairQueue, SendJob
from tests.kvtransfer.conftest import assert_blocks_equal, blocks
from tests.kvtransfer.peer import make_caches

pytestmark = pytest.mark.timeout(120)


def test_a_burst_longer_than_the_timeout_all_arrives(receiver: KvReceiver, rx_caches: list) -> None:
    """12 transfers of 0.25 s each (slowed between header and data) under a 1 s timeout: the
    whole burst takes 3 s, yet every transfer has its full second once its turn comes."""
    with KvSender(make_caches(1, 16), "burst") as sender:
        sender._after_header = lambda: time.sleep(0.25)  # a slow wire, not a stuck one
        handles = [receiver.expect(f"t{i}", [i], deadline_s=60) for i in range(12)]
        futures = [sender.submit(receiver.endpoint, f"t{i}", [i], 1.0) for i in range(12)]
        stats = [f.result(timeout=60) for f in futures]
        assert all(s.seconds < 1.0 for s in stats)
        assert all(h.wait(5).ok for h in handles)
        assert (sender.stats().transfers, sender.stats().failures) == (12, 0)
        assert_blocks_equal(
            blocks(rx_caches, list(range(12))), blocks(make_caches(1, 16), list(range(12)))
        )


def test_a_queued_transfer_cancelled_before_its_turn_is_never_sent(receiver: KvReceiver) -> None:
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:  # the first transfer waits here, between its header and its data
        entered.set()
        gate.wait(10)

    with KvSender(make_caches(1, 16), "cancel") as sender:
        first_handle = receiver.expect("first", [0], deadline_s=30)
        receiver.expect("second", [1], deadline_s=30)
        sender._after_header = hold
        first = sender.submit(receiver.endpoint, "first", [0], 5.0)
        assert entered.wait(10)
        second = sender.submit(receiver.endpoint, "second", [1], 5.0)
        assert second.cancel()  # still waiting for its turn
        assert not first.cancel()  # running: its blocks are read until it resolves
        gate.set()
        assert first.result(timeout=10).bytes > 0 and first_handle.wait(5).ok
        sender._after_header = None
        receiver.expect("third", [2], deadline_s=30)
        assert sender.send(receiver.endpoint, "third", [2], timeout_s=5).bytes > 0  # in order
        assert (sender.stats().transfers, sender.stats().failures) == (2, 0)
        assert receiver.cancel("second")  # never claimed: it was still pending


def test_an_unreachable_receiver_fails_every_queued_transfer_at_once() -> None:
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(10)

    rx = KvReceiver(make_caches(0, 16, zero=True), ReceiverOptions(io_timeout_s=3))
    with KvSender(make_caches(1, 16), "orphaned") as sender:
        rx.expect("first", [0], deadline_s=30)
        sender._after_header = hold
        first = sender.submit(rx.endpoint, "first", [0], 5.0)
        assert entered.wait(10)
        queued = [sender.submit(rx.endpoint, f"q{i}", [i], 5.0) for i in range(1, 6)]
        rx.close()  # the receiver goes away with one transfer in flight and five queued
        start = time.monotonic()
        gate.set()
        with pytest.raises(TransferError):
            first.result(timeout=10)
        for f in queued:  # the first of them cannot reconnect, the rest fail with it
            with pytest.raises(TransferError, match="cannot reach the KV receiver"):
                f.result(timeout=10)
        assert time.monotonic() - start < 5.0 + 1.0  # not 5 s for each of them
        assert sender.stats().failures == 6


def test_a_closed_sender_fails_what_is_still_queued(receiver: KvReceiver) -> None:
    gate, entered = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        gate.wait(10)

    sender = KvSender(make_caches(1, 16), "closing")
    receiver.expect("first", [0], deadline_s=30)
    sender._after_header = hold
    first = sender.submit(receiver.endpoint, "first", [0], 5.0)
    assert entered.wait(10)
    queued = sender.submit(receiver.endpoint, "queued", [1], 5.0)
    closer = threading.Thread(target=sender.close)
    closer.start()
    with pytest.raises(TransferError, match="closed"):
        queued.result(timeout=10)
    gate.set()  # the transfer in flight still ends
    assert first.result(timeout=10).bytes > 0
    closer.join(10)
    assert not closer.is_alive()
    with pytest.raises(TransferError, match="closed"):
        sender.submit(receiver.endpoint, "late", [2], 5.0)


def test_an_idle_pair_retires_and_the_next_transfer_builds_a_new_one(receiver: KvReceiver) -> None:
    """Nothing to send for idle_pair_s: the queue's thread says goodbye and exits (a decode
    worker that restarted is a new endpoint; the old one's thread must not live on)."""

    def send_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == f"kv-send {receiver.endpoint}"]

    with KvSender(make_caches(1, 16), "idle", SenderOptions(idle_pair_s=0.3)) as sender:
        receiver.expect("before", [0], deadline_s=30)
        assert sender.send(receiver.endpoint, "before", [0], timeout_s=5).bytes > 0
        (thread,) = send_threads()
        thread.join(10)  # retires by itself once idle
        assert not thread.is_alive() and not sender._queues
        receiver.expect("after", [1], deadline_s=30)
        assert sender.send(receiver.endpoint, "after", [1], timeout_s=5).bytes > 0
        assert (sender.stats().transfers, sender.stats().failures) == (2, 0)
    assert not send_threads()


def test_a_pair_whose_receiver_went_away_is_let_go_at_once_not_when_idle() -> None:
    """A decode worker that dies and restarts listens on a new KV endpoint: the old pair's
    group, sockets and thread must go when its receiver hangs up, not idle_pair_s later."""
    rx = KvReceiver(make_caches(0, 16, zero=True))
    endpoint = rx.endpoint
    with KvSender(make_caches(1, 16), "widowed", SenderOptions(idle_pair_s=300)) as sender:
        rx.expect("before", [0], deadline_s=30)
        assert sender.send(endpoint, "before", [0], timeout_s=5).bytes > 0
        (thread,) = [t for t in threading.enumerate() if t.name == f"kv-send {endpoint}"]
        rx.close()  # the receiver's end of the pair hangs up, as when its process dies
        thread.join(10)
        assert not thread.is_alive() and not sender._queues
        assert sender.stats().failures == 0  # nothing was being sent


class _Pair:
    """A stand-in pair: PairQueue only names its endpoint and closes it."""

    endpoint = "fake:1"

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self, farewell: bool = True) -> None:
        self.closed.set()

    def hung_up(self) -> bool:
        return False


def _queue(run) -> tuple[PairQueue, _Pair]:  # type: ignore[no-untyped-def]
    pair = _Pair()
    return PairQueue(pair, run, lambda: None, idle_s=60), pair  # type: ignore[arg-type]


def test_a_job_started_on_the_submitting_thread_is_finished_by_the_queue_first() -> None:
    order: list[str] = []
    gate = threading.Event()

    def run(pair: object, job: SendJob) -> TransferStats:
        if job.transfer_id == "busy":
            gate.wait(10)
        order.append(f"{job.transfer_id}:{job.inline}")
        return TransferStats(1, 0.0)

    queue, _ = _queue(run)
    callers: list[int] = []

    def start(pair: object) -> str:
        callers.append(threading.get_ident())
        return "launched"

    first = SendJob("a", [0], 5.0)
    assert queue.run_inline(first, start)  # idle: runs here, at once
    assert callers == [threading.get_ident()] and first.future.running()
    assert first.future.result(timeout=10).bytes == 1
    busy = SendJob("busy", [0], 5.0)
    queue.put(busy)
    while not busy.future.running():
        time.sleep(0.001)
    late = SendJob("b", [1], 5.0)
    assert not queue.run_inline(late, start)  # a job is running: not started here
    assert late.inline is None and callers == [threading.get_ident()]
    queue.put(late)
    gate.set()
    assert late.future.result(timeout=10).bytes == 1
    assert order == ["a:launched", "busy:None", "b:None"]
    queue.close(5)


def test_a_start_that_raised_fails_its_job_on_the_queue_and_closing_waits_for_started_jobs() -> None:  # fmt: skip
    def run(pair: object, job: SendJob) -> TransferStats:
        if isinstance(job.inline, BaseException):
            raise TransferError(f"started badly: {job.inline}")
        return TransferStats(2, 0.0)

    queue, pair = _queue(run)

    def boom(pair: object) -> None:
        raise RuntimeError("launch failed")

    failed = SendJob("x", [0], 5.0)
    assert queue.run_inline(failed, boom)
    with pytest.raises(TransferError, match="launch failed"):
        failed.future.result(timeout=10)
    cancelled = SendJob("y", [0], 5.0)
    assert cancelled.future.cancel()
    assert queue.run_inline(cancelled, boom) and cancelled.inline is None  # never started
    queue.close(5)
    assert pair.closed.wait(5)
    assert not queue.run_inline(SendJob("z", [0], 5.0), boom)  # closed
