"""Rotary position embedding tables, with the rope scaling variants of the Llama family."""

from __future__ import annotations

import math
from typing import Any

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def cos_sin_cache(
    head_dim: int, max_pos: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:  # [max_pos, head_dim] float32: cos halves then sin halves
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    positions = torch.arange(max_pos, dtype=torch.float64)
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "linear":
        positions = positions / float(scaling["factor"])
    elif kind != "default":
        raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3 are)")
    freqs = torch.outer(positions, inv_freq)  # [max_pos, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
