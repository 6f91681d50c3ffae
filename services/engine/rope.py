"""Rotary position embedding tables, with the rope scaling variants of the Llama family.

The table holds the same float32 values as transformers' ``LlamaRotaryEmbedding`` (5.x) computes
before casting cos/sin to the activation dtype: ``inv_freq`` in float32 by the same expressions
(``modeling_rope_utils``), ``freqs = position.float() * inv_freq`` in float32, then cos and sin.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:  # [D/2] float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """transformers' ``_compute_llama3_parameters``, expression for expression (float32)."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_mid, mid, scaled)


def cos_sin_cache(
    head_dim: int, max_pos: int, theta: float, scaling: dict[str, Any] | None = None
) -> torch.Tensor:  # [max_pos, head_dim] float32: cos halves then sin halves
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if kind == "mrope":  # Qwen2-VL's published config: default frequencies, split 3-D elsewhere
        kind = "default"
    inv_freq = _default_inv_freq(head_dim, theta)
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]  # transformers scales inv_freq, not positions
    elif kind != "default":
        raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3 are)")
    # the attention scaling of these three kinds is 1.0: cos and sin are used as computed
    freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
