"""CUDA graphs for decode steps: forward + logits captured once per bucketed batch size.

A decode step launches hundreds of small kernels; replaying a graph removes their launch cost.
The runner uploads a step's inputs (see ``input_staging``), ``run`` copies them into the static
buffers the graph reads; rows past the real batch are padding that writes no KV (slot -1) and
attends to one token. The outputs are the fp32 logits of every row and their argmax (the
token of a plain greedy request), written by the graph itself.

With LoRA (``lora``), each batch size has two graphs: one captured with no adapter work (a step
of base-model rows only replays it, at the base model's cost) and one whose projections run the
LoRA kernels over the fixed-size index buffers of ``lora.graph_inputs``, which ``run`` fills with
the step's segments first. Where a graph was not captured (the CPU, in tests), ``run`` runs the
same forward eagerly over the same buffers.
"""

from __future__ import annotations

import logging

import torch

from services.engine.attention_metadata import AttentionMetadata
from services.engine.lora.graph_inputs import LoRAGraphInputs
from services.engine.lora.manager import LoRAManager
from services.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)
Captured = tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]  # graph, logits, argmax
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], max_batch: int,
        max_blocks: int, device: torch.device, lora: LoRAManager | None = None,
    ) -> None:  # fmt: skip
        """``lora``: the manager whose wrappers the model's projections are in, if any."""
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
        self.lora = (
            LoRAGraphInputs(lora.batch, n, lora.config.max_loras, device)
            if lora is not None
            else None
        )
        # batch size -> the graph and its outputs: without adapter rows, and with them
        self.graphs: dict[int, Captured] = {}
        self.lora_graphs: dict[int, Captured] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            self.i64[2, :b], self.tables[:b], self.ctx[:b], self.qsl[: b + 1], num_decodes=b
        )

    def _kinds(self) -> tuple[bool, ...]:
        return (False, True) if self.lora is not None else (False,)

    def _step(self, b: int, with_lora: bool) -> torch.Tensor:
        if self.lora is not None:  # the wrappers read the graph's buffers, or skip LoRA
            self.lora.use(b if with_lora else None)
        hidden = self.model(self.i64[0, :b], self.i64[1, :b], self.kv, self._meta(b))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per bucket, largest first. With tensor parallelism every rank captures its
        own at once (``ModelRunner.capture_graphs``): the warm-up steps' collectives run eagerly
        paired up, the captured ones (NCCL) pair up at each replay. On the CPU: nothing to
        capture (``run`` runs the forward eagerly over the same buffers)."""
        if self.i64.device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            for with_lora in self._kinds():
                for _ in range(2):  # warm up: compile Triton kernels, settle allocations
                    self._step(b, with_lora)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._step(b, with_lora)
                    argmax = logits.argmax(dim=-1)  # greedy rows need nothing else
                (self.lora_graphs if with_lora else self.graphs)[b] = (graph, logits, argmax)
        if self.lora is not None:
            self.lora.use(None)  # the next eager step sets its own
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s%s", self.buckets,
                 " (each without and with LoRA)" if self.lora is not None else "")  # fmt: skip

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
        segments: torch.Tensor | None = None,  # [size(b)] int32, LoRAGraphInputs.fill's
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fp32 logits [b, V], argmax [b]; until next replay
        """``segments``: the step's LoRA segments when a row has an adapter; None: no row has."""
        self.i64[:, :b].copy_(i64.view(3, b), non_blocking=True)
        self.ctx[:b].copy_(ctx, non_blocking=True)
        self.tables[:b, : tables.shape[1]].copy_(tables, non_blocking=True)
        with_lora = segments is not None
        if segments is not None:
            assert self.lora is not None, "LoRA segments for graphs captured without LoRA"
            self.lora.load(segments, b)
        captured = (self.lora_graphs if with_lora else self.graphs).get(b)
        if captured is None:  # not captured (the CPU): the same forward over the same buffers
            logits = self._step(b, with_lora)
            if self.lora is not None:
                self.lora.use(None)
            return logits, logits.argmax(dim=-1)
        graph, logits, argmax = captured
        graph.replay()
        return logits, argmax
