"""A topology's `tandem up` command line, and SIGTERM unwinding a benchmark wherever it lands."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from deploy.bench.plan import topology
from deploy.bench.topology import raise_if_interrupted, sigterm_unwinds, up_argv
from services.cli import build_parser
from tests.deploy.conftest import disagg_args


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


def test_a_sigterm_landing_inside_an_asyncio_task_still_unwinds() -> None:
    """The signal handler runs wherever the main thread is, here in a task nobody awaits: the
    interrupt must still leave the event loop (an Exception there only failed that task, and a
    SIGTERM in the middle of a rate was lost)."""

    async def background() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this task's step

    async def main() -> str:
        task = asyncio.create_task(background())  # never awaited
        await asyncio.sleep(0.5)
        return f"ran on past {task}"

    with pytest.raises(KeyboardInterrupt), sigterm_unwinds():
        asyncio.run(main())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigterm_whose_exception_python_drops_still_interrupts() -> None:
    """Raised inside a __del__, the handler's exception is printed and dropped by Python; the
    signal is kept, so the next check between rates (and the way out) still interrupts."""

    class Dropper:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here; Python drops its raise

    checked: list[str] = []
    with pytest.raises(KeyboardInterrupt), sigterm_unwinds():
        Dropper()  # collected at once
        checked.append("ran on past the dropped exception")
        raise_if_interrupted()
    assert checked == ["ran on past the dropped exception"]
    with pytest.raises(KeyboardInterrupt), sigterm_unwinds():
        Dropper()  # nothing checks inside: the way out does
    with sigterm_unwinds():
        raise_if_interrupted()  # a new scope starts clean
