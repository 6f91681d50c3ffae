"""Gemma 3 (4B-27B) with images, in plain PyTorch: the SigLIP vision tower and Gemma 3's
projector beside the Gemma 3 language model of ``gemma3.py``, whose (scaled) token embeddings
they replace at the image's ``<image_soft_token>`` tokens (``services.engine.vision`` places
the rows; the projector's output is not scaled, as in transformers).

The tower: a patch convolution (with bias) plus a learned position per patch (the image is
always resized to the tower's square ``image_size``, so the table is never resampled), then
pre-norm blocks of bidirectional attention within each image's patches (q/k/v/out projections
with biases) and a GELU (tanh) MLP, LayerNorms throughout, and a last LayerNorm. The projector
average-pools each ``k x k`` square of the patch grid (64 x 64 patches to 16 x 16 for the
published checkpoints), applies Gemma's RMSNorm (``1 + weight``, in float32) and multiplies by
``mm_input_projection_weight`` into the language model's width. Patches come in raster order
([h * w, C * p * p], the processor's pixels cut by ``services.engine.vision``); on a GPU the
patch convolution runs as the matmul it is. Like the other towers it runs eagerly over every
image a step needs encoded at once. Positions of the language model are plain; its attention
among an image's tokens is bidirectional (the prefill kernels' ``span_last``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.model_config import ArchConfig, VisionConfig
from services.engine.models.gemma3 import Gemma3ForCausalLM

_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.in_channels, cfg.embed_dim, p, p)
        self.position_embedding = nn.Embedding(cfg.num_position_embeddings, cfg.embed_dim)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [n * N, C*p*p] -> [n * N, E]
        cfg, w = self.cfg, self.patch_embedding.weight
        x = pixels.to(w.dtype)
        if x.is_cuda:  # the same products as the convolution: one patch, one row
            x = F.linear(x, w.view(cfg.embed_dim, -1), self.patch_embedding.bias)
        else:
            x = x.view(-1, cfg.in_channels, cfg.patch_size, cfg.patch_size)
            x = self.patch_embedding(x).view(-1, cfg.embed_dim)
        n = x.shape[0] // cfg.num_position_embeddings  # images: every one the same grid
        return (x.view(n, -1, cfg.embed_dim) + self.position_embedding.weight).view_as(x)


class SiglipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [images, N, E]: within each image
        n, N, E = x.shape
        q, k, v = (
            p(x).view(n, N, self.num_heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )  # [images, H, N, D]
        o = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(o.transpose(1, 2).reshape(n, N, E))


class SiglipMlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.embed_dim, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.embed_dim)
        self.act = _ACTS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        eps = cfg.projector_eps
        self.layer_norm1 = nn.LayerNorm(cfg.embed_dim, eps=eps)
        self.self_attn = SiglipAttention(cfg.embed_dim, cfg.num_heads)
        self.layer_norm2 = nn.LayerNorm(cfg.embed_dim, eps=eps)
        self.mlp = SiglipMlp(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(cfg.depth))


class SiglipVisionModel(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.embed_dim, eps=cfg.projector_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images * N, C*p*p] patches (each image's N in raster order) -> [images, N, E]."""
        x = self.embeddings(pixels).view(-1, self.cfg.num_position_embeddings, self.cfg.embed_dim)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


class SoftEmbNorm(nn.Module):
    """Gemma's RMSNorm as transformers' Gemma3RMSNorm: in float32, times ``1 + weight``, then
    rounded to the input's dtype once."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Projector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(cfg.embed_dim, cfg.out_hidden_size)
        )
        self.mm_soft_emb_norm = SoftEmbNorm(cfg.embed_dim, cfg.projector_eps)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[images, N, E] -> [images, N / k^2, hidden]: each k x k square of patches averaged
        (raster order of the pooled grid), normed, projected."""
        n, N, E = features.shape
        side, k = round(N**0.5), self.cfg.spatial_merge_size
        grid = features.transpose(1, 2).reshape(n, E, side, side)
        pooled = F.avg_pool2d(grid, k, k).flatten(2).transpose(1, 2)  # [images, N / k^2, E]
        h = self.mm_soft_emb_norm(pooled)
        return torch.matmul(h, self.mm_input_projection_weight).to(features.dtype)


class Gemma3VLForCausalLM(Gemma3ForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        assert cfg.vision is not None
        self.vision_tower = SiglipVisionModel(cfg.vision)
        self.multi_modal_projector = Gemma3Projector(cfg.vision)

    def encode_images(
        self, images: list[tuple[torch.Tensor, tuple[int, int, int]]]
    ) -> list[torch.Tensor]:
        """Each image's embeddings [mm_tokens_per_image, hidden]: one per image soft token."""
        features = self.vision_tower(torch.cat([p for p, _ in images]))
        return list(self.multi_modal_projector(features).unbind(0))
