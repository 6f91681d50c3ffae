"""`tandem bench disagg`: the pure parts, then the whole script on the CPU with a tiny model (slow:
two topologies, the in-process engine and a colocated worker, one after the other)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deploy.bench.disagg import synthetic_model_dir
from deploy.procfs import alive, descendants
from services.cli import HANDLERS
from tests.deploy.conftest import REPO, child_env, disagg_args


# ---- pure parts ------------------------------------------------------------------------------------
def test_cli_registers_bench_disagg(monkeypatch: pytest.MonkeyPatch) -> None:
    import deploy.bench.disagg

    seen = []
    monkeypatch.setattr(deploy.bench.disagg, "main", lambda args: seen.append(args.bench) or 0)
    assert HANDLERS["bench disagg"](argparse.Namespace(bench="disagg")) == 0
    assert seen == ["disagg"]
    args = disagg_args("--model", "llama-3.1-8b", "--rates", "2,4", "--gpus", "0,1")
    assert (args.command, args.bench, args.port, args.topologies) == (
        "bench",
        "disagg",
        0,
        "disagg,colocated",
    )


def test_synthetic_tokenizer_streams_one_word_per_token(tmp_path: Path) -> None:
    from gateway.flows.tokenizer import GatewayTokenizer
    from services.model_files import resolve_model

    config = resolve_model("smollm2-135m").path
    directory = synthetic_model_dir(config, tmp_path / "smollm2-135m")
    assert json.loads((directory / "config.json").read_text()) == json.loads(config.read_text())
    tok = GatewayTokenizer(str(directory))
    assert tok.vocab_size == json.loads(config.read_text())["vocab_size"]
    assert tok.decode([5, 49151]) == "w5 w49151"
    assert tok.encode("w7 w8", add_special_tokens=False) == [7, 8]
    assert resolve_model(str(directory)).kind == "hf"


# ---- the whole script on the CPU -------------------------------------------------------------------
class Watched:
    """The script as a child process, with every process below it recorded while it runs."""

    def __init__(self, *flags: str) -> None:
        argv = [sys.executable, "-m", "deploy.bench.disagg", *flags]
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env={**os.environ, **child_env(TANDEM_UP_GRACE="10")},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.seen: set[int] = set()
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _watch(self) -> None:
        while self.proc.poll() is None:
            self.seen |= descendants(self.proc.pid)
            time.sleep(0.1)

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if any(text in line for line in list(self.lines)):
                return
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in:\n" + "\n".join(self.lines[-60:]))

    def finish(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def left_behind(self) -> list[int]:
        deadline = time.monotonic() + 10
        while any(alive(p) for p in self.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [p for p in self.seen if alive(p)]

    def cleanup(self) -> None:
        for pid in self.seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


TINY = ["--model", "smollm2-135m", "--device", "cpu", "--max-model-len", "64",
        "--kv-cache-gib", "0.05", "--workloads", "16:4", "--num-prompts", "4", "--duration-s", "0",
        "--warmup-prompts", "2", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000"]  # fmt: skip


@pytest.mark.slow
def test_both_topologies_and_the_gateway_overhead_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # --workers 1: the colocated topology is one worker (the disagg one is still a prefill and
    # a decode worker): a model load fewer, and the report is the same
    run = Watched(*TINY, "--rates", "2,inf", "--gateway-overhead", "--workers", "1",
                  "--out-dir", str(out), "--time-budget-s", "400")  # fmt: skip
    try:
        code = run.finish(timeout_s=420)
        assert code == 0, run.output[-4000:]
        assert len(run.seen) >= 4  # gateway + workers, the engine child, ...
        assert run.left_behind() == []
    finally:
        run.cleanup()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is False
    assert summary["slo"] == {"ttft_p90_ms": 60000.0, "tpot_p90_ms": 60000.0}
    assert {"torch", "python", "cpu_count"} <= set(summary["env"])
    assert list(summary["topologies"]) == ["disagg", "colocated"]
    for name, topo in summary["topologies"].items():
        assert topo["error"] is None and topo["left_behind"] == []
        assert "tandem up" in topo["up_command"] and topo["startup_s"] > 0
        assert set(topo["exit_codes"].values()) == {0}
        load = topo["workloads"]["16:4"]
        assert load["skipped"] == [] and load["warnings"] == []
        assert [r["request_rate"] for r in load["rates"]] == [2.0, "inf"]
        for row in load["rates"]:
            assert row["completed"] == row["num_prompts"] == 4 and row["failed"] == 0
            assert 0 < row["median_ttft_ms"] <= row["p90_ttft_ms"] <= row["p99_ttft_ms"]
            assert row["p90_tpot_ms"] > 0 and row["median_itl_ms"] > 0
            assert row["goodput"] > 0 and row["meets_p90_slo"] is True
            assert "gateway" in row["cpu_s_per_output_token"]
        raw = json.loads((out / load["file"]).read_text())
        assert raw["topology"]["name"] == name and raw["command"] == summary["command"]
        assert raw["workload"]["input_len"] == 16 and raw["warmup"]["completed"] == 2
        assert {"date", "env", "model", "slo", "results", "skipped"} <= set(raw)
        for result in raw["results"]:
            assert len(result["ttfts_ms"]) == 4 and result["total_output_tokens"] == 16
            assert result["bench_serve_command"].startswith("tandem bench serve --base-url")
    comparison = summary["comparison"]["16:4"]
    assert [c["request_rate"] for c in comparison] == ["2", "inf"]
    assert all(c["disagg_over_colocated"] > 0 for c in comparison)

    w6 = summary["gateway_overhead"]
    assert w6["error"] is None and w6["left_behind"] == []
    assert w6["workload"] == {"input_len": 16, "output_len": 4, "num_prompts": 4,
                              "request_rate": "inf", "ignore_eos": True}  # fmt: skip
    assert w6["gateway"]["completed"] == 4 and w6["engine"]["report"]["num_prompts"] == 4
    assert w6["ratio"] == pytest.approx(w6["gateway_output_tok_s"] / w6["engine_output_tok_s"])
    assert w6["gateway_cpu_s_per_token"] is not None and w6["gateway_cpu_s_per_token"] >= 0
    assert json.loads((out / "gateway-overhead.json").read_text())["ratio"] == w6["ratio"]

    assert (out / "w4-16in-4out.png").stat().st_size > 5000
    table = (out / "summary.md").read_text()
    for row in ("| disagg | 2 | 4/4 |", "| colocated | inf | 4/4 |", "| in-process engine |"):
        assert row in table and row in run.output


@pytest.mark.slow
def test_sigterm_stops_the_topology_and_keeps_what_was_measured(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = Watched(*TINY, "--topologies", "colocated", "--workers", "1", "--rates", "0.2",
                  "--min-prompts", "4", "--duration-s", "60", "--warmup-prompts", "0",
                  "--out-dir", str(out))  # fmt: skip
    try:
        run.wait_for("rate 0.2: 4 prompts", timeout_s=120)
        started = set(run.seen)
        run.proc.send_signal(signal.SIGTERM)
        assert run.finish(timeout_s=60) == 1
        assert len(started) >= 2 and run.left_behind() == []
    finally:
        run.cleanup()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
    colocated = summary["topologies"]["colocated"]
    assert colocated["left_behind"] == [] and colocated["workloads"]["16:4"]["rates"] == []
    assert "interrupted" in run.output
