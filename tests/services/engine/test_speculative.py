"""Speculative decoding (n-gram): the same text as without it, greedy and seeded, with drafts
really kept; the rejection rule keeps the target distribution; the proposer and adaptivity."""

from __future__ import annotations

import argparse
import itertools
import math

import pytest
import torch

from protos.sampling_params import SamplingParams
from services.cli import build_parser
from services.config import ConfigError, SpeculativeConfig
from services.engine.llm import LLM
from services.engine.sampler import sample_with_drafts
from services.engine.speculative import (
    ACCEPT_FLOOR,
    DRAFT_ADAPTIVITY,
    PAUSE_STEPS,
    VERIFY_ROWS,
    Acceptance,
    NgramProposer,
)
from services.scheduling.outputs import ScheduledRequest

COPYING = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n# add type hints to add\n",
    "Extract the name from: 'Name: John Smith, Age: 42, City: Paris'. Name:",
    "Copy the list: apples, pears, plums, cherries, grapes, figs. The list again: apples,",
    "Quote the first line of: 'Roses are red, violets are blue, sugar is sweet.' First line:",
    'Fix the typo in "I recieved the package yesterday and it was broken." Fixed:',
    "The password is tango-seven-alpha. Say the password twice: tango-seven-alpha,",
    'Fill in JSON: name=Ada, year=1815. JSON: {"name": "Ada", "year": 1815} again: {',
]
FREE = [
    "Hello, how are you today?",
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Give me three tips for sleeping well.",
    "Tell me a short story about a robot.",
    "Explain what a prime number is.",
    "Why is the sky blue?",
    "Name a few colours of the rainbow.",
]
PROMPTS = COPYING + FREE


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
              "prompt_lookup_max": 3}  # fmt: skip
    return LLM("embedded", max_num_seqs=32, speculative_config=config)


def _ids(results: list) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def assert_same_but_near_ties(got: list, want: list, top: int, most: int = 1) -> None:
    """The same greedy tokens, except that a sequence may part at a float32 near-tie: where it
    first does, each side's token is in the other's top ``top`` and the two are within 1e-4 of
    each other in both distributions (after that the texts go their own ways). At most
    ``most`` sequences part."""
    parted = 0
    for x, y in zip(got, want, strict=True):
        a, b = x.outputs[0], y.outputs[0]
        if a.token_ids == b.token_ids:
            continue
        pairs = zip(a.token_ids, b.token_ids, strict=False)
        i = next((i for i, (s, t) in enumerate(pairs) if s != t), None)
        assert i is not None, "one stopped before the other with the same tokens"
        la = {t.token_id: t.logprob for t in a.logprobs[i].top[:top]}
        lb = {t.token_id: t.logprob for t in b.logprobs[i].top[:top]}
        mine, theirs = a.token_ids[i], b.token_ids[i]
        assert theirs in la and mine in lb, f"parted at {i} on no near-tie: {la} / {lb}"
        assert abs(la[mine] - la[theirs]) < 1e-4 and abs(lb[mine] - lb[theirs]) < 1e-4
        parted += 1
    assert parted <= most, f"{parted} sequences parted"


def test_greedy_output_equals_the_engine_without_speculation(llm: LLM, spec_llm: LLM) -> None:
    """Verifying drafts computes several positions in one step, so float32 sums differ in
    their last bits from one token a step: the same tokens but at a near-tie (one of these
    prompts has one, 4e-6 apart, at its 33rd token on the CPU; 24 tokens here, the suite's
    time: ~65 drafts kept)."""
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=5)
    before = spec_llm.engine.spec_stats.num_accepted_tokens
    assert_same_but_near_ties(spec_llm.generate(PROMPTS, params), llm.generate(PROMPTS, params), 5)
    stats = spec_llm.engine.spec_stats
    assert stats.num_accepted_tokens - before > 20  # drafts were really kept, not only proposed
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1]


def test_seeded_sampling_with_penalties_and_logprobs_gives_the_same_text(
    llm: LLM, spec_llm: LLM
) -> None:
    """Each position's noise comes from (seed, output position), so a seeded request samples the
    same tokens whether its drafts were kept or not; penalties see the kept drafts as output."""
    params = [
        SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=7, logprobs=2),
        SamplingParams(
            max_tokens=32,
            temperature=0.7,
            top_k=20,
            seed=11,
            repetition_penalty=1.15,
            frequency_penalty=0.3,
        ),
        SamplingParams(max_tokens=32, temperature=1.0, min_p=0.05, seed=3, presence_penalty=0.5),
    ]
    prompts = COPYING[:3]
    want, got = llm.generate(prompts, params), spec_llm.generate(prompts, params)
    assert _ids(got) == _ids(want)
    for a, b in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs, strict=True):
        assert a.chosen.token_id == b.chosen.token_id
        assert math.isclose(a.chosen.logprob, b.chosen.logprob, abs_tol=1e-3)
        assert [t.token_id for t in a.top] == [t.token_id for t in b.top]


def test_stop_strings_and_max_tokens_cut_a_kept_run_where_they_would_without_drafts(
    llm: LLM, spec_llm: LLM
) -> None:
    params = [
        SamplingParams(max_tokens=40, temperature=0, stop=["tango-seven-alpha"]),
        SamplingParams(
            max_tokens=40, temperature=0, stop=[", cherries"], include_stop_str_in_output=True
        ),
        SamplingParams(max_tokens=5, temperature=0),
    ]
    prompts = [COPYING[6], COPYING[3], COPYING[0]]
    want, got = llm.generate(prompts, params), spec_llm.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert (b.outputs[0].text, b.outputs[0].token_ids) == (
            a.outputs[0].text,
            a.outputs[0].token_ids,
        )
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
    assert len(got[2].outputs[0].token_ids) == 5
    assert not spec_llm.engine.has_unfinished and spec_llm.engine.kv.all_free()


def test_rejection_keeps_the_target_distribution() -> None:
    """Unseeded temperature-1 sampling of a request with drafts: the first token follows the
    target distribution p0 (chi-square), a draft survives with probability p0(draft), and after
    a kept draft the next token follows the second row's distribution."""
    torch.manual_seed(0)
    V, N = 6, 20_000
    p0 = torch.tensor([0.05, 0.35, 0.1, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.1, 0.2, 0.2])
    rows = torch.stack([p0.log(), p1.log(), p1.log()])  # two drafts: 1 then 4
    sp = SamplingParams(temperature=1.0, max_tokens=8)
    reqs = [ScheduledRequest(f"r{i}", [9, 1, 4], 5, [0], True, sp, [], [9], num_spec=2)
            for i in range(N)]  # fmt: skip
    got = sample_with_drafts(rows.repeat(N, 1), reqs, {})
    first = torch.tensor([got[f"r{i}"][0].token_id for i in range(N)])
    counts = torch.bincount(first, minlength=V).double()
    expected = p0.double() * N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts)  # 5 degrees of freedom: p < 0.001 above 20.5
    kept_first = [got[f"r{i}"] for i in range(N) if got[f"r{i}"][0].token_id == 1]
    assert all(len(t) >= 2 for t in kept_first)  # a kept draft is followed by another token
    second = torch.tensor([t[1].token_id for t in kept_first])
    counts2 = torch.bincount(second, minlength=V).double()
    expected2 = p1.double() * len(kept_first)
    assert float(((counts2 - expected2) ** 2 / expected2).sum()) < 20.5
    assert all(len(got[f"r{i}"]) == 1 for i in range(N) if got[f"r{i}"][0].token_id != 1)


def test_greedy_rows_keep_drafts_until_the_first_mismatch() -> None:
    logits = torch.full((4, 5), -5.0)
    logits[0, 2] = logits[1, 3] = logits[2, 0] = logits[3, 4] = 5.0  # argmax: 2, 3, 0, 4
    sp = SamplingParams(temperature=0, max_tokens=9)
    make = lambda drafts: ScheduledRequest("r", [7, *drafts], 3, [0], True, sp, [], [7],  # noqa: E731
                                           num_spec=len(drafts))  # fmt: skip
    ids = lambda drafts: [t.token_id for t in sample_with_drafts(logits, [make(drafts)], {})["r"]]  # noqa: E731
    assert ids([2, 3, 0]) == [2, 3, 0, 4]  # all kept, plus the bonus token
    assert ids([2, 1, 0]) == [2, 3]  # the second draft differs: the target's token replaces it
    assert ids([1, 3, 0]) == [2]


def test_ngram_proposer_copies_what_followed_the_latest_match() -> None:
    prop = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                           prompt_lookup_max=2))  # fmt: skip
    prompt = [5, 6, 7, 8, 9, 5, 6, 1, 2, 3]
    assert prop.propose("a", prompt, [5, 6], limit=10) == [1, 2, 3]  # latest "5 6" wins
    assert prop.propose("a", prompt, [5, 6, 1], limit=2) == [2, 3]  # limit caps it
    assert prop.propose("a", prompt, [5, 6, 1, 4], limit=10) == []  # no earlier "1 4" or "4"
    assert prop.propose("b", [1, 2, 3], [], limit=10) == []
    # the latest match overlaps the tail: the loop it is in goes on, K drafts (not 1)
    assert prop.propose("c", [4, 4, 4, 4], [], limit=10) == [4, 4, 4]
    assert prop.propose("d", [9, 1, 2, 1, 2], [1, 2], limit=10) == [1, 2, 1]
    assert prop.propose("e", [9, 1, 2, 3, 1, 2, 3], [], limit=10) == [1, 2, 3]
    assert prop.propose("f", [9, 1, 2, 9, 1], [], limit=2) == [2, 9]  # K, or the limit
    assert prop.propose("a", prompt, [5, 6], limit=0) == []
    prop.drop("a")
    assert prop.propose("a", [1, 2, 1], [], limit=3) == [2, 1, 2]  # rebuilt, not the old buffer


def test_a_request_whose_drafts_fail_sits_out_longer_each_time() -> None:
    acc = Acceptance()
    steps = 0
    while acc.wants_proposal():
        acc.record(4, 0)
        steps += 1
    assert steps <= 5 and acc.rate == ACCEPT_FLOOR
    skipped = 1 + sum(1 for _ in range(100) if not acc.wants_proposal())
    assert skipped == PAUSE_STEPS
    acc.record(4, 0)  # fails again right after the pause: twice as long
    assert sum(1 for _ in range(100) if not acc.wants_proposal()) == 2 * PAUSE_STEPS
    acc.record(4, 4)
    acc.record(4, 4)
    assert acc.wants_proposal() and acc.rate > ACCEPT_FLOOR


def _probes(acc: Acceptance, tokens: int, k: int = 4) -> list[tuple[int, int]]:
    """(token index, drafts) of each proposal over ``tokens`` decode steps, all rejected."""
    probes = []
    for t in range(tokens):
        if acc.wants_proposal():
            drafts = min(k, acc.k)
            probes.append((t, drafts))
            acc.record(drafts, 0)
    return probes


def test_a_draft_models_request_backs_off_after_each_miss_and_proposes_one_draft() -> None:
    """Drafts that always fail: proposals at tokens 0, 9, 26, 59, 123 (pauses of 8, 16, 32 and
    then 63, capped so that the catch-up fits one graph replay of VERIFY_ROWS rows); only the
    first proposes K drafts, every later one a single draft."""
    probes = _probes(Acceptance(DRAFT_ADAPTIVITY, 4), 128)
    assert probes == [(0, 4), (9, 1), (26, 1), (59, 1), (123, 1)]
    long = _probes(Acceptance(DRAFT_ADAPTIVITY, 4), 1024)
    assert len(long) <= 5 + (1024 - 123) // VERIFY_ROWS + 1
    gaps = {b[0] - a[0] for a, b in itertools.pairwise(long[4:])}
    assert gaps == {VERIFY_ROWS}  # a probe every VERIFY_ROWS tokens: the pause plus the probe


def test_a_kept_draft_lengthens_the_next_proposal_and_ends_the_backoff() -> None:
    acc = Acceptance(DRAFT_ADAPTIVITY, 4)
    acc.record(4, 0)
    acc.record(1, 0)  # after the first pause
    assert (acc.k, acc.pause, acc.next_pause) == (1, 16, 32)
    acc.pause = 0
    acc.record(1, 1)  # kept: one more draft next time, and the next miss pauses briefly
    assert (acc.k, acc.pause, acc.next_pause) == (2, 0, PAUSE_STEPS)
    acc.record(2, 1)  # one of two kept: no pause, two drafts next time
    assert (acc.k, acc.pause) == (2, 0) and acc.wants_proposal()


def test_ngram_keeps_its_drafts_length_and_its_patience() -> None:
    acc = Acceptance()
    acc.record(4, 0)
    assert acc.pause == 0 and acc.k >= 4  # one miss: an n-gram lookup costs nothing


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"method": "eagle"}', "method must be one of ngram, draft_model"),
        ('{"method": "ngram", "model": "x"}', 'is for method "draft_model"'),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be in [1, 16]"),
        ('{"num_speculative_tokens": "4"}', "must be an integer"),
        (
            '{"prompt_lookup_min": 5, "prompt_lookup_max": 3}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ('{"num_speculative_tokens": 4, "acceptance": 1}', "not supported: acceptance"),
        ('{"disable_by_batch_size": true}', "disable_by_batch_size must be a positive integer"),
        ("[4]", "must be a JSON object"),
        ("{nope", "not valid JSON"),
    ],
)
def test_bad_speculative_configs_are_refused_naming_the_problem(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.parse(text)


def test_the_flag_is_checked_when_parsed_and_defaults_fill_in(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["decode", "--port", "0", "--speculative-config", '{"x": 1}'])
    assert exit_info.value.code == 2 and "not supported: x" in capsys.readouterr().err
    args = build_parser().parse_args(
        ["worker", "--port", "0", "--speculative-config", '{"prompt_lookup_max": 1}']
    )
    assert isinstance(args, argparse.Namespace)
    config = SpeculativeConfig.parse(args.speculative_config)
    assert config == SpeculativeConfig("ngram", 4, 1, 1)
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(
    "text", ['{"model": "ngram", "num_speculative_tokens": 3}',
             '{"method": "[ngram]", "num_speculative_tokens": 3}',
             '{"method": "ngram", "model": "[ngram]", "num_speculative_tokens": 3}'],
)  # fmt: skip
def test_vllms_older_spelling_of_ngram_is_ngram(text: str) -> None:
    """vLLM takes ``"model": "ngram"`` (and "[ngram]") as n-gram lookup, not a draft model
    named ngram."""
    assert SpeculativeConfig.parse(text) == SpeculativeConfig("ngram", 3)
