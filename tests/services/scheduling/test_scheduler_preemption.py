"""Preemption by recompute, FCFS and priority ordering."""

from __future__ import annotations

from services.scheduling.request import Request
from services.scheduling.scheduler import Scheduler
from tests.services.scheduling.conftest import (
    expected_output,
    fake_token,
    make_request,
    make_scheduler,
)
from tests.services.scheduling.simulation import FakeEngine


def workload() -> list[Request]:
    return [make_request(f"r{i}", 6 + i, max_tokens=12 + 2 * i) for i in range(4)]


def run(sched: Scheduler, reqs: list[Request]) -> FakeEngine:
    engine = FakeEngine(sched)
    engine.add(*reqs)
    engine.run()
    assert sched.kv.all_free()
    return engine


def completion_order(engine: FakeEngine) -> list[str]:
    return list(engine.finished)


def test_a_tiny_pool_preempts_and_still_produces_the_same_tokens() -> None:
    big = run(make_scheduler(num_blocks=64), workload())
    assert big.scheduler.num_preemptions == 0
    tiny_reqs = workload()
    tiny = run(make_scheduler(num_blocks=8), tiny_reqs)
    assert tiny.scheduler.num_preemptions > 0
    assert sum(r.num_preemptions for r in tiny_reqs) == tiny.scheduler.num_preemptions
    assert any(out.preempted for out in tiny.outputs)
    assert tiny.streamed == big.streamed
    for req in tiny_reqs:
        assert req.output_token_ids == expected_output(req)[0]


def test_preemption_counts_and_victims_are_reported_in_the_output() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=8))
    reqs = workload()
    engine.add(*reqs)
    engine.run()
    preempted = [rid for out in engine.outputs for rid in out.preempted]
    assert len(preempted) == engine.scheduler.num_preemptions
    for out in engine.outputs:
        assert not set(out.preempted) & {sr.request_id for sr in out.requests}


def test_fcfs_preempts_the_latest_arrival() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=9))
    reqs = [make_request(f"r{i}", 8, max_tokens=20) for i in range(3)]
    engine.add(*reqs)
    while not engine.step().preempted:
        pass
    assert engine.outputs[-1].preempted == ["r2"]
    engine.run()
    assert completion_order(engine) == ["r0", "r1", "r2"]


def test_priority_preempts_the_lowest_priority() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=9, policy="priority"))
    reqs = [make_request(f"p{p}", 8, max_tokens=20, priority=p) for p in (0, 5, 1)]
    engine.add(*reqs)
    while not engine.step().preempted:
        pass
    assert engine.outputs[-1].preempted == ["p5"]
    engine.run()
    assert completion_order(engine) == ["p0", "p1", "p5"]


def test_fcfs_admits_in_arrival_order() -> None:
    engine = FakeEngine(make_scheduler(max_num_seqs=1))
    reqs = [make_request(f"r{i}", 4, max_tokens=2, priority=9 - i) for i in range(4)]
    engine.add(*reqs)
    engine.run()
    assert completion_order(engine) == ["r0", "r1", "r2", "r3"]


def test_fcfs_follows_arrival_time_not_add_order() -> None:
    engine = FakeEngine(make_scheduler(max_num_seqs=1))
    late = make_request("late", 4, max_tokens=2, arrival_time=2.0)
    early = make_request("early", 4, max_tokens=2, arrival_time=1.0)
    engine.add(late, early)
    engine.run()
    assert completion_order(engine) == ["early", "late"]


def test_priority_admits_lower_values_first_then_by_arrival() -> None:
    engine = FakeEngine(make_scheduler(max_num_seqs=1, policy="priority"))
    reqs = [
        make_request(f"r{i}-p{p}", 4, max_tokens=2, priority=p) for i, p in enumerate([3, 1, 2, 1])
    ]
    engine.add(*reqs)
    engine.run()
    assert completion_order(engine) == ["r1-p1", "r3-p1", "r2-p2", "r0-p3"]


def test_cached_prompt_tokens_never_exceed_the_prompt_after_a_preemption() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=8))
    reqs = workload()
    engine.add(*reqs)
    engine.run()
    assert engine.scheduler.num_preemptions > 0
    for req in reqs:
        assert req.num_cached_tokens <= req.num_prompt_tokens, req.request_id
        assert engine.finished[req.request_id].num_cached_tokens <= req.num_prompt_tokens
    assert engine.scheduler.kv.pool.hits <= engine.scheduler.kv.pool.queries


def test_a_high_priority_long_prompt_does_not_starve_running_decodes() -> None:
    engine = FakeEngine(
        make_scheduler(num_blocks=128, max_num_batched_tokens=16, policy="priority")
    )
    decoders = [make_request(f"d{i}", 4, max_tokens=30, priority=5) for i in range(3)]
    engine.add(*decoders)
    engine.step()
    urgent = make_request("urgent", 100, max_tokens=2, priority=0)
    engine.add(urgent)
    while urgent.num_output_tokens == 0:
        scheduled = {sr.request_id: sr.num_new_tokens for sr in engine.step().requests}
        assert all(scheduled.get(d.request_id) == 1 for d in decoders), scheduled
    engine.run()
    for req in [urgent, *decoders]:
        assert req.output_token_ids == expected_output(req)[0]


def test_activated_requests_waiting_for_a_seat_do_not_livelock_running_ones() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=4, max_num_seqs=1))
    local = make_request("local", 4, max_tokens=8)  # grows to 3 blocks
    engine.add(local)
    engine.step()
    remote = make_request("remote", 8, max_tokens=4)
    assert engine.scheduler.reserve(remote)  # 2 blocks, kept while it waits for a seat
    engine.transfer("remote", remote)
    engine.scheduler.activate("remote", [fake_token("remote", 8)])
    engine.run(max_steps=200)
    assert local.num_preemptions == 0, "the later, waiting request gives up its KV instead"
    assert remote.num_preemptions == 1
    for req in (local, remote):
        assert req.output_token_ids == expected_output(req)[0]
    assert engine.scheduler.kv.all_free()


def test_activated_requests_do_not_deadlock_a_preempted_one() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=6))
    local = make_request("local", 4, max_tokens=16)  # grows to 5 blocks
    engine.add(local)
    while local.num_tokens < 13:  # 12 computed in 3 blocks, the next token needs a 4th
        engine.step()
    remote = make_request("remote", 12, max_tokens=3)
    assert engine.scheduler.reserve(remote)  # the last 3 blocks; local must preempt itself
    engine.step()
    assert local.num_preemptions == 1
    engine.transfer("remote", remote)
    engine.scheduler.activate("remote", [fake_token("remote", 12)])
    engine.run(max_steps=200)
    for req in (local, remote):
        assert req.output_token_ids == expected_output(req)[0]
    assert engine.scheduler.kv.all_free()
