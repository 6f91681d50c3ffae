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


@pytest.mark.parametrize("windowed", [False, True], ids=["qwen2-vl", "qwen2.5-vl"])
def test_images_encoded_together_equal_each_alone(windowed: bool) -> None:
    """forward_many (the runner's one pass over a step's images) against one forward per
    image: images of two sizes (segments of unequal length: the per-segment attention) and
    two of one size alone (equal segments: the batched attention call)."""
    from services.engine.model_config import VisionConfig
    from services.engine.models.qwen2_vl import VisionTransformer

    cfg = VisionConfig(
        depth=3, embed_dim=32, num_heads=4, mlp_ratio=2, in_channels=3, patch_size=2,
        temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=24, image_token_id=5,
        mrope_section=(2, 1, 1), intermediate_size=48 if windowed else 0,
        window_size=8 if windowed else 0, full_attention_blocks=(1,) if windowed else (),
    )  # fmt: skip
    torch.manual_seed(0)
    tower = VisionTransformer(cfg).eval()
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.2)
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    grids = [(1, 8, 6), (1, 4, 4), (2, 4, 8)]
    pixels = [torch.randn(t * h * w, width) for t, h, w in grids]
    with torch.no_grad():
        alone = [tower(p, g) for p, g in zip(pixels, grids, strict=True)]
        together = tower.forward_many(list(zip(pixels, grids, strict=True)))
        same_size = tower.forward_many([(pixels[1], grids[1]), (2 * pixels[1], grids[1])])
        second = tower(2 * pixels[1], grids[1])
    for a, b in zip(alone, together, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(same_size[0], alone[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(same_size[1], second, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone[1], second)  # the two images differ
