"""The LoRA indices a captured decode graph reads: fixed-size device buffers, so that one graph
per batch size serves any step's adapters.

A graph fixes every launch's grid and every address it reads, so the step's segments
(``StepSegments``) cannot be tensors of their own size made per step as the eager path makes
them. Instead a graph of ``b`` rows is captured over views of buffers sized for it: ``rows``
[b] (each segment's batch rows, back to back), ``row_slots`` [b] (each row's slot, -1 for none:
what the fused path's expand reads) and ``seg`` [3, max_loras] (starts, lens, slots: one
segment per slot at most, since a step's adapters each take one), with ``max_seg_len`` = b,
so the kernels' grids depend on ``b`` and ``max_loras`` only. Before a replay the runner writes
the step's values (``fill``, into the pinned staging buffer that carries its other inputs) and
``load`` copies them into the buffers; unused segments have length 0, whose programs return at
once, and rows in no segment (base-model requests, padding rows) are left as the base model made
them.
"""

from __future__ import annotations

import numpy as np
import torch

from services.engine.lora.layers import LoRABatch, Segments
from services.engine.lora.manager import StepSegments


class LoRAGraphInputs:
    def __init__(self, batch: LoRABatch, max_rows: int, slots: int, device: torch.device) -> None:
        self.batch, self.slots = batch, slots
        self.rows = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.row_slots = torch.full((max_rows,), -1, dtype=torch.int32, device=device)
        self.seg = torch.zeros(3, slots, dtype=torch.int32, device=device)  # starts, lens, slots

    def size(self, b: int) -> int:
        """int32 values a step of ``b`` rows uploads (``fill``'s layout): rows, row slots, then
        segments."""
        return 2 * b + 3 * self.slots

    def fill(self, host: np.ndarray, plan: StepSegments, b: int) -> None:
        """Lay ``plan`` out in ``host`` (int32 [size(b)]) for a graph of ``b`` rows."""
        g, p = len(plan.lens), len(plan.rows)
        if g > self.slots or p > b:
            raise ValueError(f"{g} segments of {p} rows do not fit {self.slots} slots, {b} rows")
        host[:] = 0
        host[:p] = plan.rows
        host[b : 2 * b] = plan.row_slots(b)  # padding rows: -1
        seg = host[2 * b :].reshape(3, self.slots)
        seg[0, :g], seg[1, :g], seg[2, :g] = plan.starts, plan.lens, plan.slots

    def load(self, values: torch.Tensor, b: int) -> None:
        """Copy ``fill``'s values (on the device) into the buffers the graph reads."""
        self.rows[:b].copy_(values[:b], non_blocking=True)
        self.row_slots[:b].copy_(values[b : 2 * b], non_blocking=True)
        self.seg.view(-1).copy_(values[2 * b :], non_blocking=True)

    def segments(self, b: int) -> Segments:
        """The views a graph of ``b`` rows is captured over (and reads at every replay)."""
        return self.rows[:b], self.seg[0], self.seg[1], self.seg[2], b

    def use(self, b: int | None) -> None:
        """Point the wrappers at the views of a graph of ``b`` rows; None: no LoRA work."""
        if b is None:
            self.batch.clear()
        else:
            self.batch.segments, self.batch.row_slots = self.segments(b), self.row_slots[:b]
