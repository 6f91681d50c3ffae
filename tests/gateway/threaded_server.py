"""A uvicorn server for tests: an app on a free port of 127.0.0.1, served from its own thread
for as long as the ``with`` block lasts."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Self

import uvicorn


class ThreadedServer:
    """``config`` binds port 0; ``port`` is the one the OS chose, once entered."""

    def __init__(self, config: uvicorn.Config) -> None:
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=asyncio.run, args=(self.server.serve(),))
        self.port = 0

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
