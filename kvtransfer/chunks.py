"""Splitting one transfer into chunks of whole layers, so copies overlap the wire.

The sender gathers chunk k+1 while chunk k is on the wire, and the receiver scatters chunk k
while chunk k+1 arrives. Chunks are consecutive layer ranges of the transfer buffer
``[num_layers, planes, n, block_size, heads, head_dim]`` (planes: K and V, or a latent cache's one),
so their concatenation is that buffer.
"""

from __future__ import annotations

LayerRange = tuple[int, int]  # [first, last) layers


def plan_layers(num_layers: int, layer_bytes: int, chunk_bytes: int) -> list[LayerRange]:
    """Consecutive layer ranges of about ``chunk_bytes`` each (at least one layer per chunk)."""
    per_chunk = max(1, min(num_layers, chunk_bytes // max(layer_bytes, 1)))
    return [
        (first, min(first + per_chunk, num_layers)) for first in range(0, num_layers, per_chunk)
    ]


def layer_ranges(
    sizes: tuple[int, ...], layer_bytes: int, num_layers: int
) -> list[LayerRange] | None:
    """The layer ranges that received chunk ``sizes`` cover; None unless each holds whole layers
    and together they hold exactly ``num_layers``."""
    ranges, first = [], 0
    for size in sizes:
        layers, rest = divmod(size, layer_bytes)
        if rest or layers < 1:
            return None
        ranges.append((first, first + layers))
        first += layers
    return ranges if first == num_layers else None
