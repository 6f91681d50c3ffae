"""Conditional disaggregation: where a disaggregated request's prompt is prefilled.

A prompt is prefilled by the decode worker it was admitted to ("local": no prefill worker, no
KV transfer) when

- it is short: at most ``--max-local-prefill-tokens`` tokens (reason ``short``): shipping its
  KV costs more than computing it where it is needed; or
- every prefill worker is busy: each has at least ``--local-prefill-queue`` requests waiting or
  in prefill (reason ``queue``): the decode worker can start it now instead of queueing it; or
- the decode worker is busy: it already has at least ``--local-prefill-decode-load`` other
  requests running or waiting (reason ``decode_load``). For a decode worker that shares its GPU
  with the prefill workers (``tandem up``'s default there): a prompt prefilled by another
  process on the same GPU takes that GPU from the decode worker's steps all the same, and
  without riding along on them as a chunk of its own steps does (its decodes then read the
  weights once for both). Measured on one H200 (docs/benchmarks.md, W4): at 8 req/s of
  4096-token prompts, the prefill worker's share alone cost the pair 16% of colocated's goodput.

Otherwise it goes to a prefill worker ("disagg"). 0 turns a rule off; all are off by default.
The choice is made after the Reserve (which may have waited for blocks), so the queues read are
those of the moment the prefill would start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

SHORT = "short"
QUEUE = "queue"
DECODE_LOAD = "decode_load"
NO_PREFILL = "no_prefill"  # no prefill worker is healthy (gateway.workers.dispatch)


class Queued(Protocol):
    @property
    def queue_depth(self) -> int: ...


class Loaded(Protocol):
    inflight: int  # this gateway's requests on the worker, counted from their Reserve on

    @property
    def reported_depth(self) -> int: ...  # running or waiting there, every gateway's


def other_requests(decode: Loaded) -> int:
    """Requests on ``decode`` besides the one being placed, which this gateway counts in
    ``inflight`` from its Reserve on and the worker does not report before it decodes."""
    return max(decode.inflight - 1, decode.reported_depth)


def local_prefill_reason(
    prompt_len: int,
    prefills: Sequence[Queued],
    max_tokens: int,
    min_queue: int,
    decode: Loaded | None = None,
    min_decode_load: int = 0,
) -> str | None:
    """``SHORT``, ``QUEUE`` or ``DECODE_LOAD`` when the decode worker should prefill the
    prompt; None when a prefill worker should.

    ``prompt_len`` is the whole prompt: the gateway does not know how much of it the decode
    worker has cached (the router's prefix hash steers only prefill workers, and Reserve does
    not say), so the uncached part cannot be tested.
    ``prefills``: the healthy prefill workers the request could go to. A worker's
    ``queue_depth`` is the larger of what this gateway has open on it now (counted from the
    moment a prefill is sent until its KV transfer ends, so a burst is seen at once) and what it
    reported at its last load poll (which includes other gateways' requests).
    ``decode``: the decode worker the request holds a reservation on (:func:`other_requests`).
    """
    if prompt_len <= max_tokens:
        return SHORT
    if min_queue > 0 and prefills and all(p.queue_depth >= min_queue for p in prefills):
        return QUEUE
    if min_decode_load > 0 and decode is not None and other_requests(decode) >= min_decode_load:
        return DECODE_LOAD
    return None
