"""prompt_logprobs in the engine: every prompt position's logprob, rank and top alternatives
equal transformers' log-softmax, across prefill chunks; such a request bypasses prefix-cache hits
(and still fills the cache for others); the values arrive once, with the first token."""

from __future__ import annotations

import pytest

from protos.sampling_params import InvalidRequestError, SamplingParams
from services.engine.llm import LLM
from tests.services.reference import transformers_logprobs

TEXT = "A small lighthouse stood on the rock, and every night its keeper climbed the stairs. " * 9


def test_prompt_logprobs_equal_transformers_across_chunks(llm: LLM) -> None:
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) > llm.engine.config.scheduler.token_budget  # several chunks
    res = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=4))[0]
    ref = transformers_logprobs(ids)
    scores = res.prompt_logprobs
    assert scores is not None and len(scores) == len(ids) and scores[0] is None
    for q in range(len(ids) - 1):
        entry = scores[q + 1]
        assert entry is not None and entry.chosen.token_id == ids[q + 1]
        assert abs(entry.chosen.logprob - ref[q, ids[q + 1]].item()) < 1e-4
        assert entry.chosen.rank == int((ref[q] > ref[q, ids[q + 1]]).sum()) + 1
        assert [t.token_id for t in entry.top] == ref[q].topk(4).indices.tolist()
        assert [t.rank for t in entry.top] == [1, 2, 3, 4]


def test_prefix_hits_are_bypassed_and_the_scores_repeat(llm: LLM) -> None:
    ids = llm.tokenizer.encode(TEXT)
    plain = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([ids], plain)  # fills the prefix cache
    assert llm.generate([ids], plain)[0].num_cached_tokens > 0
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    first, second = llm.generate([ids, ids], scored)
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    pairs = list(zip(first.prompt_logprobs or [], second.prompt_logprobs or [], strict=True))
    for a, b in pairs[1:]:  # the same numbers, up to the batch's float rounding
        assert a is not None and b is not None and a.top == b.top == ()
        assert (
            a.chosen.token_id == b.chosen.token_id
            and abs(a.chosen.logprob - b.chosen.logprob) < 1e-5
        )
    assert not llm.engine._prompt_lp  # nothing kept once the first token went out


def test_prompt_logprobs_are_bounded() -> None:
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be between 0 and 20"):
        SamplingParams(prompt_logprobs=21)


def test_a_recompute_after_the_first_token_sends_no_scores_again(llm: LLM) -> None:
    """Preempted after its first token, a request recomputes its prompt: the prompt logprobs
    went out with that token and are not scored (or sent) a second time."""
    engine = llm.engine
    ids = llm.tokenizer.encode(TEXT)
    engine.add_request("again", ids, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0))
    outs = []
    while not outs:
        outs = [o for o in engine.step() if o.request_id == "again"]
    assert len(outs[0].prompt_logprobs) == len(ids) - 1
    req = engine.scheduler.requests["again"]
    engine.scheduler._preempt(req)  # what running out of blocks does
    later = []
    while engine.has_unfinished:
        later += [o for o in engine.step() if o.request_id == "again"]
    assert later and all(not o.prompt_logprobs for o in later)
    assert "again" not in engine._prompt_lp
