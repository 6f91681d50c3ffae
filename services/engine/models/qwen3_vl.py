"""Qwen3-VL's vision tower: Qwen2-VL's (``qwen2_vl.py``) with 16-pixel patches, a learned table
of patch positions resampled to each image's grid and added to the patch embeddings, a
tanh-GELU MLP, and DeepStack: the output of a few intermediate blocks goes through a merger of
its own (normed after the 2x2 shuffle), and the language model adds each level to the image
tokens' hidden states after one of its first decoder layers (``llama.py``'s forward).

The language model is Qwen3's (q/k RMSNorm per head); its M-RoPE interleaves the axes over the
frequencies (``mrope_axes``). The image tokens' positions are Qwen2-VL's (``mrope.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.model_config import VisionConfig
from services.engine.models.qwen2_vl import (
    Qwen2VLForCausalLM,
    VisionBlock,
    VisionTransformer,
    patch_rows_cols,
)


class Qwen3VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, E]
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class Qwen3VisionBlock(VisionBlock):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__(cfg)
        self.mlp = Qwen3VisionMlp(cfg.embed_dim, cfg.intermediate_size)


class Qwen3PatchMerger(nn.Module):
    """Each ``merge x merge`` window of patches into one token of the language model's width;
    the LayerNorm before the shuffle (over a patch) or after it (over the window: DeepStack's)."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.width = cfg.embed_dim * cfg.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else cfg.embed_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, E] -> [N / merge^2, hidden]
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x)
        return self.linear_fc2(F.gelu(self.linear_fc1(x.view(-1, self.width))))


def _axis_taps(
    index: torch.Tensor, size: int, side: int
) -> tuple[torch.Tensor, torch.Tensor]:  # [N, 2] each: table rows and their weights
    """Bilinear resampling with aligned corners along one axis of ``size`` patches from a table
    of ``side``, in transformers' arithmetic (the same float32 operations in the same order)."""
    src = index.float() * (side - 1) / max(size - 1, 1)  # [N]
    floor = torch.floor(src)
    offsets = torch.arange(0, 2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class Qwen3VisionTransformer(VisionTransformer):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__(cfg)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = Qwen3PatchMerger(cfg, postshuffle=False)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.embed_dim)
        self.side = int(cfg.num_position_embeddings**0.5)  # the table is side x side
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_blocks
        )

    def _positions(self, grid: tuple[int, int, int]) -> torch.Tensor:  # [t*h*w, E] float32
        """The position table resampled to the image's patch grid, in the processor's order."""
        _, h, w = grid
        rows, cols = patch_rows_cols(
            grid, self.cfg.spatial_merge_size, self.pos_embed.weight.device
        )
        h_taps, h_weights = _axis_taps(rows, h, self.side)
        w_taps, w_weights = _axis_taps(cols, w, self.side)
        index = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4)  # [N, 4]
        weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weight[:, :, None]).sum(1)

    def forward_many(
        self, images: list[tuple[torch.Tensor, tuple[int, int, int]]]
    ) -> list[torch.Tensor]:
        """Each image's [tokens, hidden * (1 + levels)]: the merged tokens, then each DeepStack
        level's, side by side (one tensor per image: the encoder cache and a step's row
        gathering treat it as they treat Qwen2-VL's embeddings)."""
        m = self.cfg.spatial_merge_size
        x = self.patch_embed(torch.cat([p for p, _ in images]))  # [N, E]
        pos = torch.cat([self._positions(grid) for _, grid in images])  # [N, E] float32
        x = x + pos.to(x.dtype)
        rotary = [self._rotary(grid) for _, grid in images]
        cos, sin = torch.cat([c for c, _ in rotary]), torch.cat([s for _, s in rotary])
        frames = [g[1] * g[2] for _, g in images for _ in range(g[0])]  # attention within each
        levels = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames)
            if i in self.cfg.deepstack_blocks:
                merger = self.deepstack_merger_list[self.cfg.deepstack_blocks.index(i)]
                levels.append(merger(x))  # [N / m^2, hidden]
        out = torch.cat([self.merger(x), *levels], dim=-1)  # [N / m^2, hidden * (1 + levels)]
        return list(out.split([g[0] * g[1] * g[2] // (m * m) for _, g in images]))


class Qwen3VLForCausalLM(Qwen2VLForCausalLM):
    def vision_tower(self, cfg: VisionConfig) -> VisionTransformer:
        return Qwen3VisionTransformer(cfg)
