"""A topology's `tandem up` command line, and SIGTERM unwinding a benchmark wherever it lands."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

import deploy.bench.topology as bench_topology
from deploy.bench.plan import Budget, topology
from deploy.bench.topology import start_topology, up_argv
from services.cli import build_parser
from services.config import ConfigError
from tests.deploy.conftest import REPO, disagg_args


def test_up_argv_forwards_engine_flags_and_the_shape(tmp_path: Path) -> None:
    args = disagg_args("--model", "llama-3.1-8b", "--max-model-len", "8192", "--max-num-seqs",
                       "128", "--gpus", "0,1", "--device", "cuda")  # fmt: skip
    topo = topology("disagg", ["0", "1"], 2, None)
    argv = up_argv(args, topo, tmp_path, {"model": "/x/llama", "load_format": "dummy"})
    up = build_parser().parse_args(argv)
    assert (up.model, up.load_format, up.max_model_len, up.max_num_seqs) == (
        "/x/llama",
        "dummy",
        8192,
        128,
    )
    assert (up.prefill, up.decode, up.colocated, up.gpus, up.port, up.device) == (
        1,
        1,
        0,
        "0,1",
        0,
        "cuda",
    )
    assert up.max_local_prefill_tokens == 0  # disagg: always disaggregate
    local = topology("disagg-local", ["0", "1"], 2, None, 256, 3)
    up = build_parser().parse_args(up_argv(args, local, tmp_path, {}))
    assert (up.prefill, up.decode, up.max_local_prefill_tokens) == (1, 1, 256)
    assert up.local_prefill_queue == 3


def _refuse_plan(*args: Any, **kwargs: Any) -> Any:
    raise ConfigError("no such plan")


def _interrupt_start(*args: Any, **kwargs: Any) -> Any:
    raise KeyboardInterrupt


def _start(*args: Any, **kwargs: Any) -> Any:
    return "http://127.0.0.1:1/v1", {}


@pytest.mark.parametrize(
    ("patch", "raises"),
    [
        ({"start_all": _start}, None),
        ({"start_all": _interrupt_start}, KeyboardInterrupt),
        ({"build_plan": _refuse_plan}, ConfigError),
    ],
    ids=["started", "interrupted-while-starting", "plan-refused"],
)
def test_start_topology_leaves_no_run_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, patch: dict[str, Any], raises: Any
) -> None:
    """The run directory (the children's ready files) is gone once start_topology returns or
    raises: a plan refused before any child starts left one in /tmp per topology."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(bench_topology, "start_all", _start)
    for name, fake in patch.items():
        monkeypatch.setattr(bench_topology, name, fake)
    args = disagg_args("--model", "llama-3.1-8b", "--device", "cpu")
    topo = topology("disagg", [], 2, None)
    if raises is None:
        running = start_topology(args, topo, tmp_path / "out", {}, Budget(None))
        assert running.base_url == "http://127.0.0.1:1"
    else:
        with pytest.raises(raises):
            start_topology(args, topo, tmp_path / "out", {}, Budget(None))
    assert list(tmp_path.glob("tandem-bench-run-*")) == []


# Each SIGTERM scenario runs in a child Python: a signal sent to the test process itself lands
# wherever that process is, and one that interrupted CPython 3.11 inside an AST conversion left it
# unable to parse any source again (a later kernel test failed with "AST constructor recursion
# depth mismatch" on a two-worker run).
ASYNC_TASK = """
import asyncio, os, signal
from deploy.bench.topology import sigterm_unwinds

async def background():
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this task's step

async def main():
    task = asyncio.create_task(background())  # never awaited
    await asyncio.sleep(0.5)
    return f"ran on past {task}"

try:
    with sigterm_unwinds():
        print(asyncio.run(main()))
except KeyboardInterrupt:
    print("interrupted")
"""

DROPPED = """
import os, signal
from deploy.bench.topology import raise_if_interrupted, sigterm_unwinds

class Dropper:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here; Python drops its raise

seen = []
try:
    with sigterm_unwinds():
        Dropper()  # collected at once
        seen.append("ran on")
        raise_if_interrupted()
except KeyboardInterrupt:
    seen.append("the check interrupted")
try:
    with sigterm_unwinds():
        Dropper()  # nothing checks inside: the way out does
except KeyboardInterrupt:
    seen.append("the way out interrupted")
with sigterm_unwinds():
    raise_if_interrupted()  # a new scope starts clean
seen.append("clean")
print(",".join(seen))
"""


def _run(script: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_sigterm_landing_inside_an_asyncio_task_still_unwinds() -> None:
    """The signal handler runs wherever the main thread is, here in a task nobody awaits: the
    interrupt must still leave the event loop (an Exception there only failed that task, and a
    SIGTERM in the middle of a rate was lost)."""
    assert _run(ASYNC_TASK) == "interrupted"


def test_a_sigterm_whose_exception_python_drops_still_interrupts() -> None:
    """Raised inside a __del__, the handler's exception is printed and dropped by Python; the
    signal is kept, so the next check between rates (and the way out) still interrupts."""
    assert _run(DROPPED) == "ran on,the check interrupted,the way out interrupted,clean"
