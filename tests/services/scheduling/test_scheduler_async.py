"""Async scheduling: the decode step after a running one, scheduled before its tokens are known."""

from __future__ import annotations

import pytest

from services.scheduling.outputs import SampledToken, SchedulerOutput
from services.scheduling.request import Request, RequestStatus
from services.scheduling.scheduler import Scheduler
from tests.services.scheduling.conftest import fake_token, make_request, make_scheduler


def _decoding(sched: Scheduler, *reqs: Request) -> SchedulerOutput:
    """Prefill ``reqs`` (one step, tokens sampled and read) and schedule their first decode."""
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    sched.update(
        out, {sr.request_id: [SampledToken(fake_token(sr.request_id, 0))] for sr in out.requests}
    )
    decode = sched.schedule()
    assert all(sr.num_new_tokens == 1 for sr in decode.requests)
    return decode


def _ahead(sched: Scheduler, running: SchedulerOutput) -> tuple[SchedulerOutput, list[int]]:
    """The step ahead of ``running``, which the case expects there to be."""
    ahead = sched.schedule_ahead(running)
    assert ahead is not None, "no step ahead was scheduled"
    return ahead


def _read(sched: Scheduler, out: SchedulerOutput, token: int = 1) -> None:
    sched.update(out, {sr.request_id: [SampledToken(token)] for sr in out.requests})


def test_the_step_ahead_computes_the_token_after_the_running_one() -> None:
    sched = make_scheduler()
    a, b = make_request("a", 6, max_tokens=8), make_request("b", 9, max_tokens=8)
    running = _decoding(sched, a, b)
    nxt, rows = _ahead(sched, running)
    assert rows == [0, 1]
    for sr, before in zip(nxt.requests, running.requests, strict=True):
        assert sr.start_pos == before.start_pos + 1 and sr.num_new_tokens == 1 and sr.sample
    _read(sched, running)  # the running step's tokens arrive after the next was scheduled
    # its blocks cover the position it writes
    for sr in nxt.requests:
        assert len(sched.kv.block_ids(sr.request_id)) * 4 >= sr.start_pos + 1
    _read(sched, nxt)
    assert a.num_computed_tokens == 6 + 2 and len(a.output_token_ids) == 3
    sched.check_invariants()


def test_a_request_the_running_step_ends_by_length_is_left_out() -> None:
    sched = make_scheduler()
    short, long = make_request("s", 5, max_tokens=2), make_request("l", 5, max_tokens=8)
    running = _decoding(sched, short, long)
    ahead = _ahead(sched, running)
    assert [sr.request_id for sr in ahead[0].requests] == ["l"] and ahead[1] == [1]


@pytest.mark.parametrize(
    "case",
    ["waiting-with-a-seat", "min-tokens", "no-free-blocks", "aborted-only", "holds-its-blocks"],
)
def test_only_the_full_schedule_decides_when(case: str) -> None:
    sched = make_scheduler(num_blocks=5 if case == "no-free-blocks" else 64)
    req = make_request("a", 7 if case == "no-free-blocks" else 6, max_tokens=12,
                       min_tokens=5 if case == "min-tokens" else 0,
                       hold=case == "holds-its-blocks")  # fmt: skip
    running = _decoding(sched, req)
    if case == "waiting-with-a-seat":
        sched.add(make_request("w", 4))
    if case == "no-free-blocks":  # 2 blocks of 4 hold its 8 tokens, the 9th needs a 3rd
        assert sched.kv.allocate(make_request("x", 4), 12)
    if case == "aborted-only":
        sched.abort("a")
    assert sched.schedule_ahead(running) is None


def test_blocks_of_a_request_ending_under_a_queued_step_wait_for_it() -> None:
    """A request finished (or aborted) while a queued step still writes its KV keeps its
    blocks, and its id, until that step is read: a reservation cannot take them meanwhile."""
    sched = make_scheduler(num_blocks=8)
    running = _decoding(sched, make_request("a", 8, max_tokens=20))
    ahead = _ahead(sched, running)
    nxt = ahead[0]
    sched.settle(frozenset({"a"}))
    held = set(sched.kv.block_ids("a"))
    free = sched.kv.num_free_blocks
    sched.abort("a")
    assert sched.kv.num_free_blocks == free  # not yet
    with pytest.raises(ValueError, match="already in use"):
        sched.add(make_request("a", 4))
    other = make_request("r", 4 * free)
    assert sched.reserve(other)
    assert not held & set(sched.kv.block_ids("r"))
    _read(sched, running)
    _read(sched, nxt)  # the dropped token: the request is gone
    assert sched.kv.num_free_blocks == 0
    sched.settle(frozenset())
    assert sched.kv.num_free_blocks == len(held)
    assert sched.cancel_reservation("r") and sched.kv.all_free()
    sched.check_invariants()


def test_a_stop_token_in_the_running_step_drops_the_step_ahead_token() -> None:
    sched = make_scheduler()
    req = make_request("a", 6, max_tokens=10, stop_token_ids=(7,))
    running = _decoding(sched, req)
    ahead = _ahead(sched, running)
    sched.settle(frozenset({"a"}))
    _read(sched, running, token=7)
    assert req.status is RequestStatus.FINISHED and req.output_token_ids[-1] == 7
    assert sched.update(ahead[0], {"a": [SampledToken(3)]}) == []
    assert req.output_token_ids[-1] == 7
    sched.settle(frozenset())
    assert sched.kv.all_free()


def test_a_seat_the_running_step_frees_by_length_goes_to_the_waiting_request() -> None:
    """Every seat taken, a request waiting, and one running request that ``running`` ends by
    length: the step after it is the full schedule's, which admits the waiting request."""
    sched = make_scheduler(max_num_seqs=2)
    running = _decoding(
        sched, make_request("s", 5, max_tokens=2), make_request("l", 5, max_tokens=9)
    )
    sched.add(make_request("w", 4))
    assert sched.schedule_ahead(running) is None
    _read(sched, running)
    admitted = sched.schedule()
    assert {sr.request_id for sr in admitted.requests} == {"l", "w"}


def test_with_every_seat_kept_a_waiting_request_does_not_stop_the_step_ahead() -> None:
    sched = make_scheduler(max_num_seqs=2)
    running = _decoding(
        sched, make_request("a", 5, max_tokens=9), make_request("b", 5, max_tokens=9)
    )
    sched.add(make_request("w", 4))
    assert [sr.request_id for sr in _ahead(sched, running)[0].requests] == ["a", "b"]


def _sampled(out: SchedulerOutput, token: int = 1) -> dict[str, list[SampledToken]]:
    return {sr.request_id: [SampledToken(token)] for sr in out.requests if sr.samples_token}


def test_a_prompt_chunk_goes_on_with_its_next_chunk_beside_the_decodes() -> None:
    """A 40-token prompt in 16-token chunks beside a decode: the step ahead holds the decode
    (its input id row 0 of the running step's sampled tokens) and the prompt's next chunk
    (known tokens); then the last chunk, which samples; the tokens are the full schedule's."""
    sched = make_scheduler(max_num_batched_tokens=17, long_prefill_token_threshold=16)
    _read(sched, _decoding(sched, make_request("d", 6, max_tokens=12)))
    long = make_request("p", 40, max_tokens=4)
    sched.add(long)
    first = sched.schedule()  # the full schedule admits it: d's decode and p's first chunk
    assert [(sr.request_id, sr.num_new_tokens) for sr in first.requests] == [("d", 1), ("p", 16)]
    nxt, rows = _ahead(sched, first)
    assert [(sr.request_id, sr.start_pos, sr.num_new_tokens, sr.sample)
            for sr in nxt.requests] == [("d", 8, 1, True), ("p", 16, 16, False)]  # fmt: skip
    assert rows == [0, -1] and nxt.requests[1].token_ids == long.prompt_token_ids[16:32]
    sched.update(first, _sampled(first))
    sched.register_ahead(nxt)
    last, rows = _ahead(sched, nxt)
    assert [(sr.request_id, sr.start_pos, sr.num_new_tokens, sr.sample)
            for sr in last.requests] == [("d", 9, 1, True), ("p", 32, 8, True)]  # fmt: skip
    assert rows == [0, -1]
    sched.update(nxt, _sampled(nxt))
    after, rows = _ahead(sched, last)  # both decode: p's first token is row 1
    assert [(sr.request_id, sr.start_pos) for sr in after.requests] == [("d", 10), ("p", 40)]
    assert rows == [0, 1]
    sched.update(last, _sampled(last, 5))
    assert long.num_computed_tokens == 40 and long.output_token_ids == [5]
    sched.check_invariants()


def test_waiting_requests_take_free_seats_ahead_only_if_each_may_be() -> None:
    sched = make_scheduler(max_num_seqs=4)
    running = _decoding(sched, make_request("a", 6, max_tokens=12))
    sched.add(make_request("w1", 8))
    sched.add(make_request("w2", 8))
    assert sched.schedule_ahead(running, may_admit=lambda r: r.request_id != "w2") is None
    nxt, rows = _ahead_admitting(sched, running)
    assert [(sr.request_id, sr.num_new_tokens, sr.sample) for sr in nxt.requests] == [
        ("a", 1, True), ("w1", 8, True), ("w2", 8, True)]  # fmt: skip
    assert rows == [0, -1, -1] and not sched.waiting
    _read(sched, running)
    sched.update(nxt, _sampled(nxt))
    assert [len(r.output_token_ids) for r in sched.running] == [3, 1, 1]
    sched.check_invariants()


def _ahead_admitting(
    sched: Scheduler, running: SchedulerOutput
) -> tuple[SchedulerOutput, list[int]]:
    ahead = sched.schedule_ahead(running, may_admit=lambda r: True)
    assert ahead is not None
    return ahead


def test_a_last_chunk_under_min_tokens_is_the_full_schedules() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=16)
    sched.add(make_request("p", 24, max_tokens=8, min_tokens=2))
    first = sched.schedule()
    assert first.requests[0].num_new_tokens == 16 and not first.requests[0].sample
    assert sched.schedule_ahead(first) is None  # its last chunk samples with EOS masked
