"""Where a transfer's time goes, across both processes: ``TANDEM_KV_TIMELINE=1``.

Wraps the calls a transfer makes on each side (control messages, the copy launch, the waits)
and records when each returned, on CLOCK_MONOTONIC, which every process of one host shares, so
the sender's and the receiver's events land on one time line. :func:`breakdown` splits the
events by transfer (each starts at the sender's ``send``/``submit``) and gives each step's
median offset from that start: what the ~0.3 ms of control path around a 0.14 ms copy is made
of. A diagnosis only: the wrappers add about a microsecond per call.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

Event = tuple[int, str]  # (monotonic ns, label)
_events: list[Event] = []


def _wrap(cls: Any, name: str, label: str, enter: bool = False, what: bool = False) -> None:
    inner = getattr(cls, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if enter:
            _events.append((time.monotonic_ns(), f"{label}>"))
        out = inner(*args, **kwargs)
        tag = label
        if what:  # the message's class: send(msg) has it as an argument, recv returns it
            msg = args[1] if name == "send" else out
            tag = f"{label}:{type(msg).__name__}"
        _events.append((time.monotonic_ns(), tag))
        return out

    setattr(cls, name, wrapper)


def install(role: str) -> None:
    """Record this process's side of every transfer from now on."""
    from kvtransfer.control import ControlConn
    from kvtransfer.expectations import ExpectationRegistry
    from kvtransfer.staging import DeviceIds

    _wrap(ControlConn, "send", "send", what=True)
    _wrap(ControlConn, "recv", "recv", what=True)
    _wrap(DeviceIds, "upload", "ids uploaded", enter=True)
    if role == "receiver":
        from kvtransfer.receiver_pair import ReceiverPair

        _wrap(ExpectationRegistry, "claim", "claimed")
        _wrap(ReceiverPair, "_await_copies", "copies seen", enter=True)
        _wrap(ExpectationRegistry, "complete", "completed")
        return
    from kvtransfer.sender import KvSender
    from kvtransfer.sender_pair import SenderPair

    _wrap(KvSender, "submit", "submit", enter=True)
    _wrap(KvSender, "send", "send()")
    _wrap(SenderPair, "transfer", "pair transfer", enter=True)
    _wrap(SenderPair, "_until", "copies done", enter=True)
    _wrap(SenderPair, "_start_push", "push started", enter=True)
    from kvtransfer.pusher import Pusher
    from kvtransfer.send_queue import PairQueue

    _wrap(Pusher, "push", "push queued", enter=True)
    _wrap(PairQueue, "run_inline", "inline run", enter=True)
    try:
        from kernels.triton_block_copy import BlockCopier
    except ImportError:  # no Triton: the reference copier has no copy launch to time
        return
    _wrap(BlockCopier, "copy_from", "copy launched", enter=True)
    _wrap(BlockCopier, "push_from", "push launched", enter=True)


def take() -> list[Event]:
    """This process's events so far (and forget them)."""
    out = list(_events)
    _events.clear()
    return out


def mark(label: str) -> None:
    """A point of the caller's own (for example: the prefill's last layer computed)."""
    _events.append((time.monotonic_ns(), label))


def breakdown(
    sender: list[Event],
    receiver: list[Event],
    skip: int = 0,
    anchor: str = "submit>",
    window_ms: float = 1e9,
) -> list[dict[str, Any]]:
    """Per step: its median offset (us) from its transfer's ``anchor`` (a sender label), over
    transfers after the first ``skip``; each label's first occurrence within ``window_ms`` after
    an anchor counts."""
    starts = sorted(t for t, label in sender if label == anchor)
    if not starts:
        return []
    per: dict[str, list[float]] = {}
    order: dict[str, float] = {}
    for who, events in (("tx", sender), ("rx", receiver)):
        seen: set[tuple[int, str]] = set()
        for t, label in sorted(events):
            k = max((i for i, s in enumerate(starts) if s <= t), default=-1)
            if k < skip or (k, label) in seen or t - starts[k] > window_ms * 1e6:
                continue
            seen.add((k, label))
            us = (t - starts[k]) / 1e3
            per.setdefault(f"{who} {label}", []).append(us)
    for key, values in per.items():
        order[key] = statistics.median(values)
    return [
        {"step": key, "median_us": round(order[key], 1), "count": len(per[key])}
        for key in sorted(order, key=order.__getitem__)
    ]


def print_breakdown(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\ntimeline of {title} (median us after the start)")
    for r in rows:
        print(f"  {r['median_us']:>9.1f}  {r['step']}  (n={r['count']})")
