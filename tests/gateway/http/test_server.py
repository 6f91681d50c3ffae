"""``tandem gateway`` as a process: ready file, serving, and draining on SIGTERM."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.stack import Stack

pytestmark = pytest.mark.timeout(90)

_MAIN = """
import sys
from services.cli import HANDLERS, build_parser
args = build_parser().parse_args(sys.argv[1:])
args.drain_timeout = 1.0
sys.exit(HANDLERS["gateway"](args))
"""


@pytest.fixture
def gateway_process(
    colocated: Stack, tokenizer_dir: str, tmp_path
) -> Iterator[tuple[subprocess.Popen, str]]:
    ready = tmp_path / "ready"
    cmd = [sys.executable, "-c", _MAIN, "gateway", "--tokenizer", tokenizer_dir, "--port", "0",
           "--worker", colocated.workers[0].address, "--ready-file", str(ready)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), proc.stdout.read() if proc.poll() is not None else "no ready file"
        yield proc, f"http://127.0.0.1:{json.loads(ready.read_text())['port']}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()


def test_sigterm_drains_then_aborts_in_flight_requests(
    gateway_process: tuple[subprocess.Popen, str], colocated: Stack
) -> None:
    proc, url = gateway_process
    assert httpx.get(f"{url}/health").json() == {
        "status": "ok", "workers": {"healthy": 1, "total": 1, "down": []}
    }  # fmt: skip
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello world", "max_tokens": 2})
    assert ok.json()["choices"][0]["text"] == "Hello world"

    colocated.workers[0].behavior.token_delay_s = 0.1  # 100 tokens: far longer than the grace
    frames: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "Hello world", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    frames.append(line[6:])
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(10)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    assert httpx.get(f"{url}/health").status_code == 503  # draining, still answering
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"

    reader.join(20)
    assert frames[-1] == "[DONE]"
    finals = [json.loads(f)["choices"][0]["finish_reason"] for f in frames[:-1] if "choices" in f]
    assert finals[-1] == "abort" and len(finals) < 100
    assert proc.wait(20) == 0  # drained and exited by itself
    assert len(colocated.workers[0].records.aborts) == 1


def test_ready_file_holds_the_port_and_sigint_exits(
    gateway_process: tuple[subprocess.Popen, str],
) -> None:
    proc, url = gateway_process
    assert httpx.get(f"{url}/version").status_code == 200
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 0
    output = proc.stdout.read()
    assert f"gateway listening on {url}" in output


def test_a_second_signal_cuts_the_drain_and_exits_128_plus_its_number(
    gateway_process: tuple[subprocess.Popen, str], colocated: Stack
) -> None:
    """One signal drains and exits 0; a second one exits at once with 130 (SIGINT), as
    `tandem up` does, so a supervisor can tell that in-flight work was cut."""
    proc, url = gateway_process
    colocated.workers[0].behavior.token_delay_s = 0.1  # 100 tokens: far longer than the test
    started = threading.Event()

    def stream() -> None:
        body = {"prompt": "Hello world", "max_tokens": 100, "stream": True}
        url_ = f"{url}/v1/completions"
        # the forced exit cuts it
        with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url_, json=body) as r:
            for _ in r.iter_lines():
                started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(10)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.05)  # the drain has begun once /health says so
    proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 128 + signal.SIGINT
    assert "second signal: exiting without waiting" in proc.stdout.read()
    reader.join(20)


def test_a_listening_socket_handed_over_is_served_on_its_port(
    colocated: Stack, tokenizer_dir: str, tmp_path
) -> None:
    """`tandem up` binds the gateway's port before it starts the workers and hands the socket
    over (TANDEM_LISTEN_FD): the gateway serves it, the port busy by design, not refused."""
    import os
    import socket

    ready = tmp_path / "ready"
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cmd = [sys.executable, "-c", _MAIN, "gateway", "--tokenizer", tokenizer_dir, "--port",
               str(port), "--worker", colocated.workers[0].address, "--ready-file", str(ready)]  # fmt: skip
        env = {**os.environ, "TANDEM_LISTEN_FD": str(held.fileno())}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, pass_fds=(held.fileno(),))  # fmt: skip
    try:  # the parent's copy is closed: only the gateway's serves now
        deadline = time.monotonic() + 30
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists(), proc.stdout.read() if proc.poll() is not None else "no ready file"
        assert json.loads(ready.read_text())["port"] == port
        assert httpx.get(f"http://127.0.0.1:{port}/version").status_code == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()


def _gateway_exits_2(argv: list[str], caplog: pytest.LogCaptureFixture) -> str:
    """``tandem gateway ARGV`` refused at start: exit 2, one log line, no traceback."""
    from services.cli import main

    assert main(["gateway", *argv]) == 2
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and errors[0].exc_info is None, caplog.text
    assert "Traceback" not in caplog.text
    return errors[0].getMessage()


def test_a_port_in_use_is_refused_before_anything_loads(
    busy_port: int, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["--tokenizer", str(tmp_path), "--worker", "127.0.0.1:1", "--port", str(busy_port)]
    message = _gateway_exits_2(argv, caplog)
    assert message == f"port {busy_port} on 127.0.0.1 is in use: choose another --port"


def test_a_missing_chat_template_exits_2(
    tokenizer_dir: str, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = str(tmp_path / "nothing.jinja")
    argv = ["--tokenizer", tokenizer_dir, "--worker", "127.0.0.1:1", "--port", "0",
            "--chat-template", missing]  # fmt: skip
    message = _gateway_exits_2(argv, caplog)
    assert message == (f"--chat-template {missing}: cannot read it (No such file or directory); "
                       "pass a Jinja template file or the template itself")  # fmt: skip


def test_a_model_directory_without_a_tokenizer_exits_2(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "config.json").write_text("{}")
    argv = ["--model", str(tmp_path), "--worker", "127.0.0.1:1", "--port", "0"]
    assert "no tokenizer.json in" in _gateway_exits_2(argv, caplog)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], "no workers: give --worker HOST:PORT (colocated), or --prefill and --decode"),
        (["--prefill", "127.0.0.1:2"], "prefill workers but no decode worker"),
        (["--worker", "127.0.0.1:1", "--tool-call-parser", "hermes"],
         "--tool-call-parser is used only with --enable-auto-tool-choice"),
        (["--config", "/nonexistent.yaml"], "--config /nonexistent.yaml: cannot read it"),
        (["--worker", "127.0.0.1:1", "--api-key", ""],
         "--api-key '' is empty: give a non-empty key, or leave the flag out"),
    ],
)  # fmt: skip
def test_flags_that_leave_nothing_to_serve_or_do_nothing_exit_2(
    argv: list[str], words: str, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    message = _gateway_exits_2(["--tokenizer", str(tmp_path), "--port", "0", *argv], caplog)
    assert words in message
