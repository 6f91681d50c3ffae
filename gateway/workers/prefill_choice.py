"""Conditional disaggregation: where a disaggregated request's prompt is prefilled.

A prompt is prefilled by the decode worker it was admitted to ("local": no prefill worker, no
KV transfer) when

- it is short: at most ``--max-local-prefill-tokens`` tokens (reason ``short``): shipping its
  KV costs more than computing it where it is needed; or
- every prefill worker is busy: each has at least ``--local-prefill-queue`` requests waiting or
  in prefill (reason ``queue``): the decode worker can start it now instead of queueing it.

Otherwise it goes to a prefill worker ("disagg"). 0 turns a rule off; both are off by default.
The choice is made after the Reserve (which may have waited for blocks), so the queues read are
those of the moment the prefill would start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

SHORT = "short"
QUEUE = "queue"


class Queued(Protocol):
    @property
    def queue_depth(self) -> int: ...


def local_prefill_reason(
    prompt_len: int, prefills: Sequence[Queued], max_tokens: int, min_queue: int
) -> str | None:
    """``SHORT`` or ``QUEUE`` when the decode worker should prefill the prompt; None when a
    prefill worker should.

    ``prompt_len`` is the whole prompt: the gateway does not know how much of it the decode
    worker has cached (the router's prefix hash steers only prefill workers, and Reserve does
    not say), so the uncached part cannot be tested.
    ``prefills``: the healthy prefill workers the request could go to. A worker's
    ``queue_depth`` is the larger of what this gateway has open on it now (counted from the
    moment a prefill is sent until its KV transfer ends, so a burst is seen at once) and what it
    reported at its last load poll (which includes other gateways' requests).
    """
    if prompt_len <= max_tokens:
        return SHORT
    if min_queue > 0 and prefills and all(p.queue_depth >= min_queue for p in prefills):
        return QUEUE
    return None
