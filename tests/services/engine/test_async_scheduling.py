"""Async scheduling in the engine: a plain greedy decode step is queued on the device before the
step before it is read (its input ids are that step's tokens, on the device). The outputs must
be those of step-by-step scheduling, under stop strings, stop tokens, length limits, requests
that need the sampler, preemption and aborts, with every block free at the end."""

from __future__ import annotations

from pathlib import Path

import pytest

from protos.sampling_params import SamplingParams
from services.engine.llm import LLM
from services.engine.llm_engine import LLMEngine
from tests.services.engine.conftest import count_launches


def _results(res: list) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for r in res for o in r.outputs]


PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, stop=["the", "."]),
    SamplingParams(temperature=0, max_tokens=3),
    SamplingParams(temperature=0, max_tokens=24, stop=[" is"], include_stop_str_in_output=True),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=32),
    # drawn on the device too: the seeded noise's position is the step's, not the host's list's
    SamplingParams(temperature=0.8, seed=3, max_tokens=24),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=40, min_p=0.05, seed=5, max_tokens=28),
    SamplingParams(temperature=0, max_tokens=10, min_tokens=6),  # the sampler masks EOS first
    SamplingParams(temperature=0, max_tokens=8, logprobs=2),  # logprobs: read back each step
    SamplingParams(temperature=0.7, seed=9, max_tokens=12, presence_penalty=0.5),  # penalties
]


def test_launched_steps_give_the_outputs_of_step_by_step(
    llm: LLM, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = llm.engine
    assert engine.async_decode  # asked for (on the CPU; the default on a GPU)
    launches = count_launches(engine, monkeypatch)
    prompts = (chat_ids * 2)[: len(PARAMS)]
    ahead = llm.generate(prompts, PARAMS)
    assert launches[0] > 10, "most decode steps were meant to be launched ahead"
    assert launches[1] > 5, "steps with drawn rows were meant to be launched ahead too"
    assert not engine.has_unfinished
    assert engine.stats().free_blocks == engine.stats().total_blocks
    monkeypatch.setattr(engine, "async_decode", False)
    before = launches[0]
    one_by_one = llm.generate(prompts, PARAMS)
    assert launches[0] == before
    assert _results(ahead) == _results(one_by_one)
    # the same tokens; their logprobs to float32 rounding: steps ahead compose batches
    # differently once a request stops (it keeps its row one step more)
    got, want = ahead[8].outputs[0].logprobs, one_by_one[8].outputs[0].logprobs
    assert [p.chosen.token_id for p in got] == [p.chosen.token_id for p in want]
    for g, w in zip(got, want, strict=True):
        assert [t.token_id for t in g.top] == [t.token_id for t in w.top]
        assert [t.logprob for t in g.top] == pytest.approx([t.logprob for t in w.top], abs=1e-4)
    assert {r.outputs[0].finish_reason for r in ahead} == {"stop", "length"}


def test_a_tiny_pool_preempts_between_launched_steps(
    tiny_llama: Path, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """10 blocks of 16 for 8 requests of ~55 tokens: steps ahead cannot always get a block, the
    full schedule then preempts; the tokens are those of a big pool, step by step. (Blocks and
    steps are the engine's: a tiny random Llama serves both.)"""
    params = SamplingParams(temperature=0.0, max_tokens=16)
    big = LLM(str(tiny_llama), max_num_seqs=32)
    monkeypatch.setattr(big.engine, "async_decode", False)
    reference = [r.outputs[0].token_ids for r in big.generate(chat_ids, params)]
    monkeypatch.undo()
    tiny = LLM(str(tiny_llama), num_blocks=10, max_model_len=160, enable_prefix_caching=False,
               async_scheduling=True)  # fmt: skip
    launches = count_launches(tiny.engine, monkeypatch)
    assert [r.outputs[0].token_ids for r in tiny.generate(chat_ids, params)] == reference
    stats = tiny.engine.stats()
    assert stats.num_preemptions > 0 and launches[0] > 0
    assert stats.free_blocks == stats.total_blocks
    tiny.engine.scheduler.check_invariants()


def _abort_at_random(
    engine: LLMEngine, chat_ids: list[list[int]], count: int, most: int, seed: int,
    tokens: int,
) -> tuple[int, int]:  # fmt: skip
    """``count`` requests (``tokens`` + i tokens each, EOS ignored), stepped to the end with up
    to ``most`` live ones aborted after each step: each ends once, nothing streams after its
    abort, a request the launched step computes keeps its blocks until that step is read (a
    queued step writes them), and the pool is whole at the end. Returns (aborts of requests in
    a launched step, launched steps holding a prompt chunk)."""
    import random

    rng = random.Random(seed)
    live: set[str] = set()
    for i in range(count):
        engine.add_request(f"q{i}", chat_ids[i % len(chat_ids)],
                           SamplingParams(temperature=0, max_tokens=tokens + i, ignore_eos=True))  # fmt: skip
        live.add(f"q{i}")
    under_launch = mixed = 0
    while engine.has_unfinished:
        for out in engine.step():
            assert out.request_id in live, f"{out.request_id} streamed after it ended"
            if out.finished:
                live.discard(out.request_id)
        launched = engine._launched
        mixed += launched is not None and any(r.num_new_tokens > 1 for r in launched.out.requests)
        for rid in rng.sample(sorted(live), min(len(live), rng.randint(0, most))):
            free = engine.stats().free_blocks
            ahead = launched is not None and rid in {r.request_id for r in launched.out.requests}
            out = engine.abort(rid)
            assert out is not None and out.finish_reason == "abort"
            live.discard(rid)
            if ahead:  # held for the queued step
                under_launch += 1
                assert engine.stats().free_blocks == free
    assert not live
    assert engine.stats().free_blocks == engine.stats().total_blocks
    engine.scheduler.check_invariants()
    return under_launch, mixed


def test_aborts_of_requests_in_a_launched_step_free_their_blocks_once_it_is_read(
    tiny_llama: Path, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aborts land between steps while a decode step launched ahead still computes the aborted
    requests (see :func:`_abort_at_random`; EOS ignored: a tiny model with the session engine's
    32 seats and 128 blocks)."""
    engine = LLM(str(tiny_llama), max_num_seqs=32, num_blocks=128, async_scheduling=True).engine
    launches = count_launches(engine, monkeypatch)
    under_launch, _ = _abort_at_random(engine, chat_ids, 24, 2, 11, 6)
    assert launches[0] > 10 and under_launch >= 3


def test_an_error_between_launch_and_read_waits_for_the_device_before_freeing(
    llm: LLM, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step fails after the next one was launched: both are dropped unread, so the engine
    waits for the device before any of their blocks can be handed out again."""
    engine = llm.engine
    for i in range(3):
        engine.add_request(f"e{i}", chat_ids[i], SamplingParams(temperature=0, max_tokens=20))
    while engine._launched is None:
        engine.step()
    order: list[str] = []
    runner = type(engine.runner)
    finish, settle = runner.finish, type(engine.scheduler).settle

    def failing(self, step):  # type: ignore[no-untyped-def]
        raise RuntimeError("the device fell over")

    def settling(self, in_flight):  # type: ignore[no-untyped-def]
        if not in_flight:
            order.append("settle")
        settle(self, in_flight)

    monkeypatch.setattr(runner, "finish", failing)
    monkeypatch.setattr(runner, "wait_idle", lambda self: order.append("wait"))
    monkeypatch.setattr(type(engine.scheduler), "settle", settling)
    with pytest.raises(RuntimeError, match="fell over"):
        engine.step()
    assert order == ["wait", "settle"] and engine._launched is None
    monkeypatch.setattr(runner, "finish", finish)
    for i in range(3):
        engine.abort(f"e{i}")
    assert not engine.has_unfinished
    assert engine.stats().free_blocks == engine.stats().total_blocks


def test_prompt_chunks_and_admissions_run_launched_with_the_outputs_of_step_by_step(
    chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 40-token budget and 6 seats for 12 requests: prompts go in chunks beside the decodes
    and waiting requests join steps scheduled ahead. The outputs are step-by-step's, every
    block is free at the end. (A request needing the sampler's host work keeps the steps it is
    in, and its admission, to the full schedule: the first test mixes those in.)"""
    small = LLM("embedded", max_num_seqs=6, max_num_batched_tokens=40, async_scheduling=True)
    engine = small.engine
    seen = {"chunks": 0, "admitted": 0}
    launch = type(engine.runner).launch

    def counted(self, out, after=None, rows=None):  # type: ignore[no-untyped-def]
        if after is not None:
            before = {r.request_id for r in after.out.requests}
            seen["chunks"] += sum(r.num_new_tokens > 1 for r in out.requests)
            seen["admitted"] += sum(r.request_id not in before for r in out.requests)
        return launch(self, out, after, rows)

    monkeypatch.setattr(type(engine.runner), "launch", counted)
    prompts = (chat_ids * 2)[:12]
    params = (PARAMS[:7] * 2)[:12]  # greedy and drawn, stop strings, lengths
    ahead = small.generate(prompts, params)
    assert seen["chunks"] > 3 and seen["admitted"] > 3, seen
    assert not engine.has_unfinished
    assert engine.stats().free_blocks == engine.stats().total_blocks
    engine.scheduler.check_invariants()
    monkeypatch.setattr(engine, "async_decode", False)
    one_by_one = small.generate(prompts, params)
    assert _results(ahead) == _results(one_by_one)


def test_aborts_under_chunked_prompts_and_admissions_ahead_leave_the_pool_whole(
    tiny_llama: Path, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random aborts between steps while prompt chunks and admitted requests run launched (see
    :func:`_abort_at_random`; EOS ignored, so the model's text plays no part: a tiny one)."""
    small = LLM(str(tiny_llama), max_num_seqs=6, max_num_batched_tokens=40, async_scheduling=True)
    launches = count_launches(small.engine, monkeypatch)
    _, mixed = _abort_at_random(small.engine, chat_ids, 16, 1, 5, 4)
    assert launches[0] > 5 and mixed > 2


def test_each_call_reports_the_shape_of_the_step_it_read(
    tiny_llama: Path, chat_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Benchmarks time a ``step()`` call as the step whose tokens it read (``last_step_shape``).
    Under async scheduling a call returns once the step launched before it is done, so the shapes
    call by call are step-by-step scheduling's: prompt chunks, then decodes (they used to be the
    shapes of the step launched behind it, one step late: W1 counted a prefill step as a decode).
    Shapes are the scheduler's, EOS is ignored: a tiny model serves."""
    small = LLM(str(tiny_llama), max_num_seqs=6, max_num_batched_tokens=40,
                enable_prefix_caching=False, async_scheduling=True)  # fmt: skip
    engine = small.engine
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def shapes(tag: str) -> list[tuple[int, int]]:
        for i, ids in enumerate(chat_ids[:8]):
            engine.add_request(f"{tag}-{i}", ids, params)
        seen = []
        while engine.has_unfinished:
            engine.step()
            seen.append(engine.last_step_shape)
        return seen

    launches = count_launches(engine, monkeypatch)
    ahead = shapes("ahead")
    assert launches[0] > 5
    monkeypatch.setattr(engine, "async_decode", False)
    one_by_one = shapes("one-by-one")
    assert ahead == one_by_one
    assert sum(tokens > seqs for tokens, seqs in one_by_one) >= 3  # prompt chunks were in it
