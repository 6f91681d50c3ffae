"""Frozen configuration of each component, validated where it is built.

Torch-free, so the gateway, the CLI and the scheduler can all read it.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from protos.auth import token_from
from protos.errors import ConfigError
from protos.pooling_params import POOLING_TYPES, TASKS
from protos.roles import Role

QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "compressed-tensors")
# a worker whose engine has been in one step (or command) this long stops serving (health
# NOT_SERVING: the gateway ends or moves its streams) until the step returns
ENGINE_STALL_TIMEOUT_S = 120.0
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class ModelConfig:
    model: str = "embedded"  # "embedded", an HF directory, a .gguf file or a named config
    load_format: str = "auto"  # auto | dummy
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the model's own limit
    # the engine's random seed (--seed, vLLM's): the noise of requests without a seed of their
    # own (the same seed and sequence of requests, the same output) and dummy weights; None: a
    # fresh draw each run
    seed: int | None = None
    dummy_weight_seed: int | None = None  # the random weights' own seed (None: seed's, else 0)
    # fp8 | awq | gptq | compressed-tensors; None: the checkpoint's quantization_config, if any
    quantization: str | None = None

    @property
    def weights_seed(self) -> int:
        """The seed of --load-format dummy's random weights."""
        if self.dummy_weight_seed is not None:
            return self.dummy_weight_seed
        return self.seed if self.seed is not None else 0

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "dummy", "hf", "gguf"):
            raise ConfigError(
                f"--load-format must be auto, dummy, hf or gguf, got {self.load_format!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be positive, got {self.max_model_len}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ConfigError(
                f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"got {self.quantization!r}"
            )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9  # fraction of the GPU the worker may use
    kv_cache_gib: float | None = None  # explicit KV pool size (CPU default: one max_model_len)
    num_blocks: int | None = None  # explicit block count, overrides the two above
    # at most this many tokens in the pool (SGLang's --max-total-tokens), never fewer than one
    # sequence of max_model_len; --num-blocks overrides it. tandem up caps a prefill worker that
    # shares its GPU with a decode worker, so the decode worker gets the memory
    max_total_tokens: int | None = None
    enable_prefix_caching: bool = True
    # the prefix cache's host tier: blocks the device pool evicts are kept in this much host
    # memory and copied back on a later hit (0: off)
    kv_offloading_gib: float = 0.0
    # the KV cache's element type: auto (the model's dtype) or fp8 (e4m3; fp8_e4m3 is vLLM's
    # other name for it): half a 16-bit cache's bytes, so twice the blocks for the same memory
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(
                f"--block-size must be one of 8, 16, 32, 64, 128, got {self.block_size}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_gib is not None and not 0 < self.kv_cache_gib < math.inf:
            raise ConfigError(
                f"--kv-cache-gib must be a positive, finite number of GiB, got {self.kv_cache_gib}"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"--num-blocks must be positive, got {self.num_blocks}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ConfigError(f"--max-total-tokens must be positive, got {self.max_total_tokens}")
        if not 0 <= self.kv_offloading_gib < math.inf:
            raise ConfigError(f"--kv-offloading-size must be >= 0, got {self.kv_offloading_gib}")
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ConfigError("--kv-cache-dtype fp8_e5m2 is not supported: use fp8 (e4m3), which "
                              "keeps more precision for the same bytes")  # fmt: skip
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.kv_offloading_gib and not self.enable_prefix_caching:
            raise ConfigError("--kv-offloading-size keeps prefix-cache blocks: it needs prefix "
                              "caching (drop --no-enable-prefix-caching)")  # fmt: skip


GPU_TOKEN_BUDGET = 8192
# Upper bounds on the batch flags, checked when the flags are parsed. The engine sizes a step's
# input buffers for them up front (services.engine.input_staging: a block table row of up to
# max_model_len / block_size ids per sequence, three int64 ids per token), so a huge value was
# an allocation failure's traceback while the worker started. 65536 sequences are 256 times the
# default batch (at a 131072-token max_model_len their block tables alone take 2 GiB of pinned
# host memory and as much on the device); 2**20 tokens a step are eight of the longest sequence
# the engine serves (131072 positions).
MAX_NUM_SEQS = 1 << 16
MAX_NUM_BATCHED_TOKENS = 1 << 20
# a step of this many prompt tokens stays well under a second on a small CPU (SmolLM2-135M, two
# cores): an abort, a new request or a KV hand-off never waits long for the step in progress
CPU_TOKEN_BUDGET = 128


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # tokens per step (the chunk of a long prompt); None: by device, see with_device_defaults
    max_num_batched_tokens: int | None = None
    policy: str = "fcfs"  # fcfs | priority
    long_prefill_token_threshold: int = 0  # 0: a prompt may take the whole budget
    # --max-loras: the most distinct adapters in one step (the device's slots); 0: no LoRA
    max_loras: int = 0
    # --async-scheduling: a decode step is scheduled and queued on the device
    # while the one before it runs (its tokens are the input ids, never read in between).
    # None: on a GPU only (on the CPU the step queued ahead has run before the last one's tokens
    # are read, so it only holds them back a step); True: on the CPU too (tests of the path)
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_num_seqs <= MAX_NUM_SEQS:
            raise ConfigError(
                f"--max-num-seqs must be in [1, {MAX_NUM_SEQS}], got {self.max_num_seqs}"
            )
        tokens = self.max_num_batched_tokens
        if tokens is not None and not 1 <= tokens <= MAX_NUM_BATCHED_TOKENS:
            raise ConfigError(
                f"--max-num-batched-tokens must be in [1, {MAX_NUM_BATCHED_TOKENS}], got {tokens}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"--scheduling-policy must be fcfs or priority, got {self.policy!r}")

    @property
    def token_budget(self) -> int:
        """Tokens per step (the GPU default until :func:`with_device_defaults` picks one)."""
        return self.max_num_batched_tokens or GPU_TOKEN_BUDGET


SPEC_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min",
              "prompt_lookup_max", "disable_by_batch_size"}  # fmt: skip
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config``: ``method`` "ngram" proposes the tokens that followed the
    latest earlier occurrence of the sequence's last n tokens (n from ``prompt_lookup_max`` down
    to ``prompt_lookup_min``) in its prompt and output; "draft_model" runs ``model`` (a smaller
    model with the target's tokenizer) greedily for K steps. One target pass verifies them."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # no drafts while this many requests (or more) are decoding; None: the engine's row limit only
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model (method "draft_model"), as --model takes it

    def __post_init__(self) -> None:
        if self.method == "draft_model" and not self.model:
            raise ConfigError(
                '--speculative-config method "draft_model" needs "model": the draft model'
            )
        if self.method != "draft_model" and self.model is not None:
            raise ConfigError('--speculative-config "model" is for method "draft_model"')
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                f"--speculative-config method must be one of {', '.join(SPEC_METHODS)}, "
                f"got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                "--speculative-config num_speculative_tokens must be in [1, 16], got "
                f"{self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "--speculative-config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )

    @classmethod
    def parse(cls, text: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From the flag's JSON (or a dict); None for no flag. Unknown keys are refused."""
        if text is None or text == "":
            return None
        if isinstance(text, str):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        else:
            data = text
        if not isinstance(data, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        unknown = sorted(set(data) - _SPEC_KEYS)
        if unknown:
            raise ConfigError(
                f"--speculative-config key(s) not supported: {', '.join(unknown)} (supported: "
                f"{', '.join(sorted(_SPEC_KEYS))})"
            )
        if data.get("model") in ("ngram", "[ngram]") and data.get("method", "ngram") in (
            "ngram",
            "[ngram]",
        ):  # vLLM's older spelling of n-gram lookup: "model": "ngram" (no draft model)
            data = {k: v for k, v in data.items() if k != "model"} | {"method": "ngram"}
        if data.get("method") == "[ngram]":
            data = {**data, "method": "ngram"}
        if "method" not in data and "model" in data:  # vLLM infers the method from the model
            data = {**data, "method": "draft_model"}
        if "model" in data and data.get("method", cls.method) != "draft_model":
            raise ConfigError('--speculative-config "model" is for method "draft_model"')
        if data.get("method") == "draft_model":
            lookup = [k for k in _NGRAM_KEYS if k in data]
            if lookup:
                raise ConfigError(
                    f'--speculative-config {lookup[0]} is for method "ngram", not "draft_model"'
                )
            if not isinstance(data.get("model"), str):
                raise ConfigError(
                    '--speculative-config method "draft_model" needs "model": the draft model '
                    "(a directory, a .gguf file or a name, as --model takes it)"
                )
        off_at = data.get("disable_by_batch_size")
        if off_at is not None and (
            not isinstance(off_at, int) or isinstance(off_at, bool) or off_at < 1
        ):
            raise ConfigError(
                "--speculative-config disable_by_batch_size must be a positive integer"
            )
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            if key in data and (not isinstance(data[key], int) or isinstance(data[key], bool)):
                raise ConfigError(f"--speculative-config {key} must be an integer")
        if "prompt_lookup_max" in data and "prompt_lookup_min" not in data:
            data["prompt_lookup_min"] = min(cls.prompt_lookup_min, data["prompt_lookup_max"])
        if "prompt_lookup_min" in data and "prompt_lookup_max" not in data:
            data["prompt_lookup_max"] = max(cls.prompt_lookup_max, data["prompt_lookup_min"])
        return cls(**data)


_POOLER_KEYS = ("pooling_type", "normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's ``--pooler-config`` of an embedding worker (``--task embed``): how the final
    hidden states of a prompt become one vector. vLLM's defaults for a causal LM: the last
    token, L2-normalized."""

    pooling_type: str = "last"  # last | mean | cls
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ConfigError(
                f"--pooler-config pooling_type must be one of {', '.join(POOLING_TYPES)} (any "
                f"case), got {self.pooling_type!r}"
            )

    @classmethod
    def parse(cls, text: str | dict[str, Any] | None) -> PoolerConfig:
        """From the flag's JSON (or a dict); the defaults for no flag. Unknown keys are refused."""
        if text is None or text == "":
            return cls()
        try:
            data = json.loads(text) if isinstance(text, str) else text
        except json.JSONDecodeError as e:
            raise ConfigError(f"--pooler-config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError("--pooler-config must be a JSON object")
        unknown = sorted(set(data) - set(_POOLER_KEYS))
        if unknown:
            raise ConfigError(
                f"--pooler-config key(s) not supported: {', '.join(unknown)} (supported: "
                f"{', '.join(_POOLER_KEYS)})"
            )
        kind = data.get("pooling_type", cls.pooling_type)
        normalize = data.get("normalize", cls.normalize)
        if not isinstance(kind, str):
            raise ConfigError("--pooler-config pooling_type must be a string (LAST, MEAN, CLS)")
        if not isinstance(normalize, bool):
            raise ConfigError("--pooler-config normalize must be true or false")
        return cls(pooling_type=kind.lower(), normalize=normalize)


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def check_adapter_dir(name: str, root: Path) -> None:
    """ConfigError unless ``root`` holds a peft adapter's two files; torch-free, so that
    ``tandem up`` checks before it starts a worker, and the worker's reader as it loads."""
    if not (root / ADAPTER_CONFIG).is_file():
        raise ConfigError(
            f"LoRA adapter {name!r}: {root} is not a peft adapter directory (no {ADAPTER_CONFIG})"
        )
    if not (root / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"LoRA adapter {name!r}: {root} has no {ADAPTER_WEIGHTS} (save the "
                          "adapter with safetensors)")  # fmt: skip


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's LoRA flags: ``--enable-lora`` serves peft adapters beside the base model, the
    request's ``model`` naming one; ``modules``: (name, directory) of ``--lora-modules``;
    ``max_loras`` adapters are resident on the device at once (slots, and the most distinct
    adapters in one step); ``max_lora_rank`` the largest rank a slot holds; ``base_models``:
    (name, base model) of the entries that named their base model (vLLM's JSON form's
    ``base_model_name``), which must be the model served."""

    modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    allow_runtime_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    base_models: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be at least 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ConfigError(f"--max-lora-rank must be in [1, 512], got {self.max_lora_rank}")
        names = [name for name, _ in self.modules]
        for name, path in self.modules:
            if not name or not path:
                raise ConfigError(f"--lora-modules takes NAME=PATH, got {name!r}={path!r}")
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"--lora-modules names an adapter twice: {', '.join(dup)}")

    @classmethod
    def from_args(cls, args: Any) -> LoRAConfig | None:
        """The LoRA flags (``services.cli.add_lora_args``); None without --enable-lora."""
        modules = getattr(args, "lora_modules", None)
        runtime = getattr(args, "allow_runtime_lora_updating", False)
        if not getattr(args, "enable_lora", False):
            if modules or runtime:
                flag = "--lora-modules" if modules else "--allow-runtime-lora-updating"
                raise ConfigError(f"{flag} needs --enable-lora")
            return None
        entries = [cls._parse_module(item) for item in modules or ()]
        return cls(
            modules=tuple((name, path) for name, path, _ in entries),
            base_models=tuple((name, base) for name, _, base in entries if base),
            max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank,
            allow_runtime_updating=runtime,
        )

    def check_with(self, tensor_parallel_size: int, task: str) -> None:
        """What LoRA serving cannot be combined with yet: ConfigError. Torch-free, so that
        ``tandem up`` refuses it before it starts a worker."""
        if tensor_parallel_size > 1 and self.allow_runtime_updating:
            raise ConfigError(
                "--allow-runtime-lora-updating (adapters loaded at run time) with "
                "--tensor-parallel-size > 1 is not supported yet: name the adapters with "
                "--lora-modules"
            )
        if task != "generate":
            raise ConfigError("--enable-lora serves generation adapters: not with --task embed")

    def check_names(self, *base_names: str | None) -> None:
        """No adapter is named as the base model (``--model``, ``--served-model-name``): the
        gateway takes such a name for the base model, so the adapter could never be asked for;
        and an adapter's ``base_model_name``, where given, is one of those names (one base
        model is served: an adapter trained on another would be applied to the wrong one)."""
        names = {n for n in base_names if n}
        clash = sorted({name for name, _ in self.modules} & names)
        if clash:
            raise ConfigError(
                f"--lora-modules name {clash[0]!r} is the base model's name (--model or "
                "--served-model-name): requests naming it get the base model; name the adapter "
                "otherwise"
            )
        for name, base in self.base_models:
            if base not in names:
                raise ConfigError(
                    f"--lora-modules entry {name!r}: base_model_name {base!r} is not the model "
                    f"served ({', '.join(repr(n) for n in sorted(names))}, from --model or "
                    "--served-model-name); name the served model or leave base_model_name out"
                )

    def check_directories(self) -> None:
        """Each ``--lora-modules`` path is a peft adapter directory on this machine."""
        for name, path in self.modules:
            check_adapter_dir(name, Path(path))

    @staticmethod
    def _parse_module(item: str) -> tuple[str, str, str]:
        """One ``--lora-modules`` entry as (name, path, base model name or ""): ``NAME=PATH``,
        or vLLM's JSON form, ``{"name": ..., "path": ..., "base_model_name": ...}``."""
        if item.lstrip().startswith("{"):
            return LoRAConfig._json_module(item)
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--lora-modules takes NAME=PATH entries, got {item!r}")
        return name.strip(), path.strip(), ""

    @staticmethod
    def _json_module(item: str) -> tuple[str, str, str]:
        try:
            data = json.loads(item)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--lora-modules entry {item!r} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--lora-modules entry {item!r} must be a JSON object")
        unknown = sorted(set(data) - {"name", "path", "base_model_name"})
        if unknown:
            raise ConfigError(f"--lora-modules entry {item!r}: key(s) not supported: "
                              f"{', '.join(unknown)} (supported: name, path, base_model_name)")  # fmt: skip
        name, path, base = data.get("name"), data.get("path"), data.get("base_model_name")
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f'--lora-modules entry {item!r} needs "name", a string')
        if not isinstance(path, str) or not path.strip():
            raise ConfigError(f'--lora-modules entry {item!r} needs "path", a string')
        if base is not None and not isinstance(base, str):
            raise ConfigError(f"--lora-modules entry {item!r}: base_model_name must be a string")
        return name.strip(), path.strip(), (base or "").strip()


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    enforce_eager: bool = False  # no CUDA graphs
    speculative: SpeculativeConfig | None = None
    # generate: completions and chats; embed: prefill only, a pooled vector per prompt
    task: str = "generate"
    pooler: PoolerConfig = PoolerConfig()  # how an embed worker pools
    tensor_parallel_size: int = 1  # ranks (processes, GPUs) that split the model
    lora: LoRAConfig | None = None  # --enable-lora: adapters served beside the base model

    def __post_init__(self) -> None:
        self._check_lora()
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.task not in TASKS:
            raise ConfigError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.task == "embed" and self.speculative is not None:
            raise ConfigError("--speculative-config drafts tokens to decode: it does not apply "
                              "to --task embed")  # fmt: skip
        if self.tensor_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size must be at least 1")

    def _check_lora(self) -> None:
        if self.lora is None:
            return
        self.lora.check_with(self.tensor_parallel_size, self.task)
        if self.scheduler.max_loras != self.lora.max_loras:
            raise ConfigError("the scheduler's max_loras must be --max-loras")


def with_device_defaults(
    config: EngineConfig, device_type: str, min_budget: int = 0
) -> EngineConfig:
    """Fills what depends on the device: the token budget of a step (short on the CPU); where
    that is below ``min_budget`` (what one step must hold: a Gemma 3 image's tokens), the two
    added."""
    if config.scheduler.max_num_batched_tokens is not None:
        return config
    budget = GPU_TOKEN_BUDGET if device_type == "cuda" else CPU_TOKEN_BUDGET
    if budget < min_budget:  # one image and the usual step beside it: the requests decoding
        budget += min_budget  # do not hold the image back until they finish
    return replace(config, scheduler=replace(config.scheduler, max_num_batched_tokens=budget))


def check_pooler_flag(args: Any) -> None:
    """``--pooler-config`` says how ``--task embed`` pools: beside ``--task generate`` nothing
    would read it, so it is refused rather than ignored."""
    if getattr(args, "pooler_config", None) and getattr(args, "task", "generate") != "embed":
        raise ConfigError(
            "--pooler-config is for --task embed (how an embedding pools); this worker "
            "generates: add --task embed or leave --pooler-config out"
        )


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process (``tandem prefill|decode|worker``): its server, its KV endpoint and
    its engine, read once from the flags; servicers see this, never the argparse namespace."""

    role: Role
    engine: EngineConfig
    worker_id: str  # names it in logs, load reports and metrics
    host: str = "127.0.0.1"
    port: int = 0  # gRPC; 0 picks a free one
    ready_file: str | None = None  # where the bound ports are written once the model is loaded
    internal_token: str = ""  # required on every RPC but health checks when not empty
    lease_timeout_s: float = 6.0  # an owner silent this long loses its unclaimed reservations
    grpc_reflection: bool = False
    drain_timeout_s: float = 30.0
    engine_stall_timeout_s: float = ENGINE_STALL_TIMEOUT_S  # 0: never
    kv_host: str = ""  # the KV endpoint's address, advertised to prefill workers ("" = host)
    kv_port: int = 0
    kv_timeout_s: float = 10.0  # a KV transfer's I/O timeout; a Decode call's default KV wait
    kv_checksum: bool = False
    # prefill: ship each prompt's KV layer by layer while its last chunk is computed (False:
    # the whole KV after the first token; None: by device, streaming_on)
    kv_streaming: bool | None = None

    def streaming_on(self, device_type: str) -> bool:
        """Whether a prefill worker on ``device_type`` streams its KV out: ``--kv-streaming``,
        or by default only off a GPU. Between two H200s (2026-11-29) a streamed transfer's
        receives and layer-by-layer host work beside the engines gave no earlier first token
        than the whole KV sent after it and made the decode steps up to 1.7x slower; on one
        GPU the whole KV lands in ~0.2 ms (blocks granted ahead)."""
        return self.kv_streaming if self.kv_streaming is not None else device_type != "cuda"

    def __post_init__(self) -> None:
        if self.role is Role.PREFILL and getattr(self.engine, "speculative", None) is not None:
            raise ConfigError(
                "--speculative-config is for decode and colocated workers: a prefill worker "
                "decodes nothing (the decode worker drafts, and catches its draft model up on "
                "the prompt itself); leave it off tandem prefill"
            )
        if self.engine.task == "embed" and self.role is not Role.COLOCATED:
            raise ConfigError(
                f"--task embed is served by a colocated worker (tandem worker --task embed, or "
                f"tandem up --colocated N --task embed), not by a {self.role} worker: an "
                "embedding is one prefill, with nothing to hand to a decode worker"
            )

    @classmethod
    def from_args(cls, args: Any, role: Role, engine: EngineConfig) -> WorkerConfig:
        """From the flags of services.cli.add_server_args (the engine's already built)."""
        check_pooler_flag(args)
        return cls(
            role=role,
            engine=engine,
            worker_id=args.worker_id or f"{role}-{uuid.uuid4().hex[:8]}",
            host=args.host,
            port=args.port,
            ready_file=args.ready_file,
            internal_token=token_from(getattr(args, "internal_token", None)),
            lease_timeout_s=getattr(args, "lease_timeout", 6.0),
            grpc_reflection=getattr(args, "grpc_reflection", False),
            drain_timeout_s=args.drain_timeout,
            engine_stall_timeout_s=getattr(args, "engine_stall_timeout", ENGINE_STALL_TIMEOUT_S),
            kv_host=getattr(args, "kv_host", None) or "",
            kv_port=getattr(args, "kv_port", 0) or 0,
            kv_timeout_s=args.kv_timeout,
            kv_checksum=getattr(args, "kv_checksum", False),
            kv_streaming={"on": True, "off": False}.get(getattr(args, "kv_streaming", "auto")),
        )
