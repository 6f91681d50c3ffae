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


def _tiny_arch() -> ArchConfig:
    return ArchConfig.from_dict(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 100, "max_position_embeddings": 4096}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("cap", "max_model_len", "blocks"),
    [
        (None, 512, 1000),  # no cap: what the memory gives
        (3200, 512, 200),  # capped: 3200 tokens of 16
        (3201, 512, 201),  # a partial block counts
        (100, 512, 32),  # never fewer than one sequence of max_model_len
        (10**9, 512, 1000),  # a cap above what the memory gives changes nothing
    ],
)
def test_max_total_tokens_caps_the_pool_but_one_longest_sequence_fits(
    cap: int | None, max_model_len: int, blocks: int
) -> None:
    from services.config import CacheConfig
    from services.engine.kv_cache import block_bytes, plan_num_blocks

    arch, dtype = _tiny_arch(), torch.bfloat16
    free = 1000 * block_bytes(arch, 16, dtype)
    cuda = torch.device("cuda")  # only its type is read: the memory figure is given
    cache = CacheConfig(block_size=16, max_total_tokens=cap)
    assert plan_num_blocks(cache, arch, dtype, cuda, max_model_len, free) == blocks
    gib = CacheConfig(block_size=16, kv_cache_gib=1.0, max_total_tokens=cap)  # caps that too
    gib_blocks = (1 << 30) // block_bytes(arch, 16, dtype)
    want = gib_blocks if cap is None else min(gib_blocks, -(-max(cap, max_model_len) // 16))
    assert plan_num_blocks(gib, arch, dtype, torch.device("cpu"), max_model_len) == want
    exact = CacheConfig(block_size=16, num_blocks=7, max_total_tokens=cap)  # --num-blocks wins
    assert plan_num_blocks(exact, arch, dtype, cuda, max_model_len, free) == 7


def test_max_total_tokens_must_be_positive() -> None:
    from services.config import CacheConfig

    with pytest.raises(ConfigError, match="--max-total-tokens must be positive, got 0"):
        CacheConfig(max_total_tokens=0)
