"""Inputs and byte/FLOP counts for the kernel benchmark (Llama-3.1-8B attention shapes).

Napkin math, per the roofline: decode attention moves each K/V byte once (plus q and out), so its
floor is bytes / copy bandwidth; prefill does 4 * D FLOP per visible (query, key) pair per query
head, so its floor is FLOPs / matmul rate; the element-wise layers read and write once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


@dataclass
class Paged:
    """A paged KV cache with shuffled (non-contiguous) block tables, plus the queries."""

    q: torch.Tensor  # decode [B, Hq, D] or prefill [T, Hq, D]
    k_cache: torch.Tensor  # [N, bs, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32 (prefill)
    scale: float

    def kv_bytes(self) -> int:
        per_token = 2 * KV_HEADS * HEAD_DIM * self.k_cache.element_size()
        return int(self.context_lens.sum().item()) * per_token

    def io_bytes(self) -> int:
        """Decode traffic: K/V read once, q read, out written."""
        return self.kv_bytes() + 2 * self.q.numel() * self.q.element_size()


def paged(ctx_lens: list[int], q_lens: list[int] | None = None, seed: int = 0) -> Paged:
    """Random paged inputs on the GPU; ``q_lens=None`` means decode (one query per sequence)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda")
    blocks = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in ctx_lens]
    total = sum(blocks)
    shape = (total, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device=dev, dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device=dev, dtype=DTYPE)
    order = torch.randperm(total, generator=gen, device=dev).int()
    tables = torch.zeros((len(ctx_lens), max(blocks)), dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[used : used + n]
        used += n
    q_lens = q_lens if q_lens is not None else [1] * len(ctx_lens)
    qsl = torch.tensor([0, *q_lens], device=dev).cumsum(0).int()
    rows = int(qsl[-1].item())
    q = torch.randn((rows, Q_HEADS, HEAD_DIM), generator=gen, device=dev, dtype=DTYPE)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=dev)
    return Paged(q, k_cache, v_cache, tables, lens, qsl, HEAD_DIM**-0.5)


def new_kv(p: Paged, ctx_lens: list[int], q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' keys and values as the engine hands them to prefill attention
    (``k_new``/``v_new``, [T, Hkv, D], row for row with the queries): copies of their slots."""
    rows = []
    for b, (n, m) in enumerate(zip(ctx_lens, q_lens, strict=True)):
        pos = torch.arange(n - m, n, device=p.q.device)
        blocks = p.block_tables[b].long()[pos // BLOCK_SIZE]
        rows.append((blocks, pos % BLOCK_SIZE))
    blk = torch.cat([r[0] for r in rows])
    off = torch.cat([r[1] for r in rows])
    return p.k_cache[blk, off].contiguous(), p.v_cache[blk, off].contiguous()


def prefill_flops(ctx_lens: list[int], q_lens: list[int]) -> float:
    """QK^T and PV over the causally visible pairs: 4 * D FLOP per pair per query head."""
    pairs = sum(q * (n - q) + q * (q + 1) // 2 for n, q in zip(ctx_lens, q_lens, strict=True))
    return 4.0 * HEAD_DIM * Q_HEADS * pairs


DECODE_CASES = [(64, 4096), (1, 32768), (256, 512)]  # (batch, context)
PREFILL_CASES = [  # (name, context lengths, query lengths)
    ("8 x 1024 prompts", [1024] * 8, [1024] * 8),
    # 1.9 programs per SM with 256-row tiles, just under the shape rule's bound for them
    ("4 x 512 prompts", [512] * 4, [512] * 4),
    ("512 chunk after 4096 prefix", [4096 + 512], [512]),
]
