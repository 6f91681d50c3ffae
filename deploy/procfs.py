"""What /proc says about processes: CPU seconds, liveness, descendants (Linux; torch-free)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of one process (and its waited-for children)."""
    try:
        fields = _stat_fields(pid)
    except (OSError, IndexError):
        return None
    utime, stime, cutime, cstime = (int(fields[i]) for i in (11, 12, 13, 14))
    return (utime + stime + cutime + cstime) / _CLK_TCK


def alive(pid: int) -> bool:
    """Running (not a zombie, not gone)."""
    try:
        state = _stat_fields(pid)[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks after boot: with the pid, it names one process
    (a pid alone is reused once its process is gone). None when it is gone or /proc is not."""
    try:
        return int(_stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents.setdefault(int(_stat_fields(stat.parent.name)[1]), []).append(
                int(stat.parent.name)
            )
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def memory_bytes(pid: int) -> dict[str, int]:
    """Resident memory of one process: ``rss`` (VmRSS) and its ``anon`` and ``file`` parts
    (RssAnon, RssFile); empty when the process is gone or a zombie."""
    keys = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file"}
    found: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = keys.get(line.split(maxsplit=1)[0] if line else "")
            if key:
                found[key] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return found
