"""Batched LoRA (the torch reference): each token adds its own adapter's low-rank update.

The tokens of one step are grouped in segments, one per adapter in the step: a segment is a run
of entries of ``seg_rows`` (the batch rows it covers, wherever they lie), and reads its
adapter's slot of the stacked weights: ``y[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T``, with
the adapter's scaling folded into ``B`` when it was loaded. Rows in no segment (requests of the
base model, a CUDA graph's padding rows) are left as they are; slots no segment names are never
read, and neither are entries of ``seg_rows`` past every segment (a fixed-size buffer's tail).
"""

from __future__ import annotations

import torch


def ref_add_lora(
    y: torch.Tensor,  # [T, N], updated in place
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [S, R, K] one slot per resident adapter
    lora_b: torch.Tensor,  # [S, N, R] scaling folded in
    seg_rows: torch.Tensor,  # [P] int32, the rows of every segment, back to back
    seg_starts: torch.Tensor,  # [G] int32, each segment's first entry of seg_rows
    seg_lens: torch.Tensor,  # [G] int32, 0 for an unused segment
    seg_slots: torch.Tensor,  # [G] int32, the segment's slot
    max_seg_len: int,  # at least the longest segment (the Triton grid's rows; unused here)
) -> torch.Tensor:  # y
    """Shrink then expand, in fp32, one segment at a time; ``y`` rounded once at the end."""
    all_rows = seg_rows.tolist()
    for start, length, slot in zip(
        seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist(), strict=True
    ):
        if length == 0:
            continue
        rows = torch.tensor(all_rows[start : start + length], device=y.device)
        xa = x[rows].float() @ lora_a[slot].float().T  # [n, R]
        delta = xa @ lora_b[slot].float().T  # [n, N]
        y[rows] = (y[rows].float() + delta).to(y.dtype)
    return y
