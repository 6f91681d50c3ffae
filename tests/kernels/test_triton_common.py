"""Helpers of ``kernels.triton_common`` that kernels share: bf16 rounding in float arithmetic."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import round_to_bf16, rounds_bf16_in_kernel


@triton.jit
def _bf16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = round_to_bf16(tl.load(x_ptr + offs, mask=mask), True)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=mask)


def bf16_values_and_the_midpoints() -> torch.Tensor:
    """bf16 values of both signs over many binades, the midpoints between neighbours (ties, to
    even), values just beside them, zeros and values near bf16's largest. No subnormals: the
    interpreter's casts garble them (0x70000 -> 8.8e-39), and nothing rounded here is one."""
    bits = torch.arange(0, 1 << 15, 7, dtype=torch.int32)  # every 7th positive bf16 pattern
    values = (bits << 16).view(torch.float32)
    values = values[torch.isfinite(values)]
    nxt = ((bits + 1) << 16).view(torch.float32)[: values.numel()]
    mids = ((values.double() + nxt.double()) / 2).float()
    beside = torch.cat([torch.nextafter(mids, torch.zeros_like(mids)),
                        torch.nextafter(mids, torch.full_like(mids, float("inf")))])  # fmt: skip
    extra = torch.tensor([0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.3e38])
    out = torch.cat([values, mids, beside])
    out = out[torch.isfinite(out) & (out.abs() >= 2**-126)]
    out = torch.cat([out, extra])
    return torch.cat([out, -out])


def test_rounding_to_bf16_in_the_kernel_equals_torch_bit_for_bit(device: torch.device) -> None:
    x = bf16_values_and_the_midpoints().to(device)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _bf16_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    ref = x.to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    # ties went to even in both directions: neither plain truncation nor rounding half up
    ties = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8], device=device)
    assert ties.to(torch.bfloat16).tolist() == [1.0, 1.0 + 2**-6]


def test_only_the_interpreter_needs_it() -> None:
    assert not rounds_bf16_in_kernel(torch.float16)
    assert not rounds_bf16_in_kernel(torch.float32)
