"""CUDA graphs for decode steps: the model's forward captured once per bucketed batch size.

A decode step launches hundreds of small kernels; replaying a graph removes their launch cost.
Inputs are copied into static buffers; rows past the real batch are padding that writes no KV
(slot -1) and attends to one token.
"""

from __future__ import annotations

import logging

import torch

from services.engine.attention_metadata import AttentionMetadata
from services.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], max_batch: int,
        max_blocks: int, device: torch.device,
    ) -> None:  # fmt: skip
        self.model, self.kv = model, kv_caches
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        n = self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.pos = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.ctx = torch.ones(n, dtype=torch.int32, device=device)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            self.slots[:b], self.tables[:b], self.ctx[:b], self.qsl[: b + 1], True
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            meta = self._meta(b)
            for _ in range(2):  # warm up: compile Triton kernels, settle allocations
                self.model(self.ids[:b], self.pos[:b], self.kv, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.ids[:b], self.pos[:b], self.kv, meta)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(
        self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, b: int
    ) -> torch.Tensor:  # [n, hidden]
        n, w = ids.shape[0], meta.block_tables.shape[1]
        self.ids[:n].copy_(ids, non_blocking=True)
        self.pos[:n].copy_(pos, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slots[n:b].fill_(-1)
        self.ctx[:n].copy_(meta.context_lens, non_blocking=True)
        self.ctx[n:b].fill_(1)
        self.tables[:n, :w].copy_(meta.block_tables, non_blocking=True)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]
