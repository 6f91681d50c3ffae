"""Builders for paged-KV test inputs: random caches, shuffled block tables, tolerances."""

from __future__ import annotations

import torch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Element-wise within the dtype's tolerance (fp32 ~1e-4, bf16 ~2e-2), and no NaN anywhere."""
    assert not torch.isnan(out).any(), "output has NaN: unwritten or poisoned elements were read"
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: torch.device) -> torch.Tensor:  # fmt: skip
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)


def paged_kv(
    lens: list[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: torch.device,
    spare_blocks: int = 3,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches with every sequence's blocks scattered at random; unused blocks hold NaN.

    Table entries past a sequence's last block are -1, so a kernel that reads a block it does
    not own, or a table entry past the context, produces NaN or an out-of-range access. Block 0
    is always in use: the decode reference clamps -1 entries to 0 and multiplies them by 0.
    """
    per_seq = [(n + block_size - 1) // block_size for n in lens]
    total = sum(per_seq) + spare_blocks
    shape = (total, block_size, kv_heads, head_dim)
    k_cache = rand(shape, dtype, gen, device)
    v_cache = rand(shape, dtype, gen, device)
    order = torch.randperm(total, generator=gen)
    zero_at = int((order == 0).nonzero()[0, 0])
    order[0], order[zero_at] = 0, order[0].item()  # the reference reads block 0 for -1 entries
    width = max([*per_seq, 1]) + 2
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used : used + n].int()
        used += n
    spare = order[used:].long()
    k_cache[spare] = float("nan")
    v_cache[spare] = float("nan")
    return k_cache, v_cache, tables.to(device)


def assert_same_rounding(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal, up to one unit in the last place where a value was rounded to a 16-bit float.

    Triton's interpreter truncates fp32 -> bf16 instead of rounding to nearest even (seen with
    triton 3.9), so conversions into 16-bit caches may differ from torch by one ulp there.
    """
    if out.dtype == torch.float32:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=0.0)
