"""The worker process's GIL switch interval, from ``TANDEM_SWITCH_INTERVAL_MS``; its port
checks and start-up errors; its exit after a tensor-parallel rank died."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from deploy.procfs import descendants
from services.common.runtime import SERVER_OPTIONS, SWITCH_INTERVAL_ENV, gil_switch_interval
from services.config import ConfigError
from tests.services.engine.conftest import tiny_checkpoint
from tests.services.procs import Fleet, Proc


@pytest.fixture(autouse=True)
def _restore_the_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_unset_leaves_pythons_interval_and_a_value_sets_it(
    monkeypatch: pytest.MonkeyPatch, _restore_the_interval: float
) -> None:
    monkeypatch.delenv(SWITCH_INTERVAL_ENV, raising=False)
    gil_switch_interval()
    assert sys.getswitchinterval() == _restore_the_interval
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "20")
    gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.02)


@pytest.mark.parametrize("raw", ["0", "-1", "fast", "5000"])
def test_a_bad_value_is_a_config_error_that_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str, _restore_the_interval: float
) -> None:
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, raw)
    with pytest.raises(ConfigError, match=SWITCH_INTERVAL_ENV):
        gil_switch_interval()
    assert sys.getswitchinterval() == _restore_the_interval


ROOT = Path(__file__).resolve().parents[3]


def test_two_servers_cannot_share_a_port() -> None:
    """gRPC's default SO_REUSEPORT would let a second worker bind the first one's port (and
    take part of its traffic); the workers' options turn it off."""

    async def second_binds() -> bool:
        first = grpc.aio.server(options=SERVER_OPTIONS)
        port = first.add_insecure_port("127.0.0.1:0")
        await first.start()
        try:
            second = grpc.aio.server(options=SERVER_OPTIONS)
            try:
                second.add_insecure_port(f"127.0.0.1:{port}")
            except RuntimeError:
                return False
            await second.stop(None)
            return True
        finally:
            await first.stop(None)

    assert not asyncio.run(second_binds())


def _worker(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *argv], cwd=ROOT, timeout=120,
                          capture_output=True, text=True)  # fmt: skip


def test_a_worker_on_a_port_in_use_exits_2_on_stderr(busy_port: int) -> None:
    done = _worker("worker", "--port", str(busy_port))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"error: port {busy_port} on 127.0.0.1 is in use: choose another --port" in done.stderr
    assert "Traceback" not in done.stderr and "error" not in done.stdout


def test_a_decode_worker_whose_kv_port_is_in_use_exits_2_before_loading(busy_port: int) -> None:
    """Its KV receiver listens only once the model is loaded: the port is checked first (it
    was an OSError traceback after the load)."""
    done = _worker("decode", "--port", "0", "--kv-port", str(busy_port))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"port {busy_port} on 127.0.0.1 is in use: choose another --kv-port" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_missing_model_is_an_error_on_stderr(tmp_path: Path) -> None:
    done = _worker("prefill", "--model", str(tmp_path / "nothing"), "--port", "0")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "error: model" in done.stderr and "not found" in done.stderr
    assert "error" not in done.stdout


# a sitecustomize for the worker process alone (its follower ranks have the parent pid in their
# environment): the decode role's stop hook that shuts the KV receiver down never returns, as
# one waiting on the device for a peer that is gone would; a draining worker gives a stop hook
# 2 s instead of STOP_HOOK_S
STOP_HOOK_HANGS = """
import os, sys, time
from importlib.machinery import PathFinder
if not os.environ.get("TANDEM_TP_PARENT_PID"):
    class Finder:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name not in ("services.decode.server", "services.common.runtime"):
                return None
            spec = PathFinder.find_spec(name, path)
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                if name == "services.common.runtime":
                    module.STOP_HOOK_S = 2.0
                    return
                def stop_receiver(self):
                    open(os.environ["HANG_FLAG"], "w").close()
                    while True:
                        time.sleep(1)
                module.DecodeServicer.stop_receiver = stop_receiver
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder)
"""


@pytest.fixture
def hanging_hook_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fleet]:
    """A fleet whose decode workers' KV-receiver stop hook never returns (STOP_HOOK_HANGS; the
    flag file ``hung`` marks that it ran), and the model they serve at ``tmp_path / "model"``."""
    tiny_checkpoint(tmp_path / "model", "llama", num_hidden_layers=2, hidden_size=64,
                    num_attention_heads=8, num_key_value_heads=2, intermediate_size=96)  # fmt: skip
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(STOP_HOOK_HANGS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("HANG_FLAG", str(tmp_path / "hung"))
    fleet = Fleet(tmp_path / "fleet")
    try:
        yield fleet
    finally:
        fleet.close()


def _exit_and_log(proc: Proc, hung_flag: Path) -> tuple[int, str]:
    """The worker's exit status (within 60 s) and log, once its stop hook ran and hung."""
    try:
        code = proc.popen.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the worker did not exit:\n" + proc.log_path.read_text()[-2000:])
    log = proc.log_path.read_text()
    assert hung_flag.exists(), log[-2000:]  # the hook ran, and hung
    return code, log


@pytest.mark.slow
def test_a_worker_whose_rank_died_exits_though_a_stop_hook_hangs(
    tmp_path: Path, hanging_hook_fleet: Fleet
) -> None:
    """kill -9 of a decode worker's follower rank: the worker fails, stops its server, gives
    each stop hook 5 s and exits with status 1, though a hook never returns. Before, Python's
    teardown joined the hung hook's thread (``asyncio.run``: for ever on 3.11), and the worker
    never exited; `tandem up` could neither stop nor restart it."""
    proc = hanging_hook_fleet.start("decode", "--model", str(tmp_path / "model"), "--device",
                                    "cpu", "--dtype", "float32", "--tensor-parallel-size", "2")  # fmt: skip
    followers = [
        pid for pid in descendants(proc.pid)
        if b"services.engine.tp_follower" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]  # fmt: skip
    assert len(followers) == 1
    os.kill(followers[0], signal.SIGKILL)
    killed = time.monotonic()
    code, log = _exit_and_log(proc, tmp_path / "hung")
    print(f"the worker exited {time.monotonic() - killed:.1f} s after its rank's kill")
    assert code == 1, log[-2000:]
    assert "tensor-parallel rank 1 exited with status -9; the worker exits" in log


@pytest.mark.slow
def test_a_draining_worker_whose_stop_hook_hangs_exits_1(
    tmp_path: Path, hanging_hook_fleet: Fleet
) -> None:
    """SIGTERM: the worker drains and runs its stop hooks, each for STOP_HOOK_S at most; one
    that does not return makes it leave at once with status 1 (it would otherwise wait for the
    hook's thread for ever) and say so."""
    proc = hanging_hook_fleet.start("decode", "--model", str(tmp_path / "model"), "--device",
                                    "cpu", "--dtype", "float32")  # fmt: skip
    proc.popen.send_signal(signal.SIGTERM)
    code, log = _exit_and_log(proc, tmp_path / "hung")
    assert code == 1, log[-2000:]
    assert "a stop hook did not return in 2 s" in log


class _StuckDriver:
    """What check_engine reads of the engine thread: how long its step has run."""

    def __init__(self) -> None:
        self.busy = 0.0
        self.thread_ident = threading.get_ident()  # a live thread's stack to log

    def busy_for(self) -> float:
        return self.busy


def test_a_step_past_the_engine_stall_timeout_stops_serving_until_it_returns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from grpc_health.v1 import health_pb2

    from protos.roles import Role
    from services.common.runtime import WorkerRuntime
    from services.config import EngineConfig, WorkerConfig

    names = ["tandem.v1.DecodeService"]

    async def statuses(rt: WorkerRuntime) -> set[int]:
        request = health_pb2.HealthCheckRequest
        return {(await rt.health.Check(request(service=n), None)).status for n in ["", *names]}

    async def run() -> None:
        config = WorkerConfig(Role.DECODE, EngineConfig(device="cpu"), "d0",
                              engine_stall_timeout_s=5.0)  # fmt: skip
        rt = WorkerRuntime(config)
        driver = _StuckDriver()
        rt.driver = driver  # type: ignore[assignment]
        await rt._set_health(health_pb2.HealthCheckResponse.SERVING, names)
        serving, not_serving = (health_pb2.HealthCheckResponse.SERVING,
                                health_pb2.HealthCheckResponse.NOT_SERVING)  # fmt: skip
        driver.busy = 4.9  # a long step, within the limit
        await rt.check_engine(names)
        assert await statuses(rt) == {serving} and rt.engine_stalled_s == 0.0
        driver.busy = 5.0
        await rt.check_engine(names)
        assert await statuses(rt) == {not_serving} and rt.engine_stalled_s == 5.0
        driver.busy = 7.5  # still in it: the figure grows, the stack is logged once
        await rt.check_engine(names)
        assert rt.engine_stalled_s == 7.5
        stalls = [r for r in caplog.records if "in one step" in r.getMessage()]
        assert len(stalls) == 1 and "--engine-stall-timeout 5" in stalls[0].getMessage()
        assert "test_runtime.py" in stalls[0].getMessage()  # the engine thread's stack
        driver.busy = 0.0  # the step returned
        await rt.check_engine(names)
        assert await statuses(rt) == {serving} and rt.engine_stalled_s == 0.0
        rt.draining = True  # a draining worker stays NOT_SERVING after a stall
        await rt._set_health(not_serving, names)
        driver.busy = 6.0
        await rt.check_engine(names)
        driver.busy = 0.0
        await rt.check_engine(names)
        assert await statuses(rt) == {not_serving}
        await rt.server.stop(None)

    caplog.set_level(logging.INFO, logger="services.common.runtime")
    asyncio.run(run())


def _config(role: str, host: str, kv_host: str = "", token: str = "") -> Any:
    from types import SimpleNamespace

    from protos.roles import Role
    from services.config import WorkerConfig

    engine: Any = SimpleNamespace(task="generate")
    return WorkerConfig(Role(role), engine, "w", host=host, kv_host=kv_host, internal_token=token)


@pytest.mark.parametrize(
    ("role", "host", "kv_host", "token", "named"),
    [("colocated", "0.0.0.0", "", "", ["0.0.0.0"]),  # docker compose's default: no token set
     ("prefill", "10.1.2.3", "", "", ["10.1.2.3"]),
     ("decode", "127.0.0.1", "decode-0", "", ["decode-0"]),  # the KV rendezvous only
     ("decode", "::", "10.0.0.7", "", ["::", "10.0.0.7"]),
     ("colocated", "0.0.0.0", "", "s3cret", []),
     ("decode", "127.0.0.1", "", "", []), ("colocated", "localhost", "", "", []),
     ("prefill", "[::1]", "", "", [])],
)  # fmt: skip
def test_a_worker_reachable_beyond_loopback_without_a_token_is_named(
    role: str, host: str, kv_host: str, token: str, named: list[str]
) -> None:
    """A worker bound to 0.0.0.0 with no internal token took any caller's Reserve, Prefill or
    KV without a word; the worker now says so at start, naming what to set."""
    from services.common.runtime import open_addresses

    assert open_addresses(_config(role, host, kv_host, token)) == named
