"""What `tandem bench disagg` runs and when: workloads, request rates, topologies, the time
budget shared between them, and the log line every part writes."""

from __future__ import annotations

import argparse
import datetime
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

TOPOLOGIES = ("disagg", "colocated", "disagg-local", "disagg-whole", "disagg-streamed")
LOCAL_PREFILL_TOKENS = 1024  # the disagg-local topology's threshold unless --local-prefill-tokens
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


def check_local_prefill_tokens(
    tokens: int | None, names: Sequence[str], queue: int | None = None
) -> None:
    """--local-prefill-tokens and --local-prefill-queue shape only the disagg-local topology:
    refused without it."""
    for flag, value in (("--local-prefill-tokens", tokens), ("--local-prefill-queue", queue)):
        if value is None:
            continue
        if "disagg-local" not in names:
            raise ValueError(f"{flag} needs the disagg-local topology in --topologies")
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")


def topology(
    name: str, gpus: Sequence[str], workers: int, prefill_workers: int | None,
    local_prefill_tokens: int | None = None, local_prefill_queue: int | None = None,
) -> Topology:  # fmt: skip
    """``disagg``: prefill on the first GPUs, decode on the rest (one worker per GPU; without GPUs
    ``workers`` processes); ``colocated``: as many colocated workers; ``disagg-local``: disagg
    with conditional disaggregation (prompts of at most ``local_prefill_tokens`` tokens are
    prefilled by the decode worker, and with ``local_prefill_queue`` so are all prompts that
    arrive while every prefill worker has that many requests); ``disagg-whole`` /
    ``disagg-streamed``: disagg with each prompt's KV sent whole after its first token
    (``--kv-streaming off``) / streamed layer by layer while its last chunk is computed
    (``--kv-streaming on``), whatever the default for the device (``auto``)."""
    n = max(len(gpus), 1) if gpus else workers
    if name == "colocated":
        return Topology(name, ["--colocated", str(n)], list(gpus))
    n = max(n, 2)
    prefill = prefill_workers if prefill_workers is not None else max(1, n // 2)
    prefill = min(max(prefill, 1), n - 1)
    flags = ["--prefill", str(prefill), "--decode", str(n - prefill)]
    if name == "disagg-local":
        flags += ["--max-local-prefill-tokens", str(local_prefill_tokens or LOCAL_PREFILL_TOKENS)]
        if local_prefill_queue:
            flags += ["--local-prefill-queue", str(local_prefill_queue)]
    if name in ("disagg-whole", "disagg-streamed"):
        flags += ["--kv-streaming", "off" if name == "disagg-whole" else "on"]
    return Topology(name, flags, list(gpus))


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
