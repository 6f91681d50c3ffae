"""Continuous batching, chunked prefill, prefix hits and stop conditions, through a fake engine."""

from __future__ import annotations

import pytest

from services.scheduling.outputs import NO_TOKEN
from services.scheduling.request import FinishReason, Request
from tests.services.scheduling.conftest import (
    EOS,
    expected_output,
    fake_token,
    make_request,
    make_scheduler,
    prompt,
)
from tests.services.scheduling.simulation import FakeEngine, Sampler


def assert_finished_as_expected(engine: FakeEngine, *requests: Request) -> None:
    for req in requests:
        tokens, reason = expected_output(req)
        assert engine.streamed[req.request_id] == tokens, req.request_id
        assert req.output_token_ids == tokens
        assert req.finish_reason is reason
        assert engine.finished[req.request_id].finish_reason == reason.value
    assert engine.scheduler.kv.all_free()


def batch(engine: FakeEngine) -> dict[str, int]:
    """Run one step; request id -> tokens computed."""
    return {sr.request_id: sr.num_new_tokens for sr in engine.step().requests}


def test_one_request_prefills_then_decodes_a_token_per_step() -> None:
    engine = FakeEngine(make_scheduler())
    req = make_request("a", 10, max_tokens=4)
    engine.add(req)
    first = engine.step().requests
    assert [(sr.start_pos, sr.num_new_tokens, sr.sample) for sr in first] == [(0, 10, True)]
    assert [batch(engine) for _ in range(3)] == [{"a": 1}] * 3
    assert not engine.scheduler.has_unfinished
    assert_finished_as_expected(engine, req)


def test_a_late_request_joins_running_decodes_and_finished_ones_leave() -> None:
    engine = FakeEngine(make_scheduler())
    a = make_request("a", 6, max_tokens=5)
    b = make_request("b", 7, max_tokens=6)
    engine.add(a)
    assert batch(engine) == {"a": 6}
    assert batch(engine) == {"a": 1}
    engine.add(b)
    assert batch(engine) == {"a": 1, "b": 7}
    assert batch(engine) == {"a": 1, "b": 1}
    assert batch(engine) == {"a": 1, "b": 1}  # a's fifth token: a finishes
    assert a.finished
    assert batch(engine) == {"b": 1}
    engine.run()
    assert_finished_as_expected(engine, a, b)


def test_max_num_seqs_caps_the_batch_and_everyone_finishes() -> None:
    engine = FakeEngine(make_scheduler(max_num_seqs=2))
    reqs = [make_request(f"r{i}", 5, max_tokens=3) for i in range(5)]
    engine.add(*reqs)
    engine.run()
    assert max(len(out.requests) for out in engine.outputs) == 2
    assert_finished_as_expected(engine, *reqs)


def test_queue_time_runs_from_joining_the_queue_to_first_being_scheduled() -> None:
    engine = FakeEngine(make_scheduler(max_num_seqs=1))
    first, second = make_request("first", 5, max_tokens=3), make_request("second", 5, max_tokens=2)
    engine.add(first, second)
    engine.step()
    assert first.first_scheduled_time is not None and second.queue_s == 0.0  # not yet scheduled
    second.queued_time -= 2.0  # as if it had joined 2 s earlier
    engine.run()
    assert second.queue_s >= 2.0 and first.queue_s < 1.0
    assert engine.finished["second"].queue_s >= 2.0  # reported with its tokens


def test_a_long_prompt_is_prefilled_in_chunks_within_the_budget() -> None:
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=32))
    req = make_request("long", 100, max_tokens=2)
    engine.add(req)
    chunks = [engine.step().requests[0] for _ in range(4)]
    assert [(c.start_pos, c.num_new_tokens) for c in chunks] == [
        (0, 32),
        (32, 32),
        (64, 32),
        (96, 4),
    ]
    assert [c.sample for c in chunks] == [False, False, False, True]
    assert req.num_output_tokens == 1, "only the last chunk samples"
    engine.run()
    assert_finished_as_expected(engine, req)


def test_long_prefill_threshold_caps_each_chunk() -> None:
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8))
    long, short = make_request("long", 20, max_tokens=2), make_request("short", 5, max_tokens=2)
    engine.add(long, short)
    assert batch(engine) == {"long": 8, "short": 5}
    assert batch(engine) == {"long": 8, "short": 1}
    engine.run()
    assert_finished_as_expected(engine, long, short)


def test_running_decodes_are_scheduled_every_step_of_a_long_prefill() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=128, max_num_batched_tokens=16))
    decoders = [make_request(f"d{i}", 4, max_tokens=40) for i in range(3)]
    engine.add(*decoders)
    engine.step()
    long = make_request("long", 120, max_tokens=2)
    engine.add(long)
    while long.num_output_tokens == 0:
        remaining = long.num_prompt_tokens - long.num_computed_tokens
        scheduled = batch(engine)
        assert all(scheduled.get(d.request_id) == 1 for d in decoders), scheduled
        assert scheduled["long"] == min(remaining, 13), "the prompt takes the rest of the budget"
    engine.run()
    assert_finished_as_expected(engine, long, *decoders)


def test_a_shared_system_prompt_is_computed_once() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=64))
    system = prompt(24, "system")
    a = make_request("a", system + prompt(5, "a"), max_tokens=3)
    b = make_request("b", system + prompt(7, "b"), max_tokens=3)
    engine.add(a)
    assert batch(engine) == {"a": 29}
    engine.add(b)
    assert batch(engine) == {"a": 1, "b": 7}
    assert b.num_cached_tokens == 24
    assert a.num_cached_tokens == 0
    engine.run()
    assert_finished_as_expected(engine, a, b)
    assert engine.scheduler.kv.pool.hits >= 24


def test_a_finished_request_still_serves_its_prefix() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=64))
    system = prompt(16, "system")
    a = make_request("a", [*system, 1, 2], max_tokens=2)
    engine.add(a)
    engine.run()
    b = make_request("b", [*system, 3, 4, 5], max_tokens=2)
    engine.add(b)
    assert batch(engine) == {"b": 3}
    engine.run()
    assert b.num_cached_tokens == 16
    assert_finished_as_expected(engine, a, b)


def test_same_step_arrivals_share_a_prefix_safely() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=64, max_num_batched_tokens=256))
    system = prompt(20, "system")
    reqs = [make_request(f"r{i}", system + prompt(3, f"r{i}"), max_tokens=4) for i in range(4)]
    engine.add(*reqs)
    engine.run()
    assert_finished_as_expected(engine, *reqs)


def test_identical_prompts_arriving_together_under_chunked_prefill() -> None:
    engine = FakeEngine(make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=6))
    tokens = prompt(20, "same")
    reqs = [make_request(f"r{i}", tokens, max_tokens=3) for i in range(3)]
    engine.add(*reqs)
    engine.run()  # the KV model fails if one attends to a block slot the other has not computed
    assert_finished_as_expected(engine, *reqs)


def test_prefix_cache_metrics_count_each_admission_once() -> None:
    engine = FakeEngine(make_scheduler(num_blocks=8))
    hog = make_request("hog", 28, max_tokens=4)  # 8 blocks by its end
    waiter = make_request("waiter", 8, max_tokens=2)
    engine.add(hog, waiter)
    engine.run()
    assert waiter.first_scheduled_time is not None and hog.first_scheduled_time is not None
    assert waiter.first_scheduled_time > hog.first_scheduled_time
    assert engine.outputs[1].requests[0].request_id == "hog", "the waiter waited for space"
    pool = engine.scheduler.kv.pool
    assert (pool.queries, pool.hits) == (28 + 8, 0)


def test_prefix_caching_off_computes_everything() -> None:
    engine = FakeEngine(make_scheduler(enable_caching=False))
    system = prompt(16, "system")
    a, b = (
        make_request("a", [*system, 1], max_tokens=2),
        make_request("b", [*system, 2], max_tokens=2),
    )
    engine.add(a)
    engine.run()
    engine.add(b)
    assert batch(engine) == {"b": 17}
    engine.run()
    assert b.num_cached_tokens == 0
    assert_finished_as_expected(engine, a, b)


def sampler_with(token: int, at_output: int) -> Sampler:
    """The fake sampler, except output number ``at_output`` (0-based) of every request."""

    def sample(request_id: str, position: int) -> int:
        return token if position == 8 + at_output else fake_token(request_id, position)

    return sample


@pytest.mark.parametrize(
    ("kwargs", "sampled", "outputs", "reason"),
    [
        ({}, EOS, 3, FinishReason.STOP),
        ({"ignore_eos": True}, EOS, 10, FinishReason.LENGTH),
        ({"stop_token_ids": (7,), "ignore_eos": True}, 7, 3, FinishReason.STOP),
        ({"min_tokens": 5}, EOS, 10, FinishReason.LENGTH),
        ({"max_model_len": 12, "ignore_eos": True}, EOS, 4, FinishReason.LENGTH),
    ],
)
def test_stop_conditions_end_the_stream(
    kwargs: dict[str, object], sampled: int, outputs: int, reason: FinishReason
) -> None:
    engine = FakeEngine(make_scheduler(), sampler=sampler_with(sampled, at_output=2))
    req = make_request("r", 8, max_tokens=10, **kwargs)  # type: ignore[arg-type]
    engine.add(req)
    engine.run()
    assert len(engine.streamed["r"]) == outputs
    assert req.finish_reason is reason
    update = engine.finished["r"]
    assert update.finish_reason == reason.value
    # a stop_token_id names itself; EOS leaves it None, as vLLM
    stop_id = reason is FinishReason.STOP and sampled != EOS
    assert update.stop_reason == (sampled if stop_id else None)
    assert engine.scheduler.kv.all_free()


def test_a_row_left_without_a_token_ends_its_request_with_an_error() -> None:
    """NO_TOKEN (the sampler found every token masked): the request finishes there with
    finish_reason "error" and no output token, its blocks free; the others go on."""

    def sample(request_id: str, position: int) -> int:
        return (
            NO_TOKEN
            if request_id == "r" and position == 8 + 2
            else fake_token(request_id, position)
        )

    engine = FakeEngine(make_scheduler(), sampler=sample)
    req, other = make_request("r", 8, max_tokens=10), make_request("o", 8, max_tokens=6)
    engine.add(req, other)
    engine.run()
    assert req.finish_reason is FinishReason.ERROR and len(req.output_token_ids) == 2
    assert NO_TOKEN not in req.output_token_ids and engine.streamed["r"][-1] == NO_TOKEN
    update = engine.finished["r"]
    assert update.finish_reason == "error" and update.stop_reason is None
    assert_finished_as_expected(engine, other)  # every block free too


def test_a_stop_string_found_by_the_detokenizer_finishes_the_request() -> None:
    engine = FakeEngine(make_scheduler())
    req = make_request("r", 8, max_tokens=10)
    engine.add(req)
    engine.step()
    engine.scheduler.finish("r", FinishReason.STOP, stop_reason="###")
    assert req.finish_reason is FinishReason.STOP and req.stop_reason == "###"
    assert not engine.scheduler.has_unfinished
    assert engine.scheduler.schedule().empty
    assert engine.scheduler.kv.all_free()


def test_a_request_id_cannot_be_reused_while_in_flight() -> None:
    sched = make_scheduler()
    sched.add(make_request("a"))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(make_request("a"))
