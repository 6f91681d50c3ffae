"""The offline API: ``LLM(model).generate(prompts, params)``, like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from protos.logprobs import PositionLogprobs
from protos.multimodal import ImageItem, place_images
from protos.pooling_params import PoolingParams
from protos.sampling_params import InvalidRequestError, SamplingParams
from services.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from services.engine.llm_engine import LLMEngine

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from typing_extensions import TypeIs


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why, when finish_reason is "error"


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # prompt_logprobs: None for the first position, then each prompt token's (vLLM's layout)
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class EmbeddingResult:
    """vLLM's ``EmbeddingRequestOutput``, flattened: the prompt and its pooled vector."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    num_cached_tokens: int = 0


Prompt = str | list[int] | dict[str, Any]


def _is_one_prompt(prompts: Prompt | Sequence[Prompt]) -> TypeIs[Prompt]:
    """A single prompt (text, a dict, or a non-empty list of token ids), not a batch of them."""
    if isinstance(prompts, str | dict):
        return True
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)


class LLM:
    def __init__(
        self, model: str = "embedded", *, config: EngineConfig | None = None, **knobs: Any
    ) -> None:
        self.engine = LLMEngine(config or build_config(model, **knobs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._closed = False

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks and give its KV pools (a draft
        model's too) and decode graphs back to the GPU at once, whatever still refers to this
        object (an engine made next in the same process sizes its pool from the memory free
        then). The LLM cannot generate after this."""
        self.engine.close()
        self.engine.runner.release_kv_cache()
        draft = getattr(self.engine.proposer, "runner", None)  # a draft model's own pool
        if draft is not None:
            draft.release_kv_cache()
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was closed (its KV pool is given back): make a new one")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict) and "messages" in prompt:
            return self.apply_chat_template(prompt["messages"])
        text_or_ids: str | Sequence[int]
        if isinstance(prompt, dict):
            text_or_ids = prompt.get("prompt_token_ids") or prompt["prompt"]
        else:
            text_or_ids = prompt
        if isinstance(text_or_ids, str):
            return list(self.tokenizer.encode(text_or_ids))
        return list(text_or_ids)

    def encode_with_images(self, prompt: Prompt) -> tuple[list[int], tuple[ImageItem, ...]]:
        """The prompt's ids with each image placeholder expanded, and its images: a dict prompt
        may carry ``multi_modal_data={"image": [encoded image bytes, ...]}`` (vLLM's key)."""
        ids = self.encode(prompt)
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        images = list((data or {}).get("image") or [])
        if isinstance(data, dict) and isinstance(data.get("image"), bytes):
            images = [data["image"]]
        if not images:
            return ids, ()
        spec = self.engine.vision_spec
        if spec is None:
            arch = self.engine.runner.arch
            why = (
                f"is served for its language model only ({arch.language_only})"
                if arch.language_of
                else "is a text-only model"
            )
            raise InvalidRequestError(
                f"{self.engine.model_name} {why}: it takes no images", "prompt"
            )  # fmt: skip
        return place_images(ids, spec, images)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        enc = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True
        )
        return list(enc["input_ids"])

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        self._check_open()
        plist: list[Prompt] = [prompts] if _is_one_prompt(prompts) else list(prompts)
        params = params or SamplingParams()
        per = params if isinstance(params, list) else [params] * len(plist)
        results: dict[str, GenerationResult] = {}
        sub: dict[str, tuple[GenerationResult, CompletionOutput]] = {}
        for prompt, sp in zip(plist, per, strict=True):
            rid = str(next(self._ids))
            ids, images = self.encode_with_images(prompt)
            res = GenerationResult(rid, ids, [CompletionOutput(i) for i in range(sp.n)])
            results[rid] = res
            for i in range(sp.n):
                seeded = sp if sp.seed is None else replace(sp, seed=sp.seed + i)
                self.engine.add_request(f"{rid}-{i}", ids, replace(seeded, n=1), images=images)
                sub[f"{rid}-{i}"] = (res, res.outputs[i])
        while self.engine.has_unfinished:
            for out in self.engine.step():
                res, comp = sub[out.request_id]
                comp.token_ids.extend(out.token_ids)
                comp.text += out.text
                comp.logprobs.extend(out.logprobs)
                res.num_cached_tokens = max(res.num_cached_tokens, out.num_cached_tokens)
                if out.prompt_logprobs and res.prompt_logprobs is None:
                    res.prompt_logprobs = [None, *out.prompt_logprobs]
                if out.finished:
                    comp.finish_reason, comp.stop_reason = out.finish_reason, out.stop_reason
                    comp.error = out.error
        return list(results.values())

    def embed(
        self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None
    ) -> list[EmbeddingResult]:
        """Each prompt's pooled final hidden state (an engine built with ``task="embed"``;
        ``pooling``: the engine's ``pooler_config`` when not given)."""
        self._check_open()
        plist: list[Prompt] = [prompts] if _is_one_prompt(prompts) else list(prompts)
        results: dict[str, EmbeddingResult] = {}
        for prompt in plist:
            rid = f"embed-{next(self._ids)}"
            ids = self.encode(prompt)
            results[rid] = EmbeddingResult(rid, ids, [])
            self.engine.add_embedding(rid, ids, pooling)
        while self.engine.has_unfinished:
            for out in self.engine.step():
                res = results[out.request_id]
                res.embedding = out.embedding or []
                res.num_cached_tokens = out.num_cached_tokens
        return list(results.values())

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | None = None,
    ) -> list[GenerationResult]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([{"messages": m} for m in convs], params)


def build_config(model: str = "embedded", **knobs: Any) -> EngineConfig:
    """An EngineConfig from vLLM-style keyword arguments (max_model_len=..., block_size=...)."""
    groups: dict[type[DataclassInstance], dict[str, Any]] = {
        ModelConfig: {},
        CacheConfig: {},
        SchedulerConfig: {},
    }
    top: dict[str, Any] = {}
    for key, value in knobs.items():
        if key == "speculative_config":  # vLLM's name: a dict (or its JSON)
            top["speculative"] = SpeculativeConfig.parse(value)
            continue
        if key == "pooler_config":
            top["pooler"] = PoolerConfig.parse(value)
            continue
        if key == "lora_config":  # a LoRAConfig (--enable-lora), or None
            top["lora"] = value
            if value is not None:
                groups[SchedulerConfig]["max_loras"] = value.max_loras
            continue
        key = {
            "max_num_batched_tokens": "max_num_batched_tokens",
            "scheduling_policy": "policy",
        }.get(key, key)
        for cls, bucket in groups.items():
            if key in cls.__dataclass_fields__:
                bucket[key] = value
                break
        else:
            if key not in EngineConfig.__dataclass_fields__:
                raise TypeError(f"unknown engine option {key!r}")
            top[key] = value
    return EngineConfig(
        model=ModelConfig(model=model, **groups[ModelConfig]),
        cache=CacheConfig(**groups[CacheConfig]),
        scheduler=SchedulerConfig(**groups[SchedulerConfig]),
        **top,
    )


def config_from_args(args: Any) -> EngineConfig:
    """An EngineConfig from the CLI's engine flags (services.cli.add_engine_args)."""
    return build_config(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        quantization=getattr(args, "quantization", None),
        max_model_len=args.max_model_len,
        seed=args.seed,
        dummy_weight_seed=getattr(args, "dummy_weight_seed", None),
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_gib=args.kv_cache_gib,
        kv_offloading_gib=getattr(args, "kv_offloading_gib", 0.0),
        kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
        num_blocks=args.num_blocks,
        max_total_tokens=getattr(args, "max_total_tokens", None),
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=args.scheduling_policy,
        async_scheduling=getattr(args, "async_scheduling", None),
        device=args.device,
        enforce_eager=args.enforce_eager,
        speculative_config=getattr(args, "speculative_config", None),
        task=getattr(args, "task", "generate"),
        pooler_config=getattr(args, "pooler_config", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        lora_config=LoRAConfig.from_args(args),
    )
