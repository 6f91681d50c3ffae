"""Qwen2.5-VL's window layout against transformers' ``get_vision_window_index``."""

from __future__ import annotations

import pytest
import torch

from services.engine.models.qwen2_vl import window_order


@pytest.mark.parametrize("grid", [(1, 8, 8), (1, 6, 4), (1, 8, 10), (2, 12, 18), (1, 2, 2)])
def test_window_order_equals_transformers(grid: tuple[int, int, int]) -> None:
    from transformers.vision_utils import get_vision_window_index

    index, cu = get_vision_window_index(torch.tensor([grid]), 2, 112, 14)
    order, sizes = window_order(grid, 2, 112 // 14)
    assert order.tolist() == index.tolist()
    assert [0, *torch.tensor(sizes).cumsum(0).tolist()] == cu.tolist()
