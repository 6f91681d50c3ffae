"""Turn the scheduler's plain output into tensors, run the model, sample."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, replace
from itertools import chain

import numpy as np
import torch

from kernels import cpu_blocks, cpu_linear, ops
from kernels.gemv import GEMV_MAX_ROWS
from kvtransfer import KvLayout, KvShards
from kvtransfer.blockcopy import make_copier
from protos.blocks import blocks_for
from protos.sampling_params import SamplingParams
from services.config import ConfigError, EngineConfig
from services.engine.attention_metadata import AttentionMetadata
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.gpu_wait import GpuReader, Ticket
from services.engine.input_staging import (
    InputStaging,
    fill_tables,
    list_to_device,
    slot_mapping,
    token_spans,
)
from services.engine.kv_cache import (
    CPU_DEFAULT_MAX_MODEL_LEN,
    GIB,
    HostKV,
    allocate_kv_caches,
    check_fits,
    kv_cache_dtype,
    plan_num_blocks,
)
from services.engine.kv_handoff import LayerSink
from services.engine.loader import check_tp_split, load_model
from services.engine.lora.manager import LoRAManager, RankCut
from services.engine.model_config import (
    ALLOW_LONG_MAX_MODEL_LEN_ENV,
    allow_long_max_model_len,
    derived_max_model_len,
)
from services.engine.models.gemma3_vision import Gemma3VLForCausalLM
from services.engine.models.llama import Attention, Linear
from services.engine.models.mistral3 import Mistral3ForCausalLM
from services.engine.models.qwen2_vl import Qwen2VLForCausalLM
from services.engine.pooler import Pooler
from services.engine.sampler import keep_drafts, sample, sample_tokens, sample_with_drafts
from services.engine.speculative import VERIFY_ROWS
from services.engine.structured import GrammarBatch
from services.engine.tp_group import TPGroup
from services.engine.tp_kv import AfterPeers, ShardedCopier
from services.engine.tp_layout import TPLayout
from services.engine.tp_ranks import CaptureGraphs, Ranks, RankStep
from services.engine.vision import VisionInputs, span_last
from services.engine.warmup import warmup_steps
from services.model_files import named_model_dir
from services.scheduling.outputs import (
    PromptTokenScore,
    SampledToken,
    SchedulerOutput,
)

log = logging.getLogger(__name__)
PROMPT_SCORE_ROWS = 512  # prompt logprob rows at a time: [512, 128k] fp32 logits are 256 MB


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
    starts: list[int]  # where each request's tokens start in the step (``out.requests`` order)


@dataclass(slots=True)
class Launched:
    """A step queued on the device whose tokens the host has not read yet (async scheduling:
    the engine schedules and queues the next step meanwhile)."""

    out: SchedulerOutput
    # [S] the token of each request that samples one (in request order), on the device
    tokens: torch.Tensor
    ticket: Ticket | None = None  # their copy to the host, once started


@dataclass
class ForwardCounts:
    """Forwards run since start, by path (what a benchmark reads to tell which path ran)."""

    graph: int = 0  # decode steps through the CUDA graphs (replayed, or eager on the CPU)
    graph_lora: int = 0  # of those, steps with adapter rows
    eager: int = 0  # steps through the eager forward (warm-up included)
    eager_lora: int = 0  # of those, steps with adapter rows


# the CUDA context, loaded kernels and the driver's own buffers: outside the caching
# allocator's count (~0.5 GiB on an H100 / H200 with torch 2.11; rounded up)
CUDA_CONTEXT_BYTES = 1 * GIB


class ModelRunner:
    def __init__(
        self, config: EngineConfig, max_model_len_hint: int | None = None,
        tp: TPGroup | None = None, device: torch.device | None = None,
    ) -> None:  # fmt: skip
        """``tp``: this process is a tensor-parallel rank other than 0 (``tp_follower``) on
        ``device``; with ``config.tensor_parallel_size`` > 1 and no ``tp``, this is rank 0, which
        starts the other ranks (``tp_ranks``) and sends them every step."""
        self.config = config
        self.device = device or resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.ranks: Ranks | None = None
        self._sharded: ShardedCopier | None = None  # rank 0's KV copier over the ranks' heads
        if tp is None and config.tensor_parallel_size > 1:
            # refused here, before any rank starts, when the heads cannot be split
            check_tp_split(config.model, config.tensor_parallel_size)
            self.ranks = Ranks(config, self.device)
            tp = self.ranks.group
        self.tp = tp
        try:
            with self._collective("while starting"):  # the agreement, fp8's scale agreement
                self._build(config)
        except BaseException:
            self.close(graceful=False)
            raise

    def _check_long_max_model_len(self, limit: int) -> None:
        """A --max-model-len beyond the model's own maximum: refused, as vLLM does, unless
        VLLM_ALLOW_LONG_MAX_MODEL_LEN (or TANDEM_ALLOW_LONG_MAX_MODEL_LEN) is 1."""
        said = (
            f"--max-model-len {self.max_model_len} is greater than the model's maximum of "
            f"{limit} positions (max_position_embeddings {self.arch.max_position_embeddings}"
            f"{', with its rope scaling' if limit != self.arch.max_position_embeddings else ''})"
        )
        allowed = allow_long_max_model_len(os.environ)
        if allowed is None:
            raise ConfigError(
                f"{said}: pass --max-model-len {limit} or less (or leave it out), or set "
                f"{ALLOW_LONG_MAX_MODEL_LEN_ENV[0]}=1 to allow it anyway (outputs past the "
                "positions the model was trained on may be wrong)"
            )
        log.warning(
            "%s; allowed by %s, outputs past %d positions may be wrong", said, allowed, limit
        )

    def _build(self, config: EngineConfig) -> None:
        max_pos = 1 << 17
        if config.speculative is not None:
            # a verify step's rows must be what the plain decode steps they stand for would
            # compute, bit for bit (a bf16 near-tie would otherwise part the two): short batches
            # (a verify graph of 8 rows, batch-1 decodes) run row-invariant kernels. Set before
            # any graph is captured; the draft model's runner (no speculation of its own) keeps it
            ops.set_row_invariant(GEMV_MAX_ROWS)
        self.model, self.arch, self.files = load_model(config.model, self.device, max_pos, self.tp)
        self.kv_arch = self.model.cfg  # this rank's KV heads (all of them without TP)
        self.dtype = self.model.lm_head.weight.dtype
        # LoRA wraps the projections from outside the model, before any step runs
        self.lora = (
            LoRAManager(self.model, config.lora, self.dtype, self.device, self._lora_cut())
            if config.lora
            else None
        )
        if self.device.type == "cpu" and self.lora is None:  # (LoRA reads its base weights)
            # weights that are exactly block-quantized (a GGUF's) stay in blocks; the other
            # float32 weights take oneDNN's layout
            cpu_blocks.pack_blocks(self.model, (Linear,))
            cpu_linear.pack_linears(self.model, (Linear,))
        self.kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype, self.device)
        limit = derived_max_model_len(self.arch.max_position_embeddings, self.arch.rope_scaling)
        default_len = CPU_DEFAULT_MAX_MODEL_LEN if self.device.type == "cpu" else max_pos
        self.max_model_len = config.model.max_model_len or min(limit, max_pos, default_len)
        if self.max_model_len > limit:  # the model's own maximum first: the one to go by
            self._check_long_max_model_len(limit)
        if self.max_model_len > max_pos:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} is longer than the {max_pos} positions "
                f"Tandem serves: pass --max-model-len {max_pos} or less"
            )
        for module in self.model.modules():  # a window no context outgrows: whole attention,
            # without the kernels' window masks (7-8% of 8 x 1024 prompts' attention, H200)
            if isinstance(module, Attention) and module.window >= self.max_model_len:
                module.window = 0
        self.model.trim_rope(self.max_model_len)
        self.block_size = config.cache.block_size
        self.num_blocks, self.num_host_slots = self._plan_blocks()
        self.kv_caches = allocate_kv_caches(
            self.kv_arch, self.num_blocks, self.block_size, self.kv_dtype, self.device
        )
        self.host_kv = (
            HostKV(self.kv_arch, self.num_host_slots, self.block_size, self.kv_dtype, self.device)
            if self.num_host_slots > 0
            else None
        )
        max_blocks = blocks_for(self.max_model_len, self.block_size)
        sched = config.scheduler
        self.staging = InputStaging.for_limits(
            max(sched.token_budget, sched.max_num_seqs), sched.max_num_seqs,
            max_blocks, self.device,
        )  # fmt: skip
        self.reader = GpuReader(self.device)
        if self.ranks is not None:  # tokens of a step whose collectives were aborted: refused
            self.reader.check = self.ranks.raise_if_aborted
        self.graphs: DecodeGraphs | None = None
        self.forwards = ForwardCounts()
        self._hidden: torch.Tensor | None = None  # the last eager forward's, when scoring
        self._starts: list[int] = []
        self.pooler = Pooler()  # embeddings' running state between prefill chunks
        self.vision: VisionInputs | None = None
        towers = Qwen2VLForCausalLM | Mistral3ForCausalLM | Gemma3VLForCausalLM
        if isinstance(self.model, towers) and self.arch.vision:
            model_dir = self.files.hf_dir or named_model_dir(self.files)
            if model_dir is None:
                raise ConfigError(
                    f"{self.files.name}: a named vision-language config is a directory with "
                    "its config.json and preprocessor_config.json"
                )
            self.vision = VisionInputs(self.model, self.arch.vision, model_dir)
        if self.device.type == "cuda" and self.rank == 0:  # the other ranks follow its steps
            log.info("warm-up steps (kernel compilation) took %.1f s", self.warmup())
        # an embedding worker never decodes: no decode graphs to capture. Rank 0 of several
        # has the other ranks capture theirs with it (capture_graphs)
        generates = config.task == "generate"
        if self.device.type == "cuda" and not config.enforce_eager and generates and self.rank == 0:
            self.capture_graphs()

    def capture_graphs(self) -> None:
        """Capture the decode graphs (on the CPU: their buffers only, run eagerly). Rank 0 of
        several tells the other ranks first, and each captures its own in the same order: the
        eager warm-up forwards before each capture run their collectives paired up, and every
        graph holds the same collectives as its peers'. A step then replays a graph on every
        rank or on none: rank 0 decides (``RankStep.graph``) and the others follow, failing
        loudly if they cannot."""
        if self.ranks is not None:
            self.ranks.send(CaptureGraphs())
        # a verify step of a decode with drafts replays the same graphs, one row per token:
        # drafts only fill rows up to VERIFY_ROWS (LLMEngine._propose)
        spec = self.config.speculative
        rows = self.config.scheduler.max_num_seqs
        if spec is not None:
            rows = max(rows, min(VERIFY_ROWS, rows * (1 + spec.num_speculative_tokens)))
        max_blocks = blocks_for(self.max_model_len, self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, rows, max_blocks, self.device,
                                   self.lora)  # fmt: skip
        self.graphs.capture()

    def warmup(self) -> float:
        """Run the synthetic start-up steps of ``services.engine.warmup``; seconds taken."""
        t0 = time.perf_counter()
        sched = self.config.scheduler
        for step in warmup_steps(
            sched.token_budget, self.max_model_len, sched.max_num_seqs,
            self.block_size, self.num_blocks, self.arch.vocab_size,
        ):  # fmt: skip
            self.execute(step, {})
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    @property
    def rank(self) -> int:
        return self.tp.rank if self.tp is not None else 0

    def device_memory(self) -> dict[str, int]:
        """What this process holds of its GPU once loaded (the caching allocator's reserve, which
        holds weights, KV pool and graphs, plus ``CUDA_CONTEXT_BYTES`` for the context and
        kernels), and the GPU's size; empty on the CPU. ``tandem up`` sizes a decode worker
        that shares the GPU from a prefill worker's figures."""
        if self.device.type != "cuda":
            return {}
        total = torch.cuda.get_device_properties(self.device).total_memory
        used = torch.cuda.memory_reserved(self.device) + CUDA_CONTEXT_BYTES
        return {"gpu_bytes": int(used), "gpu_total_bytes": int(total)}

    def _plan_blocks(self) -> tuple[int, int]:
        """KV blocks and host-tier slots: what this rank's memory holds of its own KV heads,
        agreed with the other ranks (the least of them; the scheduler plans one pool for all)."""
        blocks, error = 0, None
        try:
            blocks = self._plan_rank_blocks()
        except ConfigError as exc:
            if self.tp is None:
                raise
            error = str(exc)
        gib = self.config.cache.kv_offloading_gib
        slots = HostKV.slots_for(gib, self.kv_arch, self.block_size, self.kv_dtype)
        if self.tp is None:
            return blocks, slots
        agreed = self.tp.agree((blocks, slots), error)
        return min(b for b, _ in agreed), min(s for _, s in agreed)

    def _plan_rank_blocks(self) -> int:
        free = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            total = torch.cuda.get_device_properties(self.device).total_memory
            used = torch.cuda.memory_reserved(self.device)
            reserve_activations = 2 * GIB + self.config.scheduler.token_budget * (
                self.arch.hidden_size * 4 * 8 + self.arch.vocab_size * 4
            )
            free = (
                int(total * self.config.cache.gpu_memory_utilization) - used - reserve_activations
            )
        n = plan_num_blocks(
            self.config.cache, self.kv_arch, self.kv_dtype, self.device, self.max_model_len, free
        )
        hint = (
            "--gpu-memory-utilization or --num-blocks"
            if self.device.type == "cuda"
            else "--kv-cache-gib or --num-blocks"
        )
        check_fits(n, self.block_size, self.max_model_len, hint)
        return n

    def _max_blocks(self, out: SchedulerOutput) -> int:
        return max(len(r.block_ids) for r in out.requests)

    def prepare(
        self, out: SchedulerOutput, dev_ids: torch.Tensor | None = None,
        dev_at: list[int] | None = None,
    ) -> StepInputs:  # fmt: skip
        """The eager path's inputs: every step's ids, positions, slots, tables in two uploads.

        Sequences with one new token (decodes) are laid out first, the prefill chunks after
        them (see ``AttentionMetadata``); the logits rows stay in the order of ``out.requests``.
        ``dev_ids``: token ids on the device (the launched step's tokens before it, see
        :meth:`launch`) in place of placeholders in ``out``: a decode-only step's, in request
        order, or with ``dev_at`` the first input id of each of those requests (indices into
        ``out.requests``).
        """
        reqs = out.requests
        # decodes first, then the prefill chunks with a cached prefix, then whole prompts (stable)
        order = sorted(
            range(len(reqs)), key=lambda i: (reqs[i].num_new_tokens != 1, reqs[i].start_pos == 0)
        )
        laid = [reqs[i] for i in order]
        B, W = len(reqs), self._max_blocks(out)
        lens = np.fromiter([r.num_new_tokens for r in laid], np.int64, B)  # [B]
        nd, T = int(np.count_nonzero(lens == 1)), int(lens.sum())
        S = sum(1 + r.num_spec for r in reqs if r.samples_token)
        h64, h32 = self.staging.begin([T, T, T, S], [B, B + 1, B - nd + 1, B * W])
        ids, pos, slots, rows = h64
        ctx, qsl, pqsl, tables = h32[0], h32[1], h32[2], h32[3].reshape(B, W)
        if self.lora is not None:  # each request's rows under its adapter, in this layout
            self.lora.begin_step([(r.sampling_params.lora_name, r.num_new_tokens) for r in laid])
        fill_tables(tables, [r.block_ids for r in laid])
        starts = np.fromiter([r.start_pos for r in laid], np.int64, B)  # [B]
        row, p = token_spans(starts, lens)  # [T] each
        ids[:] = np.fromiter(chain.from_iterable([r.token_ids for r in laid]), np.int64, T)
        pos[:] = p + np.fromiter([r.position_offset for r in laid], np.int64, B)[row]
        slots[:] = slot_mapping(tables, row, p, self.block_size)
        ctx[:] = starts + lens
        qsl[0] = 0
        qsl[1:] = np.cumsum(lens)
        pqsl[:] = qsl[nd:] - nd
        # where each request's tokens start and its last row, in the order of ``out.requests``
        first, last = np.empty(B, np.int64), np.empty(B, np.int64)
        first[order], last[order] = qsl[:-1], qsl[1:] - 1
        last_row = last.tolist()
        # a sampling request's last row, and with drafts the rows before it, one per draft
        rows[:] = [
            last_row[i] - j
            for i, r in enumerate(reqs)
            if r.samples_token
            for j in range(r.num_spec, -1, -1)
        ]
        n_prefix = int(np.count_nonzero(starts[nd:]))  # laid out first among the prefills
        d64, d32 = self.staging.upload()
        if dev_ids is not None and dev_at is None:  # a decode-only step: laid out in order
            assert nd == B == dev_ids.shape[0], "device ids are for decode-only steps"
            d64[0].copy_(dev_ids)
        elif dev_ids is not None and dev_at is not None:
            at = list_to_device(first[dev_at].tolist(), torch.long, d64[0].device)
            d64[0].index_copy_(0, at, dev_ids)
        meta = AttentionMetadata(
            slot_mapping=d64[2],
            block_tables=d32[3].view(B, W),
            context_lens=d32[0],
            query_start_loc=d32[1],
            num_decodes=nd,
            prefill_start_loc=d32[2] if nd < B else None,
            prefill_no_prefix=nd < B and n_prefix == 0,
            prefix_prefills=n_prefix,
            prefix_prefill_rows=int(lens[nd : nd + n_prefix].sum()),
            prefix_prefill_longest=int(starts[nd : nd + n_prefix].max()) if n_prefix else 0,
        )
        if self.vision is not None and self.vision.cfg.bidirectional and nd < B:
            spans = span_last(laid)  # Gemma 3: an image's tokens see each other
            if spans is not None:
                meta.span_last = torch.from_numpy(spans).to(d64[0].device, non_blocking=True)
        return StepInputs(d64[0], d64[1], meta, d64[3], first.tolist())

    def _graph_bucket(self, out: SchedulerOutput) -> tuple[int, int] | None:
        """The captured batch size that would replay this step and its widest block table, or
        None: no graph fits it."""
        graphs, reqs = self.graphs, out.requests
        # a decode with drafts is one row per token: row j attends to the positions up to its
        # own (the drafts before it are written by the same step, before any attention reads)
        if graphs is None or any(r.num_new_tokens != 1 + r.num_spec for r in reqs):
            return None
        if any(r.before_image_end for r in reqs):
            return None  # an image token (a one-token final chunk): its embedding, 3-D position
        b, W = graphs.bucket(out.num_tokens), self._max_blocks(out)
        if b is None or graphs.max_blocks < W:
            return None
        return b, W

    def _graph_forward(
        self, out: SchedulerOutput, dev_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode-only step through its captured graph: (logits [n, V], argmax [n]) of every
        row; None when no graph fits the step. ``dev_ids``: as :meth:`prepare`'s."""
        graphs, reqs, fit = self.graphs, out.requests, self._graph_bucket(out)
        if graphs is None or fit is None:
            return None
        (b, W), n = fit, out.num_tokens
        plan = None
        if self.lora is not None:  # the step's adapters made resident, their rows in segments
            plan = self.lora.plan([(r.sampling_params.lora_name, r.num_new_tokens) for r in reqs])
        lora = graphs.lora if plan is not None else None
        assert plan is None or lora is not None, "graphs captured without the runner's LoRA"
        h64, h32 = self.staging.begin(
            [3 * b], [b, b * W, *([lora.size(b)] if lora is not None else [])]
        )
        if plan is not None and lora is not None:
            lora.fill(h32[2], plan, b)
        ids, pos, slots = h64[0].reshape(3, b)
        ctx, tables = h32[0], h32[1].reshape(b, W)
        ids[n:], pos[n:], slots[n:], ctx[n:] = 0, 0, -1, 1  # padding rows: write no KV
        # one row per token (a request with drafts: 1 + num_spec rows), filled from lists in
        # one pass: numpy's per-call cost would be paid per token otherwise
        tok, posl, slotl, ctxl, rows = [], [], [], [], []
        bs = self.block_size
        for r in reqs:
            bids, p, offset = r.block_ids, r.start_pos, r.position_offset
            for token in r.token_ids:
                tok.append(token)
                posl.append(p + offset)
                slotl.append(bids[p // bs] * bs + p % bs)
                p += 1
                ctxl.append(p)
                rows.append(bids)
        ids[:n], pos[:n], slots[:n], ctx[:n] = tok, posl, slotl, ctxl
        fill_tables(tables, rows)
        d64, d32 = self.staging.upload()
        if dev_ids is not None:  # the token ids never pass through the host
            d64[0][:n].copy_(dev_ids)
        segments = d32[2] if lora is not None else None
        logits, argmax = graphs.run(d64[0], d32[0], d32[1].view(b, W), b, segments)
        self.forwards.graph += 1
        self.forwards.graph_lora += segments is not None
        return logits[:n], argmax[:n]

    def _graph_logits(
        self, out: SchedulerOutput, dev_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        ran = self._graph_forward(out, dev_ids)
        if ran is None:
            return None
        logits, reqs = ran[0], out.requests
        if all(r.samples_token for r in reqs):
            return logits
        keep: list[int] = []
        at = 0
        for r in reqs:
            if r.samples_token:
                keep += range(at, at + r.num_new_tokens)
            at += r.num_new_tokens
        return logits[torch.tensor(keep, device=logits.device)]

    def _lora_cut(self) -> RankCut | None:
        """This rank's part of each adapter (None without tensor parallelism)."""
        if self.tp is None:
            return None
        spans = TPLayout.of(self.arch, self.tp.rank, self.tp.size).row_spans()
        d, arch = self.arch.head_dim, self.arch
        return RankCut.of(
            spans["q"], spans["kv"], spans["mlp"],
            (arch.num_heads * d, arch.num_kv_heads * d, arch.intermediate_size),
        )  # fmt: skip

    def kv_shards(self) -> KvShards | None:
        """Rank 0 of several: what a worker's KV sender or receiver needs to ship whole blocks
        of every rank's heads (``services.engine.tp_kv``); None with one rank."""
        if self.ranks is None:
            return None
        if self._sharded is None:
            size = self.config.tensor_parallel_size
            spans = [TPLayout.of(self.arch, r, size).kv_heads for r in range(size)]
            whole = replace(KvLayout.of(self.kv_caches), num_kv_heads=self.arch.num_kv_heads)
            local = make_copier(self.kv_caches)
            self._sharded = ShardedCopier(local, self.ranks.group.kv, spans, whole, self.device)
        return KvShards(self._sharded, self._sharded.layout)

    def close(self, graceful: bool = True) -> None:
        """Stop the other tensor-parallel ranks (rank 0; nothing to do otherwise)."""
        if self.ranks is not None:
            if graceful and self._sharded is not None and not self.ranks.dead():
                with contextlib.suppress(RuntimeError):  # the ranks' KV loops end first
                    self._sharded.close()
            self.ranks.close(graceful)

    def _collective(self, when: str = "during a step") -> contextlib.AbstractContextManager[None]:
        """Around rank 0's forward calls: a rank that died is named, the others are stopped."""
        return self.ranks.guard(when) if self.ranks is not None else contextlib.nullcontext()

    @torch.inference_mode()
    def follow(self, step: RankStep | CaptureGraphs) -> None:
        """A rank other than 0: the forward calls rank 0 makes in ``execute`` and, with prompt
        logprobs, ``score_prompts``, in the same order (their collectives pair up); no sampling.
        Or, once at start-up, the decode graphs' capture with rank 0 (``capture_graphs``)."""
        if isinstance(step, CaptureGraphs):
            self.capture_graphs()
            return
        out = step.out
        if self.host_kv is not None:
            self.host_kv.move(self.kv_caches, out.kv_offloads, out.kv_restores)
        if step.graph:  # rank 0 replays its graph: so must this rank, or nothing pairs up
            if self._graph_forward(out) is None:
                raise RuntimeError(
                    f"tensor-parallel rank {self.rank}: rank 0 replayed a decode graph of "
                    f"{out.num_tokens} rows that this rank did not capture"
                )
            return
        self.forward_logits(out, eager=step.eager, allow_graph=False)
        if step.score:
            self.score_prompts(out, step.score)

    def release_kv_cache(self) -> None:
        """Give the KV pool and graphs back (benchmarks that hand the GPU to another engine)."""
        self.graphs = None
        self.kv_caches.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def forward_logits(
        self, out: SchedulerOutput, eager: bool = False, layers: LayerSink | None = None,
        dev_ids: torch.Tensor | None = None, dev_at: list[int] | None = None,
        allow_graph: bool = True,
    ) -> torch.Tensor | None:  # fmt: skip
        """Run the step's forward; fp32 logits of its sampling requests ([S, V]) or None.
        ``eager`` (prompt logprobs to score, embeddings to pool): no CUDA graph, the hidden
        states kept. ``layers``: told each layer's KV write as the forward goes (never a graph:
        it would not tell). ``dev_ids``, ``dev_at``: as :meth:`prepare`'s. ``allow_graph``
        False: eager whatever fits (tensor-parallel ranks follow rank 0's choice)."""
        self._hidden = None
        graph = allow_graph and not eager and layers is None and dev_at is None
        logits = self._graph_logits(out, dev_ids) if graph else None
        if logits is not None:
            return logits
        inputs = self.prepare(out, dev_ids, dev_at)
        self.forwards.eager += 1
        self.forwards.eager_lora += self.lora is not None and self.lora.batch.segments is not None
        peers = None
        if layers is not None and self.ranks is not None:  # a layer counts once every rank wrote it
            layers = peers = AfterPeers(layers, self.kv_arch.num_layers)
        if layers is not None:
            inputs.meta.on_kv_written = layers.record
        embeds = rope = None
        if self.vision is not None:
            embeds = self.vision.embeds(out.requests, inputs.starts)
            rope = self.vision.rope_table(out.requests, inputs.starts, inputs.positions)
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta, embeds, rope
        )
        if peers is not None:
            peers.finish()
        if eager:
            self._hidden, self._starts = hidden, inputs.starts
        if inputs.logits_rows.shape[0] == 0:
            return None
        return self.model.compute_logits(hidden[inputs.logits_rows])

    @property
    def launches_ahead(self) -> bool:
        """Whether decode steps may be queued before the last one's tokens are read: not with
        tensor-parallel ranks (they follow the steps one by one), a host KV tier (its copies
        run before a step, from the host) or LoRA (adapter slots are planned per step)."""
        return self.ranks is None and self.host_kv is None and self.lora is None

    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutput, after: Launched | None = None, rows: list[int] | None = None
    ) -> Launched:
        """Queue a step (nothing for the host in its sampling: see :func:`launchable`) without
        reading its tokens. ``after``: the launched step before it, whose sampled tokens are
        input ids here: ``rows[i]`` is the row of ``after.tokens`` that is request ``i``'s input
        id (a decode of the token sampled there), -1 where its ids are known (a prompt chunk,
        a request admitted ahead). Those ids stay on the device."""
        assert self.launches_ahead
        reqs = out.requests
        ids, at = None, None
        if after is not None:
            assert rows is not None and len(rows) == len(reqs)
            at = [i for i, r in enumerate(rows) if r >= 0]
            src = [rows[i] for i in at]
            if src == list(range(len(src))):
                ids = after.tokens[: len(src)]
            else:  # some requests of the step before end with it, or prefill in it
                index = list_to_device(src, torch.long, after.tokens.device)
                ids = after.tokens.index_select(0, index)
            if len(at) == len(reqs):
                at = None  # every input id is one: the decode-only layout
            elif not at:
                ids, at = None, None
        sampling = [r for r in reqs if r.samples_token]
        logits = None
        if at is None and len(sampling) == len(reqs):
            ran = self._graph_forward(out, ids)
            if ran is not None and all(plain_greedy(r.sampling_params) for r in reqs):
                return Launched(out, ran[1])  # the graph's own argmax
            logits = ran[0] if ran is not None else None
        if logits is None:
            logits = self.forward_logits(out, dev_ids=ids, dev_at=at)
        if logits is None:  # a step of prompt chunks only: nothing to sample
            return Launched(out, torch.empty(0, dtype=torch.long, device=self.device))
        # each sampled token's output index: the token after the step's last position
        positions = [r.start_pos + r.num_new_tokens - len(r.prompt_token_ids) for r in sampling]
        params = [r.sampling_params for r in sampling]
        return Launched(out, sample_tokens(logits, params, positions))

    def wait_idle(self) -> None:
        """Wait until the device has run everything queued (a launched step dropped unread
        after an error must not write blocks that are freed and handed out again)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def start_read(self, step: Launched) -> None:
        """Queue the launched step's tokens' copy to the host (after the previous one's
        :meth:`finish`: one buffer serves them in turn)."""
        step.ticket = self.reader.start(step.tokens)

    def finish(self, step: Launched) -> list[int]:
        """The launched step's tokens, once the device has them (``reader.while_waiting``'s
        work runs first)."""
        assert step.ticket is not None, "start_read first"
        return self.reader.finish(step.ticket)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, min_token_stop_ids: dict[str, list[int]],
        grammars: GrammarBatch | None = None, score: dict[str, int] | None = None,
        layers: LayerSink | None = None,
    ) -> dict[str, list[SampledToken]]:  # fmt: skip
        """Each sampling request's new tokens: one, or with drafts the kept ones and one more.
        ``grammars``: the constrained requests; their bitmask is filled on the host while the
        forward runs on the device, and applied before sampling. ``score``: requests whose
        prompt tokens in this step get logprobs (top-N each): ``score_prompts`` then reads them.
        ``layers``: told each layer's KV write during the forward (``kv_handoff``)."""
        if self.host_kv is not None:  # before the forward, which may overwrite evicted blocks
            self.host_kv.move(self.kv_caches, out.kv_offloads, out.kv_restores)
        sampling = [r for r in out.requests if r.samples_token]
        rids = [r.request_id for r in sampling]
        constrained = grammars is not None and grammars.constrains(rids)
        # the graph's own argmax is every row's token (plain greedy rows only)
        graph_argmax = (
            layers is None  # a final chunk of one token looks like a decode: no graph for it
            and not constrained
            and not score
            and len(sampling) == len(out.requests)
            and all(
                plain_greedy(r.sampling_params) and r.request_id not in min_token_stop_ids
                for r in sampling
            )
        )
        # prompt logprobs to score, embeddings to pool: the hidden states are kept
        eager = bool(score) or any(r.pooling is not None for r in out.requests)
        # with other ranks, whether the forward replays a decode graph is decided here once, for
        # all of them (alone, the forward tries the graphs itself)
        replay = self.ranks is None or (
            not eager and layers is None and self._graph_bucket(out) is not None
        )
        with self._collective():
            if self.ranks is not None:  # the other ranks make the same forward calls (follow)
                no_graph = eager or layers is not None
                self.ranks.send(RankStep.of(out, replay, no_graph, score or {}))
            ran = self._graph_forward(out) if graph_argmax and replay else None
            logits = (
                None
                if ran is not None
                else self.forward_logits(out, eager, layers, allow_graph=replay)
            )
        if ran is not None:  # the graph's own argmax is the token: one read, no sampler
            (ids,) = self.reader.read(ran[1])
            if len(ids) == len(sampling):  # no drafts: a token each
                return {r.request_id: [SampledToken(t)] for r, t in zip(sampling, ids, strict=True)}
            return keep_drafts(sampling, [SampledToken(t) for t in ids])
        if logits is None or not sampling:
            return {}
        allowed = grammars.fill(rids) if grammars is not None and constrained else None
        if any(r.num_spec for r in sampling):
            return sample_with_drafts(
                logits, sampling, min_token_stop_ids, allowed, read=self.reader.read
            )
        tokens = sample(
            logits,
            [r.sampling_params for r in sampling],
            [r.output_token_ids for r in sampling],
            [r.prompt_token_ids for r in sampling],
            [min_token_stop_ids.get(r.request_id, []) for r in sampling],
            read=self.reader.read,
            allowed=allowed,
        )
        return {r.request_id: [tok] for r, tok in zip(sampling, tokens, strict=True)}

    @torch.inference_mode()
    def pool(self, out: SchedulerOutput) -> dict[str, list[float]]:
        """After ``execute(out, ...)``: each embedding's chunk in this step goes to the pooler;
        the vectors of those whose prompt this step finished (float32 values)."""
        hidden = self._hidden
        if hidden is None:
            return {}
        done: dict[str, torch.Tensor] = {}
        for i, r in enumerate(out.requests):
            if r.pooling is None:
                continue
            rows = hidden[self._starts[i] : self._starts[i] + r.num_new_tokens]  # [n, H]
            vec = self.pooler.add(r.request_id, r.pooling, rows, r.start_pos,
                                  len(r.prompt_token_ids), final=r.sample)  # fmt: skip
            if vec is not None:
                done[r.request_id] = vec
        if not done:
            return {}
        return dict(zip(done, self.reader.read(*done.values()), strict=True))

    @torch.inference_mode()
    def score_prompts(
        self, out: SchedulerOutput, wanted: dict[str, int]
    ) -> dict[str, list[PromptTokenScore]]:
        """After ``execute(out, ..., score=wanted)``: each scored request's prompt tokens that
        this step's chunk predicts (the token at q + 1 from position q's logits), a slice of
        rows at a time so [prompt, vocab] logits never exist at once."""
        hidden = self._hidden
        if hidden is None:
            return {}
        with self._collective():
            return self._score(hidden, out, wanted)

    def _score(
        self, hidden: torch.Tensor, out: SchedulerOutput, wanted: dict[str, int]
    ) -> dict[str, list[PromptTokenScore]]:
        rows: list[int] = []
        owners: list[tuple[str, int, int, int]] = []  # request, position, token, top-N
        for i, r in enumerate(out.requests):
            if r.request_id not in wanted:
                continue
            last = min(r.start_pos + r.num_new_tokens, len(r.prompt_token_ids) - 1)
            for q in range(r.start_pos, last):
                rows.append(self._starts[i] + q - r.start_pos)
                owners.append(
                    (r.request_id, q + 1, r.prompt_token_ids[q + 1], wanted[r.request_id])
                )
        scores: dict[str, list[PromptTokenScore]] = {}
        k = max(wanted.values(), default=0)
        for a in range(0, len(rows), PROMPT_SCORE_ROWS):
            part = owners[a : a + PROMPT_SCORE_ROWS]
            read = self._score_rows(
                hidden, rows[a : a + PROMPT_SCORE_ROWS], [o[2] for o in part], k
            )
            for (rid, pos, token, n), (lp, rank, ids, vals) in zip(part, read, strict=True):
                top = tuple(zip(ids[:n], vals[:n], strict=True))
                scores.setdefault(rid, []).append(PromptTokenScore(pos, token, lp, rank, top))
        return scores

    def _score_rows(
        self, hidden: torch.Tensor, rows: list[int], targets: list[int], k: int
    ) -> list[tuple[float, int, list[int], list[float]]]:
        dev = hidden.device
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=dev)])  # [r, V]
        logp = logits.float().log_softmax(-1)
        target = torch.tensor(targets, device=dev)
        chosen = logp.gather(-1, target[:, None]).squeeze(-1)  # [r]
        rank = (logp > chosen[:, None]).sum(-1) + 1  # [r]
        if k:
            top_vals, top_ids = logp.topk(k, dim=-1)  # [r, k]
            lp, rk, ids, vals = self.reader.read(chosen, rank, top_ids, top_vals)
        else:
            (lp, rk), ids, vals = self.reader.read(chosen, rank), [[]] * len(rows), [[]] * len(rows)
        return list(zip(lp, rk, ids, vals, strict=True))


def plain_greedy(sp: SamplingParams) -> bool:
    """Greedy with nothing for the sampler to do: no logprobs, no penalties, no logit_bias."""
    return sp.greedy and launchable(sp)


def launchable(sp: SamplingParams) -> bool:
    """Sampling the device does alone (greedy or drawn, with temperature, top-k/p, min-p and
    seeds): no logprobs to read back, no penalties or logit_bias over the host's token lists."""
    return sp.logprobs is None and not sp.adjusts_logits
