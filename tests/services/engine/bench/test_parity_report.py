"""The GPU parity report's pieces, run on the CPU in float32, where our engine and transformers
agree exactly: the same greedy tokens and the same top log-probabilities at every position."""

from __future__ import annotations

import pytest

from services.engine.bench import parity_report
from services.engine.bench.parity_check import logprobs_close
from services.engine.llm import LLM


def test_top_logprobs_of_both_sides_agree_in_float32(
    llm: LLM, chat_ids: list[list[int]], hf_model: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(parity_report, "DEVICE", "cpu")
    monkeypatch.setattr(parity_report, "NEW_TOKENS", 8)
    model, _ = hf_model
    prompts = chat_ids[:3]
    ref = parity_report.hf_greedy_top(model, prompts, parity_report.stop_ids(llm))
    ours = parity_report.ours_greedy_top(llm, prompts)
    for a, b in zip(ours, ref, strict=True):
        assert logprobs_close(a, b).position is None
        assert a.token_ids == b.token_ids and len(a.top) == len(b.top) == len(a.token_ids) > 0
        for mine, theirs in zip(a.top, b.top, strict=True):
            assert len(mine) == len(theirs) == parity_report.TOP_N
            shared = set(mine) & set(theirs)
            assert len(shared) >= parity_report.TOP_N - 1  # the 5th may swap on a tie
            for t in shared:
                assert mine[t] == pytest.approx(theirs[t], abs=1e-3)


def test_cut_at_stop_keeps_the_first_stop_token() -> None:
    assert parity_report.cut_at_stop([5, 2, 7, 0], [0, 2]) == [5, 2]
    assert parity_report.cut_at_stop([5, 7], [0, 2]) == [5, 7]
    assert parity_report.cut_at_stop([0], [0, 2]) == [0]
