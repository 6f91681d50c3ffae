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
        blocks, left = _Blocks(block_size), cap
        full: list[ScheduledRequest] = []
        per = max(cap // 2 + 1, -(-cap // max_num_seqs))  # odd first length for an even budget
        while left > 0:
            n = min(left, longest, per)
            full.append(_request(f"warm-{len(full)}", 0, n, blocks, vocab_size))
            left -= n
        steps.append(SchedulerOutput(full))
        # the budget again as chunks after a cached prefix: a GPU with a 16-bit cache runs whole
        # prompts (above) on the contiguous path, and prompt chunks after a prefix on the paged
        # one, whose large-step tiles nothing else here would compile (kernels.triton_prefill)
        chunk = longest - block_size  # the most a sequence after one cached block can add
        left = min(cap, chunk * max_num_seqs)
        per = max(left // 2 + 1, -(-left // max_num_seqs))
        blocks = _Blocks(block_size)
        after: list[ScheduledRequest] = []
        while left > 0:  # at most max_num_seqs chunks: each of ``per`` tokens but the last
            n = min(left, chunk, per)
            after.append(_request(f"warm-p{len(after)}", block_size, n, blocks, vocab_size))
            left -= n
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
