"""deploy.bench.memory: every process of a started topology is found and its memory read."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from deploy.bench.memory import main, measure
from deploy.procfs import alive

FAKE_UP = (sys.executable, "-m", "tests.deploy.fake_up")


def test_measure_reads_every_process_of_the_topology_and_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    os.environ.setdefault("FAKE_READY_TIMEOUT", "30")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the launcher's run folder in the test's own
    flags = ["--log-dir", str(tmp_path / "logs"), "--prefill", "1", "--decode", "2"]
    result = measure(flags, requests=0, timeout_s=60, program=FAKE_UP)
    procs = result["processes"]
    roles = sorted(p["role"] for p in procs)
    assert roles.count("prefill") == 1 and roles.count("decode") == 2 and "gateway" in roles
    assert all(p["rss_mb"] > 0 and p["anon_mb"] + p["file_mb"] <= p["rss_mb"] + 0.2 for p in procs)
    assert abs(result["total_rss_mb"] - sum(p["rss_mb"] for p in procs)) < 0.5
    assert not any(alive(p["pid"]) for p in procs)  # stopped, children included


def test_a_topology_that_never_gets_ready_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    bad = ["--log-dir", str(tmp_path), "--prefill", "0", "--decode", "0", "--colocated", "0"]
    with pytest.raises(RuntimeError, match="was not ready"):
        main(["--timeout", "30", "--", *bad])
