"""How a tensor-parallel engine's close goes on GPUs: a TP 2 engine (a tiny float32 Llama),
with its CUDA graphs and without, generates, then closes; a follower still alive after 4 s gets
SIGABRT, which (PYTHONFAULTHANDLER=1) prints its Python stacks. Prints how long each close took
and the followers' exit codes (0: they stopped when told).

    PYTHONFAULTHANDLER=1 TANDEM_TEST_TOKENIZER=DIR python3 scripts/device/tp_close_diag.py

Found on two H200s (2026-11-29): with graphs the follower's main() had returned but its exit
waited in the destructors of its runner and NCCL group, until rank 0 killed it (status -9).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from protos.sampling_params import SamplingParams
from services.engine.llm import LLM
from tests.services.engine.conftest import tiny_checkpoint


def _abort_live(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            print("SIGABRT to follower", p.pid, flush=True)
            os.kill(p.pid, signal.SIGABRT)


def main() -> None:
    path = tiny_checkpoint(
        Path(tempfile.mkdtemp()) / "llama", "llama", num_hidden_layers=2, hidden_size=64,
        num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
    )  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for knobs in ({}, {"enforce_eager": True}):
        llm = LLM(str(path), tensor_parallel_size=2, num_blocks=512, **knobs)
        llm.generate([[5, 6, 7], [9] * 40], params)
        ranks = llm.engine.runner.ranks
        assert ranks is not None
        timer = threading.Timer(4.0, _abort_live, args=(ranks.procs,))
        timer.start()
        start = time.monotonic()
        llm.close()
        timer.cancel()
        codes = [p.returncode for p in ranks.procs]
        print(
            f"{knobs or 'graphs'}: close took {time.monotonic() - start:.2f} s, exit codes {codes}"
        )


if __name__ == "__main__":
    main()
