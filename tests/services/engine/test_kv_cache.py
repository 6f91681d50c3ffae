"""Start-up refuses a KV pool that cannot hold one sequence of max_model_len, saying what to do."""

from __future__ import annotations

import pytest
import torch

from services.config import ConfigError
from services.engine.kv_cache import HostKV, _runs, check_fits
from services.engine.model_config import ArchConfig


def test_a_pool_that_fits_passes() -> None:
    check_fits(num_blocks=4, block_size=16, max_model_len=64, knob_hint="--num-blocks")


def test_a_small_pool_names_the_largest_max_model_len_it_holds() -> None:
    with pytest.raises(ConfigError) as info:
        check_fits(num_blocks=3, block_size=16, max_model_len=64, knob_hint="--num-blocks")
    msg = str(info.value)
    assert "needs 4 blocks of 16 tokens" in msg and "holds 3 blocks (48 tokens)" in msg
    assert "--max-model-len 48 or less" in msg and "--num-blocks" in msg


@pytest.mark.parametrize("blocks", [0, -2])
def test_an_empty_pool_only_asks_for_more_memory(blocks: int) -> None:
    with pytest.raises(ConfigError) as info:
        check_fits(num_blocks=blocks, block_size=16, max_model_len=64, knob_hint="--kv-cache-gib")
    msg = str(info.value)
    assert "--max-model-len" not in msg  # a max-model-len of 0 or less is not a fix
    assert "holds no block" in msg and "--kv-cache-gib" in msg


def test_host_tier_copies_blocks_out_and_back() -> None:
    """HostKV: offloaded blocks land in their slots (runs of consecutive slots or not) and a
    restore brings the same bytes into other blocks."""
    assert _runs([2, 3, 4, 7, 9, 10]) == [(0, 2, 3), (3, 7, 1), (4, 9, 2)]
    arch = ArchConfig("llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                      num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5,
                      rope_theta=1e4)  # fmt: skip
    cpu = torch.device("cpu")
    tier = HostKV(arch, 6, 4, torch.float32, cpu)
    caches = [torch.randn(2, 8, 4, 1, 4) for _ in range(2)]
    before = [c.clone() for c in caches]
    tier.move(caches, [(5, 3), (1, 4), (6, 0)], [])
    for c in caches:
        c.zero_()
    tier.move(caches, [], [(4, 2), (0, 7), (3, 0)])
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[:, 2], b[:, 1]) and torch.equal(c[:, 7], b[:, 6])
        assert torch.equal(c[:, 0], b[:, 5]) and not c[:, 1].any()
