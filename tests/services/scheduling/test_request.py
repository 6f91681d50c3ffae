from __future__ import annotations

import pytest

from services.scheduling.request import FinishReason, Request
from tests.services.scheduling.conftest import EOS, make_request


def generate(req: Request, tokens: list[int]) -> FinishReason | None:
    """Append tokens one by one as the scheduler does; the first stop wins."""
    for token in tokens:
        req.output_token_ids.append(token)
        reason = req.check_stop(token)
        if reason is not None:
            return reason
    return None


def test_token_ids_span_prompt_and_output() -> None:
    req = make_request("r", [1, 2, 3])
    req.output_token_ids += [4, 5]
    assert req.num_tokens == 5
    assert req.token_ids(0, 5) == [1, 2, 3, 4, 5]
    assert req.token_ids(1, 3) == [2, 3]
    assert req.token_ids(2, 4) == [3, 4]
    assert req.token_ids(3, 5) == [4, 5]


def test_max_tokens_finishes_with_length() -> None:
    req = make_request("r", 3, max_tokens=3)
    assert generate(req, [1, 2, 3, 4]) is FinishReason.LENGTH
    assert req.output_token_ids == [1, 2, 3]
    assert req.stop_reason is None


def test_eos_stops_with_no_stop_reason() -> None:
    """As vLLM: the end of sequence leaves stop_reason None, a stop_token_id names itself."""
    req = make_request("r", 3, max_tokens=10)
    assert generate(req, [1, EOS, 2]) is FinishReason.STOP
    assert req.output_token_ids == [1, EOS]
    assert req.stop_reason is None


def test_ignore_eos_keeps_going() -> None:
    req = make_request("r", 3, max_tokens=4, ignore_eos=True)
    assert generate(req, [EOS, EOS, EOS, EOS]) is FinishReason.LENGTH
    assert req.num_output_tokens == 4


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    req = make_request("r", 3, max_tokens=10, ignore_eos=True, stop_token_ids=(42,))
    assert generate(req, [EOS, 7, 42, 8]) is FinishReason.STOP
    assert req.stop_reason == 42


@pytest.mark.parametrize("stopper", [EOS, 42])
def test_min_tokens_suppresses_early_stops(stopper: int) -> None:
    req = make_request("r", 3, max_tokens=10, min_tokens=3, stop_token_ids=(42,))
    assert generate(req, [stopper, stopper, 5, stopper]) is FinishReason.STOP
    assert req.num_output_tokens == 4


def test_min_tokens_allows_a_stop_on_the_last_required_token() -> None:
    req = make_request("r", 3, max_tokens=10, min_tokens=2)
    assert generate(req, [1, EOS]) is FinishReason.STOP


@pytest.mark.parametrize("stopper", [EOS, 42])
def test_a_stop_token_that_is_the_last_one_allowed_is_a_stop(stopper: int) -> None:
    """vLLM's order: the last token max_tokens (or the model's length) allows, if it is a
    stop token, ends the output as a stop (so its text is left out, as any stop token's);
    a prefill worker's first token (max_tokens 1 there) that is one ends it there."""
    req = make_request("r", 3, max_tokens=3, stop_token_ids=(42,))
    assert generate(req, [1, 2, stopper]) is FinishReason.STOP
    assert req.stop_reason == (None if stopper == EOS else 42)
    at_len = make_request("r", 6, max_tokens=100, max_model_len=8, stop_token_ids=(42,))
    assert generate(at_len, [1, stopper]) is FinishReason.STOP
    first = make_request("r", 3, max_tokens=1, stop_token_ids=(42,))
    assert generate(first, [stopper]) is FinishReason.STOP
    under_min = make_request("r", 3, max_tokens=3, min_tokens=3, stop_token_ids=(42,))
    assert generate(under_min, [stopper, stopper, 5]) is FinishReason.LENGTH


def test_max_model_len_finishes_with_length() -> None:
    req = make_request("r", 6, max_tokens=100, max_model_len=8)
    assert generate(req, [1, 2, 3]) is FinishReason.LENGTH
    assert req.num_tokens == 8
