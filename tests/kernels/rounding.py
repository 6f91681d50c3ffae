"""How the Triton kernels under test round fp32 to 16-bit floats, and a rotary reference that
rounds that way, so rotary kernels can be compared bit for bit even under the interpreter.

Compiled kernels round to nearest even, like torch. Triton's interpreter (3.9) truncates
fp32 -> bf16 instead; a kernel that rounds at several points then drifts from torch's result by
more than any fixed tolerance where terms cancel, though it rounds at exactly the same points.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from tests.kernels.paged import TOLERANCE

Rounder = Callable[[torch.Tensor, torch.dtype], torch.Tensor]  # fp32 in, fp32 (rounded) out


@triton.jit
def _cast_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs).to(out_ptr.dtype.element_ty))


def _truncate_bf16(y: torch.Tensor) -> torch.Tensor:
    return (y.float().view(torch.int32) & -65536).view(torch.float32)


@functools.cache
def _bf16_truncates(device: torch.device) -> bool:
    x = torch.tensor([1 + 3 * 2**-9, -(1 + 3 * 2**-9)] * 8, device=device)  # RNE rounds away
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _cast_kernel[(1,)](x, out, N=x.numel())
    if torch.equal(out, x.to(torch.bfloat16)):
        return False
    assert torch.equal(out.float(), _truncate_bf16(x)), "neither rounds nor truncates"
    return True


def kernel_rounding(device: torch.device) -> Rounder:
    """``rnd(y, dtype)``: fp32 ``y`` rounded to ``dtype`` the way Triton kernels on ``device`` do."""
    truncates = _bf16_truncates(device)

    def rnd(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.bfloat16 and truncates:
            return _truncate_bf16(y)
        return y.float().to(dtype).float()

    return rnd


def torch_rounding(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return y.float().to(dtype).float()


def rotate(
    positions: torch.Tensor,  # [T]
    t: torch.Tensor,  # [T, H, D]
    cos_sin: torch.Tensor,  # [max_pos, R], R <= D: the first R dims rotate, the rest pass
    rnd: Rounder,
) -> torch.Tensor:  # [T, H, D] fp32, values of t's dtype
    """``ref_rotary_embedding`` for one tensor, out of place, rounding with ``rnd``."""
    half, dt = cos_sin.shape[-1] // 2, t.dtype
    cs = cos_sin[positions.long()].float()
    c, s = rnd(cs[:, None, :half], dt), rnd(cs[:, None, half:], dt)
    x1, x2 = t[..., :half].float(), t[..., half : 2 * half].float()
    o1 = rnd(rnd(x1 * c, dt) - rnd(x2 * s, dt), dt)
    o2 = rnd(rnd(x2 * c, dt) + rnd(x1 * s, dt), dt)
    return torch.cat([o1, o2, t[..., 2 * half :].float()], dim=-1)


def assert_rotated(out: torch.Tensor, expected: torch.Tensor, src_dtype: torch.dtype) -> None:
    """Bit for bit, except for an fp32 source on a GPU: compiled kernels may fuse multiply-adds
    there (rounded products keep 16-bit sources exact)."""
    if src_dtype == torch.float32 and out.is_cuda:
        tol = TOLERANCE[out.dtype]
        torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    else:
        diff = (out.float() - expected.float()).abs().max()
        assert torch.equal(out.float(), expected.float()), f"max difference {diff}"
