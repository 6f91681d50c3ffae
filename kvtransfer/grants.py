"""Blocks granted ahead of a transfer on one GPU, fenced so that the grant can be taken back.

On the ``cuda_ipc`` path the sender normally asks for the receiver's blocks (header -> ``Go``)
before it copies: a round trip of two Python hops each way. A :class:`Grant` gives the sender
those blocks with the reservation instead (``KvReceiver.expect(..., grant=True)``; the caller
passes it to ``KvSender.submit(..., grant=...)`` the way the reservation itself travels), so the
sender copies at once and then tells the receiver (``Pushed``).

The danger of blocks handed out ahead is a copy that lands after the receiver took them back
(a cancel, a deadline) and gave them to another request. The fence prevents it on the GPU,
where the copy runs, not on the host, where it is queued: each grant owns a slot of a small
int64 table in the receiver's GPU memory, shared with the senders like the pool, whose first
word per slot is the state (the second is unused). The state is the grant's ``token`` while
granted; the copy kernel claims it (``token + 1``) with one compare-and-swap before writing
anything, and a one-program kernel after it, in stream order, marks it landed (``token + 2``;
``kernels.triton_block_copy``). The receiver takes a grant back with
the same compare-and-swap, ``token -> token + 3``: if it wins, no copy of that grant will ever
write (a queued one finds ``token + 3`` and exits); if it loses, a copy has claimed the blocks
and the receiver waits until it has landed before it frees them. Tokens never repeat, so a copy
that runs late into a slot granted again to someone else writes nothing either.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from kernels import ops
from kvtransfer.device import on_stream

log = logging.getLogger(__name__)

GRANTED, CLAIMED, LANDED, REVOKED = 0, 1, 2, 3  # state - token
_STEP = 4  # tokens are multiples of it: state - token tells the phase
_POLL_S, _POLL_FINE_S, _POLL_MAX_S = 20e-6, 5e-3, 1e-3  # waiting for a claimed copy to land
MAX_GRANT_BLOCKS = 1 << 20


@dataclass(frozen=True)
class Grant:
    """The receiver's blocks for one transfer, and the fence slot that guards them.

    ``pool`` names the receiver's shared pool (a sender that opened another one ignores the
    grant and asks as usual). Plain data: :meth:`to_json` / :meth:`from_json` carry it through
    whatever control plane carries the reservation."""

    pool: str
    slot: int
    token: int
    blocks: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"pool": self.pool, "slot": self.slot, "token": self.token,
                "blocks": list(self.blocks)}  # fmt: skip

    @classmethod
    def from_json(cls, doc: Any) -> Grant:
        """Raises ValueError for anything that is not a grant."""
        if not isinstance(doc, dict) or set(doc) != {"pool", "slot", "token", "blocks"}:
            raise ValueError("a grant must be an object of pool, slot, token and blocks")
        pool, slot, token, blocks = doc["pool"], doc["slot"], doc["token"], doc["blocks"]
        if not isinstance(pool, str) or not 0 < len(pool) <= 64:
            raise ValueError("a grant's pool must be a short string")
        if not _count(slot) or not _count(token) or token % _STEP:
            raise ValueError("a grant's slot and token must be integers >= 0 (token a multiple of 4)")  # fmt: skip
        if not isinstance(blocks, list) or not 0 < len(blocks) <= MAX_GRANT_BLOCKS:
            raise ValueError("a grant's blocks must be a non-empty list")
        if not all(_count(b) for b in blocks):
            raise ValueError("a grant's blocks must be integers >= 0")
        return cls(pool, int(slot), int(token), tuple(blocks))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


class GrantTable:
    """The receiver's fence slots (see the module doc). Thread-safe."""

    def __init__(self, device: torch.device, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.pool = uuid.uuid4().hex
        self.fence = torch.zeros((slots, 2), dtype=torch.int64, device=device)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Lock()
        self._free = list(range(slots - 1, -1, -1))
        self._next = 1  # token / _STEP of the next grant: 0 is never a token

    def grant(self, blocks: list[int]) -> Grant | None:
        """A fresh grant of ``blocks`` (None when every slot is taken: ask as usual)."""
        if not blocks:
            return None
        with self._lock:
            if not self._free:
                return None
            slot, token = self._free.pop(), self._next * _STEP
            self._next += 1
        # the slot must hold the token before any copy may look at it: write and wait
        with on_stream(self._stream):
            self.fence[slot].copy_(torch.tensor([token, 0], dtype=torch.int64))
        if self._stream is not None:
            self._stream.synchronize()
        return Grant(self.pool, slot, token, tuple(blocks))

    def revoke(self, grant: Grant) -> int:
        """Take the grant back unless a copy claimed it; returns its phase before: GRANTED (no
        copy will ever write), CLAIMED (a copy is writing), LANDED or REVOKED (done either way)."""
        with on_stream(self._stream):
            old = ops.fence_cas(self.fence[grant.slot], grant.token, grant.token + REVOKED)
        return self._phase(grant, old)

    def phase(self, grant: Grant) -> int:
        with on_stream(self._stream):  # read on our stream: never behind the engine's work
            return self._phase(grant, int(self.fence[grant.slot, 0]))

    def settle(self, grant: Grant, timeout_s: float) -> None:
        """Once this returns, no copy of ``grant`` writes any more: revoke it, or wait until
        the copy that claimed it has landed (a sender that died with its copy queued never
        lands it: after ``timeout_s`` it is given up on, and said so)."""
        if self.revoke(grant) != CLAIMED:
            return
        deadline, pause, start = time.monotonic() + timeout_s, _POLL_S, time.monotonic()
        while self.phase(grant) == CLAIMED:
            now = time.monotonic()
            if now >= deadline:
                log.warning("a copy into granted KV blocks (slot %d) did not land within %.1f s",
                            grant.slot, timeout_s)  # fmt: skip
                return
            time.sleep(pause)
            if now - start > _POLL_FINE_S:
                pause = min(pause * 2, _POLL_MAX_S)

    def release(self, grant: Grant) -> None:
        """The slot is free again: its state is no longer ``grant``'s token (call after
        :meth:`settle` or a landed copy), so no late copy of this grant can claim it."""
        with self._lock:
            self._free.append(grant.slot)

    def _phase(self, grant: Grant, state: int) -> int:
        phase = state - grant.token
        if not GRANTED <= phase <= REVOKED:
            raise RuntimeError(f"fence slot {grant.slot} holds {state}, not grant {grant.token}'s")
        return phase
