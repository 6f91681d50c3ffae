"""What `tandem bench disagg` writes: the JSON per topology and workload, summary.json,
summary.md and the PNG plots, rewritten after every rate."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.bench.plan import Workload, log, rate_label
from deploy.bench.rate import KEY_METRICS, slo_attainment
from deploy.bench.topology import Running


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
        repo = Path(__file__).resolve().parents[2]
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
