"""`tandem up` for real: the embedded model, gateway + 1 prefill + 1 decode (or 1 colocated
worker) on the CPU, with KV pools too small for a burst (slow)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
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
READY_COLOCATED = re.compile(
    r"^Tandem is ready: (http://\S+/v1) \(gateway \+ 1 colocated, model (.+)\)$"
)
# 256 tokens of context need 16 blocks of 16: a pool of 24 holds any one request, but not the
# 7 blocks each (~97 prompt tokens + 8) of the burst's 10 requests at once (3 fit)
SMALL_POOL = ("--max-model-len", "256", "--num-blocks", "24")
QUESTION = "Describe, in detail, how a parcel travels from one depot to the next. " * 4


def chat(url: str, model: str) -> str:
    body = {"model": model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}  # fmt: skip
    request = urllib.request.Request(
        f"{url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return str(json.load(response)["choices"][0]["message"]["content"])


def burst(url: str, model: str, n: int = 10, max_tokens: int = 8) -> list[httpx.Response]:
    def one(i: int) -> httpx.Response:
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"{i}. {QUESTION}"}]}  # fmt: skip
        return httpx.post(f"{url}/chat/completions", json=body, timeout=300)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def disconnect_while_waiting(url: str, model: str, n: int = 8) -> None:
    """Streams that go away after their first bytes or before: most are still queued."""

    def one(i: int) -> None:
        body = {"model": model, "max_tokens": 64, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"{i}. {QUESTION}"}]}  # fmt: skip
        with (
            contextlib.suppress(httpx.TimeoutException),
            httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=1.0) as r,
        ):
            next(r.iter_bytes())

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def wait_pools_free(url: str, timeout_s: float = 15.0) -> list[dict]:
    """Every worker's last reported load, once all hold nothing (or at the timeout)."""
    base = url.removesuffix("/v1")
    deadline = time.monotonic() + timeout_s
    while True:
        loads = [w["load"] for w in httpx.get(f"{base}/workers", timeout=5).json()["workers"]]
        idle = all(
            ld and ld["free_blocks"] == ld["total_blocks"] and ld["num_reserved"] == 0
            and ld["num_running"] == 0 and ld["num_waiting"] == 0 for ld in loads
        )  # fmt: skip
        if idle or time.monotonic() > deadline:
            return loads
        time.sleep(0.2)


def check_burst_is_queued_not_refused(url: str, model: str) -> None:
    """10 requests against pools that hold 3: all 200 (none refused for lack of KV); one that
    can never fit is a 400; clients that go away while queued leave every pool free."""
    responses = burst(url, model)
    assert [r.status_code for r in responses] == [200] * 10, [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in responses)
    queued = [float(dict(kv.split("=") for kv in r.headers["x-tandem-timing"].split(";"))["queue"])
              for r in responses]  # fmt: skip
    assert max(queued) > 0  # some waited for blocks
    too_long = {"model": model, "max_tokens": 600, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{url}/chat/completions", json=too_long, timeout=30)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    disconnect_while_waiting(url, model)
    loads = wait_pools_free(url)
    for ld in loads:
        assert (ld["free_blocks"], ld["num_reserved"], ld["num_running"], ld["num_waiting"]) == (
            ld["total_blocks"], 0, 0, 0,
        ), loads  # fmt: skip


def role_pids(root: int) -> dict[str, int]:
    """The `tandem ROLE` processes under ``root`` by role (one each here)."""
    out = {}
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"services.cli" in argv:
                out[argv[argv.index(b"services.cli") + 1].decode()] = pid
    return out


def check_a_killed_gateway_comes_back(up: Up, url: str, model: str) -> None:
    """kill -9 of the gateway: tandem up starts it again on its port and it serves within 10 s;
    the workers are not restarted."""
    before = role_pids(up.proc.pid)
    os.kill(before["gateway"], signal.SIGKILL)
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(OSError):  # refused or reset while it restarts
            if "Paris" in chat(url, model):
                break
        assert time.monotonic() - t0 < 10.0, "the gateway did not come back within 10 s"
        time.sleep(0.2)
    after = role_pids(up.proc.pid)
    assert after["gateway"] != before["gateway"]
    assert (after["prefill"], after["decode"]) == (before["prefill"], before["decode"])
    assert up.proc.poll() is None


def test_up_serves_a_chat_completion_queues_a_burst_and_stops_cleanly(tmp_path: Path) -> None:
    up = Up(tmp_path / "logs", *SMALL_POOL, program=TANDEM_UP)
    started: set[int] = set()
    try:
        url, model = up.wait_for(READY, timeout_s=600).groups()
        started = descendants(up.proc.pid)
        assert len(started) >= 3  # gateway, prefill, decode
        assert "Paris" in chat(url, model)
        check_burst_is_queued_not_refused(url, model)
        check_a_killed_gateway_comes_back(up, url, model)
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish(timeout_s=90) == 0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if alive(p)]
    finally:
        kill_all(up, started)


def test_up_colocated_queues_a_burst_larger_than_its_pool(tmp_path: Path) -> None:
    up = Up(tmp_path / "logs", *SMALL_POOL, "--colocated", "1", program=TANDEM_UP)
    started: set[int] = set()
    try:
        url, model = up.wait_for(READY_COLOCATED, timeout_s=600).groups()
        started = descendants(up.proc.pid)
        check_burst_is_queued_not_refused(url, model)
        up.proc.send_signal(signal.SIGTERM)
        assert up.finish(timeout_s=90) == 0
    finally:
        kill_all(up, started)


def kill_all(up: Up, started: set[int]) -> None:
    """Whatever a failed test left: the launcher and every process it ever started."""
    if up.proc.poll() is None:
        up.proc.kill()
    for pid in started | descendants(up.proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
