"""The receiver's bookkeeping of expected transfers: deadlines, cancel, claims, callbacks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvtransfer.expectations import Expectation, ExpectationRegistry
from kvtransfer.results import CounterBox, TransferResult

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def counters() -> CounterBox:
    return CounterBox()


@pytest.fixture
def registry(counters: CounterBox) -> Iterator[ExpectationRegistry]:
    reg = ExpectationRegistry(counters)
    yield reg
    reg.close()


def ok(tid: str) -> TransferResult:
    return TransferResult(tid, True, bytes=10, seconds=0.1)


def test_deadline_fails_the_handle_runs_callbacks_and_counts_a_failure(registry, counters):
    seen: list[TransferResult] = []
    handle = registry.expect("t", [1], deadline_s=0.2)
    handle.add_done_callback(seen.append)
    assert handle.wait(0.05) is None  # still pending
    result = handle.wait(3)
    assert result is not None and not result.ok and "deadline" in result.error
    assert seen == [result]
    assert counters.snapshot().failures == 1
    assert registry.pending_count() == 0


def test_without_a_deadline_it_waits_for_its_owner_and_tells_senders_why(registry):
    """The decode worker's reservation keeps the one clock: an expectation registered without
    a deadline outlives any janitor pass and ends when the owner cancels it, with its reason."""
    handle = registry.expect("owned", [1, 2])
    short = registry.expect("short", [3], deadline_s=0.05)
    assert short.wait(3) is not None  # the janitor ran past "owned" and left it alone
    assert not handle.done() and registry.pending_count() == 1
    assert registry.cancel("owned", "reservation 'owned' expired")
    result = handle.wait(1)
    assert result is not None and not result.ok and result.error == "reservation 'owned' expired"
    why = registry.claim("owned", grace_s=0.0)
    assert isinstance(why, str) and "reservation 'owned' expired" in why


def test_callback_added_after_completion_runs_at_once(registry):
    handle = registry.expect("t", [1], deadline_s=10)
    exp = registry.claim("t", 0)
    assert isinstance(exp, Expectation)
    registry.complete(exp, lambda: None, ok("t"))
    seen: list[TransferResult] = []
    handle.add_done_callback(seen.append)
    assert seen == [ok("t")]


def test_cancel_is_idempotent_and_a_cancelled_transfer_is_never_written(registry):
    handle = registry.expect("t", [1], deadline_s=10)
    exp = registry.claim("t", 0)
    assert isinstance(exp, Expectation)
    assert handle.cancel() is True
    assert registry.cancel("t") is False
    writes: list[int] = []
    result = registry.complete(exp, lambda: writes.append(1), ok("t"))
    assert writes == [] and not result.ok and "cancel" in result.error


def test_cancel_waits_for_a_write_in_progress(registry):
    handle = registry.expect("t", [1], deadline_s=10)
    exp = registry.claim("t", 0)
    assert isinstance(exp, Expectation)
    writing, finished = threading.Event(), threading.Event()

    def slow_write() -> None:
        writing.set()
        time.sleep(0.3)
        finished.set()

    worker = threading.Thread(target=registry.complete, args=(exp, slow_write, ok("t")))
    worker.start()
    writing.wait(5)
    cancelled = registry.cancel("t")
    assert finished.is_set()  # cancel returned only after the blocks were written
    assert cancelled is False and handle.wait(0) == ok("t")
    worker.join(5)


def test_claim_waits_briefly_for_a_late_expect(registry):
    timer = threading.Timer(0.1, lambda: registry.expect("late", [2], 10))
    timer.start()
    claim = registry.claim("late", grace_s=5)
    assert isinstance(claim, Expectation) and claim.handle.block_ids == (2,)
    assert "already being received" in str(registry.claim("late", 0))
    timer.join()


def test_claim_of_unknown_or_cancelled_ids_explains_why(registry):
    assert "not expected" in str(registry.claim("nobody", 0.05))
    registry.expect("c", [1], 10)
    registry.cancel("c")
    start = time.monotonic()
    assert "no longer expected" in str(registry.claim("c", grace_s=5))
    assert time.monotonic() - start < 1  # a known-dead id does not wait out the grace


def test_duplicate_expect_is_refused_but_a_finished_id_can_be_reused(registry):
    registry.expect("t", [1], 10)
    with pytest.raises(ValueError, match="already expected"):
        registry.expect("t", [2], 10)
    registry.cancel("t")
    handle = registry.expect("t", [2], 10)
    assert handle.block_ids == (2,) and not handle.done()


def test_close_fails_everything_pending(counters):
    registry = ExpectationRegistry(counters)
    handles = [registry.expect(f"t{i}", [i], 60) for i in range(3)]
    registry.close()
    assert all("closed" in h.wait(0).error for h in handles)
    with pytest.raises(RuntimeError):
        registry.expect("x", [1], 1)
