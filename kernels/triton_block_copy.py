"""Gather/scatter of paged KV blocks to and from one contiguous buffer, in Triton.

Same semantics as :mod:`kernels.block_copy`: per-layer caches ``[planes, num_blocks, block_size,
Hkv, D]`` (planes: K and V, or one: DeepSeek's latent), buffer ``[num_layers, planes, n,
block_size, Hkv, D]``; :meth:`BlockCopier.copy_from` moves blocks
from another list of caches straight into these (no buffer: each byte is read and written once). One launch copies every layer: the
kernel gets the lowest-addressed cache as its base pointer plus each layer's element offset
from it, so the layers may be separate allocations. A block is ``block_size * Hkv * D``
contiguous elements; programs copy ``CHUNK`` of them each.

:class:`BlockCopier` is the same copy for a caller that copies one fixed list of caches again and
again (the KV transfer): it checks the caches and uploads their offset table once, then each
call checks only its block ids and buffer, copies any range of layers and may gather into a
given buffer, with no host-to-device copy and no synchronization.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton_common import (
    INDEX_DTYPES,
    KV_DTYPES,
    check_devices,
    check_tensor,
    next_pow2,
)

CHUNK = 4096


@triton.jit
def _block_copy_kernel(
    cache_ptr, layer_off_ptr, buf_ptr, ids_ptr, num_ids, s_kv, s_blk, block_elems,
    GATHER: tl.constexpr, CHUNK: tl.constexpr, PLANES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # over (layer, kv, i) in buffer order
    i = pid % num_ids
    layer = pid // num_ids // PLANES
    kv = (pid // num_ids) % PLANES
    blk = tl.load(ids_ptr + i).to(tl.int64)
    cache_off = tl.load(layer_off_ptr + layer) + kv * s_kv + blk * s_blk
    buf_off = pid.to(tl.int64) * block_elems
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_elems
    if GATHER:
        x = tl.load(cache_ptr + cache_off + offs, mask=mask)
        tl.store(buf_ptr + buf_off + offs, x.to(buf_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(buf_ptr + buf_off + offs, mask=mask)
        tl.store(cache_ptr + cache_off + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _move_chunk(
    src_ptr, src_off_ptr, src_blk, dst_ptr, dst_off_ptr, dst_blk, layer, kv,
    s_kv_src, s_blk_src, s_kv_dst, s_blk_dst, block_elems, CHUNK: tl.constexpr,
):  # fmt: skip
    """Chunk ``program_id(1)`` of block ``src_blk`` (K or V of ``layer``) into ``dst_blk``."""
    src_off = tl.load(src_off_ptr + layer) + kv * s_kv_src + src_blk * s_blk_src
    dst_off = tl.load(dst_off_ptr + layer) + kv * s_kv_dst + dst_blk * s_blk_dst
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_elems
    x = tl.load(src_ptr + src_off + offs, mask=mask)
    tl.store(dst_ptr + dst_off + offs, x.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _block_move_kernel(
    src_ptr, src_off_ptr, src_ids_ptr, dst_ptr, dst_off_ptr, dst_ids_ptr, num_ids,
    s_kv_src, s_blk_src, s_kv_dst, s_blk_dst, block_elems, CHUNK: tl.constexpr,
    PLANES: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)  # over (layer, kv, i)
    i = pid % num_ids
    src_blk = tl.load(src_ids_ptr + i).to(tl.int64)
    dst_blk = tl.load(dst_ids_ptr + i).to(tl.int64)
    _move_chunk(
        src_ptr, src_off_ptr, src_blk, dst_ptr, dst_off_ptr, dst_blk, pid // num_ids // PLANES,
        (pid // num_ids) % PLANES, s_kv_src, s_blk_src, s_kv_dst, s_blk_dst, block_elems, CHUNK,
    )  # fmt: skip


@triton.jit
def _block_push_kernel(
    src_ptr, src_off_ptr, dst_ptr, dst_off_ptr, meta_ptr, fence_ptr, capacity,
    s_kv_src, s_blk_src, s_kv_dst, s_blk_dst, block_elems, CHUNK: tl.constexpr,
    PLANES: tl.constexpr,
):  # fmt: skip
    # meta: [token, slot, n, src ids (n), dst ids (n)], read here so that one launch (or one
    # captured graph) serves every transfer of up to ``capacity`` blocks; fence: [slots, 2] of
    # [state, unused]. Programs over (layer, kv, i < capacity) x chunks; those past n exit.
    pid = tl.program_id(0)
    i = pid % capacity
    num_ids = tl.load(meta_ptr + 2)
    if i < num_ids:
        token = tl.load(meta_ptr)
        state_ptr = fence_ptr + 2 * tl.load(meta_ptr + 1)
        state = tl.load(state_ptr, volatile=True)
        if state == token:  # granted, not yet claimed: claim it (unless revoked meanwhile)
            state = tl.atomic_cas(state_ptr, token, token + 1)
        if (state == token) | (state == token + 1):  # claimed, by this program or another
            src_blk = tl.load(meta_ptr + 3 + i)
            dst_blk = tl.load(meta_ptr + 3 + num_ids + i)
            _move_chunk(
                src_ptr, src_off_ptr, src_blk, dst_ptr, dst_off_ptr, dst_blk,
                pid // capacity // PLANES, (pid // capacity) % PLANES, s_kv_src, s_blk_src, s_kv_dst,
                s_blk_dst, block_elems, CHUNK,
            )  # fmt: skip


@triton.jit
def _fence_land_kernel(meta_ptr, fence_ptr):
    # after the push, in stream order: every program has run. Claimed -> landed; still granted
    # (no blocks to copy) -> landed too; revoked or another grant's: left alone
    token = tl.load(meta_ptr)
    state_ptr = fence_ptr + 2 * tl.load(meta_ptr + 1)
    old = tl.atomic_cas(state_ptr, token + 1, token + 2)
    if old == token:
        tl.atomic_cas(state_ptr, token, token + 2)


@triton.jit
def _fence_cas_kernel(word_ptr, args_ptr, out_ptr):
    old = tl.atomic_cas(word_ptr, tl.load(args_ptr), tl.load(args_ptr + 1))
    tl.store(out_ptr, old)


def fence_cas(word: torch.Tensor, expected: int, new: int) -> int:
    """Triton version of :func:`kernels.block_copy.ref_fence_cas` (waits for the device)."""
    check_tensor("word", word, ndim=1, dtypes=(torch.int64,))
    args = torch.tensor([expected, new], dtype=torch.int64).to(word.device)
    out = torch.empty(1, dtype=torch.int64, device=word.device)
    _fence_cas_kernel[(1,)](word, args, out, num_warps=1)
    return int(out.item())


def _layout(cache: torch.Tensor) -> tuple[object, ...]:
    return (cache.shape, cache.stride(), cache.dtype, cache.device)


def _check_layer(i: int, cache: torch.Tensor, first: torch.Tensor) -> None:
    check_tensor(f"kv_caches[{i}]", cache, ndim=5, dtypes=KV_DTYPES)
    if cache.shape[0] not in (1, 2):
        raise ValueError(
            f"kv_caches[{i}] must be [planes (1 or 2), blocks, bs, Hkv, D], got "
            f"{tuple(cache.shape)}"
        )
    if not cache[0, 0].is_contiguous():
        raise ValueError(f"kv_caches[{i}]: each block must be contiguous, strides {cache.stride()}")
    names = ("shape", "strides", "dtype", "device")
    for what, mine, ref in zip(names, _layout(cache), _layout(first), strict=True):
        if mine != ref:
            raise ValueError(f"kv_caches[{i}] has {what} {mine}, layer 0 has {ref}")


@functools.lru_cache(maxsize=64)
def _layer_offsets(ptrs: tuple[int, ...], elem_size: int, device: torch.device) -> torch.Tensor:
    """Each layer's element offset from the lowest-addressed one (cached: the engine's caches
    stay put, and a per-call host-to-device copy would cost more than small copies take)."""
    base = min(ptrs)
    if any((p - base) % elem_size for p in ptrs):
        raise ValueError("kv_caches are not aligned to their dtype")
    return torch.tensor([(p - base) // elem_size for p in ptrs], dtype=torch.int64, device=device)


def _check_cache_list(kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """Validate the caches; returns the int64 element offsets of each layer from the lowest one."""
    if not isinstance(kv_caches, (list, tuple)) or not kv_caches:
        raise ValueError("kv_caches must be a non-empty list")
    first = kv_caches[0]
    _check_layer(0, first, first)
    layout = _layout(first)
    for i, cache in enumerate(kv_caches):
        if not isinstance(cache, torch.Tensor) or _layout(cache) != layout:
            _check_layer(i, cache, first)
    ptrs = tuple(c.data_ptr() for c in kv_caches)
    return _layer_offsets(ptrs, first.element_size(), first.device)


def _check_ids(block_ids: torch.Tensor, cache: torch.Tensor) -> None:
    check_tensor("block_ids", block_ids, ndim=1, dtypes=INDEX_DTYPES, inner_contiguous=False)
    check_devices(block_ids=block_ids, kv_caches=cache)


def _check_push(meta: torch.Tensor, fence: torch.Tensor, cache: torch.Tensor) -> int:
    """Checks :meth:`BlockCopier.push_from`'s ``meta`` and ``fence``; returns how many blocks
    ``meta`` has room for (the count itself is read on the device)."""
    check_tensor("meta", meta, ndim=1, dtypes=(torch.int64,))
    check_tensor("fence", fence, ndim=2, dtypes=(torch.int64,))
    check_devices(meta=meta, fence=fence, kv_caches=cache)
    if meta.shape[0] < 3 or not meta.is_contiguous():
        raise ValueError(f"meta must be a contiguous [token, slot, n, n source ids, n destination ids], got {meta.shape[0]} entries")  # fmt: skip
    if fence.shape[1] != 2 or not fence.is_contiguous():
        raise ValueError(f"fence must be a contiguous [slots, 2], got {tuple(fence.shape)}")
    return (meta.shape[0] - 3) // 2


def _check_caches(kv_caches: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    offsets = _check_cache_list(kv_caches)
    _check_ids(block_ids, kv_caches[0])
    return offsets


def _check_buffer(name: str, buffer: torch.Tensor, expected: tuple[int, ...], cache: torch.Tensor) -> None:  # fmt: skip
    check_tensor(name, buffer, ndim=6, dtypes=KV_DTYPES)
    if tuple(buffer.shape) != expected:
        raise ValueError(f"{name} shape {tuple(buffer.shape)} != expected {expected}")
    if not buffer.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    check_devices(**{name: buffer, "kv_cache": cache})


def _launch(base: torch.Tensor, num_layers: int, buffer: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor, gather: bool) -> None:  # fmt: skip
    """Copy ``num_layers`` layers: ``offsets[l]`` is layer l's element offset from ``base``."""
    n = block_ids.shape[0]
    block_elems = base[0, 0].numel()
    chunk = min(CHUNK, next_pow2(block_elems))
    planes = base.shape[0]
    grid = (num_layers * planes * n, triton.cdiv(block_elems, chunk))
    _block_copy_kernel[grid](
        base, offsets, buffer, block_ids, n, base.stride(0), base.stride(1), block_elems,
        GATHER=gather, CHUNK=chunk, PLANES=planes, num_warps=4,
    )  # fmt: skip


def _lowest(kv_caches: list[torch.Tensor]) -> torch.Tensor:
    return min(kv_caches, key=lambda c: c.data_ptr())


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`kernels.block_copy.ref_gather_blocks`."""
    offsets = _check_caches(kv_caches, block_ids)
    first = kv_caches[0]
    shape = (len(kv_caches), first.shape[0], block_ids.shape[0], *first.shape[2:])
    buffer = torch.empty(shape, dtype=first.dtype, device=first.device)
    if buffer.numel() > 0:
        _launch(_lowest(kv_caches), len(kv_caches), buffer, block_ids, offsets, gather=True)
    return buffer


def scatter_blocks(buffer: torch.Tensor, kv_caches: list[torch.Tensor], block_ids: torch.Tensor) -> None:  # fmt: skip
    """Triton version of :func:`kernels.block_copy.ref_scatter_blocks` (ids must be distinct)."""
    offsets = _check_caches(kv_caches, block_ids)
    first = kv_caches[0]
    expected = (len(kv_caches), first.shape[0], block_ids.shape[0], *first.shape[2:])
    _check_buffer("buffer", buffer, expected, first)
    if buffer.numel() > 0:
        _launch(_lowest(kv_caches), len(kv_caches), buffer, block_ids, offsets, gather=False)


class BlockCopier:
    """Block gather/scatter over one fixed list of caches, checked once (see the module doc).

    Same semantics as :class:`kernels.block_copy.RefBlockCopier`. It holds references to the
    caches: the offset table it uploaded is only valid while they stay allocated.
    """

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        self._offsets = _check_cache_list(kv_caches)  # [L] int64, on the caches' device
        self._caches = list(kv_caches)
        self._base = _lowest(self._caches)
        first = self._caches[0]
        self.num_layers = len(self._caches)
        self.planes = first.shape[0]
        self.block_shape: tuple[int, ...] = tuple(first.shape[2:])  # (bs, Hkv, D)
        self.dtype = first.dtype
        self.device = first.device

    def buffer_shape(self, num_blocks: int, first: int = 0, last: int | None = None) -> tuple[int, ...]:  # fmt: skip
        """``[last - first, planes, num_blocks, bs, Hkv, D]``: the buffer of layers [first,
        last)."""
        last = self._check_range(first, last)
        return (last - first, self.planes, num_blocks, *self.block_shape)

    def gather(self, block_ids: torch.Tensor, first: int = 0, last: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Blocks ``block_ids`` of layers [first, last) into ``out`` (a new buffer if None)."""
        shape = self.buffer_shape(block_ids.shape[0], first, last)
        _check_ids(block_ids, self._base)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        else:
            _check_buffer("out", out, shape, self._base)
        if out.numel() > 0:
            _launch(self._base, shape[0], out, block_ids, self._offsets[first:], gather=True)
        return out

    def scatter(self, buffer: torch.Tensor, block_ids: torch.Tensor, first: int = 0, last: int | None = None) -> None:  # fmt: skip
        """Write ``buffer`` (layers [first, last)) into blocks ``block_ids`` (ids distinct)."""
        shape = self.buffer_shape(block_ids.shape[0], first, last)
        _check_ids(block_ids, self._base)
        _check_buffer("buffer", buffer, shape, self._base)
        if buffer.numel() > 0:
            _launch(self._base, shape[0], buffer, block_ids, self._offsets[first:], gather=False)

    def copy_from(self, src: BlockCopier, src_ids: torch.Tensor, dst_ids: torch.Tensor, first: int = 0, last: int | None = None, *, chunk: int = CHUNK, num_warps: int = 4) -> None:  # fmt: skip
        """Blocks ``src_ids`` of ``src``'s caches into blocks ``dst_ids`` of these, layers
        [first, last), in one launch (``dst_ids`` distinct; the two lists may live in different
        allocations, e.g. another process's pool opened through CUDA IPC)."""
        last = self._check_range(first, last)
        src._check_range(first, last)
        self._check_source(src)
        _check_ids(src_ids, src._base)
        _check_ids(dst_ids, self._base)
        if src_ids.shape != dst_ids.shape:
            raise ValueError(
                f"{src_ids.shape[0]} source ids for {dst_ids.shape[0]} destination ids"
            )
        n = src_ids.shape[0]
        if n == 0:
            return
        block_elems = self._base[0, 0].numel()
        chunk = min(chunk, next_pow2(block_elems))
        grid = ((last - first) * self.planes * n, triton.cdiv(block_elems, chunk))
        _block_move_kernel[grid](
            src._base, src._offsets[first:], src_ids, self._base, self._offsets[first:], dst_ids,
            n, src._base.stride(0), src._base.stride(1), self._base.stride(0),
            self._base.stride(1), block_elems, CHUNK=chunk, PLANES=self.planes,
            num_warps=num_warps,
        )  # fmt: skip

    def push_from(self, src: BlockCopier, meta: torch.Tensor, fence: torch.Tensor, *, chunk: int = CHUNK, num_warps: int = 4) -> None:  # fmt: skip
        """:meth:`copy_from` of every layer, fenced (see
        :meth:`kernels.block_copy.RefBlockCopier.push_from`): ``meta`` is int64 ``[token, slot,
        n, src ids..., dst ids...]`` (read on the device: any ``n`` that fits, so one captured
        launch serves every transfer) and ``fence`` the grant table, int64 ``[slots, 2]``.
        Two launches (the copy, then the landing mark), no synchronization: the grid is sized
        for as many blocks as ``meta`` has room for, so size it near the transfer."""
        capacity = _check_push(meta, fence, self._base)
        self._check_source(src)
        if src.num_layers != self.num_layers:
            raise ValueError(f"{src.num_layers} source layers for {self.num_layers}")
        block_elems = self._base[0, 0].numel()
        chunk = min(chunk, next_pow2(block_elems))
        if capacity:
            grid = (self.num_layers * self.planes * capacity, triton.cdiv(block_elems, chunk))
            _block_push_kernel[grid](
                src._base, src._offsets, self._base, self._offsets, meta, fence, capacity,
                src._base.stride(0), src._base.stride(1), self._base.stride(0),
                self._base.stride(1), block_elems, CHUNK=chunk, PLANES=self.planes,
                num_warps=num_warps,
            )  # fmt: skip
        _fence_land_kernel[(1,)](meta, fence, num_warps=1)

    def _check_source(self, src: BlockCopier) -> None:
        mine, theirs = (self.planes, *self.block_shape), (src.planes, *src.block_shape)
        if theirs != mine or src.device != self.device:
            raise ValueError(
                f"source blocks {theirs} on {src.device} do not fit {mine} on {self.device}"
            )

    def _check_range(self, first: int, last: int | None) -> int:
        last = self.num_layers if last is None else last
        if not 0 <= first < last <= self.num_layers:
            raise ValueError(f"layers [{first}, {last}) are not a range of {self.num_layers}")
        return last
