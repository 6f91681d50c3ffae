"""A worker on --device cuda:N is given only its GPUs, renumbered from 0, before torch starts."""

from __future__ import annotations

import pytest

from services.device_pin import pin_device


@pytest.mark.parametrize(
    ("device", "tp", "env", "want"),
    [
        ("cuda:1", 1, {}, ("cuda:0", "1")),
        ("cuda:2", 2, {}, ("cuda:0", "2,3")),
        ("cuda:1", 1, {"CUDA_VISIBLE_DEVICES": "4,6,7"}, ("cuda:0", "6")),
        ("cuda:1", 2, {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b ,GPU-c"}, ("cuda:0", "GPU-b,GPU-c")),
        # past the visible GPUs: left for the engine to refuse with how many it needs
        ("cuda:2", 2, {"CUDA_VISIBLE_DEVICES": "0,1,2"}, ("cuda:2", None)),
        ("cuda:0", 2, {}, ("cuda:0", None)),
        ("cuda", 1, {}, ("cuda", None)),
        ("auto", 1, {}, ("auto", None)),
        ("cpu", 1, {}, ("cpu", None)),
    ],
)
def test_pin_device(
    device: str, tp: int, env: dict[str, str], want: tuple[str, str | None]
) -> None:
    assert pin_device(device, tp, env) == want


def test_the_worker_commands_narrow_the_visible_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse
    import os

    from services import cli

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    args = argparse.Namespace(device="cuda:1", tensor_parallel_size=1)
    cli._pin_gpus(args)
    assert args.device == "cuda:0" and os.environ["CUDA_VISIBLE_DEVICES"] == "5"
