"""Frozen options of the two ends of a KV transfer, validated where they are built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReceiverOptions:
    host: str = "127.0.0.1"  # the address both ports bind; "0.0.0.0" for every interface
    port: int = 0  # control connections (the endpoint's port); 0: a free one (KvReceiver.port)
    store_port: int = 0  # the rendezvous store the pairs' groups are built over; 0: a free one
    advertise_host: str = ""  # host put in KvReceiver.endpoint; default: host (or the hostname)
    io_timeout_s: float = 10.0  # one transfer's data must arrive this soon after its header
    connect_timeout_s: float = 10.0  # building a pair's process group
    unknown_grace_s: float = 0.5  # a header waits this long for a matching expect()
    verify_checksums: bool = True  # check the per-chunk checksums a sender sends (a Trailer)
    max_transfer_bytes: int = 1 << 36  # a header announcing more tears the pair down
    max_pairs: int = 256  # concurrent senders
    gloo_interface: str = ""  # network interface for Gloo (default: the one `host` is on)
    auth_token: str = ""  # senders must prove this internal token (kvtransfer.auth); "": none

    def __post_init__(self) -> None:
        _check_common(self.io_timeout_s, self.connect_timeout_s)
        if not (0 <= self.port < 65536 and 0 <= self.store_port < 65536):
            raise ValueError(f"ports must be in [0, 65536), got {self.port} / {self.store_port}")
        if self.unknown_grace_s < 0:
            raise ValueError(f"unknown_grace_s must be >= 0, got {self.unknown_grace_s}")
        if self.max_transfer_bytes < 1 or self.max_pairs < 1:
            raise ValueError("max_transfer_bytes and max_pairs must be positive")


@dataclass(frozen=True)
class SenderOptions:
    timeout_s: float = 10.0  # default deadline of one send(), connecting included
    checksum: bool = False  # send each chunk's checksum after the data (--kv-checksum)
    gloo_interface: str = ""  # network interface for Gloo (default: the route to the receiver)
    # pipeline granularity (whole layers, at least one per chunk) of a KV computed before send.
    # Each chunk costs each end ~0.1 ms of host work (a gather or scatter launch and an NCCL
    # op): between two H200s an 8B KV of 1024 / 4096 tokens took 2.1 / 5.1 ms in 32 MiB chunks
    # and 1.6 / 3.2 ms in one (2026-11-29), while 64-128 MiB chunks had beaten one chunk at
    # 4096 tokens (2.4 against 2.7 ms, 2026-11-22; docs/benchmarks.md W5). 128 MiB: one chunk
    # up to 1024 tokens of an 8B model, a few beyond
    chunk_bytes: int = 128 << 20
    # the same for a KV streamed out layer by layer as prefill writes it (send with ready=):
    # what is left to ship after the last layer is written is one chunk, so keep it small
    streaming_chunk_bytes: int = 8 << 20
    auth_token: str = ""  # prove it, and ship KV only to receivers that prove it back
    # a pair (its thread, group and connection) with nothing to send this long is closed; the
    # next transfer to that receiver builds it again (a restarted decode worker is a new one)
    idle_pair_s: float = 300.0

    def __post_init__(self) -> None:
        _check_common(self.timeout_s, self.timeout_s)
        if self.idle_pair_s <= 0:
            raise ValueError(f"idle_pair_s must be positive, got {self.idle_pair_s}")
        if self.chunk_bytes < 1 or self.streaming_chunk_bytes < 1:
            raise ValueError(
                "chunk_bytes and streaming_chunk_bytes must be positive, got "
                f"{self.chunk_bytes} / {self.streaming_chunk_bytes}"
            )


def _check_common(io_timeout_s: float, connect_timeout_s: float) -> None:
    if io_timeout_s <= 0 or connect_timeout_s <= 0:
        raise ValueError(
            f"timeouts must be positive, got io {io_timeout_s} / connect {connect_timeout_s}"
        )
