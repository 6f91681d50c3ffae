"""Start child processes, wait until they report ready, and stop every one of them.

Each child runs in its own session (process group), so one ``killpg`` reaches anything it spawned,
and a Ctrl-C in the terminal reaches only the launcher, which then stops the children in order
(lowest ``stop_tier`` first: the gateway before the workers). On Linux each child also gets
SIGTERM should the launcher die without cleaning up (PR_SET_PDEATHSIG), which the child asks for
itself (:func:`follow_parent`, told by :func:`parent_death_env`): no Python runs between fork and
exec, which can crash a parent that has threads (a ``preexec_fn`` did, in the test fleet).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

_PR_SET_PDEATHSIG = 1


class ChildFailedError(RuntimeError):
    """A child exited or never became ready; the message carries the tail of its log.
    ``exit_code``: what the launcher exits with: 2 when the child refused its input (it exited
    2, the CLI's status for bad input), else 1."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment
    ready_file: Path | None = None  # the child writes JSON here once it serves
    stop_tier: int = 1  # lower tiers are stopped first
    pass_fds: tuple[int, ...] = ()  # the launcher's descriptors it inherits (a listening socket)


@dataclass
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]
    ready: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.spec.name


PARENT_PID_ENV = "TANDEM_PARENT_PID"


def parent_death_env() -> dict[str, str]:
    """Environment for a child that should get SIGTERM when this process dies (the child calls
    :func:`follow_parent` first thing)."""
    return {PARENT_PID_ENV: str(os.getpid())}


def follow_parent() -> None:
    """In a child started with :func:`parent_death_env`: SIGTERM when the parent dies (Linux).
    The variable is removed, so this process's own children do not inherit it."""
    pid = os.environ.pop(PARENT_PID_ENV, "")
    if not pid.isdigit() or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(pid):  # the parent died before the request above
        os.kill(os.getpid(), signal.SIGTERM)


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_bytes()[-64 * 1024 :].decode("utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def read_ready_file(path: Path) -> dict[str, Any] | None:
    """What a child wrote (atomically, by rename): a JSON object, or a bare port number, which
    reads as ``{"port": N}``. None while the file is not there yet."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, int) and not isinstance(data, bool):
        return {"port": data}
    return data if isinstance(data, dict) else None


class Supervisor:
    def __init__(self, log_dir: Path, grace_s: float = 15.0) -> None:
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.children: list[Child] = []
        self.hurry = False  # set (e.g. by a second Ctrl-C) to skip the grace period

    def start(self, spec: ChildSpec) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{spec.name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in shutdown()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env, **parent_death_env()}
        proc = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            pass_fds=spec.pass_fds,
        )
        child = Child(spec, proc, log_path, log)
        self.children.append(child)
        return child

    def restart(self, child: Child, spec: ChildSpec) -> Child:
        """Replace an exited child by a new one of ``spec`` (its log is appended to); the old
        ready file is removed first, so the new one's readiness is its own."""
        if child.proc.poll() is None:
            raise RuntimeError(f"{child.name} is still running")
        self.children.remove(child)
        child.log.close()
        if spec.ready_file is not None:
            spec.ready_file.unlink(missing_ok=True)
        return self.start(spec)

    def failure(self, child: Child, what: str) -> ChildFailedError:
        return ChildFailedError(
            f"{child.name} {what}; last lines of {child.log_path}:\n{log_tail(child.log_path)}",
            2 if child.proc.poll() == 2 else 1,
        )

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def wait_ready(
        self,
        children: Iterable[Child],
        timeout_s: float,
        progress: Callable[[list[Child], float], None] | None = None,
        progress_every_s: float = 5.0,
    ) -> None:
        """Block until every child has written its ready file; raise if one exits first."""
        pending = [c for c in children if c.ready is None]
        start = last_report = time.monotonic()
        while pending:
            for child in list(pending):
                assert child.spec.ready_file is not None, f"{child.name} has no ready file"
                child.ready = read_ready_file(child.spec.ready_file)
                if child.ready is not None:
                    pending.remove(child)
                elif child.proc.poll() is not None:
                    raise self.failure(child, f"exited with code {child.proc.returncode}")
            now = time.monotonic()
            if pending and now - start > timeout_s:
                raise self.failure(pending[0], f"was not ready after {timeout_s:.0f} s")
            if pending and progress is not None and now - last_report >= progress_every_s:
                progress(pending, now - start)
                last_report = now
            if pending:
                time.sleep(0.05)

    def shutdown(self) -> None:
        """SIGTERM each tier, wait up to the grace period, SIGKILL what is left; idempotent."""
        for tier in sorted({c.spec.stop_tier for c in self.children}):
            group = [c for c in self.children if c.spec.stop_tier == tier]
            self._signal(group, signal.SIGTERM)
            self._wait(group, self.grace_s)
            self._signal(group, signal.SIGKILL)  # stragglers and anything they spawned
            for child in group:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=5.0)
        for child in self.children:
            child.log.close()

    def _signal(self, group: list[Child], sig: signal.Signals) -> None:
        for child in group:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, sig)

    def _wait(self, group: list[Child], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.hurry:
            if all(c.proc.poll() is not None for c in group):
                return
            time.sleep(0.05)
