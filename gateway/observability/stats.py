"""Per-request timing as the gateway sees it (TTFT, gaps, E2E) plus what workers reported."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.core.events import Chunk, Timing


@dataclass
class RequestStats:
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0  # counted once per prompt (0 for its other choices), as usage is
    num_cached_tokens: int = 0
    max_tokens: int = 0  # the settled max_tokens (0: not known)
    num_output_tokens: int = 0
    timing: Timing = field(default_factory=Timing)

    def on_chunk(self, chunk: Chunk, now: float | None = None) -> list[float]:
        """Records a chunk; returns its ITL samples, one per token after the request's first
        (vLLM's count: a token a step). A chunk of k tokens that arrived a gap g after the
        previous one gives k samples of g / k (its tokens were made in those steps, delivered
        together); a first chunk's tokens past the first, samples of 0 (delivered with it).
        The samples sum to the time from the first token to the last."""
        now = time.monotonic() if now is None else now
        self.timing.merge(chunk.timing)
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        samples: list[float] = []
        if k := len(chunk.token_ids):
            if self.first_token is None:
                self.first_token = now
                samples = [0.0] * (k - 1)
            elif self.last_token is not None:
                samples = [(now - self.last_token) / k] * k
            self.last_token = now
            self.num_output_tokens += k
        if chunk.finish_reason is not None:
            self.finished = now
        return samples

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float:
        end = self.finished if self.finished is not None else time.monotonic()
        return end - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.first_token is None or self.last_token is None or self.num_output_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.num_output_tokens - 1)

    def meets_slo(self, ttft_s: float, tpot_s: float) -> bool:
        ttft, tpot = self.ttft, self.tpot
        return ttft is not None and ttft <= ttft_s and (tpot is None or tpot <= tpot_s)

    def header(self) -> str:
        """``queue=..;prefill=..;transfer=..;ttft=..;decode=..;e2e=..`` in seconds, then
        ``mode=disagg|local|colocated`` (where the prompt was prefilled) when known, and for
        ``local`` why: ``local_reason=short|queue|decode_load`` (``resumed``: moved to a decode worker
        mid-stream; ``no_prefill``: no prefill worker was healthy)."""
        t = self.timing
        parts = {
            "queue": t.queue_s,
            "prefill": t.prefill_s,
            "transfer": t.transfer_s,
            "ttft": self.ttft or 0.0,
            "decode": t.decode_s,
            "e2e": self.e2e,
        }
        text = ";".join(f"{k}={v:.4f}" for k, v in parts.items())
        if t.mode:
            text += f";mode={t.mode}"
        if t.local_reason:
            text += f";local_reason={t.local_reason}"
        return text


def combined(stats: list[RequestStats]) -> RequestStats:
    """One view of several choices: the earliest first token, the slowest phases, the last end."""
    out = RequestStats(arrival=min(s.arrival for s in stats))
    firsts = [s.first_token for s in stats if s.first_token is not None]
    ends = [s.finished for s in stats if s.finished is not None]
    out.first_token = min(firsts) if firsts else None
    out.finished = max(ends) if ends else None
    for s in stats:
        out.timing.merge(s.timing)
        out.num_output_tokens += s.num_output_tokens
    return out
