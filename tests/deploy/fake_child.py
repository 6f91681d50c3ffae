"""A stand-in for `tandem <role>` and `python -m services.model_files` in launcher tests.

Run as ``python -m tests.deploy.fake_child ROLE [flags]``. It binds a real port, prints one JSON line
(pid, argv, env) to its log, writes its ready file atomically and sleeps until signalled. The
gateway role also answers GET /v1/models. Behaviour switches come from the environment:
FAKE_FAIL_ROLE (exit 3 before ready, or FAKE_FAIL_CODE), FAKE_IGNORE_TERM (role that ignores SIGTERM),
FAKE_GRANDCHILD (role that spawns a sleeping grandchild), FAKE_PREPARE_FAIL, FAKE_PREPARE_GATE
(a file: preparing the model ends once it exists), FAKE_TERM_LOG
(a file each child appends its role to when SIGTERM arrives), FAKE_GPU_BYTES (``ROLE:USED:TOTAL``:
that role's ready file reports holding USED of a GPU of TOTAL bytes, as a real worker's does).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

TOKENIZER_DIR = "/fake/model/dir"


class _Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _prepare() -> int:
    print("converting the fake model ...", flush=True)
    gate = os.environ.get("FAKE_PREPARE_GATE")  # a file: the model is ready once it exists
    while gate and not os.path.exists(gate):
        time.sleep(0.02)
    if os.environ.get("FAKE_PREPARE_FAIL"):
        print("error: model 'nope' not found: give a directory", file=sys.stderr, flush=True)
        return 2
    print(TOKENIZER_DIR, flush=True)
    return 0


def _bind(role: str, port: int) -> int:
    if role == "gateway" and os.environ.get("TANDEM_LISTEN_FD"):  # tandem up's socket
        held = socket.socket(fileno=int(os.environ["TANDEM_LISTEN_FD"]))
        server = http.server.ThreadingHTTPServer(
            held.getsockname(), _Models, bind_and_activate=False
        )
        server.socket = held
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return int(held.getsockname()[1])
    if role == "gateway":
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Models)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return int(server.server_address[1])
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    _keep.append(sock)
    return int(sock.getsockname()[1])


_keep: list[socket.socket] = []


def _note_term(role: str) -> None:
    with open(os.environ["FAKE_TERM_LOG"], "a") as fh:
        fh.write(role + "\n")
    os._exit(0)


def main() -> int:
    from deploy.supervisor import follow_parent

    follow_parent()
    role = sys.argv[1]
    if role == "prepare":
        return _prepare()
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", required=True)
    args, _ = parser.parse_known_args(sys.argv[2:])
    if os.environ.get("FAKE_IGNORE_TERM") == role:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif os.environ.get("FAKE_TERM_LOG"):
        signal.signal(signal.SIGTERM, lambda *_: _note_term(role))
    if os.environ.get("FAKE_FAIL_ROLE") == role:
        print(f"boom: {role} failed to load", flush=True)
        return int(os.environ.get("FAKE_FAIL_CODE", "3"))
    info: dict[str, object] = {
        "pid": os.getpid(),
        "argv": sys.argv[1:],
        "port": _bind(role, args.port),
    }
    info["env"] = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
                                                  "TANDEM_LISTEN_FD")}  # fmt: skip
    if os.environ.get("FAKE_GRANDCHILD") == role:
        info["grandchild"] = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"]
        ).pid
    # one write with its newline: the supervisor runs children unbuffered (PYTHONUNBUFFERED),
    # where print writes the line and its newline apart, and a test that kills this child as
    # soon as it reads the line could leave it without one (the next life's line then joined it)
    sys.stdout.write(json.dumps(info) + "\n")
    sys.stdout.flush()
    gpu_role, _, sizes = os.environ.get("FAKE_GPU_BYTES", "").partition(":")
    ready = dict(info)
    if gpu_role == role:
        used, total = sizes.split(":")
        ready.update(gpu_bytes=int(used), gpu_total_bytes=int(total))
    tmp = args.ready_file + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(ready, fh)
    os.replace(tmp, args.ready_file)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
