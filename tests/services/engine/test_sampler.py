"""The sampler's filters and penalties on hand-made logits."""

from __future__ import annotations

import torch

from protos.sampling_params import SamplingParams
from services.engine.sampler import _mask_top_k_top_p, apply_penalties, sample


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
