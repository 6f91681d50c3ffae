"""The worker process's GIL switch interval, from ``TANDEM_SWITCH_INTERVAL_MS``; its port
checks and start-up errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.runtime import SERVER_OPTIONS, SWITCH_INTERVAL_ENV, gil_switch_interval
from services.config import ConfigError


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
