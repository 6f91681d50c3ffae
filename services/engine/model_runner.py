"""Turn the scheduler's plain output into tensors, run the model, sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.config import EngineConfig
from services.engine.attention_metadata import AttentionMetadata
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.kv_cache import GIB, allocate_kv_caches, check_fits, plan_num_blocks
from services.engine.loader import load_model
from services.engine.sampler import sample
from services.scheduling.outputs import SampledToken, SchedulerOutput


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and not torch.cuda.is_available():
        from services.config import ConfigError

        raise ConfigError(f"--device {name} asked for CUDA, but no CUDA GPU is visible")
    return device


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [S] index of the last token of each sampling request


class ModelRunner:
    def __init__(self, config: EngineConfig, max_model_len_hint: int | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        max_pos = 1 << 17
        self.model, self.arch, self.files = load_model(config.model, self.device, max_pos)
        self.dtype = self.model.lm_head.weight.dtype
        limit = self.arch.max_position_embeddings
        self.max_model_len = config.model.max_model_len or min(limit, max_pos)
        if self.max_model_len > max_pos:
            from services.config import ConfigError

            raise ConfigError(f"--max-model-len {self.max_model_len} exceeds {max_pos} positions")
        self.block_size = config.cache.block_size
        self.num_blocks = self._plan_blocks()
        self.kv_caches = allocate_kv_caches(
            self.arch, self.num_blocks, self.block_size, self.dtype, self.device
        )
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(
                self.model, self.kv_caches, config.scheduler.max_num_seqs,
                -(-self.max_model_len // self.block_size), self.device,
            )  # fmt: skip
            self.graphs.capture()

    def _plan_blocks(self) -> int:
        free = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            total = torch.cuda.get_device_properties(self.device).total_memory
            used = torch.cuda.memory_reserved(self.device)
            reserve_activations = 2 * GIB + self.config.scheduler.max_num_batched_tokens * (
                self.arch.hidden_size * 4 * 8 + self.arch.vocab_size * 4
            )
            free = (
                int(total * self.config.cache.gpu_memory_utilization) - used - reserve_activations
            )
        n = plan_num_blocks(self.config.cache, self.arch, self.dtype, self.device, free)
        hint = (
            "--gpu-memory-utilization or --num-blocks"
            if self.device.type == "cuda"
            else "--kv-cache-gib or --num-blocks"
        )
        check_fits(n, self.block_size, self.max_model_len, hint)
        return n

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        ctx: list[int] = []
        rows: list[int] = []
        bs = self.block_size
        max_blocks = max(len(r.block_ids) for r in out.requests)
        tables = []
        for r in out.requests:
            ids.extend(r.token_ids)
            start = r.start_pos
            for p in range(start, start + r.num_new_tokens):
                pos.append(p)
                slots.append(r.block_ids[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + r.num_new_tokens)
            ctx.append(r.context_len)
            if r.sample:
                rows.append(qsl[-1] - 1)
            tables.append(r.block_ids + [0] * (max_blocks - len(r.block_ids)))
        dev = self.device

        def t(x: list, dtype: torch.dtype) -> torch.Tensor:
            cpu = torch.tensor(x, dtype=dtype)
            return cpu.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else cpu

        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.int64),
            block_tables=t(tables, torch.int32),
            context_lens=t(ctx, torch.int32),
            query_start_loc=t(qsl, torch.int32),
            decode_only=all(r.num_new_tokens == 1 for r in out.requests),
        )
        return StepInputs(t(ids, torch.int64), t(pos, torch.int64), meta, t(rows, torch.int64))

    def release_kv_cache(self) -> None:
        """Give the KV pool and graphs back (benchmarks that hand the GPU to another engine)."""
        self.graphs = None
        self.kv_caches.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        n = inputs.input_ids.shape[0]
        if self.graphs is not None and inputs.meta.decode_only:
            b = self.graphs.bucket(n)
            if b is not None:
                return self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta, b)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, min_token_stop_ids: dict[str, list[int]]
    ) -> dict[str, SampledToken]:
        inputs = self.prepare(out)
        hidden = self._forward(inputs)
        sampling = [r for r in out.requests if r.sample]
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[inputs.logits_rows])
        tokens = sample(
            logits,
            [r.sampling_params for r in sampling],
            [r.output_token_ids for r in sampling],
            [r.prompt_token_ids for r in sampling],
            [min_token_stop_ids.get(r.request_id, []) for r in sampling],
        )
        return {r.request_id: tok for r, tok in zip(sampling, tokens, strict=True)}
