"""``tandem gateway`` as a process: ready file, serving, and draining on SIGTERM."""

from __future__ import annotations

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
