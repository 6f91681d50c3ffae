"""A decode graph's LoRA indices: the step's plan laid out in fixed-size buffers (rows padded to
the graph's batch, every slot a segment), and a wrapped projection fed from those buffers with
padding rows giving each real row the update of the step's own eager segments."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from services.engine.lora.graph_inputs import LoRAGraphInputs
from services.engine.lora.manager import StepSegments
from tests.services.engine.lora.test_manager import manager

STEP = [("b", 1), ("", 1), ("a", 1), ("b", 1), ("", 1)]  # five decodes: b, base, a, b, base


def test_the_plan_groups_each_adapters_rows_wherever_they_lie(tmp_path: Path) -> None:
    m = manager(tmp_path, slots=3)
    plan = m.plan(STEP)
    assert plan is not None
    b_slot, a_slot = m.slots.index("b"), m.slots.index("a")
    by_slot = {s: plan.rows[st : st + n] for st, n, s in zip(plan.starts, plan.lens, plan.slots, strict=True)}  # fmt: skip
    assert by_slot == {b_slot: [0, 3], a_slot: [2]}
    assert plan.slots == sorted(plan.slots), "one segment per slot, in slot order"
    assert m.plan([("", 3)]) is None and m.plan([]) is None


def test_fill_lays_rows_then_every_slots_segment_out() -> None:
    from services.engine.lora.layers import LoRABatch

    inputs = LoRAGraphInputs(LoRABatch(), 16, 4, torch.device("cpu"))
    host = np.full(inputs.size(8), 99, dtype=np.int32)  # stale values of a previous step
    inputs.fill(host, StepSegments([0, 3, 2], [0, 2], [2, 1], [1, 3]), 8)
    assert host[:8].tolist() == [0, 3, 2, 0, 0, 0, 0, 0]
    assert host[8:16].tolist() == [1, -1, 3, 1, -1, -1, -1, -1], "each row's slot, -1: none"
    assert host[16:].reshape(3, 4).tolist() == [[0, 2, 0, 0], [2, 1, 0, 0], [1, 3, 0, 0]]
    inputs.load(torch.from_numpy(host), 8)
    rows, starts, lens, slots, longest = inputs.segments(8)
    assert rows.tolist() == host[:8].tolist() and longest == 8
    assert [starts.tolist(), lens.tolist(), slots.tolist()] == host[16:].reshape(3, 4).tolist()
    inputs.use(8)
    assert inputs.batch.row_slots is not None
    assert inputs.batch.row_slots.tolist() == host[8:16].tolist()
    inputs.use(None)
    assert inputs.batch.segments is None and inputs.batch.row_slots is None
    with pytest.raises(ValueError, match="do not fit"):
        inputs.fill(np.zeros(inputs.size(2), np.int32), StepSegments([0, 1, 2], [0], [3], [0]), 2)
    with pytest.raises(ValueError, match="do not fit"):
        five = StepSegments([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [1] * 5, [0, 1, 2, 3, 4])
        inputs.fill(np.zeros(inputs.size(8), np.int32), five, 8)


# 3 slots: qkv's stacked A rows (3 x 12) outnumber its 32, so it keeps add_lora; gate_up is fused
@pytest.mark.parametrize(("proj", "fused"), [("qkv_proj", False), ("gate_up_proj", True)])
@pytest.mark.parametrize("step", [STEP, [("a", 1)] * 5, [("", 1)] * 5, [("c", 1), ("a", 1)]])
def test_a_projection_fed_from_the_buffers_matches_the_eager_step(
    tmp_path: Path, step: list[tuple[str, int]], proj: str, fused: bool
) -> None:
    m = manager(tmp_path, slots=3)
    qkv = m.layers[(1, proj)]
    assert qkv.fused == fused
    n, b = len(step), 8  # a graph of 8 rows: the rows past n are padding
    x = torch.randn(b, 16)
    m.begin_step(step)
    eager = qkv(x[:n])
    m.batch.segments = None
    base = qkv(x)
    inputs = LoRAGraphInputs(m.batch, 16, 3, torch.device("cpu"))
    host = np.zeros(inputs.size(b), dtype=np.int32)
    plan = m.plan(step)
    if plan is not None:
        inputs.fill(host, plan, b)
    inputs.load(torch.from_numpy(host), b)
    inputs.use(b)
    graphed = qkv(x)
    torch.testing.assert_close(graphed[:n], eager)
    assert torch.equal(graphed[n:], base[n:]), "a padding row got an adapter's update"
    if any(name for name, _ in step):
        assert not torch.equal(graphed[:n], base[:n])
