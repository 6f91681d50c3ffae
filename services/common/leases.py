"""Leases: state a worker holds for an owner (a gateway) lives only while that owner is alive.

An owner proves it is alive by polling the worker (GetLoad carries its instance id, about once a
second). What it holds that nothing else would free, the decode worker's unclaimed reservations,
is freed once the owner has been silent for ``timeout_s``: a gateway killed with -9 leaks no KV
for longer than that, while its streams' cancellation frees everything already running.
"""

from __future__ import annotations

import time


class Leases:
    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"--lease-timeout must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._seen: dict[str, float] = {}  # owner -> last sign of life (monotonic)

    def renew(self, owner: str) -> None:
        if owner:
            self._seen[owner] = time.monotonic()

    def lapsed(self, owner: str) -> bool:
        """True for an owner silent longer than the timeout (never for "": no lease)."""
        if not owner:
            return False
        return time.monotonic() - self._seen.get(owner, 0.0) > self.timeout_s

    def forget_lapsed(self) -> None:
        """Drop owners long gone (bounded memory across gateway restarts)."""
        cutoff = time.monotonic() - 10 * self.timeout_s
        self._seen = {o: t for o, t in self._seen.items() if t > cutoff}
