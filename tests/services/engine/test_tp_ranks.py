"""The tensor-parallel ranks' life: per-rank KV memory, start-up errors that name the rank, a
rank that dies (the step fails, the others stop; also while rank 0 waits in a collective that
would not notice, as NCCL's), rank 0 dying (the others follow it)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from protos.sampling_params import SamplingParams
from services.config import ConfigError
from services.engine import tp_ranks
from services.engine.kv_cache import GIB
from services.engine.llm import LLM
from services.engine.tp_ranks import RankFailedError
from tests.services.engine.conftest import rank_processes, tiny_checkpoint

# every engine here on the test tokenizer, loaded once (tests/services/engine/_tp_tokenizers.py)
pytestmark = pytest.mark.usefixtures("tokenizers_loaded_once")

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


def test_a_rank_that_dies_while_rank_zero_waits_in_a_collective_fails_the_step(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On GPUs a collective does not fail when a peer dies (NCCL waits for the group's 10-minute
    timeout), and an aborted one returns without an error. Here rank 0's collectives stand in
    for that: they wait until the device group is aborted, then return what they were given.
    The monitor sees the kill and aborts; the step then fails with the rank's exit status
    instead of returning tokens computed after the death, and the other rank is stopped."""
    llm = LLM(model, tensor_parallel_size=3, max_model_len=256)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    llm.generate([[1, 2, 3]], GREEDY)
    group = ranks.group
    released = threading.Event()
    aborted: list[float] = []

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        released.wait(30)  # without the monitor: 30 s, then the step would return its tokens
        return x

    def all_gather(x: torch.Tensor) -> torch.Tensor:
        released.wait(30)
        return torch.cat([x] * group.size, dim=-1)

    def abort_device() -> None:
        aborted.append(time.monotonic())
        released.set()

    monkeypatch.setattr(group, "all_reduce", all_reduce)
    monkeypatch.setattr(group, "all_gather", all_gather)
    monkeypatch.setattr(group, "abort_device", abort_device)
    killed: list[float] = []

    def kill_rank_one() -> None:
        killed.append(time.monotonic())
        ranks.procs[0].kill()

    timer = threading.Timer(0.5, kill_rank_one)  # while rank 0 waits in the step's first
    timer.start()
    try:
        with pytest.raises(
            RankFailedError, match=r"rank 1 exited with status -9 \(SIGKILL\) during a step"
        ):
            llm.generate([[4, 5, 6]], GREEDY)
    finally:
        timer.cancel()
    assert len(aborted) == 1 and aborted[0] - killed[0] < 5  # polled every MONITOR_S
    deadline = time.monotonic() + 10
    while ranks.procs[1].poll() is None:  # rank 2 stopped too
        assert time.monotonic() < deadline, "rank 2 outlived the failed step"
        time.sleep(0.05)


def test_ranks_dropped_unclosed_are_stopped_and_a_close_is_no_death(model: str) -> None:
    """The monitor thread holds the ranks weakly: an engine dropped without close() is still
    collected, its ranks killed and its monitor ended. A graceful close, whose ranks exit, is
    not taken for a death (nothing aborted; on 2 ranks: one rank exiting is the case)."""
    import gc

    before = {t for t in threading.enumerate() if t.name == "tp-monitor"}
    llm = LLM(model, tensor_parallel_size=3, max_model_len=256)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    llm.generate([[1, 2, 3]], GREEDY)
    procs = list(ranks.procs)
    (monitor,) = {t for t in threading.enumerate() if t.name == "tp-monitor"} - before
    del llm, ranks
    gc.collect()
    deadline = time.monotonic() + 20
    while any(p.poll() is None for p in procs) or monitor.is_alive():
        assert time.monotonic() < deadline, "an unclosed engine's ranks or monitor outlived it"
        gc.collect()
        time.sleep(0.05)
    llm = LLM(model, tensor_parallel_size=2, max_model_len=256)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    llm.close()
    assert [p.returncode for p in ranks.procs] == [0]  # it exited: the monitor could see it
    time.sleep(3 * tp_ranks.MONITOR_S)
    assert not ranks._aborted.is_set()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_gpu_a_rank_killed_while_decoding_ends_the_step_at_once(tmp_path: Path) -> None:
    """NCCL does not notice a dead peer: without the monitor's abort, rank 0 would wait in the
    step's collectives (CUDA-graph replays) for the group's 10-minute timeout. Steps run back
    to back until the follower is killed; the step under way then fails within seconds."""
    path = tiny_checkpoint(tmp_path / "m", "llama", num_hidden_layers=2, hidden_size=64,
                           num_attention_heads=8, num_key_value_heads=2, intermediate_size=96)  # fmt: skip
    llm = LLM(str(path), tensor_parallel_size=2, max_model_len=512, num_blocks=1024)
    ranks = llm.engine.runner.ranks
    assert ranks is not None and llm.engine.runner.device.type == "cuda"
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        ranks.procs[0].kill()

    timer = threading.Timer(2.0, kill)
    timer.start()
    start = time.monotonic()
    try:
        with pytest.raises(RankFailedError, match="rank 1 exited with status -9"):
            while time.monotonic() - start < 60:
                llm.generate([[5, 6, 7]] * 16, params)
    finally:
        timer.cancel()
        llm.close()
    print(f"the step failed {time.monotonic() - killed[0]:.2f} s after the kill")
    assert time.monotonic() - killed[0] < 20


# put on the PYTHONPATH the ranks inherit: a follower rank (they alone have the parent pid in
# their environment) finds MODULE's NAME replaced by a function that writes a line to stderr and
# exits with status 7
DIE_AT = """
import os, sys, time
from importlib.machinery import PathFinder
if os.environ.get("TANDEM_TP_PARENT_PID"):
    def die(*args, **kwargs):
        print("cannot go on", file=sys.stderr, flush=True)
        with open(os.path.join(os.path.dirname(__file__), "died"), "w") as f:
            f.write(repr(time.time()))
        os._exit(7)

    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != MODULE:
                return None
            spec = PathFinder.find_spec(name, path)
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                setattr(module, NAME, die)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder)
"""


@pytest.mark.parametrize(
    ("module", "name", "when"),
    [
        ("services.engine.tp_group", "TPGroup", "while forming the group"),
        ("services.engine.loader", "load_model", "while loading its shard"),
    ],
)
def test_a_rank_that_dies_starting_fails_the_start_up_at_once(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, name: str, when: str
) -> None:
    """Rank 1 has joined the store when it dies, before the Gloo rendezvous or before the
    agreement (its shard): rank 0 fails at once, not after the group's 10-minute timeout,
    naming the rank, its status and its last words; a rendezvous thread left behind ends."""
    (tmp_path / "sitecustomize.py").write_text(f"MODULE, NAME = {module!r}, {name!r}" + DIE_AT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(tp_ranks, "FORM_TIMEOUT", timedelta(seconds=2))
    want = rf"tensor-parallel rank 1 exited with status 7 {when}; .*\n  cannot go on"
    with pytest.raises(RankFailedError, match=want):
        LLM(model, tensor_parallel_size=2)
    assert time.time() - float((tmp_path / "died").read_text()) < 5
    deadline = time.monotonic() + 10
    while any(t.name == "tp-form" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the rendezvous thread outlived FORM_TIMEOUT"
        time.sleep(0.05)


def test_the_worker_exits_with_the_rank_s_error_and_no_traceback(
    model: str, tmp_path: Path
) -> None:
    """What `tandem up` shows as the worker's start-up failure (the tail of its log)."""
    (tmp_path / "sitecustomize.py").write_text(
        'MODULE, NAME = "services.engine.loader", "load_model"' + DIE_AT
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(tmp_path)))}
    argv = [sys.executable, "-m", "services.cli", "worker", "--model", model, "--device", "cpu",
            "--port", "0", "--tensor-parallel-size", "2"]  # fmt: skip
    res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-2000:]
    assert "error: tensor-parallel rank 1 exited with status 7 while loading its shard" in out
    assert "Traceback" not in out


def test_a_rank_that_makes_no_progress_fails_the_start_up(
    model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 stopped (SIGSTOP) somewhere in its start-up: no CPU time, faults or reads for
    START_STALL_S fail the start-up, and the stopped rank is killed."""
    monkeypatch.setattr(tp_ranks, "START_STALL_S", 1.0)
    stopped: list[int] = []
    done = threading.Event()

    def stop_rank_one() -> None:
        while not done.is_set() and not stopped:
            for pid in rank_processes():
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            time.sleep(0.01)

    stopper = threading.Thread(target=stop_rank_one)
    stopper.start()
    try:
        with pytest.raises(RankFailedError, match="rank 1 made no progress for 1 s"):
            LLM(model, tensor_parallel_size=2)
    finally:
        done.set()
        stopper.join()
    assert stopped and not _alive(stopped[0])


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


def test_a_step_sends_the_ranks_only_the_image_bytes_its_tokens_reach() -> None:
    """Every rank encodes the images a step's tokens reach into, so their bytes go with it;
    images the step's tokens do not overlap travel without bytes, and a step past every image
    (a decode) carries none."""
    from protos.multimodal import ImageItem
    from services.scheduling.outputs import ScheduledRequest

    a = ImageItem(offset=4, num_tokens=8, grid=(1, 4, 8), content_hash=b"a", data=b"A" * 99)
    b = ImageItem(offset=20, num_tokens=8, grid=(1, 4, 8), content_hash=b"b", data=b"B" * 99)

    def step(start: int, n: int) -> ScheduledRequest:
        return ScheduledRequest("r", list(range(n)), start, [0], True, SamplingParams(), [7],
                                [1] * 40, images=(a, b))  # fmt: skip

    chunk = tp_ranks._slim(step(10, 8), scored=False)  # tokens 10..17: the end of a only
    assert [im.data for im in chunk.images] == [a.data, b""]
    assert chunk.prompt_token_ids == [] and chunk.output_token_ids == []
    both = tp_ranks._slim(step(0, 32), scored=False)
    assert [im.data for im in both.images] == [a.data, b.data]
    assert tp_ranks._slim(step(28, 1), scored=False).images == ()  # a decode step
