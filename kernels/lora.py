"""Batched LoRA (the torch reference): each token adds its own adapter's low-rank update.

The tokens of one step are grouped in segments, runs of consecutive rows that share an adapter
(a request's tokens are consecutive, so one request is at least one segment). A segment reads
its adapter's slot of the stacked weights: ``y[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T``,
with the adapter's scaling folded into ``B`` when it was loaded. Rows in no segment (requests of
the base model) are left as they are; slots no segment names are never read.
"""

from __future__ import annotations

import torch


def ref_add_lora(
    y: torch.Tensor,  # [T, N], updated in place
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, R, K] one slot per resident adapter
    lora_b: torch.Tensor,  # [S, N, R] scaling folded in
    seg_starts: torch.Tensor,  # [G] int32, first row of each segment
    seg_lens: torch.Tensor,  # [G] int32
    seg_slots: torch.Tensor,  # [G] int32, the segment's slot
    max_seg_len: int,  # the longest segment (the Triton grid's rows; unused here)
) -> torch.Tensor:  # y
    """Shrink then expand, in fp32, one segment at a time; ``y`` rounded once at the end."""
    for start, length, slot in zip(
        seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist(), strict=True
    ):
        rows = slice(start, start + length)
        xa = x[rows].float() @ lora_a[slot].float().T  # [n, R]
        delta = xa @ lora_b[slot].float().T  # [n, N]
        y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y
