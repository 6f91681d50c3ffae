"""The pooler against plain torch: the reference over a whole prompt, and the chunked pooler over
every way of cutting the prompt into prefill chunks (a restart after preemption included)."""

from __future__ import annotations

import itertools

import pytest
import torch

from protos.pooling_params import PoolingParams
from protos.sampling_params import InvalidRequestError
from services.engine.pooler import Pooler, ref_pool

T, H = 13, 24


@pytest.fixture
def hidden() -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(0)) * 3  # [T, H]


@pytest.mark.parametrize("normalize", [True, False])
def test_reference_is_the_torch_computation(hidden: torch.Tensor, normalize: bool) -> None:
    expected = {"last": hidden[-1], "mean": hidden.sum(0) / T, "cls": hidden[0]}
    for kind, vec in expected.items():
        if normalize:
            vec = vec / vec.pow(2).sum().sqrt()
        got = ref_pool(hidden, PoolingParams(kind, normalize))
        assert got.dtype == torch.float32 and got.shape == (H,)
        torch.testing.assert_close(got, vec, rtol=1e-6, atol=1e-6)


def _chunked(pooler: Pooler, rid: str, hidden: torch.Tensor, params: PoolingParams,
             cuts: list[int]) -> torch.Tensor:  # fmt: skip
    bounds = [0, *cuts, hidden.shape[0]]
    out = None
    for a, b in itertools.pairwise(bounds):
        final = b == hidden.shape[0]
        out = pooler.add(rid, params, hidden[a:b], a, hidden.shape[0], final)
        assert (out is not None) == final
    assert out is not None
    return out


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
@pytest.mark.parametrize("cuts", [[], [1], [4, 8], [12], list(range(1, T))])
def test_chunks_pool_as_the_whole_prompt(hidden: torch.Tensor, kind: str, cuts: list[int]) -> None:
    pooler = Pooler()
    for normalize in (True, False):
        params = PoolingParams(kind, normalize)
        got = _chunked(pooler, "r", hidden, params, cuts)
        torch.testing.assert_close(got, ref_pool(hidden, params), rtol=1e-5, atol=1e-5)
    assert len(pooler) == 0  # nothing kept once the vector is out


def test_bf16_rows_pool_in_float32(hidden: torch.Tensor) -> None:
    rows = hidden.bfloat16()
    got = _chunked(Pooler(), "r", rows, PoolingParams("mean", False), [5])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rows.float().mean(0), rtol=1e-5, atol=1e-5)


def test_a_recompute_from_position_zero_starts_over(hidden: torch.Tensor) -> None:
    """A preempted request computes its prompt again: the sums of the first try are dropped."""
    pooler, params = Pooler(), PoolingParams("mean")
    assert pooler.add("r", params, hidden[:6] + 100, 0, T, False) is None  # the first try
    got = _chunked(pooler, "r", hidden, params, [6])
    torch.testing.assert_close(got, ref_pool(hidden, params), rtol=1e-5, atol=1e-5)


def test_drop_forgets_an_aborted_request(hidden: torch.Tensor) -> None:
    pooler = Pooler()
    pooler.add("r", PoolingParams("cls"), hidden[:4], 0, T, False)
    assert len(pooler) == 1
    pooler.drop("r")
    pooler.drop("never-seen")
    assert len(pooler) == 0


def test_unknown_pooling_types_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="pooling_type must be one of last, mean, cls"):
        PoolingParams("max")
