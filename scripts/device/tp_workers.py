"""Issue 19 on a lent machine with 2 GPUs: tensor-parallel workers through `tandem up`.

    python3 scripts/device/tp_workers.py MODEL_DIR   (a float32 checkpoint with a tokenizer)
    TP_TOPOLOGIES=name,name (of TOPOLOGIES): only those, the follower killed in the last

The offline engine's greedy text on one GPU, then `tandem up --gpus 0,1` with prefill TP 2 ->
decode TP 1, prefill TP 1 -> decode TP 2, and one colocated TP 2 worker: each completion must
equal it; then, on the last topology, a follower rank killed under load (the errors and how
long they took). Prints one JSON line per check.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

READY = re.compile(r"^Tandem is ready: (http://\S+/v1) \(gateway \+ (.+), model (.+)\)$")
READY_S = 150.0  # a topology not ready by then: its last lines are printed
PROMPTS = [[(7 * i + 3) % 49000 + 17 for i in range(n)] for n in (3, 24, 150)]
TOPOLOGIES = {
    "prefill-tp2-decode-tp1": ["--prefill-tensor-parallel-size", "2"],
    "prefill-tp1-decode-tp2": ["--decode-tensor-parallel-size", "2"],
    "colocated-tp2": ["--colocated", "1", "--tensor-parallel-size", "2"],
}


def offline(model: str) -> list[str]:
    from protos.sampling_params import SamplingParams
    from services.engine.llm import LLM

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = {}
    for size in (1, 2):
        with LLM(model, dtype="float32", tensor_parallel_size=size) as llm:
            out[size] = [r.outputs[0].text for r in llm.generate(PROMPTS, params)]
    print(json.dumps({"check": "offline tp2 == tp1 on GPUs", "ok": out[1] == out[2]}), flush=True)
    return out[1]


def followers() -> list[int]:
    pids = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"services.engine.tp_follower" in cmd.read_bytes():
                pids.append(int(cmd.parent.name))
        except OSError:
            continue
    return pids


def up(model: str, flags: list[str], expected: list[str], kill: bool) -> None:
    argv = [sys.executable, "-m", "services.cli", "up", "--model", model, "--dtype", "float32",
            "--max-model-len", "256", "--port", "0", "--gpus", "0,1", *flags]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    ready: list[tuple[str, str]] = []
    got_ready = threading.Event()

    def read() -> None:
        for line in proc.stdout or ():
            lines.append(line.rstrip())
            if m := READY.match(line.strip()):
                ready.append((m.group(1), m.group(3)))
                got_ready.set()
        got_ready.set()  # `tandem up` exited: no need to wait out READY_S

    threading.Thread(target=read, daemon=True).start()
    got_ready.wait(READY_S)
    url, served = ready[0] if ready else ("", "")
    try:
        if not url:
            print(json.dumps({"check": flags, "ok": False, "log": lines[-30:]}), flush=True)
            return
        got = []
        for p in PROMPTS:
            body = {"model": served, "prompt": p, "max_tokens": 8, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            r = httpx.post(f"{url}/completions", json=body, timeout=120)
            got.append(r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)
        print(json.dumps({"check": flags, "ok": got == expected, "got": got}), flush=True)
        if kill:
            killed(url, served)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()


def killed(url: str, served: str) -> None:
    ends: list[tuple[str, float]] = []

    def one(i: int) -> None:
        body = {"model": served, "prompt": [5 + i, 6, 7], "max_tokens": 240, "temperature": 0,
                "ignore_eos": True, "stream": True}  # fmt: skip
        how = "no [DONE]"
        try:
            with httpx.stream("POST", f"{url}/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if '"error"' in line:
                        how = "error"
                    elif line == "data: [DONE]" and how == "no [DONE]":
                        how = "done"
        except httpx.HTTPError as exc:
            how = f"error ({type(exc).__name__})"
        ends.append((how, time.monotonic()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    os.kill(followers()[0], signal.SIGKILL)
    at = time.monotonic()
    for t in threads:
        t.join(60)
    after = [(how, round(when - at, 2)) for how, when in ends if when > at]
    print(json.dumps({"check": "kill -9 of a follower under load", "after_kill": after,
                      "hung": sum(t.is_alive() for t in threads)}), flush=True)  # fmt: skip


def main() -> None:
    model = sys.argv[1]
    expected = offline(model)
    names = [n for n in os.environ.get("TP_TOPOLOGIES", ",".join(TOPOLOGIES)).split(",") if n]
    for name in names:
        up(model, TOPOLOGIES[name], expected, kill=name == names[-1])


if __name__ == "__main__":
    main()
