"""The tensor-parallel ranks' life: per-rank KV memory, start-up errors that name the rank, a
rank that dies (the step fails, the others stop), rank 0 dying (the others follow it)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from protos.sampling_params import SamplingParams
from services.config import ConfigError
from services.engine.kv_cache import GIB
from services.engine.llm import LLM
from services.engine.tp_ranks import RankFailedError
from tests.services.engine.conftest import rank_processes, tiny_checkpoint

ROOT = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
# 3 KV heads of 16 dims, 2 layers, float32: 12 KiB of KV per 16-token block on one rank,
# 8 KiB on rank 0 of 2 (2 KV heads), 4 KiB on each of 3 ranks
BLOCK_BYTES = {1: 12288, 2: 8192, 3: 4096}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("llama-3kv")
    config = {"num_hidden_layers": 2, "hidden_size": 96, "num_attention_heads": 6,
              "num_key_value_heads": 3, "intermediate_size": 64}  # fmt: skip
    return str(tiny_checkpoint(path, "llama", **config))


@pytest.fixture(autouse=True)
def no_rank_left() -> Iterator[None]:
    yield
    assert rank_processes() == [], "a tensor-parallel rank outlived its engine"


def test_heads_that_cannot_be_split_are_refused_before_any_rank_starts(model: str) -> None:
    with pytest.raises(ConfigError, match="--tensor-parallel-size 4: 3 KV heads"):
        LLM(model, tensor_parallel_size=4)


def test_a_rank_short_of_kv_memory_is_named(model: str) -> None:
    """Each rank sizes the pool from its own KV heads: 20 blocks' worth of rank 1's 4 KiB fits
    256 tokens (16 blocks), rank 0's 8 KiB blocks do not."""
    gib = 20 * 4096 / GIB
    with pytest.raises(ConfigError, match="tensor-parallel rank 0: max_model_len 256") as err:
        LLM(model, tensor_parallel_size=2, kv_cache_gib=gib, max_model_len=256)
    assert "rank 1" not in str(err.value)


def test_a_start_up_error_of_another_rank_is_raised_by_rank_zero_with_its_rank(
    model: str, tmp_path: Path
) -> None:
    """A checkpoint whose k_proj of layer 1 lacks its third KV head: rank 0 (heads 0-1) loads
    fine, rank 1 (head 2) fails; rank 0 raises rank 1's error and rank 1 is gone."""
    for f in Path(model).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors = load_file(next(Path(model).glob("*.safetensors")))
    tensors[name] = tensors[name][:32].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    want = f"tensor-parallel rank 1: ConfigError: checkpoint tensor '{name}' is (0, 96), expected"
    with pytest.raises(ConfigError, match=re.escape(want)) as err:
        LLM(str(tmp_path), tensor_parallel_size=2)
    assert "rank 0" not in str(err.value)


def test_a_rank_that_dies_fails_the_step_and_stops_the_others(model: str) -> None:
    gib = 64 * 12288 / GIB
    llm = LLM(model, tensor_parallel_size=3, kv_cache_gib=gib, max_model_len=256)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    # the pool is planned per rank: one KV head each, three times the blocks of one rank
    assert llm.engine.runner.num_blocks == 64 * 12288 // BLOCK_BYTES[3]
    assert llm.engine.runner.kv_caches[0].shape[3] == 1
    llm.generate([[1, 2, 3]], GREEDY)
    ranks.procs[0].kill()
    ranks.procs[0].wait()
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 exited with status -9"):
        llm.generate([[4, 5, 6]], GREEDY)
    assert time.monotonic() - t0 < 60  # a hang guard: the Gloo group would wait 10 minutes
    assert ranks.procs[1].poll() is not None  # rank 2 did not stay behind


RANK_ZERO = """
import sys
from services.engine.llm import build_config
from services.engine.model_runner import ModelRunner
runner = ModelRunner(build_config(sys.argv[1], tensor_parallel_size=2))
print(runner.ranks.procs[0].pid, flush=True)
sys.stdin.readline()
"""


def test_the_ranks_die_with_rank_zero(model: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", RANK_ZERO, model], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout is not None
    rank1 = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while _alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(rank1), "rank 1 outlived rank 0"


def _alive(pid: int) -> bool:
    """Running (a zombie that init has not reaped yet is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
