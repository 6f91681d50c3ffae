"""`tandem up` for real: the embedded model, gateway + 1 prefill + 1 decode on the CPU (slow)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from deploy.procfs import alive, descendants
from tests.deploy.test_launcher import Up

pytest.importorskip("services.prefill.server")
pytest.importorskip("services.decode.server")
pytestmark = pytest.mark.slow

TANDEM_UP = (sys.executable, "-m", "services.cli", "up")
READY = re.compile(
    r"^Tandem is ready: (http://\S+/v1) \(gateway \+ 1 prefill \+ 1 decode, model (.+)\)$"
)


def chat(url: str, model: str) -> str:
    body = {"model": model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return str(json.load(response)["choices"][0]["message"]["content"])


def test_up_serves_a_chat_completion_and_stops_cleanly(tmp_path: Path) -> None:
    up = Up(tmp_path / "logs", "--max-model-len", "512", program=TANDEM_UP)
    started: set[int] = set()
    try:
        url, model = up.wait_for(READY, timeout_s=600).groups()
        started = descendants(up.proc.pid)
        assert len(started) >= 3  # gateway, prefill, decode
        assert "Paris" in chat(url, model)
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish(timeout_s=90) == 0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if alive(p)]
    finally:
        if up.proc.poll() is None:
            up.proc.kill()
        for pid in started | descendants(up.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
