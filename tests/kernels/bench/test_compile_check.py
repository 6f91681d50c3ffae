"""``kernels.bench.compile_check``: the launches a test run makes under the interpreter,
recorded, then compiled for sm_90 without a GPU; a launch the GPU's compiler refuses is named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _tool(*argv: str, interpret: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": interpret}
    return subprocess.run(
        [sys.executable, "-m", "kernels.bench.compile_check", *argv],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_recorded_launches_compile_and_a_refused_one_is_named(tmp_path: Path) -> None:
    out = tmp_path / "launches.json"
    tests = [
        "tests/kernels/test_triton_routing.py::test_ties_take_the_lowest_index",
        "tests/kernels/test_triton_moe.py::test_launch_configs[config0]",
        "tests/kernels/test_triton_prefill.py::test_new_kv_through_tma_descriptors[tiles0]",
    ]
    done = _tool("record", str(out), "--", *tests, "-q", "-p", "no:cacheprovider", interpret="1")
    assert done.returncode == 0, done.stdout + done.stderr
    launches = json.loads(out.read_text())
    kernels = {e["kernel"] for e in launches}
    assert {"_route_kernel", "_gate_up_kernel", "_down_kernel"} <= kernels
    route = next(e for e in launches if e["kernel"] == "_route_kernel")
    assert route["signature"]["logits_ptr"] == "*fp32" and route["constexprs"]["TOP_K"] == 2
    assert "error" not in json.dumps(launches)  # TMA descriptors recorded too
    assert any(t.startswith("tensordesc<") for e in launches for t in e["signature"].values())
    # one of each: as recorded (compiles), and the gate/up GEMM with a K tile of 8 (tl.dot
    # needs 16: the interpreter ran such a launch, a GPU refused it)
    gate_up = next(e for e in launches if e["kernel"] == "_gate_up_kernel")
    bad = json.loads(json.dumps(gate_up))
    bad["constexprs"]["BLOCK_K"] = 8
    picked = tmp_path / "picked.json"
    picked.write_text(json.dumps([route, gate_up, bad]))
    done = _tool("compile", str(picked), interpret="1")  # re-runs itself without the interpreter
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "1 failed"
    (fail,) = [line for line in lines if line.startswith("FAIL")]
    assert "_gate_up_kernel" in fail and "'BLOCK_K': 8" in fail


def test_record_needs_the_interpreter(tmp_path: Path) -> None:
    done = _tool("record", str(tmp_path / "x.json"), "--", "tests", interpret="0")
    assert done.returncode == 2 and "TRITON_INTERPRET=1" in done.stderr
