"""Qwen3-VL's vision tower against transformers' (its merged tokens and every DeepStack level,
images of several sizes in one pass, a learned position table resampled up and down), and its
interleaved M-RoPE layout against transformers' text rotary embedding."""

from __future__ import annotations

import pytest
import torch

from services.engine.model_config import VisionConfig
from services.engine.models.qwen2_vl import mrope_table
from services.engine.models.qwen3_vl import Qwen3VisionTransformer
from services.engine.rope import cos_sin_cache


def test_vision_tower_equals_transformers() -> None:
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    hf_cfg = Qwen3VLVisionConfig(
        depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=2,
        out_hidden_size=24, num_position_embeddings=36, deepstack_visual_indexes=[0, 2],
        rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
    )  # fmt: skip
    torch.manual_seed(0)
    hf = Qwen3VLVisionModel(hf_cfg).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    cfg = VisionConfig(
        depth=3, embed_dim=32, num_heads=2, mlp_ratio=4, in_channels=3, patch_size=2,
        temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=24, image_token_id=5,
        mrope_section=(2, 1, 1), intermediate_size=48, model_type="qwen3_vl",
        num_position_embeddings=36, mrope_interleaved=True, deepstack_blocks=(0, 2),
        vision_rope_theta=100.0,
    )  # fmt: skip
    tower = Qwen3VisionTransformer(cfg).eval()
    tower.load_state_dict(hf.state_dict())  # the checkpoint's names, all of them
    # wider and narrower than the 6x6 table, and a two-frame one (attention within a frame)
    grids = [(1, 8, 12), (1, 4, 4), (2, 4, 8), (1, 2, 2)]
    width = 3 * 2 * 2 * 2
    pixels = [torch.randn(t * h * w, width) for t, h, w in grids]
    with torch.no_grad():
        ref = hf(torch.cat(pixels), grid_thw=torch.tensor(grids))
        ours = tower.forward_many(list(zip(pixels, grids, strict=True)))
        alone = tower.forward_many([(pixels[1], grids[1])])[0]
    merged = torch.cat(ours)  # [tokens, 24 * (1 + 2)]
    want = torch.cat([ref.pooler_output, *ref.deepstack_features], dim=-1)
    assert merged.shape == want.shape == (sum(t * h * w for t, h, w in grids) // 4, 72)
    torch.testing.assert_close(merged, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone, ours[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("section", [(24, 20, 20), (4, 2, 2), (2, 3, 3)])
def test_interleaved_mrope_equals_transformers(section: tuple[int, int, int]) -> None:
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    head_dim = 2 * sum(section)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(section),
            "mrope_interleaved": True}  # fmt: skip
    cfg = Qwen3VLTextConfig(head_dim=head_dim, rope_parameters=rope)
    positions = torch.stack([torch.arange(9), torch.arange(9) * 3 % 7, torch.arange(9) % 4 + 2])
    cos, sin = Qwen3VLTextRotaryEmbedding(cfg)(torch.zeros(1), positions[:, None, :])  # [1, T, D]
    table = mrope_table(cos_sin_cache(head_dim, 32, 10000.0), positions, section, True)  # [T, D]
    half = head_dim // 2
    torch.testing.assert_close(table[:, :half], cos[0, :, :half])
    torch.testing.assert_close(table[:, half:], sin[0, :, :half])
    chunked = mrope_table(cos_sin_cache(head_dim, 32, 10000.0), positions, section, False)
    assert not torch.allclose(chunked, table)  # the layout is not Qwen2-VL's
