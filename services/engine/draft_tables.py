"""The draft model's own KV bookkeeping (speculative decoding, method "draft_model"): a block
pool apart from the target's, each request's block table, and which tokens its KV holds.

Torch-free. The draft's KV is a cache the target never waits for: a request's entry remembers
the tokens whose KV the draft wrote (``fed``), its own known tokens first and then the drafts it
proposed. Before the next proposal the entry is cut back to the longest prefix the request
still agrees with (drafts the target rejected, or a bonus token the draft never saw, end it),
and only the rest is fed again. When the pool runs out, entries of requests that are not
proposing this step are dropped, least recently used first: they re-feed their tokens later.
Prompt chunks fed beside the target's prefill never evict: they take free blocks or wait.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass, field

from protos.blocks import blocks_for
from services.scheduling.block_pool import Block, BlockPool


@dataclass
class _Entry:
    blocks: list[Block] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)  # token at each position the KV holds
    known: int = 0  # the leading fed tokens that were the request's own (not drafts)


class DraftTables:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.evictions = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def valid_prefix(self, request_id: str, prompt: list[int], output: list[int]) -> int:
        """How many leading tokens of prompt + output the draft's KV holds, at most all but the
        last (whose logits give the first draft, so it is always fed again)."""
        entry = self._entries.get(request_id)
        total = len(prompt) + len(output)
        if entry is None:
            return 0
        # a request's known tokens never change, so the entry's own tokens still hold
        n = min(entry.known, total - 1)
        while n < min(len(entry.fed), total - 1) and entry.fed[n] == _token(prompt, output, n):
            n += 1
        return n

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Forget the KV past the first ``num_tokens`` tokens, blocks past them included."""
        entry = self._entries.setdefault(request_id, _Entry())
        del entry.fed[num_tokens:]
        entry.known = min(entry.known, num_tokens)
        keep = blocks_for(num_tokens, self.block_size)
        if len(entry.blocks) > keep:
            extra = entry.blocks[keep:]
            del entry.blocks[keep:], entry.ids[keep:]
            self.pool.free(reversed(extra))

    def reserve(
        self, request_id: str, num_tokens: int, keep: Collection[str], evict: bool = True
    ) -> bool:
        """Blocks for ``num_tokens`` tokens in the request's table, dropping other entries (not
        in ``keep``; none unless ``evict``) least recently used first if the pool is short;
        False if they don't fit."""
        entry = self._entries.setdefault(request_id, _Entry())
        self._entries.move_to_end(request_id)
        need = blocks_for(num_tokens, self.block_size) - len(entry.blocks)
        if need <= 0:
            return True
        while self.pool.num_free_blocks < need:
            victim = None
            if evict:
                victim = next((r for r in self._entries if r not in keep and r != request_id), None)
            if victim is None:
                return False
            self.drop(victim)
            self.evictions += 1
        new = self.pool.allocate(need)
        entry.blocks += new
        entry.ids += [b.block_id for b in new]
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._entries[request_id].ids)

    def record(self, request_id: str, tokens: list[int], known: int) -> None:
        """The KV now holds ``tokens`` after the valid prefix; the first ``known`` of the
        entry's tokens are the request's own."""
        entry = self._entries[request_id]
        entry.fed += tokens
        entry.known = known
        assert len(entry.fed) <= len(entry.blocks) * self.block_size

    def drop(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self.pool.free(reversed(entry.blocks))

    def check_invariants(self) -> None:
        held: dict[int, int] = {}
        for entry in self._entries.values():
            assert entry.ids == [b.block_id for b in entry.blocks]
            assert entry.known <= len(entry.fed) <= len(entry.blocks) * self.block_size
            for b in entry.blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        self.pool.check_invariants(held)


def _token(prompt: list[int], output: list[int], i: int) -> int:
    return prompt[i] if i < len(prompt) else output[i - len(prompt)]


def tokens_between(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Tokens ``start:end`` of prompt + output, without building the whole sequence."""
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return output[start - p : end - p]
    return prompt[start:] + output[: end - p]
