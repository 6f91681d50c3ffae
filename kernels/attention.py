"""Paged attention: the pure-torch references.

KV cache layout (one tensor pair per layer)::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

Token ``t`` of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its *slot* is ``block * block_size + offset``.

These functions define the semantics; the Triton kernels in ``kernels.triton_attention``
have the same signatures and are tested against them.
"""

from __future__ import annotations

import functools
import itertools
import struct
from collections.abc import Callable
from typing import TypeVar

import torch

from kernels.layers import check_rotary_width, rotated

T = TypeVar("T")

FP8_KV_DTYPES = (torch.float8_e4m3fn,)
E4M3_MAX = 448.0


@functools.cache
def inverse_scale(scale: float) -> float:
    """``1 / scale`` rounded to float32: what the FP8 writes multiply by (kernels too)."""
    return float(struct.unpack("f", struct.pack("f", 1.0 / scale))[0])


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K or V as a cache of ``dtype`` stores it: an FP8 cache holds ``x / scale`` (computed as
    ``x * inverse_scale(scale)`` in float32) rounded to the nearest e4m3 value, saturated at
    +-448; any other cache, ``x`` cast to its dtype."""
    if dtype in FP8_KV_DTYPES:
        inv = torch.tensor(inverse_scale(scale), dtype=torch.float32, device=x.device)
        return (x.float() * inv).clamp(-E4M3_MAX, E4M3_MAX).to(dtype)
    return x.to(dtype)


def ref_write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor | None,  # [T, Hkv, D]; None: the keys are the values, v_cache left alone
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    memo: StepMemo | None = None,  # the step's (AttentionMetadata.memo): checks reused
) -> None:
    """Write each token's K/V into its slot of the paged cache (slots < 0 are skipped); an FP8
    cache stores ``k / k_scale`` and ``v / v_scale`` (:func:`to_cache_dtype`). Readers multiply
    by the scales (folded into the softmax scale and the output: ``models.llama.Attention``).
    ``v`` None: only the keys are written (a cache whose values are its keys, DeepSeek's latent:
    ``v_cache`` may be ``k_cache`` itself)."""
    every = _memo_get(
        memo, ("all_slots",), (slot_mapping,), lambda: bool((slot_mapping >= 0).all())
    )
    if not every:
        keep = slot_mapping >= 0
        slot_mapping, k = slot_mapping[keep], k[keep]
        v = v[keep] if v is not None else None
    n, bs, h, d = k_cache.shape
    slots = slot_mapping.long()
    planes = [(k_cache, k, k_scale)] + ([(v_cache, v, v_scale)] if v is not None else [])
    for cache, x, scale in planes:
        new = to_cache_dtype(x, cache.dtype, scale)
        if cache.dtype in FP8_KV_DTYPES:  # no index_copy_ for float8 on the CPU: copy the bytes
            cache, new = cache.view(torch.uint8), new.view(torch.uint8)
        cache.view(n * bs, h, d).index_copy_(0, slots, new)


def ref_rotary_write_kv(
    positions: torch.Tensor,  # [T] int64
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor | None,  # [T, Hkv, D]; None: only the rotated keys are written
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32: cos in [:, :D/2], sin in [:, D/2:]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not write
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    k_out: torch.Tensor | None = None,  # [T, Hkv, D] of k's dtype: the rotated keys, also here
    memo: StepMemo | None = None,  # the step's (AttentionMetadata.memo): checks reused
) -> torch.Tensor:  # [T, Hq, D], contiguous
    """Rotary embedding and the KV write in one: returns the rotated q (a new contiguous tensor)
    and writes the rotated k and v into their slots (and the rotated k into ``k_out`` when
    given: what prefill attention reads as the new tokens' keys). q, k, v are read only (views of
    a fused qkv projection are fine). Rotation rounds as :func:`kernels.layers.ref_rotary_embedding` does
    (transformers' ``apply_rotary_pos_emb`` in q's / k's dtype); the rotated k is then cast to
    the cache's dtype. ``v`` None: the cache's values are its keys (DeepSeek's latent, one
    tensor given as both caches), written once, rotated."""
    check_k_out(k_out, k)
    rot = check_rotary_width(cos_sin_cache, q.shape[-1])
    cs = _memo_get(memo, ("rope_rows",), (positions, cos_sin_cache), lambda: cos_sin_cache[positions.long()])  # fmt: skip
    if rot == q.shape[-1]:  # the whole head: the rotation is the new tensor
        q_out, k_rot = rotated(q, cs), rotated(k, cs)
    else:  # partial rotary: the dims past R as they are
        q_out, k_rot = q.contiguous().clone(), k.contiguous().clone()
        q_out[..., :rot] = rotated(q_out[..., :rot], cs)
        k_rot[..., :rot] = rotated(k_rot[..., :rot], cs)
    ref_write_kv(k_rot, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, memo)
    if k_out is not None:
        k_out.copy_(k_rot)
    return q_out


def check_k_out(k_out: torch.Tensor | None, k: torch.Tensor) -> None:
    """``k_out`` (when given) has k's shape, dtype and device, unit last stride."""
    if k_out is None:
        return
    if k_out.shape != k.shape or k_out.dtype != k.dtype or k_out.device != k.device:
        raise ValueError(
            f"k_out {tuple(k_out.shape)} {k_out.dtype} on {k_out.device} must match k "
            f"{tuple(k.shape)} {k.dtype} on {k.device}"
        )
    if k_out.shape[-1] > 1 and k_out.stride(-1) != 1:
        raise ValueError(f"k_out must be contiguous in its last dim, strides {k_out.stride()}")


def check_window(window: int) -> None:
    """A sliding window is >= 0 (0: none)."""
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: no window), got {window}")


def check_span_last(span_last: torch.Tensor | None, tokens: int, device: torch.device) -> None:
    """``span_last``: [T] integers (int32 for the kernel), one per query row, on q's device."""
    if span_last is None:
        return
    if span_last.shape != (tokens,) or span_last.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"span_last must be [T] = [{tokens}] int32, got {tuple(span_last.shape)} "
            f"{span_last.dtype}"
        )
    if span_last.device != device:
        raise ValueError(f"span_last is on {span_last.device}, q on {device}")


def _gather_seq(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    bs = cache.shape[1]
    nblk = (n + bs - 1) // bs
    return gather_blocks(cache, block_table[:nblk]).flatten(0, 1)[:n]  # [n, Hkv, D]


def gather_blocks(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``cache[ids]``: the blocks ``ids`` (any shape, any integer dtype) of ``cache`` [N, ...],
    as ``[*ids.shape, ...]``. Through ``index_select``, which copies whole blocks: on the CPU
    ~8x faster than advanced indexing (16 x 8 blocks of 16 x 3 x 64 floats: 0.16 against 1.35
    ms), which the CPU decode step spent a tenth of its time in."""
    flat = torch.index_select(cache, 0, ids.reshape(-1).long())
    return flat.view(*ids.shape, *cache.shape[1:])


class StepMemo:
    """What a step's layers derive alike from the step's tensors, computed by the first layer
    and reused by the others: every layer of a step gets the same block tables, context lengths
    and slot mapping, so which slots a decode row gathers, or whether every new token has a
    slot, need not be recomputed 30 times (on the CPU, ~a dozen small ops a layer). One memo
    lives as long as one step's inputs (``AttentionMetadata.memo``); callers without one pass
    None and compute. An entry is keyed by a name and plain values, and holds the tensors it
    was derived from: it is used again only for those same tensor objects, none changed in
    place since (their version counters), so a slice of the tables taken anew is a miss, not
    a wrong answer. Tensors made under ``torch.inference_mode`` (the engine's) carry no version
    counter: for them identity alone decides, which holds because the engine builds a new
    ``AttentionMetadata`` (and memo) for every forward and changes no input during one."""

    def __init__(self) -> None:
        self._entries: dict[tuple[object, ...], tuple[tuple[torch.Tensor, ...], tuple[int, ...], object]] = {}  # fmt: skip

    def get(
        self,
        key: tuple[object, ...],
        tensors: tuple[torch.Tensor, ...],
        make: Callable[[], T],
    ) -> T:
        entry = self._entries.get(key)
        versions = tuple(-1 if t.is_inference() else t._version for t in tensors)
        if (
            entry is not None
            and len(entry[0]) == len(tensors)
            and all(a is b for a, b in zip(entry[0], tensors, strict=True))
            and entry[1] == versions
        ):
            return entry[2]  # type: ignore[return-value]
        value = make()
        self._entries[key] = (tensors, versions, value)
        return value


def _memo_get(
    memo: StepMemo | None,
    key: tuple[object, ...],
    tensors: tuple[torch.Tensor, ...],
    make: Callable[[], T],
) -> T:
    return make() if memo is None else memo.get(key, tensors, make)


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value)
    return out


def check_softcap(softcap: float) -> None:
    if not (softcap == 0 or 0 < softcap < float("inf")):
        raise ValueError(f"softcap must be 0 (none) or a positive number, got {softcap}")


# dtypes a sinks tensor may have: read as float32 (gpt-oss keeps them in the model's dtype)
SINK_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_sinks(sinks: torch.Tensor | None, num_q_heads: int, device: torch.device) -> None:
    """``sinks`` (when given) is a float tensor ``[num_q_heads]`` on ``device`` (q's): one
    learned logit per query head (gpt-oss's attention sinks)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks must be a torch.Tensor, got {type(sinks).__name__}")
    if tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(
            f"sinks has shape {tuple(sinks.shape)}; expected [num_q_heads] = ({num_q_heads},)"
        )
    if sinks.dtype not in SINK_DTYPES:
        raise ValueError(f"sinks has dtype {sinks.dtype}; expected one of {SINK_DTYPES}")
    if sinks.device != device:
        raise ValueError(f"sinks is on {sinks.device}; expected q's device {device}")


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``softmax(scores, -1)``; with ``sinks`` (one logit per row, broadcast to
    ``scores.shape[:-1] + (1,)``, float32) over the scores plus that extra logit, whose column is
    then dropped: transformers' gpt-oss ``softmax(cat([scores, sinks], -1))[..., :-1]``. A row's
    probabilities then sum to less than 1 (the sink's value vector is zero)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (transformers' order of operations); 0: as they
    are."""
    if not softcap:
        return scores
    return torch.tanh(scores / softcap) * softcap


def _decode_plan(
    block_tables: torch.Tensor, context_lens: torch.Tensor, bs: int, window: int, slotwise: bool
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What :func:`ref_paged_decode_attention` derives from the block tables and context lengths
    alone (the same for every layer of a step): the longest context L, the tables' first blocks
    [B, ceil(L / bs)], which of the L positions each row sees [B, L], and (``slotwise``) the slot
    each row reads at each position [B * L]."""
    B = context_lens.shape[0]
    max_len = int(context_lens.max().item()) if B else 0
    nblk = (max_len + bs - 1) // bs
    tables = block_tables[:, :nblk].clamp_min(0)
    pos = torch.arange(max_len, device=context_lens.device)
    written = pos[None, :] < context_lens[:, None].long()  # [B, L]
    seen = written  # and, with a window, only its last `window` positions
    if window:
        seen = seen & (pos[None, :] > context_lens[:, None].long() - 1 - window)
    if not slotwise:
        return max_len, tables, seen, None
    # where a row has no key (past its context) it reads its own first slot instead (written:
    # contexts are >= 1), so no unwritten slot's NaN enters, which a zero weight would not cancel
    at = torch.where(written, pos[None, :], 0)
    slots = (torch.gather(tables.long(), 1, at // bs) * bs + at % bs).reshape(-1)
    return max_len, tables, seen, slots


def ref_paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, bs, Hkv, D]
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [B, Hq, D] to write into
    window: int = 0,  # sliding window: the query sees its last ``window`` positions (0: all)
    softcap: float = 0.0,  # scores soft-capped to (-softcap, softcap) (Gemma 2); 0: none
    sinks: torch.Tensor | None = None,  # [Hq], any float dtype: a learned logit per head (gpt-oss)
    memo: StepMemo | None = None,  # the step's (AttentionMetadata.memo): the gather plan reused
) -> torch.Tensor:  # [B, Hq, D]
    """One query token per sequence attending to its first ``context_lens[b]`` cached tokens
    (written into ``out`` when given, which is then returned).

    The query sits at position ``context_lens[b] - 1``. ``window`` > 0 is a sliding window as
    transformers defines it: the query at position ``p`` sees keys ``p - window < j <= p``, so
    only the last ``window`` tokens (itself included); 0 is no window. ``softcap`` > 0: each
    scaled score ``x`` becomes ``softcap * tanh(x / softcap)`` before the mask and the softmax
    (transformers' Gemma 2 ``attn_logit_softcapping``).

    ``sinks`` (gpt-oss's attention sinks): head ``h``'s softmax runs over its visible scores
    plus one more logit ``sinks[h]`` (read as float32, in the scaled scores' natural-log units,
    never soft-capped) whose value vector is zero, so the weights of the keys sum to less than 1:
    ``o = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sinks[h]))``. None: a plain softmax.
    """
    check_window(window)
    check_softcap(softcap)
    B, Hq, D = q.shape
    check_sinks(sinks, Hq, q.device)
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    # the caches' slots as one run of N * bs rows (a view, no copy)
    mergeable = all(c.stride(0) == bs * c.stride(1) for c in (k_cache, v_cache))
    fused = not softcap and sinks is None and mergeable
    plan = _memo_get(
        memo, ("decode_plan", bs, window, fused), (block_tables, context_lens),
        lambda: _decode_plan(block_tables, context_lens, bs, window, fused),
    )  # fmt: skip
    max_len, tables, seen, slots = plan
    if fused:
        assert slots is not None
        k = torch.index_select(k_cache.flatten(0, 1), 0, slots).view(B, max_len, Hkv, D)
        v = torch.index_select(v_cache.flatten(0, 1), 0, slots).view(B, max_len, Hkv, D)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.float().view(B, Hq, 1, D), k.transpose(1, 2).float(), v.transpose(1, 2).float(),
            attn_mask=seen[:, None, None, :], scale=scale, enable_gqa=True,
        )  # fmt: skip
        return _into(out, o.view(B, Hq, D).to(q.dtype))
    # [B, Hkv, L, D]: one gather per cache, laid out for batched matmuls
    k = gather_blocks(k_cache, tables).flatten(1, 2)[:, :max_len].transpose(1, 2).float()
    v = gather_blocks(v_cache, tables).flatten(1, 2)[:, :max_len].transpose(1, 2).float()
    qf = q.float().view(B, Hkv, group, D)
    scores = soft_cap(torch.matmul(qf, k.transpose(-1, -2)) * scale, softcap)  # [B, Hkv, g, L]
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    v = v.masked_fill(~seen[:, None, :, None], 0.0)  # unwritten slots may hold NaN
    # sinks [Hq] -> [Hkv, g, 1]: row (kv head, group member) is query head kv * g + member
    sink = None if sinks is None else sinks.reshape(Hkv, group, 1)
    o = torch.matmul(softmax_with_sinks(scores, sink), v).reshape(B, Hq, D)  # [B, Hkv, g, D]
    return _into(out, o.to(q.dtype))


def ref_mla_decode_attention(
    q: torch.Tensor,  # [B, H, R + L]: each head's rotated rope query, then its absorbed one
    cache: torch.Tensor,  # [N, bs, 1, R + L]: a token's rope key, then its latent
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    rope_dim: int,
    *,
    out: torch.Tensor | None = None,  # [B, H, L] to write into
) -> torch.Tensor:  # [B, H, L]
    """DeepSeek's latent decode attention (multi-head latent attention absorbed, as vLLM's MLA
    decode): every head attends over the one cache row a token, ``[rope | latent]``, as its key,
    and over the row's latent part as its value; the attended latent [B, H, L] out (the rope
    columns carry no value). :func:`ref_paged_decode_attention` with the cache as keys and
    values, its rope columns dropped."""
    if not 0 < rope_dim < q.shape[-1]:
        raise ValueError(f"rope_dim must be in (0, {q.shape[-1]}), got {rope_dim}")
    o = ref_paged_decode_attention(q, cache, cache, block_tables, context_lens, scale)
    o = o[..., rope_dim:].contiguous()
    if out is not None and out.shape != o.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}; expected {tuple(o.shape)}")
    return _into(out, o)


def pad_head_dim(x: torch.Tensor, width: int) -> torch.Tensor:  # [..., d] -> [..., width]
    """``x`` contiguous, zero columns appended to its last dim up to ``width`` (attention over
    keys and values of different widths in a kernel of one head dim: zero columns add nothing
    to q . k and give zero output columns)."""
    x = x.contiguous()
    if x.shape[-1] == width:
        return x
    return torch.cat([x, x.new_zeros((*x.shape[:-1], width - x.shape[-1]))], dim=-1)


def check_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor, scale: float
) -> None:
    """:func:`ref_varlen_attention`'s inputs: shapes that agree, one dtype and device."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3 or not x.dtype.is_floating_point:
            raise ValueError(f"{name} must be a 3-D float tensor [T, heads, dim], got "
                             f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must be {q.dtype} on {q.device}, like q")
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, Hkv, D] and "
                         f"[T, Hkv, Dv] for q {tuple(q.shape)}")  # fmt: skip
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({k.shape[1]})")
    if (
        query_start_loc.ndim != 1
        or query_start_loc.shape[0] < 1
        or query_start_loc.is_floating_point()
    ):
        raise ValueError("query_start_loc must be a 1-D integer tensor of B + 1 prefix sums")
    if query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc must be on {q.device}, like q")
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")


def ref_varlen_attention(
    q: torch.Tensor,  # [T, Hq, D], the sequences' tokens, concatenated
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
    query_start_loc: torch.Tensor,  # [B + 1] int32, prefix sums of the sequences' lengths
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, Hq, Dv] to write into
) -> torch.Tensor:  # [T, Hq, Dv]
    """Causal attention of packed sequences over their own tokens only: no cache, no prefix
    (flash-attention's varlen call). Token ``i`` of a sequence sees its tokens ``0 ..= i``.
    The values' width may differ from the keys' (DeepSeek's attention expanded from its latent:
    192-dim query and key heads, 128-dim values)."""
    check_varlen(q, k, v, query_start_loc, scale)
    t, hq, _ = q.shape
    shape = (t, hq, v.shape[2])
    out = q.new_empty(shape) if out is None else out
    if tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}; expected {shape}")
    starts = query_start_loc.tolist()
    if starts[-1] != t:
        raise ValueError(f"query_start_loc ends at {starts[-1]}, not at the {t} tokens")
    for s, e in itertools.pairwise(starts):
        if e < s:
            raise ValueError("query_start_loc must not decrease")
        if e == s:
            continue
        qb, kb, vb = (x[s:e].float().transpose(0, 1)[None] for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True
        )
        out[s:e] = o[0].transpose(0, 1).to(out.dtype)
    return out


def ref_prefill_attention(
    q: torch.Tensor,  # [T, Hq, D], the new tokens of every sequence, concatenated
    k_cache: torch.Tensor,  # [N, bs, Hkv, D], already holding the new tokens' K/V
    v_cache: torch.Tensor,  # [N, bs, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32, prefix sums of query lengths
    context_lens: torch.Tensor,  # [B] int32, cached prefix + new tokens
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, Hq, D] to write into
    k_new: torch.Tensor | None = None,  # [T, Hkv, D]: the new tokens' keys, row for row with q
    v_new: torch.Tensor | None = None,  # [T, Hkv, D]
    no_prefix: bool = False,  # the caller says no sequence has a cached prefix (checked here)
    window: int = 0,  # sliding window: each query sees its last ``window`` positions (0: all)
    softcap: float = 0.0,  # scores soft-capped (Gemma 2): as ref_paged_decode_attention's
    sinks: torch.Tensor | None = None,  # [Hq] (gpt-oss): as ref_paged_decode_attention's
    span_last: torch.Tensor | None = None,  # [T] int: a row's last key when past its own
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's new tokens over its whole paged context (written into
    ``out`` when given, which is then returned).

    Query ``i`` of sequence ``b`` sits at position ``context_lens[b] - q_len + i`` and sees
    keys ``0 ..= that position`` (earlier chunks and prefix-cache hits included). With ``k_new``
    and ``v_new`` the new tokens' own keys and values come from them (the same values the cache
    holds for a cache of q's dtype: the Triton kernel then reads them contiguously), the
    earlier ones from the cache.

    ``window`` > 0 is a sliding window as transformers defines it: the query at position ``p``
    sees keys ``p - window < j <= p`` (``window`` of them, itself included, once
    ``p >= window - 1``); 0 is no window, plain causal.

    ``sinks``: each head's softmax also counts its sink logit, as
    :func:`ref_paged_decode_attention`'s (SDPA takes no sink: the explicit score path runs).

    ``span_last`` (Gemma 3's images, whose tokens attend to each other both ways): row ``i``
    also sees the keys up to position ``span_last[i]`` (its image's last token) when that lies
    past its own position; a value at or below it (0 for a text token) leaves the row causal.
    A sliding window still applies on top (transformers' mask for Gemma 3's local layers:
    window AND (causal OR same image)). Every span must end within its chunk.
    """
    check_window(window)
    check_softcap(softcap)
    check_sinks(sinks, q.shape[1], q.device)
    check_span_last(span_last, q.shape[0], q.device)
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together")
    out = torch.empty_like(q) if out is None else out
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for b in range(len(lens)):
        s, e, n = starts[b], starts[b + 1], lens[b]
        if e == s:
            continue
        if no_prefix and n != e - s:
            raise ValueError(f"no_prefix, but sequence {b} has {n - (e - s)} cached tokens")
        # 4-D [1, heads, len, D]: torch's fused (flash) kernels take nothing else; a 3-D call
        # falls back to the math path, which materializes every [q_len, n] score (on the CPU a
        # 4k-token prompt spent 80% of its prefill there)
        qb = q[s:e].float().transpose(0, 1)[None]
        k = _gather_seq(k_cache, block_tables[b], n).float()
        v = _gather_seq(v_cache, block_tables[b], n).float()
        if k_new is not None and v_new is not None:
            k = torch.cat([k[: n - (e - s)], k_new[s:e].float()])
            v = torch.cat([v[: n - (e - s)], v_new[s:e].float()])
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        plain = not softcap and sinks is None  # what SDPA computes
        plain_causal = not window and plain and span_last is None
        if n == e - s and plain_causal:  # a whole prompt: plain causal, skips
            o = torch.nn.functional.scaled_dot_product_attention(  # the masked half
                qb, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        else:  # query i sits at n - q_len + i: causal aligned to the end of the context
            qpos = torch.arange(n - (e - s), n, device=q.device)
            kpos = torch.arange(n, device=q.device)
            last = qpos
            if span_last is not None:  # an image's tokens also see the rest of their image
                last = torch.maximum(qpos, span_last[s:e].to(qpos.device, torch.long))
                if int(last.max()) >= n:
                    raise ValueError(f"sequence {b}: an image span ends past its chunk")
            mask = kpos[None, :] <= last[:, None]  # [q_len, n]
            if window:
                mask &= kpos[None, :] > qpos[:, None] - window
            if not plain:  # every score, capped, masked, softmaxed (SDPA takes no soft-capping
                # and no sink)
                group = qb.shape[1] // k.shape[1]
                kg, vg = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                scores = soft_cap(torch.matmul(qb, kg.transpose(-1, -2)) * scale, softcap)
                scores = scores.masked_fill(~mask, float("-inf"))  # [1, Hq, q_len, n]
                sink = None if sinks is None else sinks.reshape(1, -1, 1, 1)  # [1, Hq, 1, 1]
                o = torch.matmul(softmax_with_sinks(scores, sink), vg)
            else:
                o = torch.nn.functional.scaled_dot_product_attention(
                    qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True
                )
        out[s:e] = o[0].transpose(0, 1).to(q.dtype)
    return out
