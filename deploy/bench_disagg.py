"""`tandem bench disagg`: disaggregated against colocated serving (W4) and the cost of the
HTTP + gRPC path (W6), each topology started, measured and stopped in one run.

W4: for each topology (``disagg``: prefill workers on the first half of the GPUs, decode workers on
the rest; ``colocated``: one colocated worker per GPU, behind the same gateway) start it with
`tandem up`'s own launcher, warm it up, run `tandem bench serve`'s load generator at each request
rate of each workload (Poisson arrivals, random token ids, ``ignore_eos``; fresh prompts per rate so
the prefix cache never serves a later rate), then stop it (SIGTERM by tier, SIGKILL after the grace
period, and a check that no process is left).

W6 (``--gateway-overhead``): one fixed workload, all prompts at once, through the in-process engine
(`tandem bench offline`, in a child process) and through `tandem up --colocated 1` + the gateway,
same flags; output tokens/s of both, their ratio, and the CPU seconds each process spent per
streamed token (from /proc).

Writes one JSON per topology x workload, ``summary.json``, ``summary.md`` and PNG plots under
``--out-dir`` (each file rewritten after every rate, so a run cut short keeps what it measured),
and prints the markdown tables at the end. ``--time-budget-s`` shares the time left between the
topologies still to start and skips (and records) the rates that would not fit.

Named configs (``llama-3.1-8b``, ...) have no tokenizer: their workers stream token ids without text
and the gateway sends no frame for a token without text, so a client could not time tokens. Unless
``--no-synthetic-tokenizer``, the config is wrapped in a Hugging Face directory with a word-level
tokenizer of the same vocabulary (token ``i`` is the word ``w<i>``) and loaded with random weights
(``--load-format dummy``, same ``--seed``: the same weights): every token then streams as text.
Torch-free: the workers and the in-process engine run in child processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from deploy.gpus import detect_gpus
from deploy.launcher import GRACE_S, start_all
from deploy.plan import build_plan, engine_flags
from deploy.procfs import alive, cpu_seconds, descendants
from deploy.supervisor import ChildFailedError, Supervisor
from gateway.bench_serve import build_prompts, run_rates
from services.cli import build_parser
from services.config import ConfigError
from services.model_files import ModelNotFoundError, resolve_model

TOPOLOGIES = ("disagg", "colocated")
STOP_RESERVE_S = 20.0  # kept free at the end of a time budget to stop the last topology
STOP_TYPICAL_S = 5.0  # what stopping a topology usually takes, kept free at the end of its share
SATURATED_FRACTION = 0.1  # a rate where fewer requests meet both SLOs ends the workload
_T0 = time.monotonic()


def log(message: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[bench disagg {stamp} +{time.monotonic() - _T0:6.1f}s] {message}", flush=True)


# ---- what to run ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int

    @property
    def key(self) -> str:
        return f"{self.input_len}:{self.output_len}"

    @property
    def label(self) -> str:
        return f"{self.input_len}in-{self.output_len}out"


def parse_workloads(text: str) -> list[Workload]:
    """'1024:128,4096:256' -> two workloads."""
    out = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        try:
            inp, outp = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"--workloads wants INPUT:OUTPUT pairs, got {item!r}") from None
        if inp < 1 or outp < 1:
            raise ValueError(f"--workloads lengths must be positive, got {item!r}")
        out.append(Workload(inp, outp))
    if not out:
        raise ValueError("--workloads is empty")
    return out


def _rate_list(text: str) -> list[float]:
    rates = []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        rate = float(item)
        if not rate > 0:
            raise ValueError(f"request rates must be positive or 'inf', got {item!r}")
        rates.append(rate)
    return rates


def parse_rates(
    values: Sequence[str] | None, workloads: Sequence[Workload]
) -> dict[str, list[float]]:
    """Rates per workload key. '2,4,8' applies to every workload that has no list of its own;
    '4096:256=1,2,3' to that workload only. Each list is sorted, duplicates dropped."""
    common: list[float] = [2.0, 4.0, 8.0]
    own: dict[str, list[float]] = {}
    for value in values or []:
        if "=" in value:
            key, _, rest = value.partition("=")
            own[parse_workloads(key)[0].key] = _rate_list(rest)
        else:
            common = _rate_list(value)
    known = {w.key for w in workloads}
    if unknown := sorted(set(own) - known):
        raise ValueError(f"--rates names workloads not in --workloads: {', '.join(unknown)}")
    return {w.key: sorted(set(own.get(w.key, common))) for w in workloads}


def parse_topologies(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"]
    if bad := [t for t in names if t not in TOPOLOGIES]:
        raise ValueError(f"unknown topology {bad[0]!r}: choose from {', '.join(TOPOLOGIES)}")
    return list(dict.fromkeys(names))


def prompts_for_rate(rate: float, num_prompts: int, min_prompts: int, duration_s: float) -> int:
    """About ``duration_s`` of arrivals, at least ``min_prompts``, at most ``num_prompts``."""
    if math.isinf(rate) or duration_s <= 0:
        return num_prompts
    return max(min(min_prompts, num_prompts), min(num_prompts, math.ceil(rate * duration_s)))


def rate_label(rate: float | str) -> str:
    """2.0 -> '2', inf or 'inf' -> 'inf' (bench serve writes an infinite rate as 'inf')."""
    rate = float(rate)
    return "inf" if math.isinf(rate) else f"{rate:g}"


@dataclass(frozen=True)
class Topology:
    name: str
    up_flags: list[str]  # what makes `tandem up` start it
    gpus: list[str]

    def describe(self) -> str:
        return " ".join(self.up_flags) + (f" --gpus {','.join(self.gpus)}" if self.gpus else "")


def topology(name: str, gpus: Sequence[str], workers: int, prefill_workers: int | None) -> Topology:
    """``disagg``: prefill on the first GPUs, decode on the rest (one worker per GPU; without GPUs
    ``workers`` processes); ``colocated``: as many colocated workers."""
    n = max(len(gpus), 1) if gpus else workers
    if name == "colocated":
        return Topology(name, ["--colocated", str(n)], list(gpus))
    n = max(n, 2)
    prefill = prefill_workers if prefill_workers is not None else max(1, n // 2)
    prefill = min(max(prefill, 1), n - 1)
    return Topology(name, ["--prefill", str(prefill), "--decode", str(n - prefill)], list(gpus))


# ---- time ------------------------------------------------------------------------------------------
@dataclass
class Budget:
    """Deadlines on the monotonic clock; ``None`` when there is no budget."""

    deadline: float | None

    def left(self, now: float | None = None) -> float:
        if self.deadline is None:
            return math.inf
        return self.deadline - (time.monotonic() if now is None else now)

    def share(self, parts: int, reserve_s: float = 0.0) -> float | None:
        """A deadline for the next of ``parts`` equal shares of what is left (less a reserve)."""
        if self.deadline is None:
            return None
        now = time.monotonic()
        return now + max(0.0, self.left(now) - reserve_s) / max(parts, 1)


def estimate_run_s(rate: float, num_prompts: int, drain_s: float) -> float:
    """Arrivals plus the time the last requests need to finish."""
    arrivals = 0.0 if math.isinf(rate) else num_prompts / rate
    return arrivals + drain_s + 2.0


def run_timeout(args: argparse.Namespace, budget: Budget, hard_deadline: float | None) -> float:
    """The longest one rate may take: --run-timeout-s, within the budget and ``hard_deadline``."""
    left = budget.left() - STOP_RESERVE_S
    if hard_deadline is not None:
        left = min(left, hard_deadline - time.monotonic())
    return max(1.0, min(args.run_timeout_s, left))


def fits(estimate_s: float, deadline: float | None, now: float | None = None) -> bool:
    if deadline is None:
        return True
    return (time.monotonic() if now is None else now) + estimate_s <= deadline


# ---- processes --------------------------------------------------------------------------------------
class _Interrupted(Exception):
    """SIGTERM: unwind through the finally blocks that stop the topology."""


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    def on_term(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted(signum)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass
class Running:
    """A started topology: its supervisor, URL and the processes it owns."""

    topology: Topology
    sup: Supervisor
    base_url: str
    up_command: str
    startup_s: float
    pids: set[int] = field(default_factory=set)

    def named_pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.sup.children}

    def track(self) -> None:
        for child in self.sup.children:
            self.pids |= {child.proc.pid, *descendants(child.proc.pid)}

    def cpu(self) -> dict[str, float | None]:
        return {name: cpu_seconds(pid) for name, pid in self.named_pids().items()}

    def dead_child(self) -> str | None:
        child = self.sup.first_exited()
        return None if child is None else f"{child.name} exited with code {child.proc.returncode}"


def up_argv(
    args: argparse.Namespace, topo: Topology, log_dir: Path, model: dict[str, str]
) -> list[str]:
    """`tandem up`'s arguments for a topology: the benchmark's engine flags plus its shape."""
    argv = ["up", "--host", "127.0.0.1", "--port", str(args.port), "--log-dir", str(log_dir)]
    argv += engine_flags(args, model)
    if args.device != "auto":
        argv += ["--device", args.device]
    argv += topo.up_flags
    if topo.gpus:
        argv += ["--gpus", ",".join(topo.gpus)]
    return argv


def start_topology(
    args: argparse.Namespace, topo: Topology, out_dir: Path, model: dict[str, str], budget: Budget
) -> Running:
    log_dir = out_dir / "logs" / topo.name
    argv = up_argv(args, topo, log_dir, model)
    up_args = build_parser().parse_args(argv)
    at = argv.index("--log-dir")
    shown = shlex.join(["tandem", *argv[:at], *argv[at + 2 :]])
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-run-"))
    plan = build_plan(up_args, topo.gpus, os.cpu_count() or 1, run_dir, environ=os.environ)
    sup = Supervisor(log_dir, GRACE_S)
    log(f"starting {topo.name}: {plan.summary()} ({shown})")
    t0 = time.monotonic()
    try:
        url = start_all(
            plan, sup, min(args.ready_timeout_s, max(budget.left() - STOP_RESERVE_S, 1))
        )
    except BaseException:
        sup.shutdown()
        raise
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    running = Running(topo, sup, url.removesuffix("/v1"), shown, time.monotonic() - t0)
    running.track()
    log(f"{topo.name} ready in {running.startup_s:.1f} s at {running.base_url}")
    return running


def stop_topology(running: Running) -> dict[str, Any]:
    """Stop the gateway, then the workers; SIGKILL anything still there and say so."""
    running.track()
    t0 = time.monotonic()
    running.sup.shutdown()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in running.pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = sorted(p for p in running.pids if alive(p))
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    codes = {c.name: c.proc.returncode for c in running.sup.children}
    log(f"{running.topology.name} stopped in {time.monotonic() - t0:.1f} s (exit codes {codes})")
    if left:
        log(
            f"WARNING: killed {len(left)} process(es) left behind by {running.topology.name}: {left}"
        )
    return {"stop_s": time.monotonic() - t0, "exit_codes": codes, "left_behind": left}


# ---- one rate ---------------------------------------------------------------------------------------
KEY_METRICS = (
    "completed", "failed", "duration", "request_throughput", "goodput", "output_throughput",
    "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
    "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms",
)  # fmt: skip


def serve_argv(
    base_url: str, wl: Workload, n: int, rate: float, seed: int, args: argparse.Namespace
) -> list[str]:
    return ["bench", "serve", "--base-url", base_url, "--input-len", str(wl.input_len),
            "--output-len", str(wl.output_len), "--num-prompts", str(n),
            "--request-rate", rate_label(rate), "--seed", str(seed),
            "--slo-ttft-ms", f"{args.slo_ttft_ms:g}", "--slo-tpot-ms", f"{args.slo_tpot_ms:g}"]  # fmt: skip


def bench_rate(
    base_url: str,
    wl: Workload,
    n: int,
    rate: float,
    seed: int,
    args: argparse.Namespace,
    timeout_s: float,
) -> dict[str, Any]:
    """One `tandem bench serve` rate, in this process; its result object as bench serve writes it.
    What bench serve prints goes to logs/bench-serve.log under --out-dir."""
    argv = serve_argv(base_url, wl, n, rate, seed, args)
    ns = build_parser().parse_args(argv)
    prompts, _ = build_prompts(ns)

    async def one() -> dict[str, Any]:
        _, results = await asyncio.wait_for(run_rates(ns, prompts, [rate]), timeout=timeout_s)
        return results[0]

    report = Path(args.out_dir) / "logs" / "bench-serve.log"
    report.parent.mkdir(parents=True, exist_ok=True)
    with open(report, "a") as sink, contextlib.redirect_stdout(sink):
        print(f"\n{shlex.join(['tandem', *argv])}", flush=True)
        return asyncio.run(one())


def slo_attainment(result: dict[str, Any]) -> float:
    """Fraction of the completed requests that met both SLOs."""
    done = result.get("request_throughput") or 0.0
    return (result.get("goodput") or 0.0) / done if done else 0.0


def meets_p90_slo(result: dict[str, Any], args: argparse.Namespace) -> bool:
    """targets.md's goodput condition for a whole rate: TTFT p90 and TPOT p90 within the SLOs."""
    ttft, tpot = result.get("p90_ttft_ms"), result.get("p90_tpot_ms")
    return (
        bool(result.get("completed"))
        and ttft is not None
        and ttft <= args.slo_ttft_ms
        and (tpot is None or tpot <= args.slo_tpot_ms)
    )


def token_timing_warning(result: dict[str, Any], wl: Workload) -> str | None:
    """Streams without a frame per token leave TTFT at 0 and ITL empty: say so instead."""
    if not result.get("completed") or wl.output_len < 2:
        return None
    if not result.get("median_ttft_ms") or result.get("median_itl_ms") is None:
        return (
            "the streams carried no text per token (TTFT reads 0 or ITL is empty): the gateway "
            "sends no frame for tokens without text, so token timings are not measured"
        )
    return None


def cpu_per_token(
    before: dict[str, float | None], after: dict[str, float | None], tokens: int
) -> dict[str, Any]:
    used = {
        name: after[name] - b  # type: ignore[operator]
        for name, b in before.items()
        if b is not None and after.get(name) is not None
    }
    return {
        "cpu_s": used,
        "cpu_s_per_output_token": {n: (s / tokens if tokens else None) for n, s in used.items()},
    }


# ---- one topology -----------------------------------------------------------------------------------
@dataclass
class Recorder:
    """Everything measured so far; rewrites the JSON files after every change."""

    out_dir: Path
    args: argparse.Namespace
    command: str
    env: dict[str, Any]
    workloads: list[Workload]
    started: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    )
    topologies: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    overhead: dict[str, Any] | None = None
    interrupted: bool = False

    def new_run(self, running: Running, wl: Workload, model: dict[str, str]) -> dict[str, Any]:
        run: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": self.command,
            "topology": {
                "name": running.topology.name,
                "up_command": running.up_command,
                "processes": running.named_pids(),
                "gpus": running.topology.gpus,
                "startup_s": running.startup_s,
            },
            "workload": {
                "input_len": wl.input_len,
                "output_len": wl.output_len,
                "dataset": "random-ids",
                "ignore_eos": True,
                "endpoint": "/v1/completions",
            },
            "model": model,
            "slo": {"ttft_ms": self.args.slo_ttft_ms, "tpot_ms": self.args.slo_tpot_ms},
            "env": self.env,
            "warmup": None,
            "results": [],
            "skipped": [],
            "warnings": [],
        }
        self.runs[(running.topology.name, wl.key)] = run
        return run

    def file_of(self, topo: str, wl: Workload) -> str:
        return f"{topo}-{wl.label}.json"

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for (topo, key), run in self.runs.items():
            wl = next(w for w in self.workloads if w.key == key)
            _write_json(self.out_dir / self.file_of(topo, wl), run)
        if self.overhead is not None:
            _write_json(self.out_dir / "gateway-overhead.json", self.overhead)
        _write_json(self.out_dir / "summary.json", self.summary())
        (self.out_dir / "summary.md").write_text(markdown(self) + "\n")

    def summary(self) -> dict[str, Any]:
        tops: dict[str, Any] = {}
        for name, info in self.topologies.items():
            loads = {}
            for wl in self.workloads:
                run = self.runs.get((name, wl.key))
                if run is None:
                    continue
                rows = [
                    {
                        "request_rate": r["request_rate"],
                        "num_prompts": r["num_prompts"],
                        **{k: r.get(k) for k in KEY_METRICS},
                        "slo_attainment": slo_attainment(r),
                        "meets_p90_slo": r["meets_p90_slo"],
                        "cpu_s_per_output_token": r.get("cpu_s_per_output_token"),
                    }
                    for r in run["results"]
                ]
                met = [r["request_rate"] for r in rows if r["meets_p90_slo"]]
                loads[wl.key] = {
                    "file": self.file_of(name, wl),
                    "rates": rows,
                    "skipped": run["skipped"],
                    "warnings": run["warnings"],
                    "max_goodput": max((r["goodput"] or 0.0 for r in rows), default=None),
                    "max_rate_meeting_p90_slo": max(
                        met, key=lambda r: math.inf if r == "inf" else r, default=None
                    ),
                }
            tops[name] = {**info, "workloads": loads}
        return {
            "date": self.started,
            "command": self.command,
            "env": self.env,
            "settings": {k: v for k, v in vars(self.args).items() if k not in ("command", "bench")},
            "slo": {"ttft_p90_ms": self.args.slo_ttft_ms, "tpot_p90_ms": self.args.slo_tpot_ms},
            "interrupted": self.interrupted,
            "topologies": tops,
            "comparison": comparison(self),
            "gateway_overhead": self.overhead,
        }


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def comparison(rec: Recorder) -> dict[str, list[dict[str, Any]]]:
    """Per workload and rate: each topology's goodput and disagg / colocated."""
    out: dict[str, list[dict[str, Any]]] = {}
    for wl in rec.workloads:
        by_rate: dict[str, dict[str, float]] = {}
        for name in rec.topologies:
            run = rec.runs.get((name, wl.key))
            for r in run["results"] if run else []:
                by_rate.setdefault(rate_label(r["request_rate"]), {})[name] = r["goodput"]
        rows = []
        for rate, goodputs in by_rate.items():
            row: dict[str, Any] = {"request_rate": rate, "goodput": goodputs}
            d, c = goodputs.get("disagg"), goodputs.get("colocated")
            row["disagg_over_colocated"] = d / c if d is not None and c else None
            rows.append(row)
        out[wl.key] = rows
    return out


def run_workload(
    rec: Recorder,
    running: Running,
    wl: Workload,
    wi: int,
    rates: list[float],
    budget: Budget,
    deadline: float | None,
    hard_deadline: float | None,
    model: dict[str, str],
) -> None:
    """Warm up, then each rate in turn; a rate that would end past ``deadline`` is skipped and
    one still running at ``hard_deadline`` (the topology's) is cut short."""
    args = rec.args
    run = rec.new_run(running, wl, model)
    name = running.topology.name
    if args.warmup_prompts > 0:
        # Poisson arrivals over about 5 s (at least the first rate): prefills mixed into decode
        # steps, and every kernel compiled, before anything is measured
        n = args.warmup_prompts
        finite = [r for r in rates if not math.isinf(r)]
        warm_rate = max(finite[0], n / 5.0) if finite else math.inf
        log(f"{name} {wl.label}: warm-up, {n} prompts at {rate_label(warm_rate)} req/s")
        t0 = time.monotonic()
        try:
            warm = bench_rate(
                running.base_url,
                wl,
                n,
                warm_rate,
                args.prompt_seed + 1000 * wi + 999,
                args,
                run_timeout(args, budget, hard_deadline),
            )
            run["warmup"] = {
                "num_prompts": n,
                "request_rate": rate_label(warm_rate),
                "seconds": time.monotonic() - t0,
                "completed": warm["completed"],
                "failed": warm["failed"],
                "tail_s": warm["duration"] - (0 if math.isinf(warm_rate) else n / warm_rate),
            }
        except TimeoutError:
            run["warmup"] = {"num_prompts": n, "seconds": time.monotonic() - t0, "timed_out": True}
    # how long the last requests of a rate take to finish after the last arrival: at first what
    # the warm-up's took, then 1.5 x the longest tail seen so far
    warm_tail = (run["warmup"] or {}).get("tail_s")
    drain_s = max(2.0, 1.5 * warm_tail) if warm_tail else 5.0 + 0.05 * wl.output_len
    stop_reason = ""
    for ri, rate in enumerate(rates):
        n = prompts_for_rate(rate, args.num_prompts, args.min_prompts, args.duration_s)
        estimate = estimate_run_s(rate, n, drain_s)
        if not stop_reason and (dead := running.dead_child()):
            stop_reason = f"topology failed: {dead}"
            run["warnings"].append(stop_reason)
        # each workload gets at least its first rate while the topology's share allows it
        if not stop_reason and not fits(estimate, deadline if ri else hard_deadline):
            stop_reason = "time budget"
        if stop_reason:
            run["skipped"].append(
                {
                    "request_rate": rate_label(rate),
                    "reason": stop_reason,
                    "estimate_s": round(estimate, 1),
                }
            )
            log(f"{name} {wl.label} rate {rate_label(rate)}: skipped ({stop_reason})")
            rec.save()
            continue
        seed = args.prompt_seed + 1000 * wi + ri
        timeout = run_timeout(args, budget, hard_deadline)
        log(f"{name} {wl.label} rate {rate_label(rate)}: {n} prompts (about {estimate:.0f} s)")
        before = running.cpu()
        t0 = time.monotonic()
        try:
            result = bench_rate(running.base_url, wl, n, rate, seed, args, timeout)
        except TimeoutError:
            stop_reason = f"rate {rate_label(rate)} did not finish in {timeout:.0f} s"
            run["skipped"].append(
                {
                    "request_rate": rate_label(rate),
                    "reason": "timed out",
                    "timeout_s": round(timeout, 1),
                }
            )
            log(f"{name} {wl.label} rate {rate_label(rate)}: timed out after {timeout:.0f} s")
            rec.save()
            continue
        wall = time.monotonic() - t0
        result.update(cpu_per_token(before, running.cpu(), result["total_output_tokens"]))
        result["num_prompts"] = n
        result["seed"] = seed
        result["wall_s"] = wall
        result["slo_attainment"] = slo_attainment(result)
        result["meets_p90_slo"] = meets_p90_slo(result, args)
        result["bench_serve_command"] = shlex.join(
            ["tandem", *serve_argv(running.base_url, wl, n, rate, seed, args)]
        )
        run["results"].append(result)
        if (warning := token_timing_warning(result, wl)) and warning not in run["warnings"]:
            run["warnings"].append(warning)
            log(f"WARNING: {warning}")
        arrivals = 0.0 if math.isinf(rate) else n / rate
        drain_s = max(drain_s, 1.5 * (result["duration"] - arrivals))
        log(
            f"{name} {wl.label} rate {rate_label(rate)}: {result['completed']}/{n} done in "
            f"{result['duration']:.1f} s, goodput {result['goodput']:.2f} req/s, TTFT p90 "
            f"{_ms(result['p90_ttft_ms'])}, TPOT p90 {_ms(result['p90_tpot_ms'])}"
        )
        if result["completed"] == 0:
            stop_reason = f"every request failed at rate {rate_label(rate)}"
        elif args.stop_at_saturation and result["slo_attainment"] < SATURATED_FRACTION:
            stop_reason = f"saturated at rate {rate_label(rate)}"
        rec.save()


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def run_topology(
    rec: Recorder,
    topo: Topology,
    rate_map: dict[str, list[float]],
    budget: Budget,
    deadline: float | None,
    model: dict[str, str],
) -> None:
    info: dict[str, Any] = {"flags": topo.describe(), "error": None}
    rec.topologies[topo.name] = info
    running: Running | None = None
    try:
        running = start_topology(rec.args, topo, rec.out_dir, model, budget)
        info.update(
            up_command=running.up_command,
            startup_s=running.startup_s,
            processes=running.named_pids(),
        )
        for wi, wl in enumerate(rec.workloads):
            remaining = len(rec.workloads) - wi
            wl_deadline = None
            if deadline is not None:
                now = time.monotonic()
                wl_deadline = now + max(0.0, deadline - STOP_TYPICAL_S - now) / remaining
            rates = rate_map[wl.key]
            run_workload(rec, running, wl, wi, rates, budget, wl_deadline, deadline, model)
    except (ChildFailedError, ConfigError) as exc:
        info["error"] = str(exc)
        log(f"{topo.name} failed: {exc}")
    finally:
        if running is not None:
            info.update(stop_topology(running))
        rec.save()


# ---- W6 --------------------------------------------------------------------------------------------
def engine_throughput(
    args: argparse.Namespace,
    wl: Workload,
    n: int,
    gpus: Sequence[str],
    model: dict[str, str],
    out_dir: Path,
    timeout_s: float,
) -> dict[str, Any]:
    """`tandem bench offline` in a child process (so the GPU is free again afterwards)."""
    out = out_dir / "gateway-overhead-engine.json"
    argv = [sys.executable, "-m", "services.cli", "bench", "offline", *engine_flags(args, model)]
    if args.device != "auto":
        argv += ["--device", args.device]
    argv += [
        "--num-prompts",
        str(n),
        "--input-len",
        str(wl.input_len),
        "--output-len",
        str(wl.output_len),
        "--json-out",
        str(out),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[0]
    shown = shlex.join(["tandem", *argv[3:]])
    log(f"W6: in-process engine: {shown}")
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        text, _ = proc.communicate(timeout=timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(text.splitlines()[-30:])
        raise ChildFailedError(f"bench offline exited with code {proc.returncode}:\n{tail}")
    report = json.loads(out.read_text())
    return {
        "command": shown,
        "report": report,
        "output_tok_s": report["tandem"]["output_tok_s"],
        "seconds": report["tandem"]["seconds"],
    }


def gateway_overhead(
    rec: Recorder, wl: Workload, gpus: Sequence[str], budget: Budget, model: dict[str, str]
) -> None:
    args = rec.args
    n = args.overhead_num_prompts or args.num_prompts
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": rec.command,
        "workload": {
            "input_len": wl.input_len,
            "output_len": wl.output_len,
            "num_prompts": n,
            "request_rate": "inf",
            "ignore_eos": True,
        },
        "model": model,
        "gpu": gpus[0] if gpus else None,
        "env": rec.env,
        "error": None,
    }
    rec.overhead = result
    if budget.left() < 2 * STOP_RESERVE_S + 30:
        result["error"] = f"skipped: {budget.left():.0f} s left of the time budget"
        log(f"W6 {result['error']}")
        rec.save()
        return
    timeout = min(args.run_timeout_s + args.ready_timeout_s, max(budget.left() - STOP_RESERVE_S, 1))
    try:
        result["engine"] = engine_throughput(args, wl, n, gpus, model, rec.out_dir, timeout)
        log(f"W6: in-process engine: {result['engine']['output_tok_s']:.1f} output tok/s")
    except (ChildFailedError, subprocess.TimeoutExpired) as exc:
        result["error"] = f"in-process engine: {exc}"
        log(f"W6 failed: {result['error']}")
        rec.save()
        return
    rec.save()
    topo = Topology("gateway-overhead", ["--colocated", "1"], list(gpus[:1]))
    running: Running | None = None
    try:
        running = start_topology(args, topo, rec.out_dir, model, budget)
        if args.warmup_prompts > 0:
            bench_rate(
                running.base_url,
                wl,
                args.warmup_prompts,
                math.inf,
                args.prompt_seed + 998,
                args,
                run_timeout(args, budget, None),
            )
        before = running.cpu()
        timeout = run_timeout(args, budget, None)
        log(f"W6: through the gateway: {n} prompts at once")
        served = bench_rate(
            running.base_url, wl, n, math.inf, args.prompt_seed + 997, args, timeout
        )
        served.update(cpu_per_token(before, running.cpu(), served["total_output_tokens"]))
        engine_tok_s = result["engine"]["output_tok_s"]
        result.update(
            up_command=running.up_command,
            gateway=served,
            gateway_output_tok_s=served["output_throughput"],
            engine_output_tok_s=engine_tok_s,
            ratio=served["output_throughput"] / engine_tok_s if engine_tok_s else None,
            gateway_cpu_s_per_token=served["cpu_s_per_output_token"].get("gateway"),
        )
        log(
            f"W6: gateway {served['output_throughput']:.1f} output tok/s = "
            f"{result['ratio']:.3f} x the in-process engine; gateway CPU "
            f"{(result['gateway_cpu_s_per_token'] or 0) * 1e6:.1f} us per streamed token"
        )
    except (ChildFailedError, TimeoutError) as exc:
        result["error"] = f"through the gateway: {exc or 'timed out'}"
        log(f"W6 failed: {result['error']}")
    finally:
        if running is not None:
            result.update(stop_topology(running))
        rec.save()


# ---- model ------------------------------------------------------------------------------------------
def synthetic_model_dir(config_path: Path, dest: Path) -> Path:
    """An HF directory: the named config plus a word-level tokenizer over its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = json.loads(config_path.read_text())
    vocab_size = int(config["vocab_size"])
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(config_path, dest / "config.json")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(dest / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "w0",
        "model_max_length": int(config.get("max_position_embeddings", 8192)),
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_config) + "\n")
    return dest


def model_overrides(args: argparse.Namespace, scratch: Path) -> dict[str, str]:
    """Engine-flag overrides that make every token stream as text (see the module docstring)."""
    files = resolve_model(args.model)
    if files.kind != "named" or not args.synthetic_tokenizer:
        return {}
    directory = synthetic_model_dir(files.path, scratch / files.name)
    log(f"{args.model}: random weights with a synthetic word-level tokenizer in {directory}")
    return {
        "model": str(directory),
        "synthetic_tokenizer_for": files.name,
        "load_format": "dummy",
        "served_model_name": args.served_model_name or files.name,
    }


# ---- environment, plots, tables ---------------------------------------------------------------------
def environment() -> dict[str, Any]:
    """Python, torch and GPU facts, without importing torch (or touching a GPU) here."""
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "hostname": platform.node(),
    }
    probe = (
        "import json, torch; print(json.dumps({'torch': torch.__version__, "
        "'cuda': torch.version.cuda}))"
    )
    with contextlib.suppress(Exception):
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
        )
        env.update(json.loads(out.stdout.strip().splitlines()[-1]))
    with contextlib.suppress(Exception):
        query = [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,driver_version",
            "--format=csv,noheader",
        ]
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
        env["gpus"] = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    with contextlib.suppress(Exception):
        repo = Path(__file__).resolve().parents[1]
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        env["git"] = head + ("-dirty" if dirty else "")
    return env


def plot(rec: Recorder) -> list[str]:
    """One figure per workload: TTFT p90, TPOT p90 and goodput against the rate, per topology."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots")
        return []
    written = []
    panels = [
        ("p90_ttft_ms", "TTFT p90 (ms)", rec.args.slo_ttft_ms),
        ("p90_tpot_ms", "TPOT p90 (ms)", rec.args.slo_tpot_ms),
        ("goodput", "goodput (req/s)", None),
    ]
    for wl in rec.workloads:
        runs = {n: rec.runs[(n, wl.key)] for n in rec.topologies if (n, wl.key) in rec.runs}
        if not any(run["results"] for run in runs.values()):
            continue
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), constrained_layout=True)
        for ax, (key, title, slo) in zip(axes, panels, strict=True):
            for name, run in runs.items():
                rows = [r for r in run["results"] if r["request_rate"] != "inf"]
                xs = [float(r["request_rate"]) for r in rows]
                ys = [math.nan if r.get(key) is None else r[key] for r in rows]
                ax.plot(xs, ys, marker="o", label=name)
            if key == "goodput":
                rates = sorted(
                    {
                        float(r["request_rate"])
                        for run in runs.values()
                        for r in run["results"]
                        if r["request_rate"] != "inf"
                    }
                )
                if rates:
                    ax.plot(rates, rates, ls=":", color="grey", label="offered rate")
            if slo is not None:
                ax.axhline(slo, ls="--", color="red", label="SLO")
            if slo is not None:
                ax.set_yscale("log")
            ax.set_title(title)
            ax.set_xlabel("request rate (req/s)")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"{wl.input_len} in / {wl.output_len} out: " + " vs ".join(runs))
        path = rec.out_dir / f"w4-{wl.label}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(str(path))
    return written


def _p3(r: dict[str, Any], name: str) -> str:
    values = [r.get(f"{k}_{name}_ms") for k in ("median", "p90", "p99")]
    return " / ".join("n/a" if v is None else f"{v:.1f}" for v in values)


def markdown(rec: Recorder) -> str:
    """The tables for docs/benchmarks.md: one per workload, every topology and rate."""
    lines: list[str] = []
    for wl in rec.workloads:
        lines += [
            f"#### {wl.input_len} in / {wl.output_len} out",
            "",
            "| topology | rate (req/s) | done | TTFT p50 / p90 / p99 (ms) | "
            "TPOT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | goodput (req/s) | "
            "output tok/s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name in rec.topologies:
            run = rec.runs.get((name, wl.key))
            if run is None:
                lines.append(f"| {name} | not run: {rec.topologies[name].get('error')} |||||||")
                continue
            for r in run["results"]:
                lines.append(
                    f"| {name} | {rate_label(r['request_rate'])} | {r['completed']}/{r['num_prompts']} | "
                    f"{_p3(r, 'ttft')} | {_p3(r, 'tpot')} | {_p3(r, 'itl')} | "
                    f"{r['goodput']:.2f}{'' if r['meets_p90_slo'] else ' (p90 SLO missed)'} | "
                    f"{r['output_throughput']:.0f} |"
                )
            for s in run["skipped"]:
                lines.append(f"| {name} | {s['request_rate']} | skipped: {s['reason']} |||||||")
        lines.append("")
    if (o := rec.overhead) is not None:
        lines += ["#### Gateway overhead (W6)", ""]
        if o.get("ratio") is not None:
            w = o["workload"]
            lines += [
                "| path | output tok/s | gateway CPU per streamed token |",
                "|---|---|---|",
                f"| in-process engine | {o['engine_output_tok_s']:.1f} | |",
                f"| gateway + gRPC (colocated 1) | {o['gateway_output_tok_s']:.1f} "
                f"({o['ratio']:.3f} x) | {(o['gateway_cpu_s_per_token'] or 0) * 1e6:.1f} us |",
                "",
                f"{w['num_prompts']} prompts x {w['input_len']} in / {w['output_len']} out, all at once.",
            ]
        else:
            lines.append(f"not measured: {o.get('error')}")
        lines.append("")
    return "\n".join(lines)


# ---- entry points -----------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    try:
        workloads = parse_workloads(args.workloads)
        rate_map = parse_rates(args.rates, workloads)
        names = parse_topologies(args.topologies)
    except ValueError as exc:
        print(f"tandem bench disagg: {exc}", file=sys.stderr)
        return 2
    if not names and not args.gateway_overhead:
        print(
            "tandem bench disagg: nothing to run (no topology, no --gateway-overhead)",
            file=sys.stderr,
        )
        return 2
    budget = Budget(time.monotonic() + args.time_budget_s if args.time_budget_s > 0 else None)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gpus = [] if args.device.startswith("cpu") else detect_gpus(args.gpus)
    if sys.argv[1:3] == ["bench", "disagg"]:
        command = shlex.join(["tandem", *sys.argv[1:]])
    else:
        command = shlex.join(["python", "-m", "deploy.bench_disagg", *sys.argv[1:]])
    scratch = Path(tempfile.mkdtemp(prefix="tandem-bench-model-"))
    try:
        model = model_overrides(args, scratch)
    except (ModelNotFoundError, ConfigError, OSError, ValueError) as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"tandem bench disagg: {exc}", file=sys.stderr)
        return 2
    log(
        f"GPUs: {','.join(gpus) or 'none'}; topologies: {', '.join(names) or 'none'}; "
        f"workloads: {', '.join(w.key for w in workloads)}; out: {out_dir}"
    )
    rec = Recorder(out_dir, args, command, environment(), workloads)
    try:
        with sigterm_unwinds():
            topologies = [topology(n, gpus, args.workers, args.prefill_workers) for n in names]
            parts = len(topologies) + (1 if args.gateway_overhead else 0)
            for i, topo in enumerate(topologies):
                deadline = budget.share(parts - i, STOP_RESERVE_S)
                run_topology(rec, topo, rate_map, budget, deadline, model)
            if args.gateway_overhead:
                gateway_overhead(rec, workloads[0], gpus, budget, model)
    except (KeyboardInterrupt, _Interrupted):
        rec.interrupted = True
        log("interrupted: results so far are saved")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        rec.save()
    plots = plot(rec)
    print("\n" + markdown(rec), flush=True)
    log(f"wrote {out_dir / 'summary.json'}, {len(rec.runs)} run file(s), {len(plots)} plot(s)")
    failed = any(t.get("error") or t.get("left_behind") for t in rec.topologies.values())
    failed = failed or (rec.overhead is not None and rec.overhead.get("error") is not None)
    return 1 if rec.interrupted or failed else 0


def cli_main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(["bench", "disagg", *(sys.argv[1:] if argv is None else argv)])
    return main(args)


if __name__ == "__main__":
    sys.exit(cli_main())
