"""Batched LoRA (the torch reference): each token adds its own adapter's low-rank update.

The tokens of one step are grouped in segments, one per adapter in the step: a segment is a run
of entries of ``seg_rows`` (the batch rows it covers, wherever they lie), and reads its
adapter's slot of the stacked weights: ``y[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T``, with
the adapter's scaling folded into ``B`` when it was loaded. Rows in no segment (requests of the
base model, a CUDA graph's padding rows) are left as they are; slots no segment names are never
read, and neither are entries of ``seg_rows`` past every segment (a fixed-size buffer's tail).

``ref_expand_lora`` is the second half of the fused path: the shrink of every slot came out of
the base layer's own GEMM (its weight extended by the slots' stacked A), so a row's update needs
only its slot (``row_slots``), and the output is a new tensor: the base columns copied, each
adapter row's update added. That shrink is rounded to the activation dtype by the GEMM (bf16 on
the GPU: a relative error of up to 2^-9 in ``x A^T``, against fp32 in ``ref_add_lora``), so
the update carries that relative error too: within one bf16 unit of ``y`` while the update is
no larger than ``y``. In float32 (the CPU tests) both paths are fp32 throughout.
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


def ref_expand_lora(
    y_ext: torch.Tensor,  # [T, N + S * R]: the base output, then every slot's x @ A^T
    lora_b: torch.Tensor,  # [S, N, R] scaling folded in
    row_slots: torch.Tensor,  # [T] int32, each row's slot; outside [0, S): no adapter
) -> torch.Tensor:  # [T, N], a new contiguous tensor
    """The expand of a base GEMM whose weight carried every slot's A below its own rows (the
    fused path of ``LoRALinear``): row ``t`` under slot ``s`` gets ``y_ext[t, :N]`` plus its
    ``x A_s^T`` (columns ``N + s R`` on) times ``B_s^T``, in fp32, rounded once; a row with no
    adapter gets ``y_ext[t, :N]`` unchanged."""
    s, n, r = lora_b.shape
    out = y_ext[:, :n].clone(memory_format=torch.contiguous_format)
    for slot in row_slots.unique().tolist():
        if not 0 <= slot < s:
            continue
        rows = (row_slots == slot).nonzero()[:, 0]
        xa = y_ext[rows, n + slot * r : n + (slot + 1) * r].float()  # [n_rows, R]
        out[rows] = (out[rows].float() + xa @ lora_b[slot].float().T).to(out.dtype)
    return out
