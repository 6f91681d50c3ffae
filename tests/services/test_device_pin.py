"""A worker on --device cuda:N is given only its GPUs, renumbered from 0, before torch starts."""

from __future__ import annotations

import argparse
import os

import pytest

from services import cli
from services.device_pin import pin_device


@pytest.mark.parametrize(
    ("device", "tp", "env", "gpus", "want"),
    [
        ("cuda:1", 1, {}, None, ("cuda:0", "1")),
        ("cuda:1", 1, {}, 2, ("cuda:0", "1")),
        ("cuda:2", 2, {}, None, ("cuda:0", "2,3")),
        ("cuda:1", 1, {"CUDA_VISIBLE_DEVICES": "4,6,7"}, None, ("cuda:0", "6")),
        ("cuda:1", 2, {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b ,GPU-c"}, None,
         ("cuda:0", "GPU-b,GPU-c")),
        # past the GPUs there are: left for the engine to refuse, naming what was asked
        ("cuda:2", 2, {"CUDA_VISIBLE_DEVICES": "0,1,2"}, None, ("cuda:2", None)),
        ("cuda:2", 1, {}, 2, ("cuda:2", None)),
        ("cuda:0", 2, {}, None, ("cuda:0", None)),
        ("cuda", 1, {}, None, ("cuda", None)),
        ("auto", 1, {}, None, ("auto", None)),
        ("cpu", 1, {}, None, ("cpu", None)),
    ],
)  # fmt: skip
def test_pin_device(
    device: str, tp: int, env: dict[str, str], gpus: int | None, want: tuple[str, str | None]
) -> None:
    assert pin_device(device, tp, env, gpus) == want


def test_the_worker_commands_narrow_the_visible_gpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    args = argparse.Namespace(command="decode", device="cuda:1", tensor_parallel_size=1)
    cli._pin_gpus(args)
    assert args.device == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    assert "--device cuda:1: this worker sees only GPU 5" in capsys.readouterr().err
