"""``tandem gateway``: uvicorn (uvloop when available) with a draining shutdown.

SIGTERM or SIGINT: /health turns 503 and new requests get 503 at once; in-flight requests get
``--drain-timeout`` seconds, then end with finish_reason "abort"; then uvicorn closes. A second
signal exits without waiting, with status 128 + its number (130 for Ctrl-C, 143 for SIGTERM), as
`tandem up` does: in-flight work was cut.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import Generator
from typing import Any

import uvicorn

from gateway.core.config import (
    LISTEN_FD_ENV,
    GatewayConfig,
    api_key_from,
    check_topology,
    config_from_args,
)
from gateway.flows.chat_output import check_parser_flags
from gateway.http.app import build_app
from gateway.http.http_protocol import HttpLimits, guarded_protocol
from gateway.http.state import GatewayState
from protos.errors import ConfigError
from protos.ports import check_port_free

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: GatewayState, grace_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self._drain_task: asyncio.Task[None] | None = None
        self.forced_by: int | None = None  # the second signal, which cut in-flight work

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:  # uvicorn.Server's hook
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread (tests run servers in threads)
            return
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, self.begin_shutdown, sig)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def begin_shutdown(self, sig: int = signal.SIGTERM) -> None:
        if self._drain_task is not None:
            log.warning("second signal: exiting without waiting for requests")
            self.should_exit = self.force_exit = True
            self.forced_by = self.forced_by or sig
            return
        log.info("draining: no new requests; in-flight ones get %.1f s", self.grace_s)
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self.state.drain(self.grace_s)
        finally:
            self.should_exit = True

    @property
    def exit_code(self) -> int:
        """0 after a drain; 128 + the signal's number when a second one forced the exit."""
        return 0 if self.forced_by is None else 128 + self.forced_by

    @property
    def port(self) -> int | None:
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return None


def _write_ready_file(path: str, host: str, port: int) -> None:
    """``{"port", "host", "pid"}`` as JSON, written atomically (by rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"port": port, "host": host, "pid": os.getpid()}, f)
    os.replace(tmp, path)


def inherited_listener() -> socket.socket | None:
    """The listening socket ``tandem up`` bound for this gateway and handed over (its number
    in TANDEM_LISTEN_FD), taken out of the environment; None when there is none."""
    text = os.environ.pop(LISTEN_FD_ENV, "")
    if not text:
        return None
    try:
        return socket.socket(fileno=int(text))
    except (ValueError, OSError) as e:
        raise ConfigError(f"{LISTEN_FD_ENV}={text!r} is not a listening socket's descriptor "
                          f"({e}): unset it, the gateway then binds --host and --port") from None  # fmt: skip


async def serve(
    config: GatewayConfig,
    host: str,
    port: int,
    ready_file: str | None = None,
    listener: socket.socket | None = None,
    **app_kwargs: Any,
) -> int:
    """Serves until a signal; the exit status (:attr:`DrainingServer.exit_code`). ``listener``:
    a socket already listening (``tandem up``'s), served instead of binding ``host:port``."""
    app = build_app(config, **app_kwargs)
    limits = HttpLimits(
        header_timeout_s=config.header_timeout_s,
        body_timeout_s=config.body_timeout_s,
        send_timeout_s=config.send_timeout_s,
        max_connections=config.max_connections,
    )
    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level="info", lifespan="on", access_log=False,
        timeout_keep_alive=30, timeout_graceful_shutdown=10, http=guarded_protocol(limits),
    )  # fmt: skip
    server = DrainingServer(uv_config, app.state.gateway, config.drain_timeout_s)
    task = asyncio.create_task(server.serve(sockets=[listener] if listener else None))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started and server.port is not None:
        log.info("gateway listening on http://%s:%d", host, server.port)
        if ready_file:
            _write_ready_file(ready_file, host, server.port)
    await task
    return server.exit_code


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def main(
    args: argparse.Namespace, tokenizer_dir: str, model_name: str, model_dir: str | None = None
) -> int:
    """``tandem gateway``, called by the CLI with the tokenizer directory, the model's default
    served name and its files' directory (generation_config.json's) already resolved."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args, tokenizer_dir, model_name, model_dir)
        check_parser_flags(config)
        check_topology(config)
        listener = inherited_listener()
        if listener is None:
            check_port_free(args.host, args.port)
        source = api_key_from(args.api_key, os.environ)[1]
        log.info("API key: %s", f"required (from {source})" if source else "none, the API is open")
        # the tokenizer and the chat template load in serve (build_app): a bad one is a
        # ConfigError before uvicorn starts
        code: int = _run(serve(config, args.host, args.port, args.ready_file, listener))
    except ConfigError as e:
        log.error("%s", e)
        return 2
    return code
