"""The control messages of the KV transfer protocol.

Control travels as small JSON documents over the pair's control connection
(:mod:`kvtransfer.control`); only KV bytes go through the process group. Everything received
is parsed defensively (no pickle): a malformed message raises :class:`WireError`.

Conversation of one pair: sender -> :class:`Hello`; receiver -> :class:`Welcome` (backend and
the port of the store both ends build their group over, under ``pair_prefix(sender, gen)``);
then per transfer: sender -> :class:`Header`, KV bytes through the group, (with checksums) sender
-> :class:`Trailer`, receiver -> :class:`Ack`. :class:`Control` ("bye") ends the pair.

On one GPU (backend ``cuda_ipc``) no group is built: after the welcome the receiver ->
:class:`Share` (its pool, :mod:`kvtransfer.shared_pool`), sender -> :class:`Opened` (``cuda_ipc``,
or ``gloo`` when it could not open the pool: the pair then builds a Gloo group as above). Per
transfer: sender -> :class:`Header`; receiver -> :class:`Go` (the blocks it registered) or a
refusing :class:`Ack`; the sender copies its blocks into those, layer by layer as they are
written, on its own GPU stream; sender -> :class:`Done` (with checksums); receiver -> :class:`Ack`.
A receiver that cancels meanwhile -> :class:`Stop`: the sender stops copying and -> a stopped
:class:`Done`, after which the receiver's blocks are never written again. A transfer whose blocks
the receiver granted ahead (:mod:`kvtransfer.grants`: the caller passed the grant to the sender)
skips the header and the Go: the sender copies at once, fenced, then -> :class:`Pushed`;
receiver -> :class:`Ack`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kernels import ops
from kvtransfer.device import GLOO, IPC, NCCL, DeviceInfo
from kvtransfer.layout import KvLayout

# 3: per-chunk checksums in a Trailer after the data; 4: CUDA IPC; 5: a Done sent before the
# copies end, the receiver waiting for them on the sender's shared event; 6: blocks granted
# ahead (a fence shared with the pool, Pushed)
PROTOCOL_VERSION = 6
MAX_MESSAGE_BYTES = 1 << 20  # a header of a shared-GPU transfer names every source block
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
    trailer: bool = False  # a Trailer with a checksum of each chunk follows the data


@dataclass(frozen=True)
class Share:
    """The receiver's KV pool, one descriptor per layer (:func:`kvtransfer.shared_pool.export_pool`)."""

    pool: tuple[dict[str, Any], ...]
    # its grant fence (kvtransfer.grants, :func:`kvtransfer.shared_pool.export_fence`) and the
    # name its grants carry; None / "" when it grants nothing
    fence: dict[str, Any] | None = None
    grants: str = ""


@dataclass(frozen=True)
class Opened:
    """The sender's answer to a :class:`Share`: the backend the pair uses from now on."""

    backend: str  # cuda_ipc, or gloo when the pool could not be opened (``error`` says why)
    error: str = ""
    # cuda_ipc: the IPC handle (hex) of the event the sender records after each transfer's
    # copies, so that the receiver can tell when they are done without another message
    event: str = ""


@dataclass(frozen=True)
class Go:
    """cuda_ipc: the receiver's blocks transfer ``seq`` is to be copied into, in order."""

    seq: int
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class Done:
    """cuda_ipc: the sender's copies of transfer ``seq`` are finished (``stopped``: it stopped on a
    :class:`Stop`, and writes nothing more); with checksums, those of what it copied from.
    ``pending``: they are queued, not finished; they are once the pair's shared event (see
    :class:`Opened`) has completed, which the receiver waits for before it uses the blocks."""

    seq: int
    stopped: bool = False
    checksums: tuple[int, ...] = ()
    pending: bool = False


@dataclass(frozen=True)
class Pushed:
    """cuda_ipc, blocks granted ahead (:mod:`kvtransfer.grants`): transfer ``seq`` was copied
    into the blocks of grant (``slot``, ``token``) without a header or a :class:`Go`; the copy
    is queued, done once the pair's shared event has completed (as a pending :class:`Done`).
    With checksums, that of the blocks it copied from."""

    seq: int
    transfer_id: str
    num_blocks: int
    layout: KvLayout
    slot: int
    token: int
    checksums: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.layout.block_bytes * self.num_blocks


@dataclass(frozen=True)
class Stop:
    """cuda_ipc: the receiver cancelled transfer ``seq``: copy nothing more into its blocks."""

    seq: int


@dataclass(frozen=True)
class Trailer:
    """The checksum of each chunk as the sender gathered it (:func:`checksum`), sent after the
    data, so computing it never holds the data back."""

    seq: int
    checksums: tuple[int, ...]


@dataclass(frozen=True)
class Control:
    kind: str  # "bye": the sender closes the pair


@dataclass(frozen=True)
class Ack:
    seq: int
    ok: bool
    error: str = ""
    broken: bool = False  # the receiver tore its side of the pair down: rebuild it


Message = (
    Hello | Welcome | Header | Trailer | Control | Ack | Share | Opened | Go | Done | Stop | Pushed
)


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
            "trailer": msg.trailer,
        }
    elif isinstance(msg, Share):
        doc = {"t": "share", "pool": list(msg.pool), "fence": msg.fence, "grants": msg.grants}
    elif isinstance(msg, Opened):
        doc = {"t": "opened", "backend": msg.backend, "error": msg.error, "event": msg.event}
    elif isinstance(msg, Go):
        doc = {"t": "go", "seq": msg.seq, "runs": to_runs(msg.blocks)}
    elif isinstance(msg, Done):
        doc = {
            "t": "done",
            "seq": msg.seq,
            "stopped": msg.stopped,
            "checksums": list(msg.checksums),
            "pending": msg.pending,
        }
    elif isinstance(msg, Stop):
        doc = {"t": "stop", "seq": msg.seq}
    elif isinstance(msg, Pushed):
        doc = {
            "t": "pushed",
            "seq": msg.seq,
            "transfer_id": msg.transfer_id,
            "num_blocks": msg.num_blocks,
            "layout": msg.layout.to_json(),
            "slot": msg.slot,
            "token": msg.token,
            "checksums": list(msg.checksums),
        }
    elif isinstance(msg, Trailer):
        doc = {"t": "trailer", "seq": msg.seq, "checksums": list(msg.checksums)}
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
    if backend not in (GLOO, NCCL, IPC, ""):
        raise WireError(f"unknown backend {backend!r}")
    device = DeviceInfo.from_json(doc["device"]) if doc["device"] is not None else None
    proof = _str(doc, "proof", 128) if "proof" in doc else ""
    return Welcome(backend, device, _int(doc, "store_port"), _str(doc, "error", 4096), proof)


def _header(doc: dict[str, Any]) -> Header:
    trailer = doc["trailer"]
    if not isinstance(trailer, bool):
        raise WireError("trailer must be a boolean")
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
        _int(doc, "seq", 1), tid, _int(doc, "num_blocks", 1), layout, nbytes, sizes, trailer
    )


def to_runs(ids: tuple[int, ...]) -> list[list[int]]:
    """Block ids as ``[first, count]`` runs of consecutive ids (a pool hands out long runs)."""
    runs: list[list[int]] = []
    for b in ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return runs


MAX_BLOCKS = 1 << 20  # blocks one Go may name


def from_runs(runs: Any) -> tuple[int, ...]:
    """Inverse of :func:`to_runs`; raises WireError."""
    if not isinstance(runs, list) or not runs:
        raise WireError("runs must be a non-empty list")
    ids: list[int] = []
    for run in runs:
        if type(run) is not list or len(run) != 2:
            raise WireError("each run must be [first, count]")
        first, count = run
        if type(first) is not int or type(count) is not int or first < 0 or count < 1:
            raise WireError(f"a run must be two integers [first >= 0, count >= 1], got {run!r}")
        ids.extend(range(first, first + count))
        if len(ids) > MAX_BLOCKS:
            raise WireError(f"runs name more than {MAX_BLOCKS} blocks")
    return tuple(ids)


def _share(doc: dict[str, Any]) -> Share:
    pool = doc["pool"]
    if not isinstance(pool, list) or not pool or not all(isinstance(d, dict) for d in pool):
        raise WireError("pool must be a non-empty list of objects")
    fence, grants = doc.get("fence"), _str(doc, "grants", 64) if "grants" in doc else ""
    if fence is not None and (not isinstance(fence, dict) or not grants):
        raise WireError("fence must be an object, with the name of the grants it guards")
    # checked against the layout by kvtransfer.shared_pool.check_pool (the fence by open_fence)
    return Share(tuple(pool), fence, grants if fence is not None else "")


def _opened(doc: dict[str, Any]) -> Opened:
    if doc["backend"] not in (GLOO, IPC):
        raise WireError(f"unknown backend {doc['backend']!r} after a share")
    event = _str(doc, "event", 256)
    if event and (doc["backend"] != IPC or any(c not in "0123456789abcdef" for c in event)):
        raise WireError("event must be the hex IPC handle of a cuda_ipc pair's event")
    return Opened(doc["backend"], _str(doc, "error", 4096), event)


def _go(doc: dict[str, Any]) -> Go:
    return Go(_int(doc, "seq", 1), from_runs(doc["runs"]))


def _done(doc: dict[str, Any]) -> Done:
    sums = doc["checksums"]
    stopped, pending = doc["stopped"], doc["pending"]
    if not isinstance(stopped, bool) or not isinstance(pending, bool):
        raise WireError("stopped and pending must be booleans")
    if not isinstance(sums, list) or len(sums) > 1:
        raise WireError("checksums must be a list of at most one")
    checksums = tuple(_int({"checksum": c}, "checksum") for c in sums)
    return Done(_int(doc, "seq", 1), stopped, checksums, pending)


def _pushed(doc: dict[str, Any]) -> Pushed:
    sums = doc["checksums"]
    if not isinstance(sums, list) or len(sums) > 1:
        raise WireError("checksums must be a list of at most one")
    return Pushed(
        _int(doc, "seq", 1),
        _str(doc, "transfer_id", MAX_TRANSFER_ID_LEN),
        _int(doc, "num_blocks", 1),
        KvLayout.from_json(doc["layout"]),
        _int(doc, "slot"),
        _int(doc, "token"),
        tuple(_int({"checksum": c}, "checksum") for c in sums),
    )


def _trailer(doc: dict[str, Any]) -> Trailer:
    sums = doc["checksums"]
    if not isinstance(sums, list) or not 0 < len(sums) <= MAX_CHUNKS:
        raise WireError(f"checksums must be a list of 1 to {MAX_CHUNKS} integers")
    return Trailer(_int(doc, "seq", 1), tuple(_int({"checksum": c}, "checksum") for c in sums))


def _ack(doc: dict[str, Any]) -> Ack:
    if not isinstance(doc["ok"], bool) or not isinstance(doc["broken"], bool):
        raise WireError("ok and broken must be booleans")
    return Ack(_int(doc, "seq", 1), doc["ok"], _str(doc, "error", 4096), doc["broken"])


_PARSERS: dict[str, Callable[[dict[str, Any]], Message]] = {
    "hello": _hello,
    "welcome": _welcome,
    "header": _header,
    "trailer": _trailer,
    "ack": _ack,
    "share": _share,
    "opened": _opened,
    "go": _go,
    "done": _done,
    "stop": lambda doc: Stop(_int(doc, "seq", 1)),
    "pushed": _pushed,
    "bye": lambda _doc: Control("bye"),
}

CHECKSUM_MOD = (1 << 61) - 1


def checksum_tensor(data: torch.Tensor) -> torch.Tensor:
    """A position-sensitive checksum of a 1-D uint8 tensor, as an int64 tensor on its device
    (computed on the current stream; nothing waits for it): the sum of its int32 words times a
    repeating weight, each 4M-word piece once more times its index (:mod:`kernels.checksum`;
    one Triton pass over the bytes on a GPU). int64 wrap-around is the same on both ends
    (integer addition is associative), so sender and receiver agree on any device.
    :func:`checksum` makes it a number."""
    return ops.checksum(data)


def checksum_value(total: torch.Tensor) -> int:
    """A :func:`checksum_tensor` as the number both ends compare, in [0, 2**61 - 1) (waits for
    the device)."""
    return int(total) % CHECKSUM_MOD


def checksum(data: torch.Tensor) -> int:
    return checksum_value(checksum_tensor(data))
