"""Real ``tandem prefill|decode|worker|gateway`` processes for end-to-end tests.

Every process runs in its own session (process group) and dies with the test process
(PR_SET_PDEATHSIG); :meth:`Fleet.close` kills every group it started. Model loading takes seconds,
so one :class:`Fleet` per test session keeps shared workers (``fleet.shared("prefill")``) alive
across test modules and starts a fresh one only when a test killed the last; gateways in front
of them (``fleet.shared_gateway``) are kept across modules the same way. A test gets shared
workers idle: one that still holds KV or requests from an earlier test (which then failed) is
given a few seconds to settle and is replaced if it does not, so no test inherits another's
leftovers or depends on its timing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from deploy.supervisor import log_tail, parent_death_env, read_ready_file
from protos import common_pb2
from tests.services.clients import STUBS, is_idle

REPO = Path(__file__).resolve().parents[2]
# Small pools keep memory low; 1024 tokens of context need 64 of the 256 blocks.
WORKER_ARGS = ("--max-model-len", "1024", "--num-blocks", "256", "--kv-timeout", "5",
               "--drain-timeout", "3")  # fmt: skip
READY_TIMEOUT_S = 180.0
SETTLE_TIMEOUT_S = 15.0  # a shared worker left busy gets this long to become idle again


@dataclass
class Proc:
    name: str
    role: str
    popen: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def port(self) -> int:
        return int(self.ready["port"])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return log_tail(self.log_path, 60)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> Proc:
        deadline = time.monotonic() + timeout_s
        while True:
            ready = read_ready_file(self.ready_file)
            if ready is not None:
                self.ready = ready
                return self
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.popen.returncode}:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log()}")
            time.sleep(0.05)

    def signal(self, sig: signal.Signals) -> None:
        """To the process alone (SIGTERM tests); see :meth:`kill` for the whole group."""
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL to the whole process group, then reap."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)

    def wait_exit(self, timeout_s: float) -> int:
        return self.popen.wait(timeout=timeout_s)


def settled(proc: Proc, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """True once the worker holds no KV, reservation or request (polled up to ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(proc.address) as channel:
        stub = STUBS[proc.role](channel)
        while True:
            try:
                if is_idle(stub.GetLoad(common_pb2.LoadRequest(), timeout=5)):
                    return True
            except grpc.RpcError:
                pass  # an unanswering worker is not idle
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TANDEM_LOG_LEVEL": "INFO",
    }


class Fleet:
    """Starts processes under ``root`` (ready files and logs) and kills them all on close."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[Proc] = []
        self._shared: dict[str, Proc] = {}
        self._gateways: dict[tuple[str, ...], Proc] = {}
        self._count = 0

    def spawn(self, role: str, *args: str, name: str | None = None) -> Proc:
        """Start ``tandem ROLE --port 0 --ready-file F ARGS`` without waiting for it."""
        self._count += 1
        name = f"{name or role}-{self._count}"
        self.root.mkdir(parents=True, exist_ok=True)
        ready, log_path = self.root / f"{name}.json", self.root / f"{name}.log"
        ready.unlink(missing_ok=True)  # left by an earlier run
        argv = [sys.executable, "-m", "services.cli", role, "--port", "0", "--ready-file",
                str(ready), *(WORKER_ARGS if role != "gateway" else ()), *args]  # fmt: skip
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                argv, cwd=REPO, env={**child_env(), **parent_death_env()}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        proc = Proc(name, role, popen, ready, log_path)
        self.procs.append(proc)
        return proc

    def start(self, role: str, *args: str, name: str | None = None) -> Proc:
        return self.spawn(role, *args, name=name).wait_ready()

    def gateway(
        self, *, prefill: Sequence[Proc] = (), decode: Sequence[Proc] = (),
        worker: Sequence[Proc] = (), args: Sequence[str] = (),
    ) -> Proc:  # fmt: skip
        return self.start("gateway", *_gateway_flags(prefill, decode, worker), *args)

    def shared_gateway(
        self, *, prefill: Sequence[Proc] = (), decode: Sequence[Proc] = (),
        worker: Sequence[Proc] = (), args: Sequence[str] = (),
    ) -> Proc:  # fmt: skip
        """A long-lived gateway in front of these workers with these flags, started on the first
        call and given to every later one that asks for the same (each module started its own,
        ~2 s a gateway). Its users must not kill it; one in front of a worker that was since
        replaced (a new address) is never asked for again, and dies with the fleet."""
        key = (*_gateway_flags(prefill, decode, worker), *args)
        proc = self._gateways.get(key)
        if proc is None or not proc.alive:
            proc = self._gateways[key] = self.start("gateway", *key)
        return proc

    def shared(self, *roles: str) -> list[Proc]:
        """Long-lived workers of these roles (one each), idle, started together if not running."""
        for role in roles:
            proc = self._shared.get(role)
            if proc is not None and proc.alive and proc.ready and not settled(proc):
                print(f"{proc.name} still busy after {SETTLE_TIMEOUT_S:.0f} s: replaced")
                self.forget(proc)
                proc.kill()
            proc = self._shared.get(role)
            if proc is None or not proc.alive:
                self._shared[role] = self.spawn(role, name=f"shared-{role}")
        return [self._shared[role].wait_ready() for role in roles]

    def forget(self, proc: Proc) -> None:
        """A test is taking this shared worker down (the next ``shared`` starts another)."""
        for role, p in list(self._shared.items()):
            if p is proc:
                del self._shared[role]

    def close(self) -> None:
        for proc in self.procs:
            if proc.alive:
                proc.kill()


def _gateway_flags(
    prefill: Sequence[Proc], decode: Sequence[Proc], worker: Sequence[Proc]
) -> tuple[str, ...]:
    groups = (("prefill", prefill), ("decode", decode), ("worker", worker))
    return tuple(f"--{role}={p.address}" for role, procs in groups for p in procs)


_FLEET: Fleet | None = None


def session_fleet(config: pytest.Config, tmp_root: Path) -> Fleet:
    """One fleet per pytest session, killed at the session's end (``config.add_cleanup``)."""
    global _FLEET
    if _FLEET is None:
        fleet = _FLEET = Fleet(tmp_root)

        def close() -> None:
            global _FLEET
            fleet.close()
            _FLEET = None

        config.add_cleanup(close)
    return _FLEET


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    return session_fleet(request.config, tmp_path_factory.getbasetemp() / "fleet")
