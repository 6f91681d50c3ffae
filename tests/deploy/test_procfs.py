"""/proc facts about processes: CPU seconds, liveness, descendants."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from deploy.procfs import alive, cpu_seconds, descendants, memory_bytes, start_ticks


def test_a_child_and_its_grandchild_are_descendants_until_they_end() -> None:
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not descendants(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        below = descendants(proc.pid)
        assert len(below) == 1 and all(alive(p) for p in below)  # the grandchild
        assert {proc.pid} | below <= descendants(os.getpid())
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()
    assert not alive(proc.pid)
    time.sleep(0.2)
    assert not any(alive(p) for p in below)  # killed with its process group


def test_cpu_seconds_count_work_and_a_missing_process_has_none() -> None:
    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    after = cpu_seconds(os.getpid())
    assert before is not None and after is not None and after > before
    assert cpu_seconds(2**22 + 12345) is None and not alive(2**22 + 12345)


def test_memory_of_a_live_process_and_of_a_gone_one() -> None:
    mine = memory_bytes(os.getpid())
    assert mine["rss"] > 10 * 2**20 and mine["anon"] > 0 and mine["file"] > 0
    assert mine["anon"] + mine["file"] <= mine["rss"] + 2**20  # RssShmem is the rest
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert memory_bytes(proc.pid) == {}


def test_a_start_time_tells_a_process_from_a_later_one_under_its_pid() -> None:
    ours, parent = start_ticks(os.getpid()), start_ticks(os.getppid())
    assert ours is not None and parent is not None and parent <= ours
    assert start_ticks(os.getpid()) == ours  # the same process: the same start, every time
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert start_ticks(gone.pid) is None
