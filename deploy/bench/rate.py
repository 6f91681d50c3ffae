"""One request rate of `tandem bench disagg`: `tandem bench serve`'s load generator against a
running topology, and what its result says (SLO attainment, CPU per token)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
from pathlib import Path
from typing import Any

from deploy.bench.plan import Workload, rate_label
from gateway.bench.serve import build_prompts, run_rates
from services.cli import build_parser

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
