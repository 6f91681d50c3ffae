"""What the engine reports to its callers after each step: plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.logprobs import PositionLogprobs


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
    # set with ``error`` when the request itself is at fault, not the worker: the field it is
    # about (a worker ends the call as a refused one, INVALID_ARGUMENT: the gateway's 400)
    error_param: str | None = None
    queue_s: float = 0.0  # seconds from arrival in this engine to first scheduled
    # prompt_logprobs: prompt positions 1.. (position 0 has none), with the first token only
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    embedding: list[float] | None = None  # an embedding request's pooled vector, when finished

    def merged(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by a later one of the same request, as one delta (a stream that
        fell behind sends what piled up in one message)."""
        return RequestOutput(
            request_id=self.request_id,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            finished=later.finished,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            num_prompt_tokens=later.num_prompt_tokens or self.num_prompt_tokens,
            num_cached_tokens=max(self.num_cached_tokens, later.num_cached_tokens),
            logprobs=self.logprobs + later.logprobs,
            error=later.error or self.error,
            error_param=later.error_param or self.error_param,
            queue_s=max(self.queue_s, later.queue_s),
            prompt_logprobs=self.prompt_logprobs + later.prompt_logprobs,
            embedding=later.embedding if later.embedding is not None else self.embedding,
        )
