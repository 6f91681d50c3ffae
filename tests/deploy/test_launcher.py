"""`tandem up` end to end with fake children (tests/deploy/fake_child.py), as a real process."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from deploy.plan import Plan
from deploy.procfs import alive
from tests.deploy.conftest import REPO, child_env

READY = re.compile(
    r"^Tandem is ready: http://127\.0\.0\.1:(\d+)/v1 \(gateway \+ (.+), model fake-model\)$"
)

FAKE_UP = (sys.executable, "-m", "tests.deploy.fake_up")


class Up:
    """A running `fake_up` process whose output is collected line by line."""

    def __init__(
        self, log_dir: Path, *flags: str, program: Sequence[str] = FAKE_UP, **env: str
    ) -> None:
        argv = [*program, "--port", "0", "--log-dir", str(log_dir)]
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        # the run folder (tempfile's) in the test's own: a test that kills the launcher leaves
        # it behind, and /tmp filled with one a run
        self.proc = subprocess.Popen(
            [*argv, *flags],
            cwd=REPO,
            env={**os.environ, **child_env(**{"FAKE_GRACE": "2", "TMPDIR": str(log_dir), **env})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: re.Pattern[str], timeout_s: float = 30) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := pattern.match(line):
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError("no match; output:\n" + "\n".join(self.lines))

    def finish(self, timeout_s: float = 20) -> int:
        code = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        return code

    def children(self) -> dict[str, dict]:
        """What each fake child printed about itself (pid, argv, port, env)."""
        out = {}
        for log in self.log_dir.glob("*.log"):
            whole = log.read_text().split("\n")[:-1]  # the last may be still being written
            lines = [ln for ln in whole if ln.startswith("{")]
            if lines:
                out[log.stem] = json.loads(lines[0])
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for info in self.children().values():
            for pid in (info["pid"], info.get("grandchild")):
                if pid and alive(pid):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def start(tmp_path: Path):
    started: list[Up] = []

    def _start(*flags: str, **env: str) -> Up:
        up = Up(tmp_path / f"logs{len(started)}", *flags, **env)
        started.append(up)
        return up

    yield _start
    for up in started:
        up.kill()


def all_gone(pids: list[int], timeout_s: float = 5) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_up_prints_ready_and_leaves_no_process_behind(start, sig: signal.Signals) -> None:
    up = start("--prefill", "2", "--decode", "1")
    match = up.wait_for(READY)
    assert match.group(2) == "2 prefill + 1 decode"
    children = up.children()
    assert set(children) == {"prefill-0", "prefill-1", "decode-0", "gateway"}
    assert int(match.group(1)) == children["gateway"]["port"]
    assert any(line.strip().startswith("curl http://127.0.0.1:") for line in up.lines)
    up.proc.send_signal(sig)
    assert up.finish() == 0
    assert all_gone([c["pid"] for c in children.values()])


def test_gateway_is_pointed_at_every_worker(start) -> None:
    up = start("--colocated", "2")
    up.wait_for(READY)
    children = up.children()
    argv = children["gateway"]["argv"]
    targets = [argv[i + 1] for i, a in enumerate(argv) if a == "--worker"]
    assert targets == [f"127.0.0.1:{children[f'worker-{i}']['port']}" for i in range(2)]
    assert argv[argv.index("--tokenizer") + 1] == "/fake/model/dir"
    assert children["worker-0"]["env"]["OMP_NUM_THREADS"] == "1"


def test_gpus_are_pinned_per_worker(start) -> None:
    up = start("--gpus", "0,1")
    up.wait_for(READY)
    children = up.children()
    assert children["prefill-0"]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert children["decode-0"]["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert "cuda" in children["decode-0"]["argv"]


def test_a_decode_worker_sharing_a_gpu_gets_what_the_prefill_worker_leaves(start) -> None:
    # the prefill worker reports 36 of 144 GB held: the decode worker, started after it, may use
    # 0.9 - 0.25 of the GPU; the prefill worker's pool is capped at 4 steps' tokens
    up = start("--gpus", "0", FAKE_GPU_BYTES="prefill:36000000000:144000000000")
    up.wait_for(READY)
    children = up.children()
    prefill, decode = children["prefill-0"]["argv"], children["decode-0"]["argv"]
    assert prefill[prefill.index("--max-total-tokens") + 1] == "32768"
    assert prefill[prefill.index("--gpu-memory-utilization") + 1] == "0.45"
    assert decode[decode.index("--gpu-memory-utilization") + 1] == "0.65"
    assert "--max-total-tokens" not in decode
    assert any("decode-0 takes --gpu-memory-utilization 0.65" in line for line in up.lines)


def test_a_prefill_worker_holding_the_whole_gpu_stops_tandem_up_with_what_to_change(
    start,
) -> None:
    up = start("--gpus", "0", FAKE_GPU_BYTES="prefill:140000000000:144000000000")
    assert up.finish() == 2
    text = "\n".join(up.lines)
    assert "prefill workers sharing decode-0's GPU hold prefill-0 130.4 GiB" in text
    assert "--max-total-tokens" in text and "Traceback" not in text
    assert "decode-0" not in up.children()  # never started


def test_a_worker_that_fails_to_start_stops_everything_with_its_log(start) -> None:
    up = start(FAKE_FAIL_ROLE="decode")
    assert up.finish() == 1
    output = "\n".join(up.lines)
    assert "decode-0 exited with code 3" in output and "boom: decode failed" in output
    assert not any(line.startswith("Tandem is ready") for line in up.lines)
    assert all_gone([c["pid"] for c in up.children().values()])


def _lives(up: Up, name: str, count: int, timeout_s: float = 30) -> list[dict]:
    """The JSON self-descriptions in ``name``'s log (one per start), once there are ``count``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = (up.log_dir / f"{name}.log").read_text()
        lines = text.split("\n")[:-1]  # whole lines only: the last may be still being written
        lives = [json.loads(ln) for ln in lines if ln.startswith("{")]
        if len(lives) >= count:
            return lives
        time.sleep(0.05)
    raise AssertionError(f"{name} was not started {count} times; output:\n" + "\n".join(up.lines))


def test_a_worker_that_dies_is_started_again_on_its_port(start) -> None:
    up = start()
    up.wait_for(READY)
    children = up.children()
    os.kill(children["decode-0"]["pid"], signal.SIGKILL)
    first, second = _lives(up, "decode-0", 2)
    port = first["port"]
    assert second["port"] == port and second["pid"] != first["pid"]
    assert second["argv"][second["argv"].index("--port") + 1] == str(port)
    up.wait_for(re.compile(rf"tandem up: decode-0 exited unexpectedly .* again on port {port} "))
    assert up.proc.poll() is None  # still serving
    up.proc.send_signal(signal.SIGTERM)
    assert up.finish() == 0
    assert all_gone([second["pid"], *(c["pid"] for c in children.values())])


def test_a_worker_killed_ten_times_keeps_coming_back_while_the_rest_serve(start) -> None:
    up = start(TANDEM_UP_MAX_BACKOFF="0.3")  # the backoff grows, capped short for the test
    up.wait_for(READY)
    children = up.children()
    for n in range(2, 12):
        os.kill(_lives(up, "decode-0", n - 1)[-1]["pid"], signal.SIGKILL)
        _lives(up, "decode-0", n)
    lives = _lives(up, "decode-0", 11)
    assert len({life["pid"] for life in lives}) == 11 and {life["port"] for life in lives} == {
        children["decode-0"]["port"]
    }
    assert up.proc.poll() is None  # the launcher never gave up
    assert all(alive(c["pid"]) for name, c in children.items() if name != "decode-0")
    assert re.search(
        r"decode-0 exited unexpectedly .* in 0 s \(\d+ exits in 300 s\)", "\n".join(up.lines)
    )
    up.proc.send_signal(signal.SIGTERM)
    assert up.finish() == 0
    assert all_gone([life["pid"] for life in lives] + [c["pid"] for c in children.values()])


def test_a_dead_gateway_is_started_again_on_its_port_and_the_workers_stay(start) -> None:
    up = start()
    up.wait_for(READY)
    children = up.children()
    os.kill(children["gateway"]["pid"], signal.SIGKILL)
    first, second = _lives(up, "gateway", 2)
    assert second["pid"] != first["pid"] and second["port"] == first["port"]
    at = first["argv"].index("--port") + 1  # --port 0 became the port it had bound
    assert second["argv"] == [*first["argv"][:at], str(first["port"]), *first["argv"][at + 1 :]]
    assert up.proc.poll() is None
    assert all(alive(c["pid"]) for name, c in children.items() if name != "gateway")
    up.proc.send_signal(signal.SIGTERM)
    assert up.finish() == 0
    assert all_gone([second["pid"], *(c["pid"] for c in children.values())])


def test_stubborn_workers_and_grandchildren_are_killed_after_the_grace_period(start) -> None:
    up = start(FAKE_IGNORE_TERM="prefill", FAKE_GRANDCHILD="prefill")
    up.wait_for(READY)
    children = up.children()
    grandchild = children["prefill-0"]["grandchild"]
    up.proc.send_signal(signal.SIGTERM)
    assert up.finish() == 0
    assert all_gone([grandchild, *(c["pid"] for c in children.values())])


STOPPING = re.compile(r"^tandem up: stopping$")


@pytest.mark.parametrize(("first", "second", "code"), [
    (signal.SIGINT, signal.SIGINT, 130),
    (signal.SIGTERM, signal.SIGTERM, 143),
    (signal.SIGTERM, signal.SIGINT, 130),  # the signal that forced it names the status
], ids=["INT-INT", "TERM-TERM", "TERM-INT"])  # fmt: skip
def test_a_second_signal_forces_the_stop_and_exits_128_plus_its_number(
    start, first: signal.Signals, second: signal.Signals, code: int
) -> None:
    """A first signal drains (here a gateway that never finishes draining: it ignores SIGTERM,
    as one with a stream in flight waits out --drain-timeout); a second cuts the grace short and
    kills everything, and tandem up says so with 128 + N, not the 0 of a clean stop."""
    up = start(FAKE_IGNORE_TERM="gateway", FAKE_GRACE="60")
    up.wait_for(READY)
    children = up.children()
    up.proc.send_signal(first)
    up.wait_for(STOPPING)  # the first signal was taken: the stop has begun
    up.proc.send_signal(second)
    assert up.finish(timeout_s=20) == code  # well before the 60 s grace
    assert "in-flight work was cut" in "\n".join(up.lines)
    assert all_gone([c["pid"] for c in children.values()])


def test_the_ready_message_names_the_variable_the_gateways_key_came_from(start) -> None:
    up = start(VLLM_API_KEY="from-vllm", TANDEM_API_KEY="")
    up.wait_for(READY)
    curl = next(line for line in up.lines if line.strip().startswith("curl "))
    assert '-H "Authorization: Bearer $VLLM_API_KEY"' in curl
    assert not any("export TANDEM_API_KEY" in line for line in up.lines)  # it is set already
    up.proc.send_signal(signal.SIGTERM)
    assert up.finish() == 0


def test_a_worker_that_refuses_its_flags_makes_tandem_up_exit_2(start) -> None:
    """A child that exits 2 (the CLI's status for bad input: a flag only the engine checks)
    makes tandem up exit 2 as well, as a bad flag of its own would."""
    up = start(FAKE_FAIL_ROLE="prefill", FAKE_FAIL_CODE="2")
    assert up.finish() == 2
    assert "prefill-0 exited with code 2" in "\n".join(up.lines)


def test_a_failed_model_preparation_starts_no_worker(start) -> None:
    up = start(FAKE_PREPARE_FAIL="1")
    assert up.finish() == 2  # the model was not found: bad input
    output = "\n".join(up.lines)
    assert "preparing the model failed" in output and "model 'nope' not found" in output
    assert output.count("model 'nope' not found") == 1  # said once, not echoed and then again
    assert up.children() == {}


def test_a_log_dir_that_cannot_be_written_is_refused_before_anything_starts(
    start, tmp_path: Path
) -> None:
    """--log-dir under a file (or on a read-only disk) was a traceback, exit 1, once the first
    child started; now exit 2 and one line, before the model is prepared."""
    (tmp_path / "a-file").write_text("")
    up = start("--log-dir", str(tmp_path / "a-file" / "logs"))
    assert up.finish() == 2
    output = "\n".join(up.lines)
    assert "--log-dir " in output and "cannot write a log there (Not a directory)" in output
    assert "Traceback" not in output and "preparing model" not in output


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--decode", "0"], "--colocated"),
        (["--tensor-parallel-size", "2", "--gpus", "0"], "needs 2 GPUs"),
    ],
)
def test_tandem_up_refuses_impossible_topologies(flags: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", *flags],
        cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, **child_env()},
    )  # fmt: skip
    assert out.returncode == 2
    assert message in out.stderr


def test_a_busy_gateway_port_fails_before_any_model_loads(start) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        up = start("--port", str(busy.getsockname()[1]))
        assert up.finish() == 2
    assert "choose another --port" in "\n".join(up.lines)
    assert up.children() == {}


def test_a_second_tandem_up_on_the_port_fails_before_it_starts_anything(
    start, tmp_path: Path
) -> None:
    """Two `tandem up` on one port started moments apart: the port was only tried at the
    start and bound by the gateway once the workers were ready, so the second launch started
    its workers too (minutes of model loading) and found out at its gateway. The first now
    holds the port from its first step and hands it to its gateway."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gate = tmp_path / "model-ready"
    first = start("--port", str(port), FAKE_PREPARE_GATE=str(gate))
    first.wait_for(re.compile(r"tandem up: preparing model"))  # no worker, no gateway yet
    second = start("--port", str(port))
    assert second.finish() == 2
    assert second.lines == [f"tandem up: port {port} on 127.0.0.1 is in use: choose another --port"]
    assert second.children() == {}
    gate.touch()
    assert int(first.wait_for(READY).group(1)) == port  # its gateway serves the held socket
    assert first.children()["gateway"]["env"]["TANDEM_LISTEN_FD"] is not None
    first.proc.send_signal(signal.SIGINT)
    assert first.finish() == 0


def _plan(task: str) -> Plan:
    return Plan([], [], [], {}, Path("ready"), "cpu", "127.0.0.1", 8000, "m", task=task)


def _curl_body(message: str) -> tuple[str, dict]:
    curl = next(line for line in message.splitlines() if line.strip().startswith("curl "))
    return curl.split()[1], json.loads(curl.split(" -d ", 1)[1].strip("'"))


def test_the_ready_example_is_short_and_greedy() -> None:
    """On the CPU an unbounded, sampled chat runs minutes and prints noise: README's example."""
    from deploy.launcher import ready_message

    url, body = _curl_body(ready_message(_plan("generate"), "http://h:1/v1", "m", None))
    assert url == "http://h:1/v1/chat/completions"
    assert body["max_tokens"] == 32 and body["temperature"] == 0 and body["model"] == "m"


def test_an_embedding_server_shows_an_embeddings_example() -> None:
    """A chat to an embed worker is a 400 wrong_task: the example asks for what it serves."""
    from deploy.launcher import ready_message

    url, body = _curl_body(ready_message(_plan("embed"), "http://h:1/v1", "m", "k", "VLLM_API_KEY"))
    assert url == "http://h:1/v1/embeddings"
    assert body == {"model": "m", "input": "Paris is the capital of France."}


def test_tandem_up_hands_its_task_to_the_ready_message(start) -> None:
    up = start("--colocated", "1", "--task", "embed")
    up.wait_for(READY)
    curl = next(line for line in up.lines if line.strip().startswith("curl "))
    assert "/v1/embeddings " in curl
    up.proc.send_signal(signal.SIGTERM)
    assert up.finish() == 0


# ---- the run directory: removed by the next tandem up once its launcher was killed -----------
LAUNCHER_MAKING_A_RUN_DIR = (
    "import sys, time; from pathlib import Path; from deploy.launcher import make_run_dir; "
    "print(make_run_dir(Path(sys.argv[1])), flush=True); time.sleep(120)"
)


def test_a_run_dir_left_by_a_launcher_killed_with_sigkill_goes_with_the_next_tandem_up(
    tmp_path: Path,
) -> None:
    """SIGKILL gives a launcher no chance to remove its run directory (one more in /tmp a
    run): the next `tandem up` removes it, and never that of a launcher still running."""
    from deploy.launcher import make_run_dir, sweep_run_dirs

    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER_MAKING_A_RUN_DIR, str(tmp_path)], cwd=REPO,
        env={**os.environ, **child_env()}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert launcher.stdout is not None
        left = Path(launcher.stdout.readline().strip())
        assert (left / "launcher.pid").read_text().split()[0] == str(launcher.pid)
        assert sweep_run_dirs(tmp_path) == [] and left.is_dir()  # its launcher runs: kept
    finally:
        launcher.kill()
        launcher.wait()
    assert left.is_dir()  # what SIGKILL leaves
    ours = make_run_dir(tmp_path)  # the next tandem up
    assert not left.exists()
    assert [p.name for p in tmp_path.iterdir()] == [ours.name]
    assert sweep_run_dirs(tmp_path) == [] and ours.is_dir()  # ours, we run


def _run_dir(parent: Path, name: str, owner: str | None) -> Path:
    path = parent / f"tandem-run-{name}"
    path.mkdir()
    if owner is not None:
        (path / "launcher.pid").write_text(owner)
    return path


def test_a_run_dir_whose_pid_now_names_another_process_is_stale(tmp_path: Path) -> None:
    """A pid is reused once its process is gone: the start time tells the two apart."""
    from deploy.launcher import sweep_run_dirs
    from deploy.procfs import start_ticks

    parent = os.getppid()
    started = start_ticks(parent)
    assert started is not None
    reused = _run_dir(tmp_path, "reused", f"{parent} {started + 1}\n")
    same = _run_dir(tmp_path, "same", f"{parent} {started}\n")
    unknown = _run_dir(tmp_path, "unknown", f"{parent} 0\n")  # no /proc when it was made
    assert sweep_run_dirs(tmp_path) == [reused]
    assert not reused.exists() and same.is_dir() and unknown.is_dir()


def test_a_run_dir_of_a_zombie_or_reaped_launcher_is_stale(tmp_path: Path) -> None:
    from deploy.launcher import sweep_run_dirs
    from deploy.procfs import start_ticks

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    started = None
    while started is None or alive(gone.pid):  # exited, not yet waited for: a zombie
        started = started or start_ticks(gone.pid) or 0
        time.sleep(0.01)
    zombie = _run_dir(tmp_path, "zombie", f"{gone.pid} {started}\n")
    assert sweep_run_dirs(tmp_path) == [zombie]
    gone.wait()
    reaped = _run_dir(tmp_path, "reaped", f"{gone.pid} {started}\n")
    assert sweep_run_dirs(tmp_path) == [reaped]


def test_what_the_sweep_cannot_tell_is_left_alone(tmp_path: Path) -> None:
    """No owner file (a launcher making it, an older Tandem's), an unreadable one, a symlink or
    a file of that name, another prefix: kept, whatever their owner's pid would say."""
    from deploy.launcher import sweep_run_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = f"{gone.pid} 0\n"
    kept = [
        _run_dir(tmp_path, "making", None),
        _run_dir(tmp_path, "garbage", "not a pid\n"),
        _run_dir(tmp_path, "empty", ""),
    ]
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "launcher.pid").write_text(dead)
    (tmp_path / "tandem-run-link").symlink_to(target)
    (tmp_path / "tandem-run-file").write_text(dead)
    logs = tmp_path / "tandem-logs-x"
    logs.mkdir()
    (logs / "launcher.pid").write_text(dead)
    assert sweep_run_dirs(tmp_path) == []
    assert all(p.is_dir() for p in [*kept, target, logs])
    assert (tmp_path / "tandem-run-link").is_symlink() and (tmp_path / "tandem-run-file").exists()


def test_tandem_up_sweeps_the_temporary_directory_and_removes_its_own_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    import deploy.launcher
    from services.cli import build_parser
    from services.config import ConfigError

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = _run_dir(tmp_path, "killed", f"{gone.pid} 0\n")
    made: list[Path] = []

    def plan(args: object, gpus: object, cpus: int, run_dir: Path, **kw: object) -> None:
        made.append(run_dir)
        assert not stale.exists() and (run_dir / "launcher.pid").is_file()
        raise ConfigError("stop here")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(deploy.launcher, "detect_gpus", lambda *a, **kw: [])
    monkeypatch.setattr(deploy.launcher, "build_plan", plan)
    args = build_parser().parse_args(["up", "--log-dir", str(tmp_path / "logs")])
    assert deploy.launcher.main(args) == 2
    assert len(made) == 1 and made[0].parent == tmp_path
    assert not list(tmp_path.glob("tandem-run-*"))  # the stale one and its own
