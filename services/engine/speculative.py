"""Speculative decoding's proposer side: n-gram prompt lookup and per-request adaptivity.

Torch-free. The engine asks a :class:`Proposer` (:class:`NgramProposer`, or the draft model's
``services.engine.draft_proposer.DraftProposer``) for up to K draft tokens per running decode
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
slower than without it. How quickly it backs off is the proposer's (``Adaptivity``): an n-gram
lookup costs nothing, so only a low average pauses it; a draft model's probe costs forwards of
its own, so one verify step that keeps nothing pauses it, the pauses double, and the next
proposal is one draft longer than what was kept last time (one after a miss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.config import SpeculativeConfig

# adaptivity: the acceptance rate is an exponential average over verify steps; below the floor a
# request sits out PAUSE_STEPS decode steps, doubling each time it fails again (up to MAX_PAUSE)
EMA_WEIGHT = 0.3
ACCEPT_FLOOR = 0.25
PAUSE_STEPS = 8
MAX_PAUSE = 256
# most rows (decodes plus their drafts) a step gets drafts for: see LLMEngine._propose
VERIFY_ROWS = 64


@dataclass(frozen=True)
class Adaptivity:
    """How a proposer's requests back off when their drafts fail."""

    pause_on_miss: bool = False  # a verify step that keeps no draft pauses the request
    adaptive_k: bool = False  # propose one more draft than were kept last time (1 after a miss)
    first_pause: int = PAUSE_STEPS
    max_pause: int = MAX_PAUSE


NGRAM_ADAPTIVITY = Adaptivity()
# a draft model's probe costs its forwards; the longest pause is capped so that the tokens to
# catch up on after it (the pause plus the bonus token) fit one CUDA-graph replay of the draft
DRAFT_ADAPTIVITY = Adaptivity(pause_on_miss=True, adaptive_k=True, max_pause=VERIFY_ROWS - 1)


@dataclass
class Acceptance:
    """One request's record: proposals made and kept, whether it sits out for a while, and how
    many drafts it takes next."""

    policy: Adaptivity = NGRAM_ADAPTIVITY
    k: int = 16  # most drafts of its next proposal (the engine caps it at K)
    rate: float = 1.0  # exponential average of kept / proposed over its verify steps
    pause: int = 0  # decode steps left without proposals
    next_pause: int = PAUSE_STEPS

    def __post_init__(self) -> None:
        self.next_pause = self.policy.first_pause

    def record(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        policy = self.policy
        self.rate = (1 - EMA_WEIGHT) * self.rate + EMA_WEIGHT * (accepted / proposed)
        if policy.adaptive_k:
            self.k = accepted + 1
        missed = policy.pause_on_miss and accepted == 0
        if self.rate < ACCEPT_FLOOR or missed:
            self.pause = self.next_pause
            self.next_pause = min(self.next_pause * 2, policy.max_pause)
            # one more chance after the pause, not a permanent ban
            self.rate = max(self.rate, ACCEPT_FLOOR)
        elif accepted == proposed:
            self.next_pause = policy.first_pause

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


@dataclass(frozen=True)
class ProposalRequest:
    """A running decode that wants drafts: its tokens so far and how many may follow."""

    request_id: str
    prompt: list[int]
    output: list[int]
    limit: int  # most drafts it can take (max_tokens, the context and its Acceptance.k)
    remaining: int = 1 << 30  # tokens it may still produce (max_tokens and the context)


@dataclass(frozen=True)
class PromptChunk:
    """A prompt chunk the target computes this step, for a request that may propose later:
    tokens up to ``end`` of prompt + output (a recompute after preemption has output)."""

    request_id: str
    prompt: list[int]
    output: list[int]
    end: int


class Proposer(Protocol):
    adaptivity: Adaptivity

    def prefill(self, chunks: list[PromptChunk]) -> None:
        """See the target's prompt chunks as the target computes them (in the same step)."""
        ...

    def propose_batch(self, wanted: list[ProposalRequest], room: int) -> dict[str, list[int]]:
        """Drafts for some of ``wanted`` (in order), ``room`` drafts in all at most."""
        ...

    def drop(self, request_id: str) -> None:
        """Forget what is kept for the request (finished, aborted or preempted)."""
        ...


class NgramProposer:
    """Drafts from the request's own tokens: find the latest earlier place where its last n
    tokens occurred (n = prompt_lookup_max down to prompt_lookup_min) and propose the tokens
    that followed there.

    Each request keeps its tokens and an index from token to the positions it holds, grown as
    tokens arrive, so a step's lookup starts from the earlier places of the last token (none,
    usually, when nothing repeats) instead of scanning the sequence. Only the latest
    MAX_CANDIDATES places are tried."""

    MAX_CANDIDATES = 64
    adaptivity = NGRAM_ADAPTIVITY

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max
        self._seqs: dict[str, tuple[list[int], dict[int, list[int]]]] = {}

    def _indexed(
        self, request_id: str, prompt: list[int], output: list[int]
    ) -> tuple[list[int], dict[int, list[int]]]:
        total = len(prompt) + len(output)
        entry = self._seqs.get(request_id)
        if entry is None or len(entry[0]) > total or len(entry[0]) < len(prompt):
            entry = ([], {})  # new, or its tokens changed under it
            self._seqs[request_id] = entry
        seq, where = entry
        for pos in range(len(seq), total):
            token = prompt[pos] if pos < len(prompt) else output[pos - len(prompt)]
            seq.append(token)
            where.setdefault(token, []).append(pos)
        return entry

    def propose(
        self, request_id: str, prompt: list[int], output: list[int], limit: int
    ) -> list[int]:
        """Up to ``min(K, limit)`` draft tokens to follow prompt + output (possibly none)."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        seq, where = self._indexed(request_id, prompt, output)
        last = len(seq) - 1
        places = where.get(seq[last], ())
        best_n, best_end = 0, -1
        for i in range(len(places) - 2, max(len(places) - 2 - self.MAX_CANDIDATES, -1), -1):
            end = places[i]  # an earlier place of the last token, latest first
            n = 1
            while n < self.n_max and end - n >= 0 and seq[end - n] == seq[last - n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, end
                if n == self.n_max:
                    break
        if best_n < self.n_min:
            return []
        drafts = seq[best_end + 1 : best_end + 1 + k]
        # the match overlaps the tail (a loop: "a b a b a b"): what followed it runs into the
        # last token, and the same loop goes on, period (last - best_end) tokens at a time
        period = last - best_end
        while len(drafts) < k:
            drafts.append(drafts[len(drafts) - period])
        return drafts

    def propose_batch(self, wanted: list[ProposalRequest], room: int) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for w in wanted:
            if room <= 0:
                break
            drafts = self.propose(w.request_id, w.prompt, w.output, min(w.limit, room))
            if drafts:
                out[w.request_id] = drafts
                room -= len(drafts)
        return out

    def prefill(self, chunks: list[PromptChunk]) -> None:
        pass  # the index grows from the request's tokens when it proposes

    def drop(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
