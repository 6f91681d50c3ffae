"""`tandem up --prefill 2 --decode 2` for real: load spreads over all four workers,
`tandem bench serve` against it writes its JSON and plot, and a stream outlives the decode
worker serving it (slow: five processes on the CPU)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from deploy.procfs import alive, descendants
from tests.deploy.test_launcher import Up
from tests.deploy.test_up_e2e import TANDEM_UP

pytestmark = pytest.mark.slow
READY = re.compile(
    r"^Tandem is ready: (http://\S+/v1) \(gateway \+ 2 prefill \+ 2 decode, model (.+)\)$"
)
# distinct openings: the router sends prompts that share their leading blocks to the same prefill
# worker (prefix-cache affinity), so load spreads over prefill workers across different prompts
TOPICS = ["rivers", "mountains", "violins", "satellites", "bread", "glaciers", "chess", "volcanoes",
          "lighthouses", "bees", "trains", "comets", "orchids", "deserts", "submarines", "owls"]  # fmt: skip
PROMPTS = [f"{t.capitalize()} are fascinating. Here is a long list of facts about {t}, each one more "
           f"surprising than the last, written for curious readers:" for t in TOPICS]  # fmt: skip


def _workers(url: str) -> list[dict]:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/workers", timeout=10) as resp:
        return list(json.load(resp)["workers"])


def _wait_for_load(url: str, deadline_s: float = 10) -> list[dict]:
    deadline = time.monotonic() + deadline_s
    while True:  # GetLoad is polled about once a second
        ws = _workers(url)
        if (
            all(w["load"] and w["load"]["generation_tokens"] > 0 for w in ws)
            or time.monotonic() > deadline
        ):
            return ws
        time.sleep(0.5)


def _sse_text(url: str, body: dict, on_chunk: Callable[[int], None]) -> tuple[str, list[dict]]:
    """A streamed completion's text and its error frames; ``on_chunk(n)`` after the n-th."""
    req = urllib.request.Request(url + "/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    text, errors, n = "", [], 0
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame = json.loads(line[len("data: ") :])
            if "error" in frame:
                errors.append(frame)
                continue
            text += "".join(c["text"] for c in frame["choices"])
            n += 1
            on_chunk(n)
    return text, errors


def _kill_the_busy_decode_worker(url: str, started: set[int]) -> int:
    """SIGKILL the decode worker that has a request running (its load says so); its pid."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        busy = [w["name"] for w in _workers(url)
                if w["role"] == "decode" and w["load"] and w["load"]["num_running"] > 0]  # fmt: skip
        if busy:
            for pid in started:
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if (
                        b"--worker-id" in argv
                        and argv[argv.index(b"--worker-id") + 1] == busy[0].encode()
                    ):
                        os.kill(pid, signal.SIGKILL)
                        return pid
        time.sleep(0.1)
    raise AssertionError("no decode worker reported the request running")


def _stream_outlives_its_decode_worker(url: str, model: str, started: set[int]) -> None:
    """A greedy stream whose decode worker is killed after 8 chunks resumes on the other
    decode worker: one stream, no error frame, the text of a run nobody killed, and most of
    its chunks came after the kill (the stream was not over when it happened)."""
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    whole, errors = _sse_text(url, body, lambda n: None)
    assert not errors and whole
    deadline = time.monotonic() + 20  # the loads polled after that run: the next busy one is ours
    while any(w["load"]["num_running"] for w in _workers(url) if w["role"] == "decode"):
        assert time.monotonic() < deadline, "a decode worker still reports a request running"
        time.sleep(0.1)
    killed_at: list[int] = []
    chunks: list[int] = []

    def kill_at(n: int) -> None:
        chunks.append(n)
        if n == 8:
            _kill_the_busy_decode_worker(url, started)
            killed_at.append(n)

    text, errors = _sse_text(url, body, kill_at)
    assert killed_at, "the stream ended before its decode worker could be killed"
    assert not errors, errors
    assert text == whole
    assert chunks[-1] - killed_at[0] > 30  # streamed on by the other decode worker


def test_up_two_by_two_spreads_load_and_bench_serve_reports(tmp_path: Path) -> None:
    from openai import OpenAI

    up = Up(tmp_path / "logs", "--prefill", "2", "--decode", "2", "--max-model-len", "512",
            "--kv-cache-gib", "0.25", program=TANDEM_UP)  # fmt: skip
    started: set[int] = set()
    try:
        url, model = up.wait_for(READY, timeout_s=900).groups()
        started = descendants(up.proc.pid)
        client = OpenAI(base_url=url, api_key="unused", timeout=120)

        def ask(prompt: str) -> str:
            res = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=8,
                temperature=0,
            )
            return res.choices[0].message.content or ""

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, PROMPTS))
        assert all(answers)
        workers = _wait_for_load(url)
        assert sorted(w["role"] for w in workers) == ["decode", "decode", "prefill", "prefill"]
        busy = [w["address"] for w in workers if w["load"] and w["load"]["generation_tokens"] > 0]
        assert len(busy) == 4, f"load did not reach every worker: {workers}"

        out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
        bench = [sys.executable, "-m", "services.cli", "bench", "serve", "--base-url",
                 url.removesuffix("/v1"), "--model", model, "--input-len", "32", "--output-len", "8",
                 "--num-prompts", "6", "--request-rate", "inf", "--request-rate", "4",
                 "--json-out", str(out), "--plot", str(plot)]  # fmt: skip
        res = subprocess.run(bench, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        report = json.loads(out.read_text())
        assert len(report["results"]) == 2
        for row in report["results"]:
            assert row["completed"] == 6 and row["failed"] == 0
            for key in ("mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p90_itl_ms", "mean_e2el_ms",
                        "request_throughput", "output_throughput", "goodput"):  # fmt: skip
                assert key in row
            assert 0 < row["mean_ttft_ms"] <= row["mean_e2el_ms"]
        assert plot.stat().st_size > 1000

        _stream_outlives_its_decode_worker(url, model, started)

        up.proc.send_signal(signal.SIGTERM)
        assert up.finish(timeout_s=120) == 0
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
