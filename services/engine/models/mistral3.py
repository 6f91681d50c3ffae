"""Mistral 3 (Mistral Small 3.1/3.2, Magistral Small) with images, in plain PyTorch: Pixtral's
vision tower and Mistral 3's projector beside the Mistral language model of ``llama.py``, whose
embeddings they replace at the image's ``[IMG]`` tokens (its ``[IMG_BREAK]`` and ``[IMG_END]``
tokens keep their own; ``services.engine.vision`` places the rows).

The tower: a patch convolution (no bias), an RMSNorm, then blocks of attention (2-D rotary
positions by each patch's row and column; bidirectional, within each image's patches) and a
gated MLP, each behind an RMSNorm. The projector: an RMSNorm, the patch merger (each
``merge x merge`` square of patches, their features interleaved as transformers' ``unfold``
lays them out, through one linear layer), then linear-activation-linear to the language model's
width. Like Qwen-VL's tower (``qwen2_vl.py``), it runs eagerly over every image a step needs
encoded at once, the patches given in raster order ([h * w, C * p * p], the processor's pixels
cut into patches by ``services.engine.vision``); on a GPU the patch convolution runs as the
matmul it is. Positions of the language model are plain (no M-RoPE).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.model_config import ArchConfig, VisionConfig
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.qwen2_vl import _rotate_half

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu}


class PixtralRMSNorm(nn.Module):
    """Computed in float32, the weight applied in the input's dtype (transformers')."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class PixtralAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [N, E]
        cos: torch.Tensor,  # [N, D] in x's dtype
        sin: torch.Tensor,
        seqlens: list[int],  # each image's patches: attention stays within one
    ) -> torch.Tensor:
        N, h = x.shape[0], self.num_heads
        q, k, v = (p(x).view(N, h, -1) for p in (self.q_proj, self.k_proj, self.v_proj))
        c, s = cos[:, None, :], sin[:, None, :]
        q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
        outs = []
        for qs, ks, vs in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens), strict=True):
            o = F.scaled_dot_product_attention(  # [H, n, D]
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1)
            )
            outs.append(o.transpose(0, 1).reshape(qs.shape[0], -1))  # [n, E]
        return self.o_proj(torch.cat(outs))


class PixtralMlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        dim, hidden = cfg.embed_dim, cfg.intermediate_size
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PixtralBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.attention_norm = PixtralRMSNorm(cfg.embed_dim, 1e-5)
        self.attention = PixtralAttention(cfg.embed_dim, cfg.num_heads)
        self.ffn_norm = PixtralRMSNorm(cfg.embed_dim, 1e-5)
        self.feed_forward = PixtralMlp(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, seqlens)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PixtralBlock(cfg) for _ in range(cfg.depth))


def pixtral_rotary(
    grid: tuple[int, int, int], cfg: VisionConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # cos and sin [h*w, D] float32
    """Pixtral's 2-D rotary, patches in raster order: of a head's frequencies (theta over the
    head's dims), the even ones turn by the patch's row, the odd ones by its column; rows' then
    columns', then both again for the second half."""
    _, h, w = grid
    dim = cfg.embed_dim // cfg.num_heads
    inv_freq = 1.0 / (cfg.vision_rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    inv_freq = inv_freq.to(device)  # [D/2]
    rows = torch.arange(h, device=device).repeat_interleave(w).float()
    cols = torch.arange(w, device=device).repeat(h).float()
    freqs = torch.cat([rows[:, None] * inv_freq[0::2], cols[:, None] * inv_freq[1::2]], -1)
    freqs = torch.cat([freqs, freqs], -1)  # [N, D]
    return freqs.cos(), freqs.sin()


class PixtralVisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        self.patch_conv = nn.Conv2d(cfg.in_channels, cfg.embed_dim, p, p, bias=False)
        self.ln_pre = PixtralRMSNorm(cfg.embed_dim, 1e-5)
        self.transformer = PixtralTransformer(cfg)

    def _patches(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C*p*p] -> [N, E]
        cfg = self.cfg
        x = pixels.to(self.patch_conv.weight.dtype)
        if x.is_cuda:  # the same products as the convolution: one patch, one row
            return F.linear(x, self.patch_conv.weight.view(cfg.embed_dim, -1))
        x = x.view(-1, cfg.in_channels, cfg.patch_size, cfg.patch_size)
        return self.patch_conv(x).view(-1, cfg.embed_dim)

    def forward_many(
        self, images: list[tuple[torch.Tensor, tuple[int, int, int]]]
    ) -> list[torch.Tensor]:
        """Each image's features [h*w, E] (the hidden state of ``cfg.feature_layer``), its
        patches in raster order; several images in one pass, attention within each."""
        x = self.ln_pre(self._patches(torch.cat([p for p, _ in images])))  # [N, E]
        rotary = [pixtral_rotary(grid, self.cfg, x.device) for _, grid in images]
        cos = torch.cat([c for c, _ in rotary]).to(x.dtype)
        sin = torch.cat([s for _, s in rotary]).to(x.dtype)
        seqlens = [g[1] * g[2] for _, g in images]
        for layer in self.transformer.layers[: self.cfg.feature_layer]:
            x = layer(x, cos, sin, seqlens)
        return list(x.split(seqlens))


class PatchMerger(nn.Module):
    """Each ``merge x merge`` square of patches into one row: the features channel by channel,
    each channel's patches row by row (transformers' ``unfold`` order), through one linear."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.merging_layer = nn.Linear(cfg.embed_dim * self.merge**2, cfg.embed_dim, bias=False)

    def forward(
        self, x: torch.Tensor, grid: tuple[int, int, int]
    ) -> torch.Tensor:  # [h*w, E] -> [h*w / m^2, E]
        _, h, w = grid
        m, e = self.merge, x.shape[-1]
        squares = x.view(h // m, m, w // m, m, e).permute(0, 2, 4, 1, 3)  # [h/m, w/m, E, m, m]
        return self.merging_layer(squares.reshape(-1, e * m * m))


class Mistral3Projector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm = PixtralRMSNorm(cfg.embed_dim, cfg.projector_eps)
        self.patch_merger = PatchMerger(cfg)
        bias = cfg.projector_bias
        self.linear_1 = nn.Linear(cfg.embed_dim, cfg.out_hidden_size, bias=bias)
        self.linear_2 = nn.Linear(cfg.out_hidden_size, cfg.out_hidden_size, bias=bias)
        self.act = _ACTS[cfg.projector_act]

    def forward(
        self, features: list[torch.Tensor], grids: list[tuple[int, int, int]]
    ) -> list[torch.Tensor]:  # each image's [h*w / m^2, hidden], merged patches in raster order
        merged = [self.patch_merger(self.norm(f), g) for f, g in zip(features, grids, strict=True)]
        out = self.linear_2(self.act(self.linear_1(torch.cat(merged))))
        return list(out.split([t.shape[0] for t in merged]))


class Mistral3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        assert cfg.vision is not None
        self.vision_tower = PixtralVisionModel(cfg.vision)
        self.multi_modal_projector = Mistral3Projector(cfg.vision)

    def encode_images(
        self, images: list[tuple[torch.Tensor, tuple[int, int, int]]]
    ) -> list[torch.Tensor]:
        """Each image's embeddings [merged patches, hidden]: one per ``[IMG]`` token."""
        features = self.vision_tower.forward_many(images)
        return self.multi_modal_projector(features, [g for _, g in images])
