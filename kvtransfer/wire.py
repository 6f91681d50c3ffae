"""The control messages of the KV transfer protocol.

Control travels as small JSON documents over the pair's control connection
(:mod:`kvtransfer.control`); only KV bytes go through the process group. Everything received
is parsed defensively (no pickle): a malformed message raises :class:`WireError`.

Conversation of one pair: sender -> :class:`Hello`; receiver -> :class:`Welcome` (backend and
the port of the store both ends build their group over, under ``pair_prefix(sender, gen)``);
then per transfer: sender -> :class:`Header`, KV bytes through the group, receiver ->
:class:`Ack`. :class:`Control` ("bye") ends the pair.
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

PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 64 * 1024
MAX_TRANSFER_ID_LEN = 512
MAX_CHUNKS = 1024
_NAME = re.compile(r"^[A-Za-z0-9._:@+-]{1,128}$")


class WireError(ValueError):
    """A control message that does not parse or breaks the protocol."""


def check_name(kind: str, value: str) -> str:
    """Sender ids and generations become store key parts: keep them short and plain."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise WireError(f"{kind} must match {_NAME.pattern}, got {value!r}")
    return value


def pair_prefix(sender_id: str, gen: str) -> str:
    return f"tandem/kv/pair/{sender_id}/{gen}"


@dataclass(frozen=True)
class Hello:
    sender_id: str
    gen: str  # fresh per pair build, so a rebuilt pair never reuses a broken one's keys
    device: DeviceInfo
    protocol: int = PROTOCOL_VERSION
    issued: float = 0.0  # wall-clock time the proof was made (kvtransfer.auth)
    proof: str = ""  # HMAC over the hello with the internal token; "" without one


@dataclass(frozen=True)
class Welcome:
    backend: str  # "" when refused
    device: DeviceInfo | None
    store_port: int = 0  # the receiver's rendezvous store, for building the group
    error: str = ""
    proof: str = ""  # HMAC over the sender's gen with the internal token; "" without one


@dataclass(frozen=True)
class Header:
    """Announces the next data of a pair: ``nbytes`` bytes follow, as one message per entry
    of ``chunks`` (their sizes, in order; each chunk holds whole layers)."""

    seq: int
    transfer_id: str
    num_blocks: int
    layout: KvLayout
    nbytes: int
    chunks: tuple[int, ...]
    checksum: int | None = None  # set in debug mode


@dataclass(frozen=True)
class Control:
    kind: str  # "bye": the sender closes the pair


@dataclass(frozen=True)
class Ack:
    seq: int
    ok: bool
    error: str = ""
    broken: bool = False  # the receiver tore its side of the pair down: rebuild it


Message = Hello | Welcome | Header | Control | Ack


def encode(msg: Message) -> bytes:
    doc: dict[str, Any]
    if isinstance(msg, Hello):
        doc = {
            "t": "hello",
            "sender_id": msg.sender_id,
            "gen": msg.gen,
            "device": msg.device.to_json(),
            "protocol": msg.protocol,
            "issued": msg.issued,
            "proof": msg.proof,
        }
    elif isinstance(msg, Welcome):
        device = msg.device.to_json() if msg.device else None
        doc = {
            "t": "welcome",
            "backend": msg.backend,
            "device": device,
            "store_port": msg.store_port,
            "error": msg.error,
            "proof": msg.proof,
        }
    elif isinstance(msg, Header):
        doc = {
            "t": "header",
            "seq": msg.seq,
            "transfer_id": msg.transfer_id,
            "num_blocks": msg.num_blocks,
            "layout": msg.layout.to_json(),
            "nbytes": msg.nbytes,
            "chunks": list(msg.chunks),
            "checksum": msg.checksum,
        }
    elif isinstance(msg, Control):
        doc = {"t": msg.kind}
    else:
        doc = {"t": "ack", "seq": msg.seq, "ok": msg.ok, "error": msg.error, "broken": msg.broken}
    return json.dumps(doc).encode()


def decode(raw: bytes) -> Message:
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
    issued = doc.get("issued", 0.0)
    if isinstance(issued, bool) or not isinstance(issued, int | float):
        raise WireError("issued must be a number")
    proof = _str(doc, "proof", 128) if "proof" in doc else ""
    device = DeviceInfo.from_json(doc["device"])
    return Hello(sender_id, gen, device, _int(doc, "protocol"), float(issued), proof)


def _welcome(doc: dict[str, Any]) -> Welcome:
    backend = doc["backend"]
    if backend not in (GLOO, NCCL, ""):
        raise WireError(f"unknown backend {backend!r}")
    device = DeviceInfo.from_json(doc["device"]) if doc["device"] is not None else None
    proof = _str(doc, "proof", 128) if "proof" in doc else ""
    return Welcome(backend, device, _int(doc, "store_port"), _str(doc, "error", 4096), proof)


def _header(doc: dict[str, Any]) -> Header:
    checksum = doc["checksum"]
    if checksum is not None and (not isinstance(checksum, int) or isinstance(checksum, bool)):
        raise WireError("checksum must be an integer or null")
    tid = _str(doc, "transfer_id", MAX_TRANSFER_ID_LEN)
    nbytes = _int(doc, "nbytes", 1)
    chunks = doc["chunks"]
    if not isinstance(chunks, list) or not 0 < len(chunks) <= MAX_CHUNKS:
        raise WireError(f"chunks must be a list of 1 to {MAX_CHUNKS} sizes")
    sizes = tuple(_int({"chunk": c}, "chunk", 1) for c in chunks)
    if sum(sizes) != nbytes:
        raise WireError(f"chunk sizes add up to {sum(sizes)}, not nbytes {nbytes}")
    layout = KvLayout.from_json(doc["layout"])
    return Header(
        _int(doc, "seq", 1), tid, _int(doc, "num_blocks", 1), layout, nbytes, sizes, checksum
    )


def _ack(doc: dict[str, Any]) -> Ack:
    if not isinstance(doc["ok"], bool) or not isinstance(doc["broken"], bool):
        raise WireError("ok and broken must be booleans")
    return Ack(_int(doc, "seq", 1), doc["ok"], _str(doc, "error", 4096), doc["broken"])


_PARSERS: dict[str, Callable[[dict[str, Any]], Message]] = {
    "hello": _hello,
    "welcome": _welcome,
    "header": _header,
    "ack": _ack,
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
