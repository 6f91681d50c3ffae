"""Both ends of a KV pair prove they hold the deployment's internal token, without sending it.

The sender's Hello carries ``HMAC(token, hello|sender|gen|issued)``; the receiver accepts it only
if it is fresh (``issued`` within :data:`FRESH_S`) and its ``gen`` was not seen before, so a
captured Hello cannot be replayed. The receiver's Welcome carries ``HMAC(token, welcome|gen)``
bound to that fresh ``gen``, and a sender with a token ships KV only to a receiver that proved
it. With no token configured on either end, nothing is checked (a single-host, loopback setup);
a token on one end only refuses the pair.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time

FRESH_S = 60.0  # a Hello older or newer than this (clock skew included) is refused


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def hello_proof(token: str, sender_id: str, gen: str, issued: float) -> str:
    return _mac(token, "hello", sender_id, gen, f"{issued:.6f}") if token else ""


def welcome_proof(token: str, gen: str) -> str:
    return _mac(token, "welcome", gen) if token else ""


def proven(expected: str, given: str) -> bool:
    return hmac.compare_digest(expected.encode(), given.encode())


class HelloChecker:
    """The receiver's side: a Hello's proof, freshness and first use of its ``gen``."""

    def __init__(self, token: str) -> None:
        self.token = token
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}  # gen -> when it expires from memory

    def refusal(self, sender_id: str, gen: str, issued: float, proof: str) -> str:
        """Why this Hello is refused, or "" if it is accepted."""
        if not self.token:
            return ""
        if not proof or not proven(hello_proof(self.token, sender_id, gen, issued), proof):
            return "the sender did not prove the internal token"
        now = time.time()
        if abs(now - issued) > FRESH_S:
            return "the sender's hello is stale (clocks more than 60 s apart, or a replay)"
        with self._lock:
            self._seen = {g: t for g, t in self._seen.items() if t > now}
            if gen in self._seen:
                return "the sender's hello was already used (a replay)"
            self._seen[gen] = now + 2 * FRESH_S
        return ""
