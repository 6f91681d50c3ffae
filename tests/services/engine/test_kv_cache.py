"""Start-up refuses a KV pool that cannot hold one sequence of max_model_len, saying what to do."""

from __future__ import annotations

import pytest

from services.config import ConfigError
from services.engine.kv_cache import check_fits


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
