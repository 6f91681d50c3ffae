"""`tandem bench serve`: the serving benchmark against a running OpenAI-compatible endpoint.

Random fixed-length prompts (or a JSONL file), Poisson arrivals at one or more request rates,
streaming requests with ``ignore_eos``; reports TTFT, TPOT, ITL and E2E latency (mean, median,
p90, p99 in ms), throughput and goodput per rate, as `vllm bench serve` names them, so the
numbers compare. Torch-free: httpx, numpy, tokenizers; matplotlib only for ``--plot``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from gateway.bench.client import READ_TIMEOUT_S, run_load
from gateway.bench.dataset import (
    BenchPrompt,
    DatasetError,
    file_prompts,
    load_tokenizer,
    random_prompts,
)
from gateway.bench.metrics import PERCENTILES, format_result, format_summary, summarize


def parse_rates(values: list[str] | None) -> list[float]:
    """'--request-rate 2 --request-rate 4,8 --request-rate inf' -> [2.0, 4.0, 8.0, inf]."""
    rates = []
    for value in values or ["inf"]:
        for item in value.split(","):
            rate = float(item)
            if not rate > 0:
                raise ValueError(f"--request-rate must be positive or 'inf', got {item!r}")
            rates.append(rate)
    return rates


def build_prompts(args: argparse.Namespace) -> tuple[list[BenchPrompt], str]:
    """The prompts and the name of where they came from."""
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    if args.prompts_file:
        prompts = file_prompts(
            args.prompts_file, args.num_prompts, args.output_len, args.endpoint, tokenizer
        )
        return prompts, "file"
    prompts = random_prompts(
        args.num_prompts, args.input_len, args.output_len, args.endpoint, args.seed, tokenizer
    )
    return prompts, "random-text" if tokenizer is not None else "random-ids"


def fresh_prompts(
    args: argparse.Namespace, prompts: list[BenchPrompt], index: int
) -> list[BenchPrompt]:
    """The prompts of the ``index``-th rate: random ones are drawn again with seed + index, so a
    server's prefix cache never serves a later rate from an earlier rate's prompts (which made
    every rate after the first measure cache hits). A prompts file is sent again as it is."""
    if args.prompts_file:
        return prompts
    return build_prompts(argparse.Namespace(**{**vars(args), "seed": args.seed + index}))[0]


def api_root(base_url: str) -> str:
    """The server root: 'http://h:8000/v1/' and 'http://h:8000' both give 'http://h:8000'."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


async def discover_model(client: httpx.AsyncClient, root: str) -> str:
    response = await client.get(f"{root}/v1/models")
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def _label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


async def run_rates(
    args: argparse.Namespace, prompts: list[BenchPrompt], rates: list[float]
) -> tuple[str, list[dict[str, Any]]]:
    root = api_root(args.base_url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connections = args.max_concurrency or len(prompts)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(30.0, read=READ_TIMEOUT_S)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = args.model or await discover_model(client, root)
        results = []
        for index, rate in enumerate(rates):
            batch = prompts if index == 0 else fresh_prompts(args, prompts, index)
            with tqdm(
                total=len(batch), desc=f"rate {_label(rate)}", unit="req", disable=None
            ) as bar:
                done, duration = await run_load(
                    client, root + args.endpoint, model, args.endpoint, batch, rate,
                    args.max_concurrency, args.seed + index, lambda: bar.update(1),
                )  # fmt: skip
            metrics = summarize(
                done, duration, rate, args.max_concurrency, args.slo_ttft_ms, args.slo_tpot_ms
            )
            print(format_result(metrics), flush=True)
            results.append(metrics)
    return model, results


def config_of(
    args: argparse.Namespace, model: str, source: str, rates: list[float]
) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "tokenizer": args.tokenizer,
        "dataset": source,
        "input_len": None if source == "file" else args.input_len,
        "output_len": args.output_len,
        "num_prompts": args.num_prompts,
        "request_rates": [_label(r) if math.isinf(r) else r for r in rates],
        "max_concurrency": args.max_concurrency,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "seed": args.seed,
    }


def plot_latencies(results: list[dict[str, Any]], path: str) -> None:
    """Median/p90/p99 of TTFT, TPOT, ITL and E2E latency against the request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r if isinstance(r := m["request_rate"], str) else f"{r:g}" for m in results]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    for ax, name in zip(axes.flat, ("ttft", "tpot", "itl", "e2el"), strict=True):
        for key in ("median", *(f"p{p}" for p in PERCENTILES)):
            values = [m[f"{key}_{name}_ms"] for m in results]
            ax.plot(labels, [math.nan if v is None else v for v in values], marker="o", label=key)
        ax.set_title(f"{name.upper()} (ms)")
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    try:
        rates = parse_rates(args.request_rate)
        prompts, source = build_prompts(args)
    except (ValueError, OSError) as exc:  # DatasetError is a ValueError
        print(f"tandem bench serve: {exc}", file=sys.stderr)
        return 2
    try:
        model, results = asyncio.run(run_rates(args, prompts, rates))
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"tandem bench serve: cannot use {args.base_url}: {exc}", file=sys.stderr)
        return 2
    if len(results) > 1:
        print(format_summary(results))
    if args.json_out:
        report = {"config": config_of(args, model, source, rates), "results": results}
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot_latencies(results, args.plot)
    return 0 if any(m["completed"] for m in results) else 1


__all__ = ["DatasetError", "main"]
