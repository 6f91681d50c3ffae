"""Abort in every state, prefill-only hold/release, decode-side reserve/activate/cancel."""

from __future__ import annotations

import pytest

from services.scheduling.request import FinishReason, Request, RequestStatus
from tests.services.scheduling.conftest import (
    expected_output,
    fake_token,
    make_request,
    make_scheduler,
    prompt,
)
from tests.services.scheduling.simulation import FakeEngine


def engine_with(*reqs: Request, **config: int | str) -> FakeEngine:
    engine = FakeEngine(make_scheduler(**config))  # type: ignore[arg-type]
    engine.add(*reqs)
    return engine


def assert_aborted(engine: FakeEngine, req: Request) -> None:
    assert req.finish_reason is FinishReason.ABORT
    assert req.finished
    assert req.request_id not in engine.scheduler.requests
    assert all(sr.request_id != req.request_id for sr in engine.scheduler.schedule().requests)
    engine.check_state()


def test_abort_while_waiting() -> None:
    req = make_request("a")
    engine = engine_with(req)
    assert engine.scheduler.abort("a") is req
    assert_aborted(engine, req)
    assert engine.scheduler.kv.all_free()


def test_abort_mid_prefill_and_mid_decode_frees_everything() -> None:
    decoding = make_request("dec", 4, max_tokens=50)
    prefilling = make_request("pre", 40, max_tokens=4)
    engine = engine_with(decoding, prefilling, max_num_batched_tokens=16)
    engine.step()
    engine.step()
    assert 0 < prefilling.num_computed_tokens < 40
    assert decoding.num_output_tokens == 2
    engine.scheduler.abort("pre")
    assert_aborted(engine, prefilling)
    engine.scheduler.abort("dec")
    assert_aborted(engine, decoding)
    assert not engine.scheduler.has_unfinished
    assert engine.scheduler.kv.all_free()


def test_abort_while_the_step_runs_drops_its_result() -> None:
    a, b = make_request("a", 6, max_tokens=3), make_request("b", 6, max_tokens=3)
    engine = engine_with(a, b)
    out = engine.step(during=lambda: engine.scheduler.abort("a"))
    assert {sr.request_id for sr in out.requests} == {"a", "b"}
    assert list(engine.streamed) == ["b"]
    assert a.output_token_ids == []
    assert a.finish_reason is FinishReason.ABORT
    engine.run()
    assert b.output_token_ids == expected_output(b)[0]
    assert engine.scheduler.kv.all_free()


def test_abort_of_a_preempted_request() -> None:
    reqs = [make_request(f"r{i}", 8, max_tokens=20) for i in range(3)]
    engine = engine_with(*reqs, num_blocks=9)
    while not engine.step().preempted:
        pass
    victim = engine.scheduler.requests[engine.outputs[-1].preempted[0]]
    assert victim.status is RequestStatus.PREEMPTED
    engine.scheduler.abort(victim.request_id)
    assert_aborted(engine, victim)
    engine.run()
    assert engine.scheduler.kv.all_free()


def test_abort_of_an_unknown_request_is_a_no_op() -> None:
    engine = engine_with(make_request("a"))
    assert engine.scheduler.abort("nope") is None
    engine.run()


def test_abort_keeps_a_prefix_shared_with_a_running_request() -> None:
    system = prompt(16, "system")
    a = make_request("a", [*system, 1], max_tokens=6)
    b = make_request("b", [*system, 2], max_tokens=6)
    engine = engine_with(a)
    engine.step()
    engine.add(b)
    engine.step()
    assert b.num_cached_tokens == 16
    engine.scheduler.abort("a")
    engine.run()  # b keeps attending to the shared blocks: the KV model checks them
    assert b.output_token_ids == expected_output(b)[0]
    assert engine.scheduler.kv.all_free()


def test_an_aborted_half_prefilled_prompt_is_not_served_as_a_prefix() -> None:
    shared = prompt(20, "shared")
    first = make_request("first", [*shared, 1], max_tokens=2)
    engine = engine_with(first, max_num_batched_tokens=6)  # the chunk ends inside block 1
    engine.step()
    engine.scheduler.abort("first")
    second = make_request("second", [*shared, 2], max_tokens=2)
    engine.add(second)
    engine.run()  # the KV model fails if second attends to slots 6-7, which nobody computed
    assert second.num_cached_tokens == 4
    assert second.output_token_ids == expected_output(second)[0]


# ---- prefill-only: hold the blocks after the first token until released ----------------------
def test_a_prefill_only_request_holds_its_kv_until_released() -> None:
    req = make_request("pf", 10, max_tokens=1, hold=True)
    engine = engine_with(req)
    engine.run()
    sched = engine.scheduler
    assert req.finish_reason is FinishReason.LENGTH
    assert engine.finished["pf"].finished
    assert "pf" in sched.held and not sched.has_unfinished
    assert len(sched.kv.block_ids("pf")) == 3
    engine.check_state()
    assert sched.release("pf") is req
    assert sched.kv.all_free()
    assert sched.release("pf") is None


def test_held_kv_survives_other_traffic() -> None:
    held = make_request("pf", 12, max_tokens=1, hold=True)
    engine = engine_with(held, num_blocks=8)
    engine.run()
    table = engine.scheduler.kv.block_ids("pf")
    snapshot = {bid: dict(engine.kv_store[bid]) for bid in table}
    others = [make_request(f"o{i}", 6, max_tokens=6) for i in range(3)]
    engine.add(*others)
    engine.run()
    assert engine.scheduler.num_preemptions > 0, "the pool was under pressure"
    assert engine.scheduler.kv.block_ids("pf") == table
    assert {bid: engine.kv_store[bid] for bid in table} == snapshot
    engine.scheduler.release("pf")
    assert engine.scheduler.kv.all_free()


def test_abort_of_a_held_request_releases_it() -> None:
    req = make_request("pf", 10, max_tokens=1, hold=True)
    engine = engine_with(req)
    engine.run()
    assert engine.scheduler.abort("pf") is req
    assert engine.scheduler.kv.all_free()


def test_an_aborted_prefill_only_request_holds_nothing() -> None:
    req = make_request("pf", 40, max_tokens=1, hold=True)
    engine = engine_with(req, max_num_batched_tokens=16)
    engine.step()
    engine.scheduler.abort("pf")
    assert "pf" not in engine.scheduler.held
    assert engine.scheduler.kv.all_free()


def test_a_held_request_id_cannot_be_reused() -> None:
    engine = engine_with(make_request("pf", 6, max_tokens=1, hold=True))
    engine.run()
    with pytest.raises(ValueError, match="already in use"):
        engine.scheduler.add(make_request("pf"))


# ---- decode side: reserve, KV arrives, activate; or cancel -----------------------------------
def first_token(req: Request) -> list[int]:
    return [fake_token(req.request_id, req.num_prompt_tokens)]


def test_reserve_then_activate_decodes_from_the_transferred_kv() -> None:
    req = make_request("d", 10, max_tokens=5)
    engine = FakeEngine(make_scheduler())
    sched = engine.scheduler
    assert sched.reserve(req)
    assert len(sched.kv.block_ids("d")) == 3
    assert not sched.has_unfinished
    assert sched.schedule().empty, "nothing runs before the KV arrives"
    engine.transfer("d", req)
    req.queued_time -= 30.0  # the wait for the KV ...
    sched.activate("d", first_token(req))
    (sr,) = engine.step().requests
    assert req.queue_s < 1.0  # ... is not time queued in this engine
    assert (sr.start_pos, sr.token_ids, sr.sample) == (10, first_token(req), True)
    assert req.num_cached_tokens == 0
    engine.run()
    assert req.output_token_ids == expected_output(req)[0]
    assert engine.streamed["d"] == expected_output(req)[0][1:]
    assert sched.kv.all_free()


def test_a_reservation_that_does_not_fit_takes_nothing() -> None:
    sched = make_scheduler(num_blocks=4)
    assert sched.reserve(make_request("a", 12))
    assert not sched.reserve(make_request("b", 8))
    assert sched.kv.block_ids("b") == []
    assert sched.kv.num_free_blocks == 1
    sched.check_invariants()
    assert sched.cancel_reservation("a")
    assert sched.reserve(make_request("b", 8))


def test_cancel_reservation_frees_the_blocks_once() -> None:
    sched = make_scheduler()
    sched.reserve(make_request("a", 12))
    assert sched.cancel_reservation("a")
    assert not sched.cancel_reservation("a")
    assert sched.kv.all_free()
    with pytest.raises(KeyError):
        sched.activate("a", [1])


def test_a_reserved_id_cannot_be_reserved_twice() -> None:
    sched = make_scheduler()
    sched.reserve(make_request("a", 12))
    with pytest.raises(ValueError, match="already in use"):
        sched.reserve(make_request("a", 12))


def test_a_reserved_id_cannot_be_added() -> None:
    sched = make_scheduler()
    sched.reserve(make_request("a", 12))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(make_request("a", 12))


def test_abort_cancels_a_reservation() -> None:
    sched = make_scheduler()
    req = make_request("a", 12)
    sched.reserve(req)
    assert sched.abort("a") is req
    assert "a" not in sched.reserved
    assert sched.kv.all_free()


def test_kv_that_never_arrived_is_not_served_as_a_prefix() -> None:
    shared = prompt(16, "shared")
    engine = FakeEngine(make_scheduler())
    engine.scheduler.reserve(make_request("lost", [*shared, 1]))
    engine.scheduler.cancel_reservation("lost")  # the transfer failed
    local = make_request("local", [*shared, 2], max_tokens=3)
    engine.add(local)
    engine.run()  # the KV model fails if local attends to blocks nobody wrote
    assert local.num_cached_tokens == 0
    assert engine.scheduler.kv.all_free()


def test_kv_in_flight_is_not_served_as_a_prefix() -> None:
    shared = prompt(16, "shared")
    engine = FakeEngine(make_scheduler())
    incoming = make_request("incoming", [*shared, 1], max_tokens=3)
    engine.scheduler.reserve(incoming)
    local = make_request("local", [*shared, 2], max_tokens=3)
    engine.add(local)
    engine.step()  # the transfer has not written anything yet
    engine.transfer("incoming", incoming)
    engine.scheduler.activate("incoming", first_token(incoming))
    engine.run()
    assert local.num_cached_tokens == 0
    assert incoming.output_token_ids == expected_output(incoming)[0]


def test_activated_requests_survive_preemption() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=12))
    reqs = [make_request(f"d{i}", 8, max_tokens=16) for i in range(3)]
    for req in reqs:
        assert engine.scheduler.reserve(req)
        engine.transfer(req.request_id, req)
        engine.scheduler.activate(req.request_id, first_token(req))
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    for req in reqs:
        assert req.output_token_ids == expected_output(req)[0]
    assert engine.scheduler.kv.all_free()


def test_activating_an_already_finished_request_generates_nothing_more() -> None:
    req = make_request("d", 8, max_tokens=1)
    engine = FakeEngine(make_scheduler())
    engine.scheduler.reserve(req)
    engine.transfer("d", req)
    engine.scheduler.activate("d", first_token(req))
    engine.run()
    assert req.output_token_ids == first_token(req)
    assert req.finish_reason is FinishReason.LENGTH
    assert engine.scheduler.kv.all_free()
