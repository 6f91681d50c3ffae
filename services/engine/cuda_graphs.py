"""CUDA graphs for decode steps: forward + logits captured once per bucketed batch size.

A decode step launches hundreds of small kernels; replaying a graph removes their launch cost.
The runner uploads a step's inputs (see ``input_staging``), ``run`` copies them into the static
buffers the graph reads; rows past the real batch are padding that writes no KV (slot -1) and
attends to one token. The outputs are the fp32 logits of every row and their argmax (the
token of a plain greedy request), written by the graph itself.
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
        # up to the first bucket that holds max_batch rows (or the largest)
        fit = next((b for b in BUCKETS if b >= max_batch), BUCKETS[-1])
        self.buckets = [b for b in BUCKETS if b <= fit]
        self.max_blocks = max_blocks
        n = self.buckets[-1]
        self.i64 = torch.zeros(3, n, dtype=torch.int64, device=device)  # ids, positions, slots
        self.i64[2].fill_(-1)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.ctx = torch.ones(n, dtype=torch.int32, device=device)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            self.i64[2, :b], self.tables[:b], self.ctx[:b], self.qsl[: b + 1], num_decodes=b
        )

    def _step(self, b: int) -> torch.Tensor:
        hidden = self.model(self.i64[0, :b], self.i64[1, :b], self.kv, self._meta(b))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            for _ in range(2):  # warm up: compile Triton kernels, settle allocations
                self._step(b)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._step(b)
                argmax = logits.argmax(dim=-1)  # greedy rows need nothing else
            self.graphs[b] = (graph, logits, argmax)
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def bucket(self, n: int) -> int | None:
        for b in self.buckets:
            if b >= n:
                return b
        return None

    def run(
        self,
        i64: torch.Tensor,  # [3 * b]: ids, positions, slots of the padded batch
        ctx: torch.Tensor,  # [b]
        tables: torch.Tensor,  # [b, w], w <= max_blocks
        b: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fp32 logits [b, V], argmax [b]; until next replay
        self.i64[:, :b].copy_(i64.view(3, b), non_blocking=True)
        self.ctx[:b].copy_(ctx, non_blocking=True)
        self.tables[:b, : tables.shape[1]].copy_(tables, non_blocking=True)
        graph, logits, argmax = self.graphs[b]
        graph.replay()
        return logits, argmax
