"""Rotary position embedding tables, with the rope scaling variants of the Llama family (linear,
llama3), YaRN (Qwen2.5/Qwen3's long-context setting) and LongRoPE (Phi-3.5, Phi-4-mini).

The table holds the same float32 values as transformers' ``LlamaRotaryEmbedding`` (5.x) computes
before casting cos/sin to the activation dtype: ``inv_freq`` in float32 by the same expressions
(``modeling_rope_utils``), ``freqs = position.float() * inv_freq`` in float32, then cos and sin.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from services.engine.model_config import SUPPORTED_SCALING, scaling_kind


def _pos_freqs(head_dim: int, theta: float) -> torch.Tensor:  # [D/2] float32: theta^(2i/D)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return theta**exponents


def _default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:  # [D/2] float32
    return 1.0 / _pos_freqs(head_dim, theta)


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


def _yarn_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int | None
) -> tuple[torch.Tensor, float]:
    """transformers' ``_compute_yarn_parameters`` (YaRN: the high frequencies kept, the low ones
    interpolated by ``factor``, a linear ramp between, and cos/sin scaled by the attention
    factor), expression for expression (float32): (inv_freq, attention factor)."""
    old_len = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if old_len is None:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    factor = scaling["factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (
            float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
        )
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singular ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = _pos_freqs(head_dim, theta)
    extrapolation = 1 - ramp  # the share of each frequency kept as it was
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention)


def longrope_tables(
    head_dim: int,
    max_pos: int,
    theta: float,
    scaling: dict[str, Any],
    max_position_embeddings: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # two [max_pos, head_dim] float32
    """transformers' ``_compute_longrope_parameters`` (Phi-3.5, Phi-4-mini): cos and sin of the
    frequencies divided by ``short_factor`` or ``long_factor``, scaled by the attention
    factor. (The short factors below ``original_max_position_embeddings`` and the long ones
    from there on; the long ones at every position.)

    transformers picks one of the two for a whole sequence by its length: the short factors
    while it fits the original length, the long ones once it is longer (a prompt that long at
    once; one that grows past it in decoding has its cache computed again). The engine rotates
    a request whose prompt is longer by the second table, the others by the first (a sequence
    that grows past the original length keeps the keys it cached, as transformers without
    that recomputation would)."""
    old_len = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or (max_position_embeddings or max_pos) / old_len
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    shape = _pos_freqs(head_dim, theta)
    positions = torch.arange(max_pos, dtype=torch.int64).float()[:, None]

    def table(name: str) -> torch.Tensor:
        inv_freq = 1.0 / (torch.tensor(scaling[name], dtype=torch.float32) * shape)
        freqs = positions * inv_freq[None, :]
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * float(attention)

    long = table("long_factor")
    return torch.where(
        (torch.arange(max_pos) < old_len)[:, None], table("short_factor"), long
    ), long


def cos_sin_cache(
    head_dim: int,
    max_pos: int,
    theta: float,
    scaling: dict[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> torch.Tensor:  # [max_pos, head_dim] float32: cos halves then sin halves
    """``head_dim``: the dims rotated (the rotary dim of a partial rotary model).
    ``max_position_embeddings``: the config's, which YaRN falls back on where its own
    parameters leave a length out, and LongRoPE's factor comes from."""
    scaling = scaling or {}
    kind = scaling_kind(scaling)
    if kind == "longrope":  # the table of prompts within the original length
        return longrope_tables(head_dim, max_pos, theta, scaling, max_position_embeddings)[0]
    inv_freq = _default_inv_freq(head_dim, theta)
    attention = 1.0  # default, linear and llama3 use cos and sin as computed
    if kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]  # transformers scales inv_freq, not positions
    elif kind == "yarn":
        inv_freq, attention = _yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    elif kind != "default":
        raise ValueError(
            f"rope scaling {kind!r} is not supported ({', '.join(SUPPORTED_SCALING)} are)"
        )
    freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    return table * attention if attention != 1.0 else table


def halves_from_pairs(rows: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The rows of a q or k projection (weight [H D, K] or bias [H D]) with each head's first
    ``rotary_dim`` rows reordered from rotary pairs (0, 1), (2, 3), ... (GLM's and Cohere's
    rotation) to halves (0, 2, 4, ..., 1, 3, 5, ...): the engine's rotation of the first half
    with the second then turns each pair as the checkpoint's model does. q and k reordered
    alike leave every score q . k as it was."""
    order = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                       torch.arange(rotary_dim, head_dim)])  # fmt: skip
    heads = rows.reshape(-1, head_dim, *rows.shape[1:])  # [H, D, ...]
    return heads[:, order].reshape(rows.shape)
