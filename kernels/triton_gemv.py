"""Matrix-vector products in Triton for decode at batch 1 (and other very short batches).

A linear layer at batch 1 reads its whole weight once and does 2 FLOP per weight element: it
is a pure bandwidth problem. cuBLAS's heuristics sometimes launch too few CTAs for a square
4096x4096 projection on an H100 (64 tiles for 132 SMs, ~1.6 TB/s measured in a decode step),
while a kernel that gives each program a few output rows fills the machine. Each program owns
``BLOCK_N`` rows of the weight, streams them along K in ``BLOCK_K`` chunks (16-byte loads along
the contiguous dim) with the next chunks' loads in flight (for long rows three chunks ahead,
software-pipelined through shared memory; else one ahead in registers), keeps an fp32 partial
product per element and reduces once at the end:
no split-K, so the result is deterministic and does not depend on the launch configuration's
reduction order beyond the chunking.

Short batches (M <= 8): a program takes a group of 1, 2 or 4 rows of x, loads each weight
chunk once for all of them and keeps one accumulator per row; the groups of one weight tile are
neighbours in the grid, so the tile comes from HBM about once. Each row's sums are the same
operations in the same order whatever the group and the batch: a row's result is bit for bit
the one it gets in a batch of 1 (what a speculative verify step needs to match plain decoding).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.gemv import GEMV_MAX_ROWS as MAX_ROWS
from kernels.triton_common import (
    FLOAT_DTYPES,
    check_devices,
    check_tensor,
    cuda_index,
    pdl,
    pdl_enter,
    pdl_release,
    pdl_wait,
)
from kernels.triton_layers import act_and_mul

# (BLOCK_N, BLOCK_K, num_warps[, STAGES]): the launch used unless a caller picks another;
# STAGES > 1 software-pipelines the chunk loads (1, left out: one chunk ahead in registers)
DEFAULT_CONFIG = (8, 512, 4)
# rows of at least this many elements: 256-long chunks on 4 warps, four stages (three chunks'
# loads in flight through shared memory), 16 rows a program for weights with more outputs than
# inputs, 8 for the rest. Llama-3.1-8B's projections in a graph on one H200
# (kernels.bench.gemv_stages, 2026-11-30): qkv 14.3 -> 13.0 us, o 11.6 -> 9.6, gate_up 57.6 ->
# 53.8, down 29.6 -> 27.8 against the one-chunk-ahead launches before (103.7 against 113.1 us a
# layer, 88% -> 96% of the copy bandwidth)
STAGED_MIN_K = 2048


# an H100's launches for rows of at least STAGED_MIN_K (other than a vocabulary's LM head), by
# the weight's shape: wider than twice its rows (gate_up), wider (qkv), rows at least twice its
# outputs (down), else (o). The pipelined launch above was tuned on an H200; on one H100 80GB
# HBM3 (2026-12-02), Llama-3.1-8B's projections in a graph (kernels.bench.gemv_graph, 48
# distinct weights a shape) took qkv 18.1 -> 17.5 us, o 12.5 -> 11.7, gate_up 78.3 -> 75.3, down
# 39.8 -> 39.3 at these launches, and the W2 batch-1 step (tandem bench latency, context 1024,
# each run its own process, alternated, two rounds: scripts/device/h100_launches.sh) 5.63 /
# 5.64 -> 5.44 / 5.44 ms. The LM head keeps the pipelined launch (not swept on an H100)
H100_LAUNCHES = {"wide": (2, 4096, 4), "taller": (4, 1024, 8), "long": (4, 1024, 4),
                 "square": (8, 512, 8)}  # fmt: skip
# outputs from which a weight is a vocabulary's LM head (Llama-3's 128256, Qwen2's 151936,
# Gemma's 262144; Llama-2's 32000 heads are taken for gate_up-like weights)
LM_HEAD_MIN_N = 65536


@functools.cache
def _is_h100(device_index: int) -> bool:
    return torch.version.hip is None and "H100" in torch.cuda.get_device_name(device_index)


def _h100(device: torch.device | None) -> bool:
    return device is not None and device.type == "cuda" and _is_h100(cuda_index(device))


def pick_config(n: int, k: int, device: torch.device | None = None) -> tuple[int, ...]:
    """The launch for an [n, k] weight on ``device``. Rows of ``STAGED_MIN_K`` or more:
    pipelined (``STAGED_MIN_K``'s note), on an H100 ``H100_LAUNCHES``. Shorter rows (a small
    model's, SmolLM2-135M's 576 and 1536; H100, 2026-11-25) take short chunks and few warps,
    which also keep a verify step's 8 rows cheap (the wide 8-warp launches ran a 49152 x 576
    lm_head at 8 rows in 213 us against 53 us). The launch depends on the weight and the GPU
    only, never on the rows of x: a row's bits are the same in any batch."""
    if k < STAGED_MIN_K:
        if n >= 2 * k:
            return (4, 128, 1)
        return (8, 256, 2) if k <= 1024 else (8, 512, 4)
    if _h100(device) and n < LM_HEAD_MIN_N:
        wide, taller, long = n > 2 * k, n > k, k >= 2 * n
        return H100_LAUNCHES[
            "wide" if wide else "taller" if taller else "long" if long else "square"
        ]
    return (16 if n > k else 8, 256, 4, 4)


@triton.jit
def _row_ptrs(x_ptr, out_ptr, row, M, s_xm, s_om):
    """Row ``row`` of x and of the output, and whether the batch has it: a group's rows past
    the batch read its last row (unmasked loads) and store nothing."""
    r = tl.minimum(row, M - 1).to(tl.int64)
    return x_ptr + r * s_xm, out_ptr + r * s_om, tl.full([1], row, tl.int32) < M


@triton.jit
def _load_x(x_row, ks, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_row + ks).to(tl.float32)
    return tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)


@triton.jit
def _load_w_chunk(w_rows, k0, offs_k, n_mask, k_end):
    """The weight chunk at ``k0``, its columns from ``k_end`` on masked (a prefetch past the
    program's share of K reads nothing)."""
    ks = k0 + offs_k
    return tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & (ks < k_end)[None, :], other=0.0)


@triton.jit
def _gemv_rows(w, ks, K, x0, x1, x2, x3, acc0, acc1, acc2, acc3, ROWS: tl.constexpr,
               EVEN_K: tl.constexpr):  # fmt: skip
    """One weight chunk (float32) into each row's accumulator: the same operations in the same
    order for a row whatever the group."""
    acc0 += w * _load_x(x0, ks, K, EVEN_K)[None, :]
    if ROWS > 1:
        acc1 += w * _load_x(x1, ks, K, EVEN_K)[None, :]
    if ROWS > 2:
        acc2 += w * _load_x(x2, ks, K, EVEN_K)[None, :]
        acc3 += w * _load_x(x3, ks, K, EVEN_K)[None, :]
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, s_xm, s_wn, s_om, GROUPS,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    STAGES: tl.constexpr, ACT: tl.constexpr, LATE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``LATE`` (pipelined launches): the next kernel may launch only after this one's loop
    (:func:`pdl_wait`). ``ACT`` (SiLU-and-mul, the weight a gate_up projection's: gate rows
    then as many up rows): a program's BLOCK_N rows are BLOCK_N / 2 gate rows and the up rows
    of the same outputs, interleaved, and it stores ``silu(gate) * up`` of them (``out``:
    [M, N / 2]), each sum rounded to out's dtype first, as the separate kernels round it."""
    pid = tl.program_id(0)  # the row groups of one weight tile side by side: one HBM read
    pid_n = pid // GROUPS
    row0 = (pid % GROUPS) * ROWS
    offs_out, offs_n, n_mask = tile_rows(pid_n, N, BLOCK_N, ACT)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
    # one accumulator per row (ROWS of them live; the rest are never touched and vanish): the
    # weight chunk is loaded once for all of the group's rows, and each row's sums are the
    # same operations in the same order as in a group of one
    x0, o0, l0 = _row_ptrs(x_ptr, out_ptr, row0, M, s_xm, s_om)
    x1, o1, l1 = _row_ptrs(x_ptr, out_ptr, row0 + 1, M, s_xm, s_om)
    x2, o2, l2 = _row_ptrs(x_ptr, out_ptr, row0 + 2, M, s_xm, s_om)
    x3, o3, l3 = _row_ptrs(x_ptr, out_ptr, row0 + 3, M, s_xm, s_om)
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if STAGES > 1:
        # software-pipelined: the compiler issues each chunk's loads STAGES - 1 chunks ahead
        # through shared memory (cp.async), the loads in flight no longer bounded by registers;
        # its prologue loads x too, so the wait comes first
        pdl_wait(USE_PDL, not LATE)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            w = _load_w_chunk(w_rows, k0, offs_k, n_mask, K).to(tl.float32)
            acc0, acc1, acc2, acc3 = _gemv_rows(
                w, k0 + offs_k, K, x0, x1, x2, x3, acc0, acc1, acc2, acc3, ROWS, EVEN_K
            )
        pdl_release(USE_PDL, not LATE)
    else:
        # the weight is no earlier kernel's output: its first chunk loads before the wait,
        # while the kernel before this one (a norm, an attention) still runs; each step then
        # loads the next chunk before it uses the one in hand
        w_next = _load_w_chunk(w_rows, 0, offs_k, n_mask, K)
        pdl_enter(USE_PDL)
        for k0 in range(0, K, BLOCK_K):
            w = w_next.to(tl.float32)
            w_next = _load_w_chunk(w_rows, k0 + BLOCK_K, offs_k, n_mask, K)
            acc0, acc1, acc2, acc3 = _gemv_rows(
                w, k0 + offs_k, K, x0, x1, x2, x3, acc0, acc1, acc2, acc3, ROWS, EVEN_K
            )
    store_sums(o0, tl.sum(acc0, axis=1), l0, offs_out, N, BLOCK_N, ACT)
    if ROWS > 1:
        store_sums(o1, tl.sum(acc1, axis=1), l1, offs_out, N, BLOCK_N, ACT)
    if ROWS > 2:
        store_sums(o2, tl.sum(acc2, axis=1), l2, offs_out, N, BLOCK_N, ACT)
        store_sums(o3, tl.sum(acc3, axis=1), l3, offs_out, N, BLOCK_N, ACT)


@triton.jit
def tile_rows(pid_n, N, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
    """A GEMV program's outputs, the weight rows it reads and their mask: BLOCK_N rows from
    ``pid_n * BLOCK_N``; with ``ACT`` (a gate_up weight: N / 2 gate rows, then the up rows)
    BLOCK_N / 2 outputs, their gate and up rows interleaved (gate, up, gate, up, ...)."""
    # one return: the compiler reads the code after a constexpr branch's return too
    if ACT:
        offs_out = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        i = tl.arange(0, BLOCK_N)
        half = pid_n * (BLOCK_N // 2) + i // 2
        offs_n = half + (i % 2) * (N // 2)
        n_mask = half < N // 2
    else:
        offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_n = offs_out
        n_mask = offs_out < N
    return offs_out, offs_n, n_mask


@triton.jit
def store_sums(out_row, sums, live, offs_out, N, BLOCK_N: tl.constexpr, ACT: tl.constexpr):
    """A row's float32 sums (the :func:`tile_rows` order) rounded to out's dtype; with ``ACT``
    their ``silu(gate) * up``."""
    ty = out_row.dtype.element_ty
    sums = sums.to(ty)
    if ACT:
        gate, up = tl.split(tl.reshape(sums, [BLOCK_N // 2, 2]))
        y = act_and_mul(gate.to(tl.float32), up.to(tl.float32), ty, False)
        tl.store(out_row + offs_out, y, mask=(offs_out < N // 2) & live)
    else:
        tl.store(out_row + offs_out, sums, mask=(offs_out < N) & live)


# where a pipelined GEMV lets the next kernel launch (programmatic launch): "act" (the launches
# fused with SiLU-and-mul, whose next kernel is the down GEMV) after its loop, the others at
# their start; "all" / "none": every pipelined launch after its loop / at its start
RELEASE_AFTER_LOOP = "act"


def release_late(act: bool) -> bool:
    return RELEASE_AFTER_LOOP == "all" or (RELEASE_AFTER_LOOP == "act" and act)


# fp32 accumulator registers a thread may spend on a group's rows; past it, fewer rows a group
ACC_REGISTERS = 64


def rows_per_program(m: int, block_n: int, block_k: int, num_warps: int) -> int:
    """1, 2 or 4 rows of x per program: as many as the accumulators' registers allow."""
    per_row = max(1, block_n * block_k // (32 * num_warps))
    rows = 1
    while rows < 4 and rows < m and 2 * rows * per_row <= ACC_REGISTERS:
        rows *= 2
    return rows


def gemv(
    x: torch.Tensor,  # [M, K], M <= 8
    weight: torch.Tensor,  # [N, K]
    *,
    config: tuple[int, ...] | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:  # [M, N], or [M, N / 2] with silu_and_mul
    """Triton version of :func:`kernels.gemv.ref_gemv` for short batches (M <= 8). ``config``:
    (BLOCK_N, BLOCK_K, num_warps[, STAGES]), :data:`DEFAULT_CONFIG` if None. ``silu_and_mul``:
    the weight is a gate_up projection's (gate rows, then up rows) and the result
    ``silu_and_mul`` of the product in the same kernel, bit for bit what the two kernels give
    (the SiLU-and-mul kernel launched after this one costs a batch-1 decode step ~2 us a layer).

    Under programmatic launch an unpipelined launch (no STAGES) reads its first weight chunk
    before it waits for the kernel before it: the weight must not be the output of the kernel
    launched just before (model weights, LoRA slots written between steps and TP shards never
    are)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=FLOAT_DTYPES)
    m, k = x.shape
    n, wk = weight.shape
    if wk != k:
        raise ValueError(f"x has {k} features but weight {tuple(weight.shape)} expects {wk}")
    if m > MAX_ROWS:
        raise ValueError(f"gemv is for at most {MAX_ROWS} rows, got {m}: use a GEMM")
    if silu_and_mul and n % 2:
        raise ValueError(f"a gate_up weight has as many up rows as gate rows, got {n} rows")
    check_devices(x=x, weight=weight)
    out = torch.empty((m, n // 2 if silu_and_mul else n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:  # every sum 0, and silu(0) * 0 = 0
        return out.zero_()
    block_n, block_k, warps, *staged = config or DEFAULT_CONFIG
    stages = staged[0] if staged else 1
    if len(staged) > 1 or stages < 1 or (silu_and_mul and block_n % 2):
        raise ValueError(
            f"a GEMV launch is (BLOCK_N, BLOCK_K, warps[, STAGES >= 1]), BLOCK_N even with "
            f"silu_and_mul, got {config}"
        )
    block_k = min(block_k, triton.next_power_of_2(k))
    rows = rows_per_program(m, block_n, block_k, warps)
    groups = triton.cdiv(m, rows)
    _gemv_kernel[(triton.cdiv(n, block_n) * groups,)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0), groups,
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, STAGES=stages,
        ACT=silu_and_mul, LATE=release_late(silu_and_mul), num_warps=warps, **pdl(x.device, m),
    )  # fmt: skip
    return out
