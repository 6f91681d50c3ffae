"""Qwen2-VL and Qwen2.5-VL in plain PyTorch: the vision transformer beside the Qwen2 language
model of ``llama.py``, whose embeddings it replaces at the image placeholder tokens, and the
multimodal rotary table (M-RoPE) those tokens are rotated with.

The vision tower runs eagerly, once per step over every image the step needs encoded (their
patches concatenated: one launch per layer for all of them), with bidirectional attention
within each image's patches (Qwen2.5-VL: within windows of merged patches, but in its
full-attention blocks; equal-length segments go to one batched attention call). Its output is
cached by the runner (``services.engine.vision``). On a GPU the patch embedding runs as the
matmul it is (a convolution whose kernel is its stride and its input: cuDNN's conv3d took 7 ms
an image for it on an H100); elsewhere as the model's own Conv3d.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.model_config import ArchConfig, VisionConfig
from services.engine.models.llama import LlamaForCausalLM


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self,
        x: torch.Tensor,  # [N, E]
        cos: torch.Tensor,  # [N, D] float32
        sin: torch.Tensor,
        seqlens: list[int],  # the patches of each frame: attention stays within one
    ) -> torch.Tensor:
        N = x.shape[0]
        q, k, v = self.qkv(x).reshape(N, 3, self.num_heads, -1).unbind(1)  # [N, H, D] each
        c, s = cos[:, None, :], sin[:, None, :]  # [N, 1, D]
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        if len(set(seqlens)) == 1:  # segments of one length (images of one size): one call
            n, h = seqlens[0], self.num_heads
            q, k, v = (t.view(len(seqlens), n, h, -1).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v)  # [B, H, n, D]
            return self.proj(o.transpose(1, 2).reshape(N, -1))
        outs = []
        for qs, ks, vs in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens), strict=True):
            o = F.scaled_dot_product_attention(  # [H, n, D]
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1)
            )
            outs.append(o.transpose(0, 1).reshape(qs.shape[0], -1))  # [n, E]
        return self.proj(torch.cat(outs))  # [N, E]


class VisionRMSNorm(nn.Module):
    """Qwen2.5-VL's norm: computed in float32, the weight applied in the input's dtype."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


def _norm(cfg: VisionConfig, size: int) -> nn.Module:
    return VisionRMSNorm(size) if cfg.windowed else nn.LayerNorm(size, eps=1e-6)


class GatedVisionMlp(nn.Module):
    """Qwen2.5-VL's MLP: SiLU-gated, with biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, E]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, E]
        return self.fc2(_quick_gelu(self.fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        p, tp = cfg.patch_size, cfg.temporal_patch_size
        shape = (tp, p, p)  # Qwen3-VL's has a bias
        self.proj = nn.Conv3d(cfg.in_channels, cfg.embed_dim, shape, shape, bias=cfg.qwen3)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C*tp*p*p] -> [N, E]
        cfg = self.cfg
        x = pixels.to(self.proj.weight.dtype)
        if x.is_cuda:  # the same products as the convolution: one patch, one row
            w = self.proj.weight.view(cfg.embed_dim, -1)
            return F.linear(x.view(x.shape[0], -1), w, self.proj.bias)
        x = x.view(-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        return self.proj(x).view(-1, cfg.embed_dim)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(cfg, cfg.embed_dim)
        self.norm2 = _norm(cfg, cfg.embed_dim)
        self.attn = VisionAttention(cfg.embed_dim, cfg.num_heads)
        self.mlp: nn.Module = (
            GatedVisionMlp(cfg.embed_dim, cfg.intermediate_size)
            if cfg.windowed
            else VisionMlp(cfg.embed_dim, cfg.embed_dim * cfg.mlp_ratio)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]
    ) -> torch.Tensor:  # [N, E]
        x = x + self.attn(self.norm1(x), cos, sin, seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each ``merge x merge`` window of patches (adjacent rows in the processor's order) into one
    token of the language model's width."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.width = cfg.embed_dim * cfg.spatial_merge_size**2
        self.ln_q = _norm(cfg, cfg.embed_dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, cfg.out_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, E] -> [N / merge^2, hidden]
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger: nn.Module = PatchMerger(cfg)

    def _rotary(self, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.patch_embed.proj.weight.device
        return vision_rotary(grid, self.cfg, dev)

    def forward(
        self, pixels: torch.Tensor, grid: tuple[int, int, int]
    ) -> torch.Tensor:  # [t*h*w, C*tp*p*p] -> [t*h*w / merge^2, hidden]
        return self.forward_many([(pixels, grid)])[0]

    def forward_many(
        self, images: list[tuple[torch.Tensor, tuple[int, int, int]]]
    ) -> list[torch.Tensor]:
        """Several images in one pass: their patches concatenated, attention kept within each
        image's segments (frames; Qwen2.5-VL's windows), each image's tokens in raster order."""
        cfg, m = self.cfg, self.cfg.spatial_merge_size
        x = self.patch_embed(torch.cat([p for p, _ in images]))  # [N, E], every image's patches
        rotary = [self._rotary(grid) for _, grid in images]
        cos, sin = torch.cat([c for c, _ in rotary]), torch.cat([s for _, s in rotary])
        full = [g[1] * g[2] for _, g in images for _ in range(g[0])]  # one segment per frame
        merged = [g[0] * g[1] * g[2] // (m * m) for _, g in images]  # tokens of each image
        if not cfg.windowed:
            for block in self.blocks:
                x = block(x, cos, sin, full)
            return list(self.merger(x).split(merged))
        orders, windows, perms, start = [], [], [], 0
        for (_, grid), n in zip(images, merged, strict=True):
            order, wins = window_order(grid, m, cfg.window_size // cfg.patch_size)
            order = order.to(x.device)  # [n]: merged patches, window by window
            orders.append(order)
            windows += wins
            perms.append(
                start + (order[:, None] * m * m + torch.arange(m * m, device=x.device)).flatten()
            )
            start += n * m * m
        perm = torch.cat(perms)  # [N]
        x, cos, sin = x[perm], cos[perm], sin[perm]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in cfg.full_attention_blocks else windows)
        out = self.merger(x).split(merged)
        return [o[torch.argsort(order)] for o, order in zip(out, orders, strict=True)]  # raster


def patch_rows_cols(
    grid: tuple[int, int, int], merge: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # [t*h*w] each
    """Each patch's (row, column) in the processor's order: merge windows in raster order,
    raster order inside each, frame after frame."""
    t, h, w = grid
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    order = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(order).transpose(1, 2).flatten().repeat(t)
    cols = cols.reshape(order).transpose(1, 2).flatten().repeat(t)
    return rows, cols


def vision_rotary(
    grid: tuple[int, int, int], cfg: VisionConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # cos and sin [t*h*w, D] float32
    """The 2-D rotary of each patch: a quarter of a head's frequencies by its row, a quarter by
    its column (then both again for the second half)."""
    half = cfg.embed_dim // cfg.num_heads // 2
    exponent = torch.arange(0, half, 2, dtype=torch.float) / half
    inv_freq = (1.0 / (cfg.vision_rope_theta**exponent)).to(device)  # [D/4]
    rows, cols = patch_rows_cols(grid, cfg.spatial_merge_size, device)
    freqs = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], -1)
    freqs = torch.cat([freqs, freqs], -1)  # [N, D] float32
    return freqs.cos(), freqs.sin()


def window_order(
    grid: tuple[int, int, int], merge: int, window_patches: int
) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the merged patches in window order (windows of
    ``window_patches / merge`` merged patches a side, raster order within and between them, the
    last row and column of windows cut short), and each window's count of patches."""
    t, h, w = grid
    gh, gw, side = h // merge, w // merge, window_patches // merge
    nh, nw = -(-gh // side), -(-gw // side)
    index = torch.arange(t * gh * gw).reshape(t, gh, gw)
    padded = F.pad(index, (0, nw * side - gw, 0, nh * side - gh), value=-1)
    padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, -1)
    counts = (padded >= 0).sum(-1).tolist()  # merged patches per window
    order = padded.flatten()
    return order[order >= 0], [c * merge * merge for c in counts if c > 0]


def mrope_axes(section: tuple[int, ...], interleaved: bool) -> torch.Tensor:  # [D/2] long
    """The position axis (0: t, 1: h, 2: w) that rotates each rotary frequency: ``section[i]``
    frequencies in a row for each axis (Qwen2-VL), or (Qwen3-VL) h and w on every third
    frequency from the second and third up to three times their section, t on the rest."""
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
    axis = torch.zeros(sum(section), dtype=torch.long)
    for a in (1, 2):
        axis[a : 3 * section[a] : 3] = a
    return axis


def mrope_table(
    cos_sin: torch.Tensor,  # [max_pos, D]: cos halves then sin halves
    positions: torch.Tensor,  # [3, T]: t, h, w
    section: tuple[int, ...],  # frequencies of each axis, summing to D / 2
    interleaved: bool = False,
) -> torch.Tensor:  # [T, D]: each frequency's cos and sin at its own axis' position
    rows = cos_sin[positions]  # [3, T, D]
    half = cos_sin.shape[1] // 2
    axis = mrope_axes(section, interleaved).to(positions.device)  # [D/2]
    axis = torch.cat([axis, axis])  # cos and sin halves pick alike
    cols = torch.arange(2 * half, device=positions.device)
    return rows[axis, :, cols].T.contiguous()  # [T, D] (the rotary kernel reads rows whole)


class Qwen2VLForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg, max_positions)
        assert cfg.vision is not None
        self.visual = self.vision_tower(cfg.vision)

    def vision_tower(self, cfg: VisionConfig) -> VisionTransformer:
        return VisionTransformer(cfg)

    def encode_images(
        self, images: list[tuple[torch.Tensor, tuple[int, int, int]]]
    ) -> list[torch.Tensor]:
        """Each image's embeddings [tokens, hidden] (Qwen3-VL: [tokens, hidden * (1 + DeepStack
        levels)], the levels' features after the embeddings)."""
        return self.visual.forward_many(images)
