"""`tandem up --prefill 2 --decode 2` for real: load spreads over all four workers, and
`tandem bench serve` against it writes its JSON and plot (slow: five processes on the CPU)."""

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
