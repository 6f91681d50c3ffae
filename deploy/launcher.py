"""`tandem up`: the whole topology (prefill + decode workers and a gateway) on this machine.

Bind the gateway's port (held from the first step, so a busy one, a second ``tandem up`` on it
included, stops this one before any model loads), prepare the model once, start the workers on
free ports, wait for their ready files, start the gateway pointed at them on the socket held
(it inherits it), print one ``Tandem is ready:`` line, then watch. Ctrl-C or SIGTERM stops
the gateway first, then the workers; no child outlives the launcher, and its run directory
(the children's ready files) is removed; after a SIGKILL, by the next ``tandem up``. A child
that dies, the gateway included, is started again on its port, after a backoff that grows
while it keeps dying (up to TANDEM_UP_MAX_BACKOFF, 30 s), never given up on; the others keep
serving meanwhile (the gateway routes around a dead worker and finds it back through its
health checks; a restarted gateway rebuilds its state from the workers, and the dead one's
reservations lapse there).

Exit status: 0 after a stop that let every child drain (one Ctrl-C or SIGTERM, its grace period
run out or not); 128 + N when a second signal N forced the stop, cutting what was in flight
(130 for a second Ctrl-C, 143 for a second SIGTERM), as shells report a process killed by it;
2 for bad input (a flag, a model not found, a busy port); 1 when a child failed to start.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import IO, TextIO

from deploy.gpus import detect_gpus
from deploy.plan import Plan, Worker, build_plan, fill_utilization, gateway_spec, with_flag
from deploy.procfs import alive, start_ticks
from deploy.supervisor import Child, ChildFailedError, ChildSpec, Supervisor, parent_death_env
from gateway.core.config import LISTEN_FD_ENV, api_key_from
from protos.auth import TOKEN_ENV
from services.config import ConfigError

READY_TIMEOUT_S = float(os.environ.get("TANDEM_UP_READY_TIMEOUT", "900"))
GRACE_S = float(os.environ.get("TANDEM_UP_GRACE", "15"))  # a floor; see shutdown_grace()
# a child that dies is started again on its port, after a backoff that grows with its deaths in
# RESTART_WINDOW_S, up to MAX_BACKOFF_S
RESTART_WINDOW_S = 300.0
MAX_BACKOFF_S = float(os.environ.get("TANDEM_UP_MAX_BACKOFF", "30"))
DRAIN_MARGIN_S = 5.0  # past the gateway's --drain-timeout, for its last frames and exit
WILDCARDS = ("0.0.0.0", "::", "")
# below this fraction of the GPU a decode worker could not even hold its weights' share
MIN_FILL_UTILIZATION = 0.02


class _Stop(KeyboardInterrupt):
    """Raised by the signal handler to unwind into the shutdown path (a KeyboardInterrupt, so
    no ``except Exception`` on the way, such as the model-id probe's, can swallow it)."""


def say(text: str, error: bool = False) -> None:
    # one write, text and newline together: print() writes them apart, and a Ctrl-C raised
    # between the two (the signal handler's stop) left the line unended, so the next one
    # ("tandem up: stopping") was glued to it
    stream = sys.stderr if error else sys.stdout
    stream.write(text + "\n")
    stream.flush()


def prepare_model(argv: list[str]) -> str:
    """Run the prepare step, echoing its output; returns the last line it printed (a directory)."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, **parent_death_env()},
    )  # fmt: skip
    errors: deque[str] = deque(maxlen=20)
    echo = threading.Thread(target=_echo_lines, args=(proc.stderr, sys.stderr, errors), daemon=True)
    echo.start()
    lines: deque[str] = deque(maxlen=20)
    try:
        _echo_lines(proc.stdout, sys.stdout, lines)
        code = proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    echo.join(timeout=5)
    if code != 0 or not lines:
        # its "error: ..." lines were held back to be said once, here; else the last line
        # echoed (a traceback's exception) is enough, the rest is above
        held = [line for line in errors if line.startswith("error:")]
        detail = "\n".join(held) or (errors[-1] if errors else "\n".join(lines)) or "(no output)"
        raise ChildFailedError(
            f"preparing the model failed (exit code {code}):\n{detail}", 2 if code == 2 else 1
        )
    return lines[-1]


def _echo_lines(stream: IO[str] | None, out: TextIO, keep: deque[str]) -> None:
    for line in stream or ():
        if line.strip():
            keep.append(line.strip())
            if not line.startswith("error:"):  # said once, in the failure's message
                print(f"  {line.rstrip()}", file=out, flush=True)


def public_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in WILDCARDS else host
    if ":" in shown:
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/v1"


def served_model_id(base_url: str, api_key: str | None, fallback: str) -> str:
    """The first model id the gateway lists, so the printed example works as is."""
    request = urllib.request.Request(f"{base_url}/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return str(json.load(response)["data"][0]["id"])
    except Exception:
        return fallback


def ready_message(
    plan: Plan, url: str, model_id: str, api_key: str | None, key_env: str | None = None
) -> str:
    """``key_env``: the variable the key came from (None: --api-key, which is not in the
    user's environment, so the message says to export it)."""
    auth = f' -H "Authorization: Bearer ${key_env or "TANDEM_API_KEY"}"' if api_key else ""
    # an example that answers in seconds on the CPU, the same on every run, of the task served
    if plan.task == "embed":
        endpoint = "embeddings"
        request: dict = {"model": model_id, "input": "Paris is the capital of France."}
    else:
        endpoint = "chat/completions"
        request = {
            "model": model_id,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
            "temperature": 0,
        }
    body = json.dumps(request)
    # the key itself stays out of the terminal's scrollback: the line reads it from the env
    given = api_key and not key_env
    key_note = "  (export TANDEM_API_KEY=<the key given to --api-key> first)\n" if given else ""
    return (
        f"Tandem is ready: {url} ({plan.summary()}, model {model_id})\n"
        f"  curl {url}/{endpoint} -H 'Content-Type: application/json'{auth} -d '{body}'\n"
        f"{key_note}Press Ctrl-C to stop."
    )


def _describe(plan: Plan) -> str:
    parts = []
    for w in plan.workers:
        where = f"GPU {','.join(w.gpus)}" if w.gpus else plan.device
        threads = w.spec.env.get("OMP_NUM_THREADS")
        parts.append(
            f"{w.spec.name} on {where}" + (f" (OMP_NUM_THREADS={threads})" if threads else "")
        )
    argv = plan.gateway_argv
    if "--local-prefill-queue" in argv:  # conditional disaggregation: say it is on
        n = argv[argv.index("--local-prefill-queue") + 1]
        parts.append(f"prompts prefilled by the decode worker while prefill has {n}+ queued")
    if "--local-prefill-decode-load" in argv:
        n = argv[argv.index("--local-prefill-decode-load") + 1]
        parts.append(f"and while the decode worker has {n}+ other requests")
    return ", ".join(parts)


def _progress(pending: list[Child], elapsed: float) -> None:
    names = ", ".join(c.name for c in pending)
    say(f"tandem up: waiting for {names} ({elapsed:.0f} s)")


def hold_port(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound (as uvicorn binds: SO_REUSEADDR, one address) and
    listening before anything starts, then handed to every gateway this run starts
    (:func:`with_listener`). A busy port fails here, before minutes of model loading; and a
    second ``tandem up`` on the port, however soon after, fails at this step too: a check
    that only tried the port would leave it free until the gateway binds it, after the
    workers are ready, and the second launch would start its workers meanwhile. Held to the
    end, it also queues the connections that come while a dead gateway is started again."""
    bare = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bare, port))
        sock.listen(2048)  # uvicorn's default backlog
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            message = f"port {port} on {host} is in use: choose another --port"
        else:
            message = f"cannot listen on {host}:{port} ({e.strerror or e}): check --host and --port"
        raise ChildFailedError(message, 2) from None
    return sock


def with_listener(spec: ChildSpec, listener: socket.socket) -> ChildSpec:
    """The gateway's spec with ``listener`` handed over: inherited, named in its environment."""
    fd = listener.fileno()
    env = {**spec.env, LISTEN_FD_ENV: str(fd)}
    return dataclasses.replace(spec, env=env, pass_fds=(fd,))


def start_all(
    plan: Plan, sup: Supervisor, ready_timeout_s: float, listener: socket.socket | None = None
) -> tuple[str, dict[str, int]]:
    """Prepare, start workers, start the gateway on ``listener``; returns the gateway's /v1 URL
    and each child's port (name -> port). Without a ``listener`` (a caller that restarts no
    gateway) the port is held here, and this copy closed once the gateway has its own."""
    if listener is None:
        with hold_port(plan.host, plan.port) as held:
            return start_all(plan, sup, ready_timeout_s, held)
    say(f"tandem up: preparing model {plan.model}")
    tokenizer_dir = prepare_model(plan.prepare_argv)
    say(f"tandem up: starting {_describe(plan)}; logs in {sup.log_dir}")
    deadline = time.monotonic() + ready_timeout_s  # one for both phases
    workers = [sup.start(w.spec) for w in plan.workers if not w.fill_after]
    sup.wait_ready(workers, ready_timeout_s, _progress)
    late = [w for w in plan.workers if w.fill_after]
    if late:  # decode workers sized from what the prefill workers on their GPUs hold
        ready = {c.name: c.ready or {} for c in workers}
        specs = [late_spec(w, plan.workers, ready) for w in late]
        late_children = [sup.start(s) for s in specs]
        sup.wait_ready(late_children, max(1.0, deadline - time.monotonic()), _progress)
        workers += late_children
    ports = {c.name: int((c.ready or {})["port"]) for c in workers}
    say("tandem up: workers ready (" + ", ".join(f"{n} :{p}" for n, p in ports.items()) + ")")
    gateway = sup.start(with_listener(gateway_spec(plan, ports, tokenizer_dir), listener))
    sup.wait_ready([gateway], ready_timeout_s, _progress)
    port = int((gateway.ready or {}).get("port", plan.port))
    return public_url(plan.host, port), {**ports, gateway.name: port}


def late_spec(worker: Worker, workers: list[Worker], ready: dict[str, dict]) -> ChildSpec:
    """A decode worker's spec once the prefill workers on its GPUs are ready: its
    --gpu-memory-utilization set to what they leave (the plan's even split if they reported
    nothing)."""
    util = fill_utilization(worker, workers, ready)
    if util is None:
        return worker.spec
    holds = ", ".join(
        f"{n} {ready[n]['gpu_bytes'] / 2**30:.1f} GiB" for n in worker.fill_after if n in ready
    )
    if util < MIN_FILL_UTILIZATION:
        raise ChildFailedError(
            f"tandem up: the prefill workers sharing {worker.spec.name}'s GPU hold {holds}, which "
            f"leaves it {max(util, 0):g} of the GPU: give them less (--max-total-tokens) or set "
            "--gpu-memory-utilization for every worker yourself",
            2,
        )
    say(f"tandem up: {worker.spec.name} takes --gpu-memory-utilization {util:g} ({holds} held)")
    argv = with_flag(worker.spec.argv, "--gpu-memory-utilization", f"{util:g}")
    return dataclasses.replace(worker.spec, argv=argv)


def shutdown_grace(drain_timeout_s: float, floor_s: float = GRACE_S) -> float:
    """Seconds each tier gets after SIGTERM before SIGKILL.

    At least the gateway's drain timeout plus a margin, so a stop lets in-flight streams finish
    (or end with finish_reason "abort" and [DONE]) instead of cutting them; TANDEM_UP_GRACE only
    raises it.
    """
    return max(floor_s, drain_timeout_s + DRAIN_MARGIN_S)


def same_port_spec(spec: ChildSpec, port: int) -> ChildSpec:
    """A worker's spec with ``--port`` fixed to the port it had: the gateway knows it there."""
    argv = list(spec.argv)
    at = argv.index("--port") + 1
    argv[at] = str(port)
    return dataclasses.replace(spec, argv=argv)


def restart_delay(recent_deaths: int, cap_s: float = MAX_BACKOFF_S) -> float:
    """Seconds before a child that died is started again: at once after its first death in
    the window, then 1, 2, 4, ... up to ``cap_s``, so a crash loop costs little CPU."""
    return 0.0 if recent_deaths <= 1 else min(cap_s, 2.0 ** (recent_deaths - 2))


def watch(sup: Supervisor, ports: dict[str, int], window_s: float = RESTART_WINDOW_S) -> int:
    """Serve until a signal. Any child that exits, the gateway included, is started again on its
    port (the gateway's clients and the gateway's worker list stay valid), after a backoff
    that grows with its deaths in ``window_s`` (:func:`restart_delay`); the launcher never gives
    up on it and never stops the parts that still serve (the gateway reports a worker that is
    down in /health and /workers meanwhile)."""
    deaths: dict[str, deque[float]] = {}
    due: dict[str, tuple[float, Child]] = {}  # name -> (when to restart, the exited child)
    while True:
        now = time.monotonic()
        for name, (when, child) in list(due.items()):
            if now >= when:
                del due[name]
                sup.restart(child, same_port_spec(child.spec, ports[name]))
        exited = [c for c in sup.children if c.name not in due and c.proc.poll() is not None]
        for child in exited:
            recent = deaths.setdefault(child.name, deque())
            while recent and now - recent[0] > window_s:
                recent.popleft()
            recent.append(now)
            delay = restart_delay(len(recent))
            say(
                f"tandem up: {child.name} exited unexpectedly with code {child.proc.returncode}; "
                f"starting it again on port {ports[child.name]}"
                + (f" in {delay:.0f} s ({len(recent)} exits in {window_s:.0f} s)" if delay else "")
                + f" (log {child.log_path})",
                error=True,
            )
            due[child.name] = (now + delay, child)
        time.sleep(0.2)


def run(
    plan: Plan,
    log_dir: Path,
    api_key: str | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    grace_s: float | None = None,
    key_env: str | None = None,
) -> int:
    """Start everything in ``plan``, serve (restarting what dies, :func:`watch`) until a signal,
    then stop it all; returns the exit status (the module's docstring).

    ``grace_s`` None: :func:`shutdown_grace` of the drain timeout the gateway was given.
    ``key_env``: the variable ``api_key`` came from, for the ready message (None: --api-key).
    """
    try:
        check_log_dir(log_dir)
    except ConfigError as exc:
        say(f"tandem up: {exc}", error=True)
        return 2
    if grace_s is None:
        grace_s = shutdown_grace(plan.drain_timeout_s)
    sup = Supervisor(log_dir, grace_s)
    stopping = False
    forced: int | None = None  # the signal that cut the stop short

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping, forced
        if stopping:
            sup.hurry = True  # a second Ctrl-C: no more grace
            forced = forced or signum
            return
        stopping = True
        raise _Stop(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    listener: socket.socket | None = None
    try:
        listener = hold_port(plan.host, plan.port)  # first: a busy port starts nothing
        url, ports = start_all(plan, sup, ready_timeout_s, listener)
        model_id = served_model_id(url, api_key, plan.model)
        say(ready_message(plan, url, model_id, api_key, key_env))
        code = watch(sup, ports)
    except _Stop:
        code = 0
    except ChildFailedError as exc:
        say(f"tandem up: {exc}", error=True)
        code = exc.exit_code
    finally:
        stopping = True
        if listener is not None:  # new connections are refused once the gateway's copy closes
            listener.close()
        if sup.children:
            say("tandem up: stopping")
        sup.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if forced is not None:
        name = signal.Signals(forced).name
        say(f"tandem up: a second {name} stopped everything at once: in-flight work was cut",
            error=True)  # fmt: skip
        return 128 + forced
    return code


def gateway_key(flag: str | None, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The key the gateway will require (it reads the same flag and variables: --api-key, then
    TANDEM_API_KEY, then VLLM_API_KEY), so the ready message's example carries it, and the
    variable it came from (None: the flag, or no key)."""
    api_key, source = api_key_from(flag, environ)
    return api_key, None if source == "--api-key" else source


def check_log_dir(path: Path) -> None:
    """``--log-dir`` is made (with its parents) and written to before anything starts: a
    path under a file or on a read-only disk was a traceback once the first child started."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=path, prefix=".tandem-probe-").close()
    except OSError as exc:
        raise ConfigError(
            f"--log-dir {path}: cannot write a log there ({exc.strerror or exc}): give a "
            "directory tandem up may create and write to"
        ) from None


RUN_DIR_PREFIX = "tandem-run-"
RUN_DIR_OWNER = "launcher.pid"  # "PID START_TICKS": the launcher that made the run directory


def make_run_dir(parent: Path | None = None) -> Path:
    """A fresh run directory (the children's ready files) under ``parent`` (the temporary
    directory by default) that names this launcher as its owner, made after the stale ones
    there are removed (:func:`sweep_run_dirs`)."""
    parent = Path(parent or tempfile.gettempdir())
    sweep_run_dirs(parent)
    run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=parent))
    pid = os.getpid()
    partial = run_dir / f"{RUN_DIR_OWNER}.tmp"  # renamed whole: a sweep never reads half of it
    partial.write_text(f"{pid} {start_ticks(pid) or 0}\n")
    partial.rename(run_dir / RUN_DIR_OWNER)
    return run_dir


def sweep_run_dirs(parent: Path) -> list[Path]:
    """Remove the run directories under ``parent`` whose launcher is gone; returns them.

    A launcher removes its own when it stops, but SIGKILL (a ``kill -9``, the OOM killer)
    cannot be caught, and each such run left one behind in /tmp. Gone: no such process, a
    zombie, or another process under a reused pid (its start time differs). Left alone: what
    cannot be told, a directory without an owner file (a launcher making it, an older
    Tandem's), one of another user, a symlink or file of that name."""
    removed = []
    for path in parent.glob(f"{RUN_DIR_PREFIX}*"):
        if _run_dir_orphaned(path):
            shutil.rmtree(path, ignore_errors=True)  # another launcher may sweep it too
            removed.append(path)
    return removed


def _run_dir_orphaned(path: Path) -> bool:
    try:
        info = path.lstat()  # a symlink is not followed
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return False
        pid, started = (int(f) for f in (path / RUN_DIR_OWNER).read_text()[:64].split())
    except (OSError, ValueError):
        return False
    if pid == os.getpid():
        return False
    if not Path("/proc/self/stat").exists():  # no /proc: whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:  # another user's process
            return False
        return False
    return not alive(pid) or started not in (0, start_ticks(pid))


def main(args: argparse.Namespace) -> int:
    # the workers' gRPC API and KV rendezvous take only callers with this run's secret; the
    # children inherit it through the environment (not argv, which any local user can read)
    os.environ.setdefault(TOKEN_ENV, secrets.token_urlsafe(32))
    run_dir = make_run_dir()  # after removing those of launchers killed with SIGKILL
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="tandem-logs-"))
    try:
        plan = build_plan(
            args, detect_gpus(args.gpus, note=say), os.cpu_count() or 1, run_dir, environ=os.environ
        )
        api_key, key_env = gateway_key(args.api_key, os.environ)
        code = run(plan, log_dir, api_key, key_env=key_env)
    except ConfigError as exc:
        say(f"tandem up: {exc}", error=True)
        code = 2
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if not args.log_dir and (code == 0 or not any(log_dir.iterdir())):  # kept: child logs
        shutil.rmtree(log_dir, ignore_errors=True)
    return code
