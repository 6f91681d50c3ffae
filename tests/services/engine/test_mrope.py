"""M-RoPE positions of any range of a prompt equal transformers' ``get_rope_index`` of the whole
prompt, and the rope delta its ``rope_deltas``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from protos.multimodal import ImageItem
from services.engine.mrope import mrope_positions, rope_delta

PAD = 7


def _reference(ids: list[int], grids: list[tuple[int, int, int]], family: str) -> tuple[list, int]:
    from transformers import Qwen2VLConfig, Qwen3VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    text = {"vocab_size": 16, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    if family == "qwen3_vl":
        vision = {"depth": 1, "hidden_size": 8, "intermediate_size": 8, "num_heads": 2,
                  "out_hidden_size": 8, "deepstack_visual_indexes": []}  # fmt: skip
        text |= {"head_dim": 4, "rope_parameters": {"rope_type": "default",
                 "rope_theta": 10000.0, "mrope_section": [1, 1, 0]}}  # fmt: skip
        model: Any = Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config=vision,
                                                image_token_id=PAD))  # fmt: skip
    else:
        vision = {"depth": 1, "embed_dim": 8, "hidden_size": 8, "num_heads": 2}
        model = Qwen2VLModel(Qwen2VLConfig(text_config=text, vision_config=vision,
                                           image_token_id=PAD))  # fmt: skip
    input_ids = torch.tensor([ids])
    pos, delta = model.get_rope_index(input_ids, (input_ids == PAD).int(), torch.tensor(grids))
    return pos[:, 0].tolist(), int(delta.item())


@pytest.mark.parametrize(
    "layout",
    [
        [(2, (1, 4, 6)), ],  # one image after two text tokens
        [(0, (1, 8, 4)), (3, (1, 2, 2))],  # an image first, text, a second image
        [(5, (1, 2, 12)), (1, (1, 6, 6))],  # a wide image, then a square one right after
    ],
)  # fmt: skip
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])  # Qwen3-VL's are Qwen2-VL's
def test_positions_and_delta_equal_transformers(layout: list, family: str) -> None:
    ids: list[int] = []
    images = []
    for text, grid in layout:
        ids += [1] * text
        n = grid[0] * grid[1] * grid[2] // 4
        images.append(ImageItem(len(ids), n, grid, b"h" * 16, b""))
        ids += [PAD] * n
    ids += [2, 3, 4]
    expected, delta = _reference(ids, [g for _, g in layout], family)
    assert mrope_positions(images, 2, 0, len(ids)).tolist() == expected
    assert rope_delta(images, 2) == delta
    for start in range(len(ids)):  # any chunk gives its slice of the whole
        for n in (1, 5):
            part = mrope_positions(images, 2, start, min(n, len(ids) - start)).tolist()
            assert part == [row[start : start + n] for row in expected]
