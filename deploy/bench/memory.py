"""Resident memory of a `tandem up` topology: start it, serve a few chat requests, then read the
RSS of `tandem up` and of every process below it (issue 18's "default CPU topology under 2.5 GB").

    python -m deploy.bench.memory [--requests 8] [--json-out mem.json] [-- tandem up flags]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from deploy.procfs import descendants, memory_bytes

READY = re.compile(r"Tandem is ready: (\S+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _role(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    for role in ("gateway", "prefill", "decode", "worker", "up"):
        if role in words:
            return role
    return Path(words[0]).name if words else "?"


def _wait_ready(proc: subprocess.Popen[str], timeout_s: float) -> str:
    found: list[str] = []
    done = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = READY.search(line)
            if m and not found:
                found.append(m.group(1))
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    if not done.wait(timeout_s) or not found:
        raise RuntimeError(f"tandem up was not ready within {timeout_s:.0f} s (exit {proc.poll()})")
    return found[0]


UP = (sys.executable, "-m", "services.cli", "up")


def measure(
    up_flags: list[str], requests: int, timeout_s: float, program: Sequence[str] = UP
) -> dict[str, Any]:
    """Start ``program`` (`tandem up`) with ``up_flags``, serve ``requests`` chat requests,
    then read every process's memory; the topology is stopped before returning."""
    argv = [*program, "--port", str(_free_port()), *up_flags]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t0 = time.monotonic()
        url = _wait_ready(proc, timeout_s)
        ready_s = time.monotonic() - t0
        with httpx.Client(base_url=url, timeout=timeout_s) as client:
            model = client.get("/models").json()["data"][0]["id"] if requests else ""
            for i in range(requests):
                body = {
                    "model": model,
                    "messages": [
                        {"role": "user", "content": f"Tell me fact number {i} about the sea."}
                    ],
                    "max_tokens": 32,
                }
                client.post("/chat/completions", json=body).raise_for_status()
        pids = [proc.pid, *sorted(descendants(proc.pid))]
        procs: list[dict[str, Any]] = []
        for pid in pids:
            mem = {f"{k}_mb": round(v / 1e6, 1) for k, v in memory_bytes(pid).items()}
            procs.append({"pid": pid, "role": _role(pid), **mem})
        return {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": ["tandem", "up", *up_flags],
            "ready_s": round(ready_s, 1),
            "requests": requests,
            "processes": procs,
            "total_rss_mb": round(sum(p.get("rss_mb", 0.0) for p in procs), 1),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.bench.memory", description=__doc__)
    p.add_argument("--requests", type=int, default=8, help="chat requests served before reading")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to the ready line")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("up_flags", nargs=argparse.REMAINDER, help="-- then flags for tandem up")
    args = p.parse_args(argv)
    flags = args.up_flags[1:] if args.up_flags[:1] == ["--"] else args.up_flags
    result = measure(flags, args.requests, args.timeout)
    text = json.dumps(result, indent=2)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    for p_ in result["processes"]:
        parts = f"anon {p_.get('anon_mb', 0):7.1f}, file {p_.get('file_mb', 0):6.1f}"
        print(
            f"{p_['role']:>10} {p_['pid']:>8} {p_.get('rss_mb', 0):8.1f} MB ({parts})",
            file=sys.stderr,
        )
    print(f"{'total':>10} {'':>8} {result['total_rss_mb']:9.1f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
