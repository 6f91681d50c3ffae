"""Serving metrics from request results, named and scaled as `vllm bench serve` reports them (ms).

TPOT of a request = (E2E - TTFT) / (output tokens - 1); ITL = every gap between text chunks;
goodput = requests/s whose TTFT and TPOT both meet the SLOs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from gateway.bench.client import RequestResult

METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}  # fmt: skip
PERCENTILES = (90, 99)


def tpot_s(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def stats_ms(name: str, values_s: Sequence[float]) -> dict[str, float | None]:
    """mean/median/std/p90/p99 of one metric in milliseconds (None when there is no sample)."""
    keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES)]
    if not values_s:
        return {f"{k}_{name}_ms": None for k in keys}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    values = [ms.mean(), np.median(ms), ms.std(), *(np.percentile(ms, p) for p in PERCENTILES)]
    return {f"{k}_{name}_ms": float(v) for k, v in zip(keys, values, strict=True)}


def meets_slo(r: RequestResult, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    tpot = tpot_s(r)
    return r.ttft * 1000.0 <= slo_ttft_ms and (tpot is None or tpot * 1000.0 <= slo_tpot_ms)


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    rate: float,
    max_concurrency: int | None,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok)
    out: dict[str, Any] = {
        "request_rate": "inf" if math.isinf(rate) else rate,
        "max_concurrency": max_concurrency,
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration,
        "goodput": good / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    tpots = [t for r in ok if (t := tpot_s(r)) is not None]
    samples = {"ttft": [r.ttft for r in ok], "tpot": tpots,
               "itl": [g for r in ok for g in r.itl], "e2el": [r.latency for r in ok]}  # fmt: skip
    for name, values in samples.items():
        out.update(stats_ms(name, values))
    out["errors"] = dict(Counter(r.error for r in results if not r.ok).most_common(10))
    out["input_lens"] = [r.prompt_len for r in ok]
    out["output_lens"] = [r.output_tokens for r in ok]
    out["ttfts_ms"] = [r.ttft * 1000.0 for r in ok]
    out["e2els_ms"] = [r.latency * 1000.0 for r in ok]
    return out


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_result(m: dict[str, Any]) -> str:
    """The result of one rate as `vllm bench serve` prints it."""
    rows: list[tuple[str, Any]] = [
        ("Request rate (req/s)", m["request_rate"]),
        ("Max request concurrency", m["max_concurrency"]),
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", m["duration"]),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", m["request_throughput"]),
        ("Request goodput (req/s)", m["request_goodput"]),
        ("Output token throughput (tok/s)", m["output_throughput"]),
        ("Total Token throughput (tok/s)", m["total_token_throughput"]),
    ]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{label + ':':<40} {_fmt(value):<10}" for label, value in rows]
    for name, title in METRICS.items():
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        label = name.upper()
        for key, text in [
            ("mean", "Mean"),
            ("median", "Median"),
            *((f"p{p}", f"P{p}") for p in PERCENTILES),
        ]:
            lines.append(f"{f'{text} {label} (ms):':<40} {_fmt(m[f'{key}_{name}_ms']):<10}")
    lines.append("=" * 50)
    if m["errors"]:
        lines += ["Errors:"] + [f"  {count} x {error}" for error, count in m["errors"].items()]
    return "\n".join(lines)


def format_summary(results: Sequence[dict[str, Any]]) -> str:
    """One line per request rate: throughput, goodput and the latency percentiles."""
    head = f"{'rate':>6} {'ok':>5} {'fail':>4} {'req/s':>7} {'good/s':>7} {'out tok/s':>9}"
    head += "".join(f" {n.upper() + ' p50/p90/p99 (ms)':>26}" for n in ("ttft", "tpot"))
    lines = [head]
    for m in results:
        row = f"{m['request_rate']!s:>6} {m['completed']:>5} {m['failed']:>4} "
        row += (
            f"{m['request_throughput']:>7.2f} {m['goodput']:>7.2f} {m['output_throughput']:>9.1f}"
        )
        for name in ("ttft", "tpot"):
            cells = "/".join(_fmt(m[f"{k}_{name}_ms"], 1) for k in ("median", "p90", "p99"))
            row += f" {cells:>26}"
        lines.append(row)
    return "\n".join(lines)
