"""What the engine reports to its callers after each step: plain data."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    token: str


@dataclass(frozen=True)
class PositionLogprobs:
    chosen: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass
class RequestOutput:
    """A delta: the tokens and text one step added to one request."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    error: str | None = None
