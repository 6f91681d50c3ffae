"""The control messages of the KV transfer protocol and the store keys they travel under.

Control (handshake, per-transfer headers, acknowledgements) goes through the receiver's
TCPStore as small JSON documents; only KV bytes go through the process group. Everything
received is parsed defensively (no pickle): a malformed message raises :class:`WireError`.

Keys, all in the receiver's store:
- ``tandem/kv/hello`` (queue): a sender's :class:`Hello`; the receiver answers at
  ``welcome_key(sender, gen)`` with a :class:`Welcome`.
- ``pair_prefix(sender, gen)`` prefixes everything of one pair generation: the process group's
  own rendezvous, the ``hdr`` queue of :class:`Header` (or :class:`Control`) messages and the
  ``ack/<seq>`` keys of :class:`Ack` messages.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer.device import GLOO, NCCL, DeviceInfo
from kvtransfer.layout import KvLayout

PROTOCOL_VERSION = 1
HELLO_QUEUE = "tandem/kv/hello"
HEADER_QUEUE = "hdr"
MAX_MESSAGE_BYTES = 64 * 1024
MAX_TRANSFER_ID_LEN = 512
_NAME = re.compile(r"^[A-Za-z0-9._:@+-]{1,128}$")


class WireError(ValueError):
    """A control message that does not parse or breaks the protocol."""


def check_name(kind: str, value: str) -> str:
    """Sender ids and generations become store key parts: keep them short and plain."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise WireError(f"{kind} must match {_NAME.pattern}, got {value!r}")
    return value


def welcome_key(sender_id: str, gen: str) -> str:
    return f"tandem/kv/welcome/{sender_id}/{gen}"


def pair_prefix(sender_id: str, gen: str) -> str:
    return f"tandem/kv/pair/{sender_id}/{gen}"


def ack_key(seq: int) -> str:
    return f"ack/{seq}"


@dataclass(frozen=True)
class Hello:
    sender_id: str
    gen: str  # fresh per pair build, so a rebuilt pair never reuses a broken one's keys
    device: DeviceInfo
    protocol: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Welcome:
    backend: str  # "" when refused
    device: DeviceInfo | None
    error: str = ""


@dataclass(frozen=True)
class Header:
    """Announces the next data message of a pair: exactly ``nbytes`` bytes follow."""

    seq: int
    transfer_id: str
    num_blocks: int
    layout: KvLayout
    nbytes: int
    checksum: int | None = None  # set in debug mode


@dataclass(frozen=True)
class Control:
    kind: str  # "stop" (the receiver ends a loop) | "bye" (the sender closed the pair)


@dataclass(frozen=True)
class Ack:
    seq: int
    ok: bool
    error: str = ""


def encode(msg: Hello | Welcome | Header | Control | Ack) -> bytes:
    doc: dict[str, Any]
    if isinstance(msg, Hello):
        doc = {"t": "hello", "sender_id": msg.sender_id, "gen": msg.gen,
               "device": msg.device.to_json(), "protocol": msg.protocol}  # fmt: skip
    elif isinstance(msg, Welcome):
        device = msg.device.to_json() if msg.device else None
        doc = {"t": "welcome", "backend": msg.backend, "device": device, "error": msg.error}
    elif isinstance(msg, Header):
        doc = {"t": "header", "seq": msg.seq, "transfer_id": msg.transfer_id,
               "num_blocks": msg.num_blocks, "layout": msg.layout.to_json(),
               "nbytes": msg.nbytes, "checksum": msg.checksum}  # fmt: skip
    elif isinstance(msg, Control):
        doc = {"t": msg.kind}
    else:
        doc = {"t": "ack", "seq": msg.seq, "ok": msg.ok, "error": msg.error}
    return json.dumps(doc).encode()


def decode(raw: bytes) -> Hello | Welcome | Header | Control | Ack:
    """Parse one message; raises WireError for anything malformed."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise WireError(f"control message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise WireError("control message must be a JSON object")
        return _PARSERS[str(doc.get("t"))](doc)
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise WireError(f"malformed control message: {e}") from e


def _int(doc: dict[str, Any], key: str, low: int = 0) -> int:
    value = doc[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise WireError(f"{key} must be an integer >= {low}, got {value!r}")
    return value


def _str(doc: dict[str, Any], key: str, limit: int) -> str:
    value = doc[key]
    if not isinstance(value, str) or len(value) > limit:
        raise WireError(f"{key} must be a string of at most {limit} characters")
    return value


def _hello(doc: dict[str, Any]) -> Hello:
    sender_id = check_name("sender_id", doc["sender_id"])
    gen = check_name("gen", doc["gen"])
    return Hello(sender_id, gen, DeviceInfo.from_json(doc["device"]), _int(doc, "protocol"))


def _welcome(doc: dict[str, Any]) -> Welcome:
    backend = doc["backend"]
    if backend not in (GLOO, NCCL, ""):
        raise WireError(f"unknown backend {backend!r}")
    device = DeviceInfo.from_json(doc["device"]) if doc["device"] is not None else None
    return Welcome(backend, device, _str(doc, "error", 4096))


def _header(doc: dict[str, Any]) -> Header:
    checksum = doc["checksum"]
    if checksum is not None and (not isinstance(checksum, int) or isinstance(checksum, bool)):
        raise WireError("checksum must be an integer or null")
    tid = _str(doc, "transfer_id", MAX_TRANSFER_ID_LEN)
    return Header(_int(doc, "seq", 1), tid, _int(doc, "num_blocks", 1),
                  KvLayout.from_json(doc["layout"]), _int(doc, "nbytes", 1), checksum)  # fmt: skip


def _ack(doc: dict[str, Any]) -> Ack:
    if not isinstance(doc["ok"], bool):
        raise WireError("ok must be a boolean")
    return Ack(_int(doc, "seq", 1), doc["ok"], _str(doc, "error", 4096))


_PARSERS: dict[str, Callable[[dict[str, Any]], Hello | Welcome | Header | Control | Ack]] = {
    "hello": _hello,
    "welcome": _welcome,
    "header": _header,
    "ack": _ack,
    "stop": lambda _doc: Control("stop"),
    "bye": lambda _doc: Control("bye"),
}

_CHECKSUM_CHUNK = 1 << 22  # int32 words per step: bounds the temporary int64 tensor


def checksum(data: torch.Tensor) -> int:
    """Cheap position-sensitive checksum of a 1-D uint8 tensor (debug mode), in [0, 2**61).

    Sums int32 words times a repeating weight; int64 wrap-around is identical on both ends
    because integer addition is associative.
    """
    words = data[: data.numel() // 4 * 4].view(torch.int32)
    tail = data[words.numel() * 4 :].to(torch.int64)
    total = int(
        (tail * torch.arange(1_000_003, 1_000_003 + tail.numel(), device=data.device)).sum()
    )
    weights = torch.arange(min(words.numel(), _CHECKSUM_CHUNK), device=data.device) % 65521 + 1
    for i, start in enumerate(range(0, words.numel(), _CHECKSUM_CHUNK)):
        chunk = words[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        total += int((chunk * weights[: chunk.numel()]).sum()) * (i + 1)
    return total % ((1 << 61) - 1)
