"""Start and stop one topology of `tandem bench disagg` with `tandem up`'s launcher: SIGTERM by
tier, SIGKILL after the grace period, and a check that no process is left."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from deploy.bench.plan import STOP_RESERVE_S, Budget, Topology, log
from deploy.launcher import GRACE_S, start_all
from deploy.plan import build_plan, engine_flags
from deploy.procfs import alive, cpu_seconds, descendants
from deploy.supervisor import Supervisor
from services.cli import build_parser


# ---- processes --------------------------------------------------------------------------------------
class _Interrupted(KeyboardInterrupt):
    """SIGTERM: unwind through the finally blocks that stop the topology.

    A KeyboardInterrupt, not an Exception: raised wherever the main thread happens to be, it
    must get through any ``except Exception`` on the way, and asyncio re-raises it out of the
    event loop even when it lands inside a task's step (an Exception there only failed that
    task, so a SIGTERM during a rate was lost and the benchmark ran on and exited 0)."""


# The signal the handler saw, kept as well as raised: Python drops an exception raised where it
# cannot propagate (a __del__, a weakref or GC callback: "Exception ignored in ..."), and a SIGTERM
# that lands there would be lost. The benchmark calls raise_if_interrupted() between rates, and
# sigterm_unwinds() calls it on the way out.
_received: list[int] = []


def raise_if_interrupted() -> None:
    """Raise _Interrupted if a SIGTERM arrived under sigterm_unwinds() and its exception was lost."""
    if _received:
        raise _Interrupted(_received[0])


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    def on_term(signum: int, frame: FrameType | None) -> None:
        _received.append(signum)
        raise _Interrupted(signum)

    _received.clear()
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
        raise_if_interrupted()
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class Running:
    """A started topology: its supervisor, URL and the processes it owns."""

    topology: Topology
    sup: Supervisor
    base_url: str
    up_command: str
    startup_s: float
    pids: set[int] = field(default_factory=set)

    def named_pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.sup.children}

    def track(self) -> None:
        for child in self.sup.children:
            self.pids |= {child.proc.pid, *descendants(child.proc.pid)}

    def cpu(self) -> dict[str, float | None]:
        return {name: cpu_seconds(pid) for name, pid in self.named_pids().items()}

    def dead_child(self) -> str | None:
        child = self.sup.first_exited()
        return None if child is None else f"{child.name} exited with code {child.proc.returncode}"


def up_argv(
    args: argparse.Namespace, topo: Topology, log_dir: Path, model: dict[str, str]
) -> list[str]:
    """`tandem up`'s arguments for a topology: the benchmark's engine flags plus its shape."""
    argv = ["up", "--host", "127.0.0.1", "--port", str(args.port), "--log-dir", str(log_dir)]
    argv += engine_flags(args, model)
    if args.device != "auto":
        argv += ["--device", args.device]
    argv += topo.up_flags
    if topo.gpus:
        argv += ["--gpus", ",".join(topo.gpus)]
    return argv


def start_topology(
    args: argparse.Namespace, topo: Topology, out_dir: Path, model: dict[str, str], budget: Budget
) -> Running:
    log_dir = out_dir / "logs" / topo.name
    argv = up_argv(args, topo, log_dir, model)
    up_args = build_parser().parse_args(argv)
    at = argv.index("--log-dir")
    shown = shlex.join(["tandem", *argv[:at], *argv[at + 2 :]])
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-run-"))
    try:  # removed however this ends: a refused plan too, before any child starts
        plan = build_plan(up_args, topo.gpus, os.cpu_count() or 1, run_dir, environ=os.environ)
        sup = Supervisor(log_dir, GRACE_S)
        log(f"starting {topo.name}: {plan.summary()} ({shown})")
        t0 = time.monotonic()
        try:
            url, _ = start_all(
                plan, sup, min(args.ready_timeout_s, max(budget.left() - STOP_RESERVE_S, 1))
            )
        except BaseException:
            sup.shutdown()
            raise
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    running = Running(topo, sup, url.removesuffix("/v1"), shown, time.monotonic() - t0)
    running.track()
    log(f"{topo.name} ready in {running.startup_s:.1f} s at {running.base_url}")
    return running


def stop_topology(running: Running) -> dict[str, Any]:
    """Stop the gateway, then the workers; SIGKILL anything still there and say so."""
    running.track()
    t0 = time.monotonic()
    running.sup.shutdown()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in running.pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = sorted(p for p in running.pids if alive(p))
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    codes = {c.name: c.proc.returncode for c in running.sup.children}
    log(f"{running.topology.name} stopped in {time.monotonic() - t0:.1f} s (exit codes {codes})")
    if left:
        log(
            f"WARNING: killed {len(left)} process(es) left behind by {running.topology.name}: {left}"
        )
    return {"stop_s": time.monotonic() - t0, "exit_codes": codes, "left_behind": left}
