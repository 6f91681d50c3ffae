"""TCPStore plumbing: a server bound to one address, and client connections to it."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist


def serve_store(host: str, port: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A TCPStore server listening on ``host`` only; returns it and its port (0: a free one).

    TCPStore would bind every interface by itself, so it is handed a socket bound here.
    """
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(512)
        bound = int(sock.getsockname()[1])
    except OSError:
        sock.close()
        raise
    store = dist.TCPStore(
        host,
        bound,
        None,
        True,
        timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
    )
    return store, bound


def clone(store: dist.TCPStore, timeout: timedelta) -> dist.TCPStore:
    """A new client connection to the same server (blocking calls never share one)."""
    client = cast(dist.TCPStore, cast(Any, store).clone())
    client.set_timeout(timeout)
    return client
