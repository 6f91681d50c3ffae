"""Per-step tensors that tell every attention layer where its tokens' KV lives."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kernels.attention import StepMemo


@dataclass
class AttentionMetadata:
    """Sequences with one new token each (decodes) come first, ``num_decodes`` of them; the
    rest (prefill chunks) follow. Decode rows go to the paged decode kernel, which reads each
    K/V byte once per KV head; prefill rows to the causal prefill kernel."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32: cached + new tokens per sequence
    query_start_loc: torch.Tensor  # [B + 1] int32
    num_decodes: int  # the leading sequences with exactly one new token
    # [B - num_decodes + 1] int32: query_start_loc of the prefill sequences, counted from their
    # first token (None when every sequence decodes)
    prefill_start_loc: torch.Tensor | None = None
    # every prefill sequence starts at position 0 (whole prompts, no cached prefix): the prefill
    # kernel may then read their K/V contiguously with nothing paged compiled in (91% of SDPA on
    # an H200 against 74% through the block table, docs/benchmarks.md W3)
    prefill_no_prefix: bool = False
    # the prefill sequences with a cached prefix (an earlier chunk, a prefix-cache hit), laid
    # out first among the prefill sequences (the model runner's order), and their rows; with
    # prefill_no_prefix False and 0 here nothing is known (a model then treats every prefill
    # row as having a prefix). DeepSeek's MLA computes the rows after them in expanded form
    prefix_prefills: int = 0
    prefix_prefill_rows: int = 0
    prefix_prefill_longest: int = 0  # the longest cached prefix among them (tokens)
    # told each layer's index right after the layer's KV write, when a prefill hand-off streams
    # the KV out while this forward runs (``services.engine.kv_handoff``); None on every other
    # step, and in CUDA graphs, which would not run it
    on_kv_written: Callable[[int], None] | None = None
    # [T] int32, Gemma 3's images: each row's last key when past its own (an image token: its
    # image's last token, which its chunk holds), 0 elsewhere; the prefill kernels' span_last.
    # None on every step without an image token of such a model (causal prefill)
    span_last: torch.Tensor | None = None
    # what the layers' torch attention path derives alike from the tensors above (the slots a
    # decode row gathers, ...): computed by the first layer of the step, reused by the others
    memo: StepMemo = field(default_factory=StepMemo)

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs
