"""What the batch-1 int4 GEMV's loads alone cost: a ceiling for its arithmetic.

    python -m kernels.bench.w4_ceiling [--json-out w4_ceiling.json]

The served GEMV's programs, chunks and loads (``kernels.triton_quant``'s ``_w4_gemv_program``
and ``_w4_gemv_chunk``: the next chunk's words loaded ahead, this chunk's scales and zeros,
x's eight columns ``8p + j``), at its served launch, with the nibble planes and their products
replaced by one XOR a word (and a max of the scales and zeros, a sum of x, so no load is
dropped). Each of Llama-3.1-8B's projections over distinct weights in one CUDA graph, as
``kernels.bench.w4_unpack`` times them, beside the served GEMV and the copy floor, in three
forms: the words alone, with the scales and zeros, and with x too (every load the GEMV makes).

If the loads alone take about the GEMV's time, fewer instructions a nibble will not make it
faster: the memory side (bytes in flight, the access pattern) bounds it. If they take much less,
the arithmetic does. ``ref_loads`` is the torch reference the kernel is tested against.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.bench.w4_unpack import GROUP, awq_weights, weight_bytes
from kernels.triton_quant import _w4_gemv_chunk, _w4_gemv_program, _w4_next_words, w4_gemv_config

# form -> (scales and zeros: 0 none, 1 as served (two bf16 tiles), 2 one int32 a pair, x too)
FORMS = {"words": (0, False), "words+sz": (1, False), "words+sz32": (2, False),
         "all loads": (1, True)}  # fmt: skip
# launches of the words alone and with packed scales (BLOCK_N, BLOCK_K, warps)
LAUNCHES = [(16, 1024, 8), (32, 512, 8), (32, 1024, 8), (64, 256, 8), (64, 512, 8), (128, 256, 8),
            (64, 512, 16), (128, 512, 16)]  # fmt: skip


@triton.jit
def _w4_loads_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, xor_ptr, top_ptr, xsum_ptr, N, K, s_xm, s_qk, s_sg,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SZ: tl.constexpr,
    X: tl.constexpr, TILED: tl.constexpr,
):  # fmt: skip
    """One row of x, K unsplit: the XOR of each column's words, the max of its scales and zeros
    (``SZ``: 1 from two bf16 tensors, 2 from one int32 a pair, :func:`pack_scales`) and, from
    the first column tile, the sum of x (``X``); ``TILED``: the words tile-major."""
    _m0, _m1, _pid_k, offs_n, n_mask, k_lo, k_hi, qw_tile, sz_tile, x0_row, _x1 = _w4_gemv_program(
        x_ptr, qw_ptr, 1, N, K, K, s_xm, s_qk, s_sg, 1, GROUP, 1, BLOCK_N, BLOCK_K
    )
    if TILED:  # the words tile-major (:func:`tile_major`): a program's column tile contiguous
        rows = tl.arange(0, BLOCK_K // 8)
        base = qw_ptr + tl.program_id(0).to(tl.int64) * (K // 8) * BLOCK_N
        qw_tile = base + rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    following = tl.load(qw_tile + (k_lo // 8) * s_qk, mask=n_mask[None, :], other=0)
    acc = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.int32)
    top = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    xs = tl.zeros([BLOCK_K // 8], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        packed = following
        if SZ == 1:
            following, s, z = _w4_gemv_chunk(
                qw_tile, s_ptr, z_ptr, sz_tile, n_mask, k0, k_hi, s_qk, s_sg, GROUP, BLOCK_K
            )
            top = tl.maximum(top, tl.maximum(s, z))
        else:
            following = _w4_next_words(qw_tile, n_mask, k0, k_hi, s_qk, BLOCK_K)
            if SZ == 2:  # s_ptr: int32 words, a scale's bf16 bits low and its zero's high
                w = tl.load(s_ptr + (k0 // GROUP) * s_sg + sz_tile, mask=n_mask[None, :], other=0)
                s = (w << 16).to(tl.float32, bitcast=True)
                z = (w & -65536).to(tl.float32, bitcast=True)
                top = tl.maximum(top, tl.maximum(s, z))
        acc ^= packed
        if X:
            for j in tl.static_range(8):
                xs += tl.load(x0_row + k0 + j).to(tl.float32)
    tl.store(xor_ptr + offs_n, tl.xor_sum(acc, axis=0), mask=n_mask)
    tl.store(top_ptr + offs_n, tl.max(top, axis=0), mask=n_mask)
    if tl.program_id(0) == 0:
        tl.store(xsum_ptr, tl.sum(xs))


def tile_major(qweight: torch.Tensor, block_n: int) -> torch.Tensor:
    """The packed words ``[K/8, N]`` as ``[N/BN, K/8, BN]``: each tile of ``block_n`` columns
    contiguous, as the ``TILED`` kernel reads them (row stride ``block_n``)."""
    k8, n = qweight.shape
    return qweight.reshape(k8, n // block_n, block_n).permute(1, 0, 2).contiguous()


def pack_scales(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """bf16 scales and zeros as one int32 each pair: the scale's bits low, the zero's high."""
    lo = scales.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return lo | (zeros.to(torch.bfloat16).view(torch.int16).to(torch.int32) << 16)


def loads(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    *, sz: int = 1, with_x: bool = True, config: tuple[int, ...] | None = None,
    packed: torch.Tensor | None = None, tiled: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The loads-only kernel at the GEMV's served launch for one row of x (or ``config``):
    each column's XOR of words, max of scales and zeros, and the sum of x. ``sz=2`` reads
    ``packed`` (:func:`pack_scales`, made here if not given) in place of scales and zeros;
    ``tiled``: the words of ``qweight`` as :func:`tile_major` lays them out for this launch."""
    if sz == 2:
        scales = zeros = packed if packed is not None else pack_scales(scales, zeros)
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    bn, bk, warps = (config or w4_gemv_config(n, k, 1))[:3]
    if k % bk:
        raise ValueError(f"K={k} must be a multiple of the chunk {bk}")
    if tiled is not None and (n % bn or tiled.shape != (n // bn, k // 8, bn)):
        raise ValueError(f"tiled words must be tile_major(qweight, {bn}) and N % {bn} == 0")
    words = qweight if tiled is None else tiled
    xor = torch.empty(n, dtype=torch.int32, device=x.device)
    top = torch.empty(n, dtype=torch.float32, device=x.device)
    xsum = torch.zeros(1, dtype=torch.float32, device=x.device)
    _w4_loads_kernel[(triton.cdiv(n, bn),)](
        x, words, scales, zeros, xor, top, xsum, n, k, x.stride(0),
        qweight.stride(0) if tiled is None else bn, scales.stride(0), GROUP=GROUP, BLOCK_N=bn,
        BLOCK_K=bk, SZ=sz, X=with_x, TILED=tiled is not None, num_warps=warps,
    )  # fmt: skip
    return xor, top, xsum


def ref_loads(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
    *, sz: int = 1, with_x: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """What :func:`loads` returns, in torch and numpy."""
    xor = np.bitwise_xor.reduce(qweight.cpu().numpy(), axis=0)
    both = torch.maximum(scales.to(torch.bfloat16).float(), zeros.to(torch.bfloat16).float())
    top = both.amax(0).clamp(min=0) if sz else torch.zeros(qweight.shape[1], device=x.device)
    xsum = x[0].float().sum().reshape(1) if with_x else torch.zeros(1, device=x.device)
    return torch.from_numpy(xor).to(qweight.device), top, xsum


def _each(fn: Callable[..., object], x: torch.Tensor, weights: list) -> None:
    for w, packed, tiled in weights:
        fn(x, *w, packed=packed, tiled=tiled)


def time_shape(name: str, n: int, k: int, copy: float) -> dict:
    from kernels.bench import gemv_graph
    from kernels.triton_quant import w4a16_linear

    graph_us = gemv_graph.graph_us
    weights = awq_weights(n, k, torch.device("cuda"))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    nbytes = weight_bytes(n, k)
    floor_us = nbytes / copy / 1e3
    packs = [pack_scales(s, z) for _, s, z in weights]
    timed = {"served": graph_us(lambda: [w4a16_linear(x, *w, GROUP) for w in weights])}
    swept: dict[str, float] = {}
    runs: list[tuple[str, int, bool, tuple[int, ...] | None]] = [
        (form, sz, with_x, None) for form, (sz, with_x) in FORMS.items()
    ]
    runs += [
        (f"{form} {c}", sz, False, c)
        for c in LAUNCHES
        for form, sz in (("words", 0), ("words+sz32", 2), ("tiled", 0), ("tiled+sz32", 2))
    ]
    for form, sz, with_x, config in runs:
        fn = functools.partial(loads, sz=sz, with_x=with_x, config=config)
        bn = (config or w4_gemv_config(n, k, 1))[0]
        tiles = [tile_major(w[0], bn) if form.startswith("tiled") else None for w in weights]
        each = list(zip(weights, packs, tiles, strict=True))
        got = fn(x, *weights[0], packed=packs[0], tiled=tiles[0])
        want = ref_loads(x, *weights[0], sz=sz, with_x=with_x)
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            raise SystemExit(f"{name}: the {form} kernel differs from its reference")
        us = graph_us(functools.partial(_each, fn, x, each))
        (timed if config is None else swept)[form] = us
        del tiles, each
    line = "  ".join(f"{f} {u:6.1f} us ({100 * floor_us / u:4.1f}%)" for f, u in timed.items())
    print(f"{name:8s} floor {floor_us:6.1f} us  {line}", flush=True)
    for form in ("words", "words+sz32", "tiled", "tiled+sz32"):
        mine = {f: u for f, u in swept.items() if f.split(" ")[0] == form}
        best = min(mine, key=mine.__getitem__)
        print(f"    {form} best launch {best.split(' ', 1)[1]}: {mine[best]:.1f} us "
              f"({100 * floor_us / mine[best]:.1f}%)", flush=True)  # fmt: skip
    launch = w4_gemv_config(n, k, 1)
    return {"shape": name, "n": n, "k": k, "bytes": nbytes, "floor_us": floor_us,
            "launch": list(launch), "us": timed, "launches_us": swept}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.gemv_graph import sweep

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    sweep(time_shape, args.json_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
