"""W1's transformers peer: each batch size in its own process, the best one reported."""

from __future__ import annotations

import argparse
import os

import pytest

from services.cli import build_parser
from services.engine.bench import hf_peer

pytestmark = pytest.mark.timeout(300)


def test_each_batch_size_runs_in_its_own_process_and_the_best_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spawned: list[list[str]] = []
    real_run = hf_peer.subprocess.run

    def run(cmd: list[str], **kwargs: object):  # type: ignore[no-untyped-def]
        spawned.append(cmd)
        return real_run(cmd, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(hf_peer.subprocess, "run", run)
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    args = argparse.Namespace(
        model="smollm2-135m", load_format="dummy", dtype="auto",
        num_prompts=4, input_len=16, output_len=3,
    )  # fmt: skip
    out = hf_peer.sweep(args, [1, 4])
    assert [cmd[cmd.index("--batch-size") + 1] for cmd in spawned] == ["1", "4"]
    runs = out["runs"]
    assert set(runs) == {"bs1", "bs4"}
    for bs, run_ in ((1, runs["bs1"]), (4, runs["bs4"])):
        assert run_["batch_size"] == bs and run_["seconds"] > 0
        assert run_["total_tok_s"] == pytest.approx(4 * (16 + 3) / run_["seconds"])
    assert out["best"] == max(runs.values(), key=lambda r: r["total_tok_s"])


def test_a_failing_peer_is_reported_not_raised() -> None:
    args = argparse.Namespace(
        model="smollm2-135m", load_format="dummy", dtype="no_such_dtype",
        num_prompts=2, input_len=8, output_len=2,
    )  # fmt: skip
    out = hf_peer.sweep(args, [2])
    assert out["best"] is None and "no_such_dtype" in out["runs"]["bs2"]["error"]


def test_only_the_offline_benchmark_takes_compare_transformers() -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", "offline", "--compare-transformers"]).compare_transformers
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["bench", "latency", "--compare-transformers"])
    assert info.value.code == 2
