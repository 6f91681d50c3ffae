"""The contiguous-K/V flash-attention kernel of ``kernels.bench.prefill_probe`` computes causal
GQA attention as torch SDPA does, in every variant the probe times (under the interpreter on the
CPU; the timing itself needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from kernels.bench.prefill_probe import contig, tile_configs, variant_configs

# (BLOCK_M, BLOCK_N, warps, stages, heads per tile, TMA, lazy, warp-specialized), small tiles
CASES = [
    (32, 16, 4, 2, 1, False, False, False),
    (32, 16, 4, 2, 4, False, True, False),  # packed GQA rows, lazy rescaling
    (32, 32, 4, 2, 1, True, False, False),  # TMA descriptors; BLOCK_N > a tile's tokens
    (64, 16, 4, 3, 4, True, True, False),
]


@pytest.mark.parametrize("cfg", CASES)
def test_probe_kernel_equals_sdpa(cfg: tuple, device: torch.device) -> None:
    b, n, hq, hkv, d = 2, 128, 8, 2, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b * n, h, d, generator=gen).to(device) for h in (hq, hkv, hkv))
    k[40] *= 30.0  # a key whose large scores move the running max mid-row (the lazy branch)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.view(b, n, -1, d).transpose(1, 2) for x in (q, k, v)), is_causal=True, enable_gqa=True
    )
    out = contig(q, k, v, n, cfg, torch.empty_like(q))
    # compiled for a GPU, tl.dot rounds the float32 inputs to tf32 (10 mantissa bits)
    tol = {"atol": 2e-5, "rtol": 1e-4} if device.type == "cpu" else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(b * n, hq, d), **tol)


def test_sweeps_fit_shared_memory_and_pair_warp_specialization_with_tma() -> None:
    tiles = tile_configs()
    assert tiles and all((s * 2 * bn + bm) * 256 <= 200 * 1024 for bm, bn, _, s, *_ in tiles)
    assert all(tma or not ws for *_, tma, _, ws in variant_configs())
