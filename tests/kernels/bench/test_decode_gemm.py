"""The decode-batch GEMM probe's Triton kernels (``kernels.bench.decode_gemm``) against their
torch reference: split-K tiles and stream-K shares, partial tiles in M and N, K split unevenly
between programs, and stream-K's bits the same on every call (partials added in a fixed order)."""

from __future__ import annotations

import pytest
import torch

from kernels.bench.decode_gemm import ref_gemm, split_gemm, streamk_gemm
from tests.kernels.paged import rand


def _tol(device: torch.device) -> dict[str, float]:
    """Compiled for a GPU, ``tl.dot`` rounds float32 inputs to tf32 (10 mantissa bits)."""
    return {"rtol": 1e-5, "atol": 1e-4} if device.type == "cpu" else {"rtol": 2e-2, "atol": 1e-1}


@pytest.mark.parametrize(
    ("m", "n", "k", "config"),
    [
        (5, 48, 64, (16, 16, 16, 4, 2, 7)),  # 12 K-steps over 7 programs: tiles cut mid-K
        (33, 80, 128, (16, 32, 16, 4, 2, 5)),  # partial tiles in M and N
        (20, 64, 96, (16, 16, 32, 4, 2, 3)),  # a program's share spans three tiles
        (20, 64, 96, (16, 16, 32, 4, 2, 40)),  # more programs than iterations: clamped
    ],
)
def test_streamk_equals_the_reference_and_is_deterministic(
    m: int, n: int, k: int, config: tuple[int, ...], gen: torch.Generator, device: torch.device
) -> None:
    x, w = rand((m, k), torch.float32, gen, device), rand((n, k), torch.float32, gen, device)
    got = streamk_gemm(x, w, config)
    torch.testing.assert_close(got, ref_gemm(x, w), **_tol(device))
    assert torch.equal(streamk_gemm(x, w, config), got)


@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_k_equals_the_reference(
    split: int, gen: torch.Generator, device: torch.device
) -> None:
    x, w = rand((33, 96), torch.float32, gen, device), rand((80, 96), torch.float32, gen, device)
    got = split_gemm(x, w, (16, 32, 16, 4, 2, split) if split != 3 else (16, 32, 32, 4, 2, 3))
    torch.testing.assert_close(got, ref_gemm(x, w), **_tol(device))


def test_a_k_the_slices_do_not_divide_is_refused(
    gen: torch.Generator, device: torch.device
) -> None:
    x, w = rand((4, 96), torch.float32, gen, device), rand((16, 96), torch.float32, gen, device)
    with pytest.raises(ValueError, match="multiple of BLOCK_K"):
        split_gemm(x, w, (16, 16, 64, 4, 2, 1))
    with pytest.raises(ValueError, match="multiple of BLOCK_K"):
        streamk_gemm(x, w, (16, 16, 64, 4, 2, 4))
