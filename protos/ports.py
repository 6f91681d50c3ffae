"""Whether this process can listen where it was told to: checked before a slow start (a model
load, a tokenizer), so that a busy or impossible address is a clean error naming the flag to
change, not a server library's traceback minutes later."""

from __future__ import annotations

import errno
import socket

from protos.errors import ConfigError


def check_port_free(host: str, port: int, flag: str = "--port", host_flag: str = "--host") -> None:
    """ConfigError unless ``host:port`` can be listened on (port 0: any free one, so only
    ``host`` is checked: an address not on this machine was a traceback once the model had
    loaded). Every address ``host`` resolves to is bound once with SO_REUSEADDR, as gRPC and
    uvicorn bind, so a port in TIME_WAIT passes and one a live server holds does not."""
    bare = host.strip("[]")
    try:
        addresses = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)  # fmt: skip
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is in use: choose another {flag}") from e
        raise ConfigError(
            f"cannot listen on {host}:{port} ({e.strerror}): check {host_flag} and {flag}"
        ) from e
