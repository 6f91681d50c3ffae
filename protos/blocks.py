"""KV block arithmetic every side agrees on: the gateway sizes a reservation with it, the decode
worker checks it, the scheduler allocates by it."""

from __future__ import annotations


def blocks_for(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold ``num_tokens`` tokens (a partial last block counts)."""
    return -(-num_tokens // block_size)
