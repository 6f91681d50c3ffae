"""The checksum benchmark: a clear refusal without a GPU, the floor's napkin math, and every launch
it sweeps valid (checked bit-exact against the reference on the CPU here)."""

from __future__ import annotations

import pytest
import torch

from kernels.bench import checksum


def test_without_a_gpu_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        checksum.main([])


def test_the_floor_is_the_bytes_read_once_at_copy_bandwidth() -> None:
    nbytes, offset = checksum.SIZES["1024 tokens"]
    assert nbytes == 1024 * 128 * 1024 and offset == 0  # 128 KiB of Llama-3.1-8B KV a token
    assert checksum.roofline_ms(nbytes, 3000.0) == pytest.approx(0.0447, abs=1e-4)


def test_every_swept_launch_matches_the_reference(device: torch.device) -> None:
    x = checksum.data(4099, 1, device)
    assert x.numel() == 4099 and x.data_ptr() % 4 != 0
    for cfg in checksum.CONFIGS:
        checksum.check(x, cfg)
