"""Speculative decoding's proposer side: n-gram prompt lookup and per-request adaptivity.

Torch-free. The engine asks :class:`NgramProposer` for up to K draft tokens per running decode
before each step; the scheduler puts them after the request's last token, the runner computes
logits for all of them in the same forward and samples every position as if it were the next
token (``ModelRunner.execute``). Drafts are kept while they equal what was sampled; the first
sample that differs (or the one after the last draft) is the step's extra token. With one-hot
drafts that is exact rejection sampling: position j's draft is kept with probability p_j(draft),
and a rejected position emits a sample of p_j conditioned on not being the draft, which is the
residual distribution (p - q)+ normalised. Seeded requests draw each position's noise from
(seed, output position), so they produce exactly the non-speculative text.

A request whose drafts keep being rejected stops getting proposals for a while (``Acceptance``):
a verify pass costs more than a decode step, and speculation must never make a request much
slower than without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.config import SpeculativeConfig

# adaptivity: the acceptance rate is an exponential average over verify steps; below the floor a
# request sits out PAUSE_STEPS decode steps, doubling each time it fails again (up to MAX_PAUSE)
EMA_WEIGHT = 0.3
ACCEPT_FLOOR = 0.25
PAUSE_STEPS = 8
MAX_PAUSE = 256


@dataclass
class Acceptance:
    """One request's record: proposals made and kept, and whether it sits out for a while."""

    rate: float = 1.0  # exponential average of kept / proposed over its verify steps
    pause: int = 0  # decode steps left without proposals
    next_pause: int = PAUSE_STEPS

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.rate = (1 - EMA_WEIGHT) * self.rate + EMA_WEIGHT * (accepted / proposed)
        if self.rate < ACCEPT_FLOOR:
            self.pause, self.next_pause = self.next_pause, min(self.next_pause * 2, MAX_PAUSE)
            self.rate = ACCEPT_FLOOR  # one more chance after the pause, not a permanent ban
        elif accepted == proposed:
            self.next_pause = PAUSE_STEPS

    def wants_proposal(self) -> bool:
        if self.pause > 0:
            self.pause -= 1
            return False
        return True


@dataclass
class SpecStats:
    """Engine-wide counters, as vLLM names them (spec_decode_num_*)."""

    num_drafts: int = 0  # verify steps (requests x steps that carried drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position += [0] * (proposed - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1


class NgramProposer:
    """Drafts from the request's own tokens: find the latest earlier place where its last n
    tokens occurred (n = prompt_lookup_max down to prompt_lookup_min) and propose the tokens
    that followed there. Each request's tokens are kept as a growing numpy array."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # buffer, length used

    def _array(self, request_id: str, prompt: list[int], output: list[int]) -> np.ndarray:
        total = len(prompt) + len(output)
        buf, used = self._tokens.get(request_id, (np.empty(0, dtype=np.int64), 0))
        if used > total or used < len(prompt):  # new, or recomputed from scratch
            used = 0
        if buf.shape[0] < total:
            grown = np.empty(max(total * 2, 64), dtype=np.int64)
            grown[:used] = buf[:used]
            buf = grown
        if used < len(prompt):
            buf[: len(prompt)] = prompt
            used = len(prompt)
        if used < total:
            buf[used:total] = output[used - len(prompt) :]
        self._tokens[request_id] = (buf, total)
        return buf[:total]

    def propose(
        self, request_id: str, prompt: list[int], output: list[int], limit: int
    ) -> list[int]:
        """Up to ``min(K, limit)`` draft tokens to follow prompt + output (possibly none)."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        seq = self._array(request_id, prompt, output)
        total = seq.shape[0]
        for n in range(min(self.n_max, total - 1), self.n_min - 1, -1):
            tail = seq[total - n :]
            # windows starting at 0 .. total - n - 1: every earlier occurrence of the tail
            windows = np.lib.stride_tricks.sliding_window_view(seq[: total - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest match: the most recent context
                return seq[start : start + k].tolist()
        return []

    def drop(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)
