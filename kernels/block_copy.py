"""Gather/scatter of paged KV blocks to and from one contiguous buffer (for KV transfer).

Per-layer caches are ``[planes, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V,
or one plane: DeepSeek's latent). The buffer is ``[num_layers, planes, n, block_size,
num_kv_heads, head_dim]``. :class:`RefBlockCopier`
is the same over one fixed list of caches, for any range of layers.
"""

from __future__ import annotations

import torch


def ref_gather_blocks(kv_caches: list[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    """Copy blocks ``block_ids`` of every layer into one new contiguous tensor."""
    ids = block_ids.long()
    return torch.stack([cache[:, ids] for cache in kv_caches])


def ref_scatter_blocks(
    buffer: torch.Tensor, kv_caches: list[torch.Tensor], block_ids: torch.Tensor
) -> None:
    """Inverse of :func:`ref_gather_blocks`: write the buffer into blocks ``block_ids``."""
    ids = block_ids.long()
    for layer, cache in enumerate(kv_caches):
        cache[:, ids] = buffer[layer].to(cache.dtype)


def ref_fence_cas(word: torch.Tensor, expected: int, new: int) -> int:
    """Compare-and-swap of ``word[0]`` (int64): set it to ``new`` if it holds ``expected``;
    returns what it held. The GPU version is one atomic, against a push running beside it."""
    old = int(word[0])
    if old == expected:
        word[0] = new
    return old


class RefBlockCopier:
    """Reference of :class:`kernels.triton_block_copy.BlockCopier`: gather/scatter over one
    fixed list of caches, any range of layers [first, last), gathering into ``out`` if given."""

    def __init__(self, kv_caches: list[torch.Tensor]) -> None:
        if not kv_caches:
            raise ValueError("kv_caches must be a non-empty list")
        self._caches = list(kv_caches)
        first = self._caches[0]
        self.num_layers = len(self._caches)
        self.planes = first.shape[0]
        self.block_shape: tuple[int, ...] = tuple(first.shape[2:])  # (bs, Hkv, D)
        self.dtype = first.dtype
        self.device = first.device

    def buffer_shape(
        self, num_blocks: int, first: int = 0, last: int | None = None
    ) -> tuple[int, ...]:
        last = self.num_layers if last is None else last
        if not 0 <= first < last <= self.num_layers:
            raise ValueError(f"layers [{first}, {last}) are not a range of {self.num_layers}")
        return (last - first, self.planes, num_blocks, *self.block_shape)

    def gather(
        self,
        block_ids: torch.Tensor,
        first: int = 0,
        last: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        shape = self.buffer_shape(block_ids.shape[0], first, last)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        elif tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {shape}, got {tuple(out.shape)}")
        ids = block_ids.long()
        for layer in range(shape[0]):  # index_select into out: ~100x faster than indexing on CPU
            cache = self._caches[first + layer]
            if out.dtype == cache.dtype:
                torch.index_select(cache, 1, ids, out=out[layer])
            else:
                out[layer].copy_(cache.index_select(1, ids))
        return out

    def scatter(
        self, buffer: torch.Tensor, block_ids: torch.Tensor, first: int = 0, last: int | None = None
    ) -> None:
        shape = self.buffer_shape(block_ids.shape[0], first, last)
        if tuple(buffer.shape) != shape:
            raise ValueError(f"buffer shape {tuple(buffer.shape)} != expected {shape}")
        ids = block_ids.long()
        for layer in range(shape[0]):  # ids are distinct: index_copy_ is the same as indexing
            cache = self._caches[first + layer]
            cache.index_copy_(1, ids, buffer[layer].to(cache.dtype))

    def copy_from(
        self,
        src: RefBlockCopier,
        src_ids: torch.Tensor,
        dst_ids: torch.Tensor,
        first: int = 0,
        last: int | None = None,
    ) -> None:
        """Blocks ``src_ids`` of ``src``'s caches into blocks ``dst_ids`` of these, layers
        [first, last) (``dst_ids`` distinct)."""
        last = self.buffer_shape(0, first, last)[0] + first
        src.buffer_shape(0, first, last)
        if src_ids.shape != dst_ids.shape:
            raise ValueError(
                f"{src_ids.shape[0]} source ids for {dst_ids.shape[0]} destination ids"
            )
        sids, dids = src_ids.long(), dst_ids.long()
        for layer in range(first, last):
            cache = self._caches[layer]
            cache.index_copy_(1, dids, src._caches[layer].index_select(1, sids).to(cache.dtype))

    def push_from(self, src: RefBlockCopier, meta: torch.Tensor, fence: torch.Tensor) -> None:
        """:meth:`copy_from` of every layer, fenced: a copy into blocks another party granted
        (``kvtransfer.grants``) and may take back before it runs.

        ``meta`` is int64 ``[token, slot, n, src ids (n)..., dst ids (n)...]`` (room for more is
        ignored: the GPU version reads ``n`` on the device, so that one captured launch serves
        any transfer); ``fence`` the grant table, int64 ``[slots, 2]`` of ``[state, unused]``.
        The copy runs only if the slot's ``state`` is ``token`` (granted: it is claimed,
        ``token + 1``) or ``token + 1`` (claimed); afterwards ``state`` is ``token + 2``
        (landed). In any other state (revoked, or granted to another transfer) nothing is
        written. The second word of each slot is left as it is (room for later use)."""
        if meta.dtype != torch.int64 or meta.dim() != 1 or meta.shape[0] < 3:
            raise ValueError("meta must be int64 [token, slot, n, n source ids, n destination ids]")  # fmt: skip
        if fence.dtype != torch.int64 or fence.dim() != 2 or fence.shape[1] != 2:
            raise ValueError(f"fence must be an int64 [slots, 2], got {tuple(fence.shape)}")
        if src.num_layers != self.num_layers:
            raise ValueError(f"{src.num_layers} source layers for {self.num_layers}")
        token, slot, n = (int(v) for v in meta[:3])
        if 3 + 2 * n > meta.shape[0]:
            raise ValueError(f"meta holds fewer than the {n} blocks it names")
        row = fence[slot]
        state = ref_fence_cas(row, token, token + 1)
        if state not in (token, token + 1):
            return
        if n:
            self.copy_from(src, meta[3 : 3 + n], meta[3 + n : 3 + 2 * n])
        ref_fence_cas(row, token + 1, token + 2)
