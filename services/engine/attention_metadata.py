"""Per-step tensors that tell every attention layer where its tokens' KV lives."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32: cached + new tokens per sequence
    query_start_loc: torch.Tensor  # [B + 1] int32
    decode_only: bool  # every sequence has exactly one new token
