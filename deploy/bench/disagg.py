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
(``--load-format dummy``, same ``--dummy-weight-seed``: the same weights): every token then
streams as text. Torch-free: the workers and the in-process engine run in child processes.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deploy.bench.overhead import gateway_overhead
from deploy.bench.plan import (
    SATURATED_FRACTION,
    STOP_RESERVE_S,
    STOP_TYPICAL_S,
    Budget,
    Topology,
    Workload,
    check_local_prefill_tokens,
    estimate_run_s,
    fits,
    log,
    parse_rates,
    parse_topologies,
    parse_workloads,
    prompts_for_rate,
    rate_label,
    run_timeout,
    topology,
)
from deploy.bench.rate import (
    bench_rate,
    cpu_per_token,
    meets_p90_slo,
    serve_argv,
    slo_attainment,
    token_timing_warning,
)
from deploy.bench.report import Recorder, environment, markdown, plot
from deploy.bench.topology import (
    Running,
    _Interrupted,
    raise_if_interrupted,
    sigterm_unwinds,
    start_topology,
    stop_topology,
)
from deploy.gpus import detect_gpus
from deploy.supervisor import ChildFailedError
from services.cli import build_parser
from services.config import ConfigError
from services.model_files import ModelNotFoundError, resolve_model


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
        raise_if_interrupted()
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
        raise_if_interrupted()  # a rate a SIGTERM cut short is not a measurement
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
        "served_model_name": (args.served_model_name or [files.name])[0],
    }


# ---- entry points -----------------------------------------------------------------------------------
def main(args: argparse.Namespace) -> int:
    try:
        workloads = parse_workloads(args.workloads)
        rate_map = parse_rates(args.rates, workloads)
        names = parse_topologies(args.topologies)
        check_local_prefill_tokens(args.local_prefill_tokens, names, args.local_prefill_queue)
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
        command = shlex.join(["python", "-m", "deploy.bench.disagg", *sys.argv[1:]])
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
            topologies = [
                topology(
                    n,
                    gpus,
                    args.workers,
                    args.prefill_workers,
                    args.local_prefill_tokens,
                    args.local_prefill_queue,
                )
                for n in names
            ]
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
