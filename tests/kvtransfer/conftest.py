"""Builders for KV transfer tests: peer processes driven over pipes, and in-process ends."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvtransfer import KvReceiver, ReceiverOptions
from tests.kvtransfer.peer import make_caches

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 60.0  # importing torch on a loaded 2-core machine


class Peer:
    """A ``tests.kvtransfer.peer`` process; every read is bounded by a timeout."""

    def __init__(self, role: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kvtransfer.peer", role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        self.hello: dict[str, Any] | None = None

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def started(self) -> Peer:
        """Wait for the first line (ready / endpoint)."""
        if self.hello is None:
            self.hello = self.read(STARTUP_S)
        return self

    def read(self, timeout: float) -> dict[str, Any]:
        line = self._lines.get(timeout=timeout)
        if line is None:
            raise RuntimeError(f"peer exited with {self.proc.wait(5)}")
        return json.loads(line)

    def write(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, timeout: float = 30.0, **cmd: Any) -> dict[str, Any]:
        self.write(**cmd)
        return self.read(timeout)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.write(op="exit")
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._reader.join(5)


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    """Two sender processes shared by a module's tests (started together: startup overlaps)."""
    procs = [Peer("sender"), Peer("sender")]
    try:
        yield [p.started() for p in procs]
    finally:
        for p in procs:
            p.close()


def add_sender(
    peer: Peer, sender_id: str, seed: int, num_blocks: int = 12, device: str = "cpu", **layout: int
) -> None:
    reply = peer.call(
        op="sender", id=sender_id, seed=seed, num_blocks=num_blocks, layout=layout, device=device
    )
    assert reply == {"ok": True}


@pytest.fixture
def rx_caches() -> list[torch.Tensor]:
    return make_caches(0, 16, zero=True)


@pytest.fixture
def receiver(rx_caches: list[torch.Tensor]) -> Iterator[KvReceiver]:
    """An in-process receiver over 16 zeroed blocks with short timeouts."""
    rx = KvReceiver(rx_caches, ReceiverOptions(io_timeout_s=3, unknown_grace_s=0.2))
    try:
        yield rx
    finally:
        rx.close()


def blocks(caches: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    return [c[:, ids] for c in caches]


def assert_blocks_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
