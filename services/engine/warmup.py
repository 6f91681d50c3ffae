"""Synthetic steps run once at start-up, before the first request (CUDA workers).

Triton compiles a kernel the first time it meets a new combination of compile-time constants and
integer specializations (a value of 1, a multiple of 16). Without a warm-up those compilations
(about a second each) land on the first requests that happen to need them: a TTFT of seconds, or
a benchmark that times the compiler. The steps below cover what serving meets: a full prefill
step at the token budget (whole prompts, then chunks after a cached prefix), a mixed step
(decodes first, then a prefill chunk after a cached prefix) of a token count that is not a
multiple of 16, and decode-only steps of one and of three sequences. The full-budget step also runs the largest activations a step can have, so a KV pool
sized too greedily fails at start-up instead of under load.

Plain data only: the steps are ordinary ``SchedulerOutput`` objects over blocks of the (still
empty) pool; the KV they write is garbage nobody reads, since every request writes its own KV
before attending to it.
"""

from __future__ import annotations

from protos.blocks import blocks_for
from protos.sampling_params import SamplingParams
from services.scheduling.outputs import ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class _Blocks:
    """Hands out consecutive block ids of the pool."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.next = block_size, 0

    def take(self, num_tokens: int) -> list[int]:
        n = blocks_for(num_tokens, self.block_size)
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def _request(rid: str, start: int, new: int, blocks: _Blocks, vocab_size: int) -> ScheduledRequest:
    ids = [(7919 * (start + i) + 13) % vocab_size for i in range(new)]
    return ScheduledRequest(
        request_id=rid, token_ids=ids, start_pos=start, block_ids=blocks.take(start + new),
        sample=True, sampling_params=GREEDY, output_token_ids=[], prompt_token_ids=ids,
    )  # fmt: skip


def _budget_step(
    tag: str, start: int, tokens: int, most: int, max_num_seqs: int, blocks: _Blocks,
    vocab_size: int,
) -> list[ScheduledRequest]:  # fmt: skip
    """``tokens`` new tokens (at most ``most * max_num_seqs``) after ``start`` cached ones each, in
    at most ``max_num_seqs`` requests of at most ``most`` tokens: the first of an odd length when
    the total is even, the rest as long as the batch limit allows."""
    per = max(tokens // 2 + 1, -(-tokens // max_num_seqs))
    out: list[ScheduledRequest] = []
    while tokens > 0:
        n = min(tokens, most, per)
        out.append(_request(f"{tag}{len(out)}", start, n, blocks, vocab_size))
        tokens -= n
    return out


def warmup_steps(
    max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int,
    num_blocks: int, vocab_size: int,
) -> list[SchedulerOutput]:  # fmt: skip
    """The steps to run, each within the pool's blocks, the model's length and the batch limit."""
    longest = max_model_len - 1
    cap = min(max_num_batched_tokens, (num_blocks - max_num_seqs) * block_size)
    cap = min(cap, longest * max_num_seqs)
    steps: list[SchedulerOutput] = []
    if cap >= 1:
        steps.append(SchedulerOutput(_budget_step("warm-", 0, cap, longest, max_num_seqs,
                                                  _Blocks(block_size), vocab_size)))  # fmt: skip
        # the budget again as chunks after a cached prefix: a GPU with a 16-bit cache runs whole
        # prompts (above) on the contiguous path, and prompt chunks after a prefix on the paged
        # one, whose large-step tiles nothing else here would compile (kernels.triton_prefill)
        chunk = longest - block_size  # the most a sequence after one cached block can add
        blocks = _Blocks(block_size)
        after = _budget_step("warm-p", block_size, min(cap, chunk * max_num_seqs), chunk,
                             max_num_seqs, blocks, vocab_size)  # fmt: skip
        if after and blocks.next <= num_blocks:
            steps.append(SchedulerOutput(after))
    mixed = [(16, 1), (32, 1), (39, 1), (20, 37)][-max_num_seqs:]  # (cached, new) tokens
    if sum(s + n for s, n in mixed) <= (num_blocks - 8) * block_size and max_model_len > 60:
        blocks = _Blocks(block_size)
        steps.append(
            SchedulerOutput(
                [_request(f"warm-m{i}", s, n, blocks, vocab_size) for i, (s, n) in enumerate(mixed)]
            )
        )
    for batch in sorted({1, min(3, max_num_seqs)}):
        if batch * 2 <= num_blocks and max_model_len > 8:
            blocks = _Blocks(block_size)
            steps.append(
                SchedulerOutput(
                    [_request(f"warm-d{i}", 7, 1, blocks, vocab_size) for i in range(batch)]
                )
            )
    return steps
