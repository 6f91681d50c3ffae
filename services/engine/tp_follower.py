"""A tensor-parallel rank other than 0 (``python -m services.engine.tp_follower RANK SIZE PORT``,
the engine's config pickled on stdin; started by ``services.engine.tp_ranks``).

It loads its shard, takes part in the start-up agreement (its error, if any, travels to rank 0
there), then runs each step rank 0 broadcasts until rank 0 sends None, or dies with rank 0; a
thread of its own serves rank 0's gathers and scatters of its KV heads (a serving worker's KV
transfers, ``services.engine.tp_kv``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import pickle
import signal
import sys
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from kvtransfer import KvLayout
from kvtransfer.blockcopy import make_copier
from services.config import ConfigError, EngineConfig
from services.engine.model_runner import ModelRunner, resolve_device
from services.engine.tp_group import TPGroup
from services.engine.tp_kv import serve_kv
from services.engine.tp_ranks import PARENT_PID_ENV, START_TIMEOUT_S, rank_device

_PR_SET_PDEATHSIG = 1
# What this rank built, never torn down: the process ends in os._exit. Freed on main's return,
# the model runner's CUDA graphs and its NCCL communicator (collectives captured in them) would
# block the exit in their destructors until rank 0 kills the rank.
_KEPT: list[object] = []


def _follow_parent() -> None:
    """SIGKILL when rank 0 dies (Linux), even in the middle of a collective."""
    pid = os.environ.pop(PARENT_PID_ENV, "")
    if not pid.isdigit() or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(pid):  # rank 0 died before the request above
        os._exit(1)


def main(rank: int, size: int, port: int) -> int:
    _follow_parent()
    config: EngineConfig = pickle.loads(sys.stdin.buffer.read())
    device = rank_device(config, resolve_device(config.device), rank)
    if device.type == "cuda":  # before the NCCL group exists
        torch.cuda.set_device(device)
    store = dist.TCPStore(
        "127.0.0.1", port, size, False, timeout=timedelta(seconds=START_TIMEOUT_S)
    )
    store.set(f"joined/{rank}", "1")
    group = TPGroup(store, rank, size, device)
    _KEPT.append(group)
    try:
        runner = ModelRunner(config, tp=group, device=device)
    except Exception as exc:
        if not group.agreed:  # rank 0 raises it, named by rank
            group.agree(None, f"{type(exc).__name__}: {exc}")
        elif not isinstance(exc, ConfigError):  # not the agreement's own error: printed here
            raise
        return 1
    _KEPT.append(runner)
    stopping = threading.Event()  # rank 0 said stop: the KV thread's peers may go first
    kv = threading.Thread(
        target=serve_kv, name="tp-kv", daemon=True,
        args=(group.kv, rank, make_copier(runner.kv_caches), KvLayout.of(runner.kv_caches),
              stopping),
    )  # fmt: skip
    kv.start()  # a worker's KV transfers: this rank's heads of the blocks (services.engine.tp_kv)
    while (step := group.broadcast()) is not None:
        runner.follow(step)
    stopping.set()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("TANDEM_LOG_LEVEL", "WARNING"))
    try:
        code = main(*(int(a) for a in sys.argv[1:4]))
    except Exception:  # rank 0 notices the exit at its next collective and names this rank
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown (torch's takes seconds): rank 0 waits for this exit
