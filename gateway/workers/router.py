"""Which worker gets a request.

Prefill (and colocated) workers: weighted rendezvous hashing on a hash of the prompt's leading
blocks, so prompts sharing a prefix land where that prefix is cached, while a worker's weight
falls with its queue depth, so a hot prefix cannot pile everything onto one busy worker.
Decode workers: admission needs free KV blocks; among those, the most free blocks per queued
request.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Sequence
from typing import Protocol, TypeVar

from protos.multimodal import ImageItem


class Candidate(Protocol):
    @property
    def address(self) -> str: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def prefix_key(
    prompt_ids: Sequence[int], block_size: int, max_blocks: int,
    images: Sequence[ImageItem] = (), lora: str = "", cache_salt: str = "",
) -> bytes:  # fmt: skip
    """A hash of the first ``max_blocks`` full blocks (the whole prompt if shorter than one), of
    the content of the images whose placeholders start in them, of the LoRA adapter and of the
    request's cache salt: what the workers' prefix cache keys those blocks by (an image's
    placeholder ids are the same for every image; an adapter's KV is its own; a salt's blocks
    are found only with that salt), so two prompts share a key only where they could share
    cached blocks."""
    full = min(len(prompt_ids) // block_size, max_blocks) * block_size
    head = prompt_ids[: full or len(prompt_ids)]
    h = hashlib.blake2b(array("q", head).tobytes(), digest_size=16)
    for image in images:
        if image.offset < len(head):
            h.update(image.content_hash)
    if lora:
        h.update(b"\0lora:" + lora.encode())
    if cache_salt:
        h.update(b"\0salt:" + cache_salt.encode())
    return h.digest()


def _unit(key: bytes, address: str) -> float:
    """A uniform number in (0, 1) for this (prefix, worker) pair."""
    digest = hashlib.blake2b(key + address.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 1) / (2**64 + 2)


def rank_by_affinity(candidates: Sequence[C], key: bytes) -> list[C]:
    """Best first: weighted rendezvous score ``-w / ln(u)`` with ``w = 1 / (1 + queue_depth)``."""

    def score(c: C) -> float:
        weight = 1.0 / (1.0 + c.queue_depth)
        return -weight / math.log(_unit(key, c.address))

    return sorted(candidates, key=score, reverse=True)


def rank_decode(candidates: Sequence[C], needed_blocks: int) -> list[C]:
    """Best first: workers with room for ``needed_blocks``, most free blocks per queued request."""

    def key(c: C) -> tuple[bool, float]:
        return (c.free_blocks >= needed_blocks, c.free_blocks / (1.0 + c.queue_depth))

    return sorted(candidates, key=key, reverse=True)


def least_queued(candidates: Sequence[C]) -> C:
    """Where to wait when no worker has room: the shortest queue, then the most free blocks."""
    return min(candidates, key=lambda c: (c.queue_depth, -c.free_blocks))
