"""A request's timing as the gateway sees it: its ITL samples, one per token after the first."""

from __future__ import annotations

import pytest

from gateway.core.events import Chunk
from gateway.observability.stats import RequestStats


def test_tokens_delivered_together_give_one_itl_sample_each() -> None:
    """vLLM counts an ITL sample a token (a step); a worker's stream may deliver several
    tokens in one chunk when the gateway lags: each still counts, their gap shared."""
    stats = RequestStats(arrival=0.0)
    assert stats.on_chunk(Chunk(token_ids=(1, 2)), now=1.0) == [0.0]  # the first and one more
    assert stats.on_chunk(Chunk(token_ids=(3,)), now=1.5) == [0.5]
    assert stats.on_chunk(Chunk(token_ids=(4, 5, 6)), now=2.4) == pytest.approx([0.3] * 3)
    assert stats.on_chunk(Chunk(finish_reason="length"), now=2.5) == []
    samples = [0.0, 0.5, 0.3, 0.3, 0.3]  # tokens - 1 of them, summing to first-to-last
    assert stats.num_output_tokens - 1 == len(samples)
    assert sum(samples) == pytest.approx(stats.last_token - stats.first_token)  # type: ignore[operator]
    assert stats.ttft == 1.0 and stats.e2e == 2.5
