"""W6 of `tandem bench disagg`: the same prompts through the in-process engine and through
`tandem up --colocated 1` + the gateway; output tok/s of both and CPU seconds per token."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deploy.bench.plan import STOP_RESERVE_S, Budget, Topology, Workload, log, run_timeout
from deploy.bench.rate import bench_rate, cpu_per_token
from deploy.bench.report import Recorder
from deploy.bench.topology import Running, start_topology, stop_topology
from deploy.plan import engine_flags
from deploy.supervisor import ChildFailedError


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
