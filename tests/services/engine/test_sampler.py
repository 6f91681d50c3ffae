"""The sampler's filters and penalties on hand-made logits."""

from __future__ import annotations

import torch

from protos.sampling_params import SamplingParams
from services.engine.sampler import (
    PENALTY_ROWS,
    _mask_top_k_top_p,
    apply_penalties,
    mask_ids,
    sample,
)
from services.scheduling.outputs import NO_TOKEN


def test_greedy_takes_argmax_and_min_tokens_masks_stop_ids() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    out = sample(logits, [SamplingParams(temperature=0)] * 2, [[], []], [[0], [0]], [[1], []])
    assert [t.token_id for t in out] == [2, 0]  # token 1 is masked for the first row


def test_top_k_and_top_p_keep_the_right_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    k2 = _mask_top_k_top_p(logits, torch.tensor([2]), torch.tensor([1.0]))
    assert torch.isfinite(k2).tolist() == [[True, True, False, False]]
    p = _mask_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.7]))
    assert torch.isfinite(p).tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.8


def test_sampling_follows_the_distribution_and_filters() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]])).repeat(4000, 1)
    params = [SamplingParams(temperature=1.0, top_k=2)] * 4000
    toks = torch.tensor(
        [t.token_id for t in sample(logits, params, [[]] * 4000, [[0]] * 4000, [[]] * 4000)]
    )
    freq = torch.bincount(toks, minlength=4).float() / 4000
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0].item() - 2 / 3) < 0.04


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.25, 0.05]])).repeat(500, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.2, seed=i) for i in range(500)]
    toks = {t.token_id for t in sample(logits, params, [[]] * 500, [[0]] * 500, [[]] * 500)}
    assert toks == {0, 1}


def test_a_tiny_temperature_samples_the_likely_token() -> None:
    """temperature 1e-40 divided the logits into inf (NaN probabilities, read as token 0 every
    step); raised to vLLM's 0.01 it samples the argmax of well-separated logits."""
    logits = torch.tensor([[0.0, 5.0, 1.0]]).repeat(50, 1)
    params = [SamplingParams(temperature=1e-40, seed=i) for i in range(50)]
    assert {t.token_id for t in sample(logits, params, [[]] * 50, [[0]] * 50, [[]] * 50)} == {1}


def test_min_p_filters_before_top_p() -> None:
    """vLLM's order after the temperature: min_p, then top-k and top-p on what it left. Of
    0.5/0.3/0.1/0.1, min_p 0.3 leaves 0.625/0.375, where top_p 0.6 keeps the first token only
    (top_p first would keep two: 0.5 < 0.6)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]])).repeat(400, 1)
    params = [SamplingParams(temperature=1.0, min_p=0.3, top_p=0.6, seed=i) for i in range(400)]
    toks = {t.token_id for t in sample(logits, params, [[]] * 400, [[0]] * 400, [[]] * 400)}
    assert toks == {0}


def test_penalties() -> None:
    logits = torch.tensor([[2.0, 2.0, -1.0, 1.0]])
    apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [[2]], [[0]])
    assert logits.tolist() == [[1.0, 2.0, -2.0, 1.0]]
    logits = torch.zeros(1, 3)
    apply_penalties(
        logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], [[1, 1, 2]], [[0]]
    )
    assert logits.tolist() == [[0.0, -1.0, -0.75]]


def test_logit_bias_shifts_the_biased_tokens_only() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = [SamplingParams(temperature=0, logit_bias={1: -100}),
              SamplingParams(temperature=0, logit_bias={"0": 100, 2: 1.5})]  # fmt: skip
    out = sample(logits, params, [[], []], [[0], [0]], [[], []])
    assert [t.token_id for t in out] == [2, 0]
    assert logits.tolist() == [[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]]  # the caller's logits untouched
    lp = sample(logits[:1], [SamplingParams(temperature=0, logprobs=0, logit_bias={1: -100})],
                [[]], [[0]], [[]])[0]  # fmt: skip
    assert lp.token_id == 2 and lp.logprob == torch.log_softmax(logits[0], -1)[2].item()


def test_logit_bias_comes_before_the_repetition_penalty() -> None:
    """vLLM's order: a prompt token's biased logit is what the repetition penalty divides (or
    multiplies, where the bias made it negative), so a bias cannot lift a repeated token past
    a fresh one that the penalty alone would not."""
    logits = torch.tensor([[4.0, 5.0, 1.0]])
    sp = SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={0: 4.0, 2: -3.0})
    out = sample(logits, [sp], [[2]], [[0]], [[]])
    assert out[0].token_id == 1  # (4 + 4) / 2 = 4 < 5; the bias after the penalty gave 6
    penalized = logits.clone()
    apply_penalties(penalized, [sp], [[2]], [[0]])
    assert penalized.tolist() == [[4.0, 5.0, -4.0]]  # (1 - 3) * 2


def test_allowed_token_ids_leave_only_those_tokens() -> None:
    """vLLM's allowed_token_ids: the best of the allowed tokens (after logit_bias), even a far
    less likely one; sampled rows draw among them only; logprobs stay the raw model's."""
    logits = torch.tensor([[0.0, 5.0, 1.0, -2.0], [0.0, 5.0, 1.0, -2.0], [4.0, 0.0, 3.0, 9.0]])
    params = [
        SamplingParams(temperature=0, allowed_token_ids=[0, 3], logprobs=1),
        SamplingParams(temperature=0, allowed_token_ids=[0, 3], logit_bias={3: 3.0}),
        SamplingParams(temperature=1.0, seed=5, allowed_token_ids=[1, 2]),
    ]
    out = sample(logits, params, [[], [], []], [[0], [0], [0]], [[], [], []])
    assert [t.token_id for t in out[:2]] == [0, 3]
    assert out[0].logprob == torch.log_softmax(logits[0], -1)[0].item()
    draws = {t.token_id for _ in range(50)
             for t in sample(logits[2:], [SamplingParams(temperature=2.0, allowed_token_ids=[1, 2])],
                             [[]], [[0]], [[]])}  # fmt: skip
    assert out[2].token_id in (1, 2) and draws == {1, 2}
    assert logits[0].tolist() == [0.0, 5.0, 1.0, -2.0]  # the caller's logits untouched


def test_bad_words_ban_a_word_s_last_token_after_its_others() -> None:
    """A one-token bad word is banned everywhere; a longer one's last token only where the
    output ends with its other tokens."""
    logits = torch.tensor([[0.0, 1.0, 9.0, 3.0, 2.0, 8.0]] * 2)
    sp = SamplingParams(temperature=0, bad_word_ids=[(5,), (1, 2)])
    out = sample(logits, [sp, sp], [[4, 1], [1, 4]], [[0], [0]], [[], []])
    assert [t.token_id for t in out] == [3, 2]  # after 1: neither 5 nor 2; after 4: 2 allowed


def test_a_row_with_every_token_masked_gets_no_token_and_the_fields_that_masked_it() -> None:
    """Masks that together leave nothing: NO_TOKEN (argmax said 0, a draw NaN's 0), with the
    request fields that masked the row, whatever the row's sampling; the other rows as ever."""
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 5)
    grammar = torch.tensor([[0b0010], [-1], [-1], [0b0100], [-1]], dtype=torch.int32)
    params = [
        SamplingParams(temperature=0, allowed_token_ids=[0]),  # the grammar allows only 1
        SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[2], logprobs=2),
        SamplingParams(temperature=0.7, allowed_token_ids=[0, 2], bad_word_ids=[(2,), (9, 0)]),
        SamplingParams(temperature=0, allowed_token_ids=[1, 2], logprobs=1),  # 2 is left
        SamplingParams(temperature=0),
    ]
    stops = [[], [2], [], [1], []]
    out = sample(logits, params, [[], [], [9], [], []], [[0]] * 5, stops,
                 allowed=(grammar, [0, 3]))  # fmt: skip
    assert [t.token_id for t in out] == [NO_TOKEN, NO_TOKEN, NO_TOKEN, 2, 1]
    assert [t.masked_by for t in out] == [
        ("structured_outputs", "allowed_token_ids"),
        ("allowed_token_ids", "min_tokens"),
        ("allowed_token_ids", "bad_words"),  # (9, 0) bans 0 after 9
        (),
        (),
    ]
    assert out[1].logprob is None and out[1].top_logprobs == ()  # none for no token
    assert out[3].logprob == torch.log_softmax(logits[3], -1)[2].item()
    free = sample(logits[:1], [SamplingParams(temperature=0, bad_word_ids=[(1,)])], [[]], [[0]],
                  [[]])  # fmt: skip
    assert free[0].token_id == 3  # a mask that leaves tokens: sampled as before


def _one_row_at_a_time(
    logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
    prompts: list[list[int]],
) -> None:  # fmt: skip
    """The penalties row by row, in vLLM's order (logit_bias, repetition, presence/frequency)."""
    for i, (sp, out) in enumerate(zip(params, outputs, strict=True)):
        row = logits[i]
        if sp.logit_bias:
            biased, bias = zip(*sp.logit_bias, strict=True)
            row[list(biased)] += torch.tensor(bias, dtype=row.dtype)
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompts[i]) | set(out)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty
            )
        if (sp.presence_penalty or sp.frequency_penalty) and out:
            ids = torch.tensor(out, dtype=torch.long)
            counts = torch.zeros_like(row).index_add_(0, ids, torch.ones_like(ids, dtype=row.dtype))
            row -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(row.dtype)


def test_batched_penalties_give_the_bits_of_one_row_at_a_time() -> None:
    """Rows asking for every mix of the penalties and logit_bias, or none; empty prompts and
    outputs, repeated tokens: the batched penalties equal the row-by-row ones bit for bit (on
    the CPU; see apply_penalties for CUDA's division)."""
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 50, 40  # more rows than PENALTY_ROWS: several launches of each kind
    assert rows > PENALTY_ROWS
    params, outputs, prompts = [], [], []
    for r in range(rows):
        kinds = r % 8
        params.append(SamplingParams(
            repetition_penalty=1.0 + 0.3 * (kinds & 1) * (1 + r % 3) * (1 if r % 4 == 1 else -1),
            presence_penalty=0.3 * ((kinds >> 1) & 1) * (r % 4 - 1.5),
            frequency_penalty=0.17 * ((kinds >> 1) & 1) * (1 + r % 2),
            logit_bias={int(t): float(b) for t, b in zip(
                torch.randint(0, vocab, (3,), generator=gen).tolist(),
                (torch.randn(3, generator=gen) * 5).tolist(), strict=True)} if kinds & 4 else {},
        ))  # fmt: skip
        n_out, n_prompt = (r * 7) % 13, (r * 5) % 11  # some of each empty
        outputs.append(torch.randint(0, vocab, (n_out,), generator=gen).tolist())
        prompts.append(torch.randint(0, vocab, (n_prompt,), generator=gen).tolist())
    logits = torch.randn(rows, vocab, generator=gen) * 3
    want = logits.clone()
    _one_row_at_a_time(want, params, outputs, prompts)
    apply_penalties(logits, params, outputs, prompts)
    assert torch.equal(logits, want)
    assert any(sp.adjusts_logits for sp in params) and not all(sp.adjusts_logits for sp in params)


def test_min_tokens_masks_each_rows_own_stop_ids() -> None:
    logits = torch.zeros(3, 5)
    mask_ids(logits, [[1, 3], [], [0, 0, 4]])
    assert torch.isinf(logits).tolist() == [
        [False, True, False, True, False],
        [False] * 5,
        [True, False, False, False, True],
    ]
    mask_ids(logits, [[], [], []])  # nothing to mask: no launch, no change
    assert torch.isinf(logits).sum() == 4
