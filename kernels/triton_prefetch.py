"""Bringing a tensor into L2 ahead of the kernel that reads it, off the critical path.

A decode step at batch 1 leaves the GPU's memory idle while its small kernels run (rotary and
the KV write, attention, the split merge: ~10 us a layer between the qkv and o projections).
:func:`prefetch_l2` launches a few programs that issue ``prefetch.global.L2::evict_last`` for
every 128-byte line of a tensor and return; nothing reads the lines, nothing waits for them.
Launched on a side stream (``kernels.ops.prefetch_l2_async``), the prefetch fills that idle
time with the next GEMV's weight, which then comes from L2. Issued from the end of a kernel on
the main stream it made the step slower (the kernel's completion, which the next one waits for,
waited for the prefetched bytes: the 8B batch-1 step 4.11 -> 4.25 ms on an H200).

There is no value to compare with a reference: the kernel writes nothing. Its test checks that
it leaves memory as it was and that a launch on the CPU or in the interpreter (which has no
inline assembly) is refused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_common import interpreting

__all__ = ["interpreting", "prefetch_l2"]

# bytes of one L2 line: one prefetch instruction each
L2_LINE = 128
# programs of a prefetch launch: enough issuing SMs for the copy bandwidth, few enough to leave
# the rest to the kernels the prefetch runs beside
PREFETCH_PROGRAMS = 32


@triton.jit
def _prefetch_kernel(ptr, nbytes, THREADS: tl.constexpr):
    """This program's share of ``nbytes`` from ``ptr`` into L2, ``THREADS`` lines at a time."""
    pid = tl.program_id(0)
    lines = tl.cdiv(nbytes, 128)
    share = tl.cdiv(lines, tl.num_programs(0))
    first = pid * share
    end = tl.minimum(first + share, lines)
    base = ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    for i in range(first, end, THREADS):
        line = i + tl.arange(0, THREADS)
        addr = (base + line.to(tl.int64) * 128).to(tl.int64, bitcast=True)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
            "@p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [addr, (line < end).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


def prefetch_l2(t: torch.Tensor, programs: int = PREFETCH_PROGRAMS) -> None:
    """Issue L2 prefetches for every byte of contiguous CUDA tensor ``t`` on the current
    stream; returns at once (the kernel finishes when its prefetches are issued)."""
    if t.device.type != "cuda":
        raise ValueError(f"prefetch_l2 takes a CUDA tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError("prefetch_l2 takes a contiguous tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return
    grid = (max(1, min(programs, triton.cdiv(nbytes, L2_LINE * 128))),)
    _prefetch_kernel[grid](t, nbytes, THREADS=128, num_warps=4)
