"""Draft tokens (speculative decoding) in the scheduler: after a decode's last token, within the
budget left by the other decodes, never at another request's expense, rolled back when
rejected, and cut by the stop conditions."""

from __future__ import annotations

from services.scheduling.outputs import SampledToken
from services.scheduling.request import FinishReason
from tests.services.scheduling.conftest import make_request, make_scheduler


def _decoding(sched, *reqs):  # type: ignore[no-untyped-def]
    """Prefill every request and sample its first token (7)."""
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    sched.update(out, {s.request_id: [SampledToken(7)] for s in out.requests if s.sample})
    return out


def test_drafts_follow_the_last_token_and_only_kept_ones_count_as_computed() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    req = make_request("a", 8, max_tokens=20)
    _decoding(sched, req)
    req.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    (sr,) = out.requests
    assert sr.token_ids == [7, 1, 2, 3] and sr.num_spec == 3 and sr.draft_token_ids == [1, 2, 3]
    assert sr.start_pos == 8 and sr.sample and not req.spec_token_ids  # drafts used once
    assert len(sr.block_ids) == 3  # 12 positions' KV: the drafts' slots are allocated
    # the runner kept drafts 1 and 2, then sampled 9 where the draft said 3
    updates = sched.update(out, {"a": [SampledToken(1), SampledToken(2), SampledToken(9)]})
    assert [u.token.token_id for u in updates if u.token] == [1, 2, 9]
    assert req.output_token_ids == [7, 1, 2, 9] and req.num_computed_tokens == 11
    out = sched.schedule()  # the next step recomputes nothing: it starts at the new token
    assert out.requests[0].token_ids == [9] and out.requests[0].start_pos == 11


def test_drafts_take_only_what_the_other_decodes_leave_of_the_budget() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=5)
    a, b, c = (make_request(n, 4, max_tokens=20) for n in "abc")
    _decoding(sched, a)
    _decoding(sched, b)
    _decoding(sched, c)
    a.spec_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    by_id = {s.request_id: s for s in out.requests}
    assert by_id["a"].num_spec == 2 and by_id["b"].num_new_tokens == 1  # 5 = 3 + 1 + 1
    assert by_id["c"].num_new_tokens == 1 and out.num_tokens == 5


def test_drafts_never_preempt_another_request() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)  # 16 slots
    a, b = make_request("a", 7, max_tokens=9), make_request("b", 7, max_tokens=9)
    _decoding(sched, a, b)  # each holds 2 blocks, 8 slots, 8 tokens known: none free
    a.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert not out.preempted and [s.num_spec for s in out.requests] == [0, 0]
    assert {s.request_id for s in out.requests} == {"a", "b"}


def test_drafts_never_take_the_block_a_later_decode_needs() -> None:
    """One block free: a's drafts would fit in it, but b's next token needs it (review finding)."""
    sched = make_scheduler(num_blocks=5, block_size=4)
    a, b = make_request("a", 6, max_tokens=9), make_request("b", 8, max_tokens=9)
    _decoding(sched, a, b)  # a: 7 tokens in 2 blocks; b: 9 tokens, its 9th needs a third block
    a.spec_token_ids = [1, 2, 3]
    out = sched.schedule()
    assert not out.preempted and {s.request_id for s in out.requests} == {"a", "b"}
    by_id = {s.request_id: s for s in out.requests}
    assert by_id["a"].num_spec == 1  # only the slot left in a's own blocks
    assert by_id["b"].num_new_tokens == 1


def test_drafts_come_after_admissions_in_the_budget() -> None:
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=6)
    a = make_request("a", 4, max_tokens=20)
    _decoding(sched, a)
    sched.add(make_request("late", 4, max_tokens=4))
    a.spec_token_ids = [1, 2, 3, 4, 5]
    out = sched.schedule()
    by_id = {s.request_id: s for s in out.requests}
    assert by_id["late"].num_new_tokens == 4 and by_id["a"].num_spec == 1  # 6 = 1 + 4 + 1


def test_blocks_of_rejected_drafts_go_back_to_the_pool() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    req = make_request("a", 4, max_tokens=20)
    _decoding(sched, req)  # 5 tokens: 2 blocks
    req.spec_token_ids = [1, 2, 3, 4, 5, 6]
    out = sched.schedule()
    assert len(out.requests[0].block_ids) == 3  # positions 4..10
    free_before = sched.kv.num_free_blocks
    sched.update(out, {"a": [SampledToken(9)]})  # the first draft was rejected
    assert len(sched.kv.block_ids("a")) == 2 and sched.kv.num_free_blocks == free_before + 1
    sched.check_invariants()


def test_a_kept_run_stops_at_max_tokens_and_frees_the_blocks() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4)
    req = make_request("a", 5, max_tokens=3)
    _decoding(sched, req)
    req.spec_token_ids = [1, 2]
    out = sched.schedule()
    updates = sched.update(out, {"a": [SampledToken(1), SampledToken(2), SampledToken(3)]})
    assert [u.token.token_id for u in updates if u.token] == [1, 2]  # 3 tokens in all
    assert updates[-1].finished and req.finish_reason is FinishReason.LENGTH
    assert sched.kv.all_free()
