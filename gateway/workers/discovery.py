"""Workers found by DNS: ``--discover decode=decode.tandem.svc.cluster.local:50051``.

A Kubernetes headless Service (or any DNS name with one A/AAAA record per worker) lists the pods of
a role; the registry resolves it every ``--discover-interval`` seconds and adds the workers that
appeared and retires the ones that left, so ``kubectl scale statefulset/decode --replicas 6`` needs
nothing else. A failed lookup changes nothing (a DNS hiccup must not empty the pool).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable

# (host, port) -> the addresses it names now; raises OSError when the lookup fails
Resolver = Callable[[str, int], Awaitable[list[str]]]


def worker_address(ip: str, port: int) -> str:
    """``ip:port``, with brackets for IPv6."""
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to now, as worker addresses, sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({worker_address(str(info[4][0]), port) for info in infos})
