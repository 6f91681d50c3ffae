"""A topology's `tandem up` command line."""

from __future__ import annotations

from pathlib import Path

from deploy.bench_plan import topology
from deploy.bench_topology import up_argv
from services.cli import build_parser
from tests.deploy.conftest import disagg_args


def test_up_argv_forwards_engine_flags_and_the_shape(tmp_path: Path) -> None:
    args = disagg_args("--model", "llama-3.1-8b", "--max-model-len", "8192", "--max-num-seqs",
                       "128", "--gpus", "0,1", "--device", "cuda")  # fmt: skip
    topo = topology("disagg", ["0", "1"], 2, None)
    argv = up_argv(args, topo, tmp_path, {"model": "/x/llama", "load_format": "dummy"})
    up = build_parser().parse_args(argv)
    assert (up.model, up.load_format, up.max_model_len, up.max_num_seqs) == (
        "/x/llama",
        "dummy",
        8192,
        128,
    )
    assert (up.prefill, up.decode, up.colocated, up.gpus, up.port, up.device) == (
        1,
        1,
        0,
        "0,1",
        0,
        "cuda",
    )
