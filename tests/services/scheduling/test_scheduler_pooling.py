"""Embedding requests in the scheduler: prefill only, in chunks; the step that computes the last
prompt chunk finishes them without a token and frees their blocks; only last-token pooling
reads the prefix cache (mean and cls need every position)."""

from __future__ import annotations

import pytest

from protos.pooling_params import PoolingParams
from services.scheduling.outputs import SampledToken
from services.scheduling.request import FinishReason, Request
from services.scheduling.scheduler import Scheduler
from tests.services.scheduling.conftest import make_request, make_scheduler, prompt


def embedding(rid: str, tokens: list[int], kind: str = "last") -> Request:
    req = make_request(rid, tokens, max_tokens=1)
    req.pooling = PoolingParams(kind)
    return req


def run_to_end(scheduler: Scheduler, req: Request) -> list[tuple[int, int, bool]]:
    """(start, tokens, last chunk) of each step the request ran in, until it finished."""
    chunks = []
    while not req.finished:
        out = scheduler.schedule()
        (sr,) = out.requests
        assert sr.pooling == req.pooling and not sr.samples_token
        chunks.append((sr.start_pos, sr.num_new_tokens, sr.sample))
        (update,) = scheduler.update(out, {}) or [None]
        if sr.sample:
            assert update is not None and update.token is None and update.finished
            assert update.finish_reason == "stop" and update.num_prompt_tokens == len(
                req.prompt_token_ids
            )
        else:
            assert update is None
    return chunks


def test_an_embedding_prefills_in_chunks_and_finishes_without_a_token() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    req = embedding("e", prompt(20))
    scheduler.add(req)
    assert run_to_end(scheduler, req) == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert req.finish_reason is FinishReason.STOP and req.output_token_ids == []
    assert scheduler.kv.all_free() and not scheduler.requests
    scheduler.check_invariants()


@pytest.mark.parametrize(("kind", "reads_cache"), [("last", True), ("mean", False), ("cls", False)])
def test_only_last_token_pooling_reads_the_prefix_cache(kind: str, reads_cache: bool) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    tokens = prompt(18, "shared")
    first = embedding("first", tokens)
    scheduler.add(first)
    run_to_end(scheduler, first)  # fills the cache with its 4 full blocks
    again = embedding("again", tokens, kind)
    scheduler.add(again)
    chunks = run_to_end(scheduler, again)
    if reads_cache:  # 16 tokens cached, the last block's 2 computed: the last position is there
        assert chunks == [(16, 2, True)] and again.num_cached_tokens == 16
    else:
        assert chunks == [(0, 18, True)] and again.num_cached_tokens == 0
    assert scheduler.kv.all_free()


def test_an_embedding_batches_with_a_generation() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    gen = make_request("g", 6, max_tokens=3)
    emb = embedding("e", prompt(9, "e"))
    scheduler.add(gen)
    scheduler.add(emb)
    out = scheduler.schedule()
    assert [(r.request_id, r.samples_token) for r in out.requests] == [("g", True), ("e", False)]
    updates = scheduler.update(out, {"g": [SampledToken(7)]})
    assert [(u.request_id, u.token is None, u.finished) for u in updates] == [
        ("g", False, False),
        ("e", True, True),
    ]
    assert "e" not in scheduler.requests and "g" in scheduler.requests
