"""Gather/scatter of paged KV blocks to and from one contiguous buffer (for KV transfer).

Per-layer caches are ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
The buffer is ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import torch


def ref_gather_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into one new contiguous tensor."""
    ids = block_ids.long()
    return torch.stack([cache[:, ids] for cache in kv_caches])


def ref_scatter_blocks(
    buffer: torch.Tensor, kv_caches: list[torch.Tensor], block_ids: torch.Tensor
) -> None:
    """Inverse of :func:`ref_gather_blocks`: write the buffer into blocks ``block_ids``."""
    ids = block_ids.long()
    for layer, cache in enumerate(kv_caches):
        cache[:, ids] = buffer[layer].to(cache.dtype)
