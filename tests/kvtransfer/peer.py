"""A KV transfer peer in its own process, driven by JSON lines on stdin (test helper).

``python -m tests.kvtransfer.peer sender`` answers ``{"ready": true}`` and then takes
  {"op": "sender", "id": ..., "seed": ..., "layout": {...}, "num_blocks": ...}  (add a sender)
  {"op": "send", "id": ..., "endpoint": ..., "transfer_id": ..., "blocks": [...],
   "timeout": s, "pause_after_header": s}   (prints {"event": "header_sent"} before pausing)
``python -m tests.kvtransfer.peer receiver`` answers ``{"endpoint": ...}`` and then takes
  {"op": "expect", "transfer_id": ..., "blocks": [...], "deadline": s}
Every command gets one JSON line back; {"op": "exit"} (or EOF) ends the process.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from kvtransfer import KvReceiver, KvSender, ReceiverOptions, SenderOptions
from kvtransfer.grants import Grant

LAYOUT = {"num_layers": 3, "block_size": 4, "num_kv_heads": 2, "head_dim": 8}


def make_caches(
    seed: int, num_blocks: int, layout: dict[str, int] | None = None, zero: bool = False
) -> list[torch.Tensor]:
    """Deterministic per-layer caches [2, num_blocks, block_size, heads, head_dim] (float32)."""
    lay = {**LAYOUT, **(layout or {})}
    gen = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, lay["block_size"], lay["num_kv_heads"], lay["head_dim"])
    if zero:
        return [torch.zeros(shape) for _ in range(lay["num_layers"])]
    return [torch.randn(shape, generator=gen) for _ in range(lay["num_layers"])]


def _emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def _send(senders: dict[str, KvSender], cmd: dict[str, Any]) -> dict[str, Any]:
    sender = senders[cmd["id"]]
    pause = float(cmd.get("pause_after_header", 0))

    def after_header() -> None:
        _emit({"event": "header_sent"})
        time.sleep(pause)

    sender._after_header = after_header if pause else None
    grant = Grant.from_json(cmd["grant"]) if cmd.get("grant") else None
    try:
        stats = sender.send(cmd["endpoint"], cmd["transfer_id"], cmd["blocks"], cmd.get("timeout"),
                            grant=grant)  # fmt: skip
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "bytes": stats.bytes}


def run_sender() -> None:
    senders: dict[str, KvSender] = {}
    _emit({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "sender":
            caches = make_caches(cmd["seed"], cmd["num_blocks"], cmd.get("layout"))
            caches = [c.to(cmd.get("device", "cpu")) for c in caches]
            # one layer per chunk: the pipelined path is what these tests exercise
            options = SenderOptions(checksum=cmd.get("checksum", False), chunk_bytes=1)
            senders[cmd["id"]] = KvSender(caches, cmd["id"], options)
            _emit({"ok": True})
        elif cmd["op"] == "send":
            _emit(_send(senders, cmd))
        else:
            break
    for sender in senders.values():
        sender.close()


def run_receiver() -> None:
    receiver = KvReceiver(make_caches(0, 16, zero=True), ReceiverOptions(io_timeout_s=5))
    _emit({"endpoint": receiver.endpoint})
    handles = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] != "expect":
            break
        handles[cmd["transfer_id"]] = receiver.expect(
            cmd["transfer_id"], cmd["blocks"], cmd["deadline"]
        )
        _emit({"ok": True})
    receiver.close()


if __name__ == "__main__":
    run_sender() if sys.argv[1] == "sender" else run_receiver()
