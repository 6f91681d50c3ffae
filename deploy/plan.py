"""What `tandem up` starts: pure functions from the parsed flags to child command lines.

No process is started here, so every decision (GPU placement, threads, forwarded engine flags,
gateway targets) is unit-tested without spawning anything.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.supervisor import ChildSpec
from gateway.core.config import (
    CORS_ANY,
    MAX_BODY_BYTES,
    MEDIA_FETCH_TIMEOUT_S,
    MEDIA_MAX_BYTES,
    RESPONSES_STORE_MAX_BYTES,
    RESPONSES_STORE_SIZE,
    SEND_TIMEOUT_S,
    WORKER_STALL_TIMEOUT_S,
    check_drain_timeout,
    check_metrics_prefix,
    check_send_timeout,
    check_worker_stall_timeout,
    media_domain,
    parse_default_chat_template_kwargs,
    parse_mm_limit,
)
from gateway.flows.chat_output import check_parser_flags
from services.cli import add_engine_args, add_request_limit_args
from services.config import (
    ENGINE_STALL_TIMEOUT_S,
    GPU_TOKEN_BUDGET,
    ConfigError,
    LoRAConfig,
    check_pooler_flag,
)
from services.model_files import base_model_names

DEFAULT_PROGRAM = (sys.executable, "-m", "services.cli")
LOOPBACK = "127.0.0.1"
_NOT_FORWARDED = {"help", "device"}  # the launcher decides the device itself


@dataclass(frozen=True)
class Worker:
    spec: ChildSpec
    role: str  # prefill | decode | worker
    gpus: tuple[str, ...]  # CUDA_VISIBLE_DEVICES entries; empty on the CPU
    # a decode worker sharing its GPU with prefill workers: started once these are ready, its
    # --gpu-memory-utilization then set to what they leave of the GPU (fill_utilization),
    # split between the ``fill_share`` decode workers on that GPU
    fill_after: tuple[str, ...] = ()
    fill_share: int = 1


@dataclass(frozen=True)
class Plan:
    prepare_argv: list[str]
    workers: list[Worker]
    gateway_argv: list[str]  # without the worker targets and the tokenizer
    gateway_env: dict[str, str]
    gateway_ready_file: Path
    device: str  # cpu or cuda (or what the user forced)
    host: str
    port: int
    model: str
    drain_timeout_s: float = 30.0  # passed to the gateway; the launcher's stop grace follows it
    task: str = "generate"  # --task: what the ready message's example asks for

    def count(self, role: str) -> int:
        return sum(w.role == role for w in self.workers)

    def summary(self) -> str:
        roles = ("worker",) if self.count("worker") else ("prefill", "decode")
        parts = [f"{self.count(r)} {'colocated' if r == 'worker' else r}" for r in roles]
        return " + ".join(["gateway", *parts])


def engine_flags(
    args: argparse.Namespace, overrides: Mapping[str, object] | None = None
) -> list[str]:
    """The engine flags whose values differ from their defaults, as a command line."""
    probe = argparse.ArgumentParser(add_help=False)
    add_engine_args(probe)
    values = {**vars(args), **(overrides or {})}
    out: list[str] = []
    for action in probe._actions:
        if action.dest in _NOT_FORWARDED or not action.option_strings:
            continue
        value = values.get(action.dest, action.default)
        if value == action.default:
            continue
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(value, list | tuple):  # nargs="+" (--lora-modules)
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def task_flags(args: argparse.Namespace) -> list[str]:
    """``--task`` and ``--pooler-config`` when they differ from the defaults."""
    check_pooler_flag(args)
    out = []
    if getattr(args, "task", "generate") != "generate":
        out += ["--task", args.task]
    if getattr(args, "pooler_config", None):
        out += ["--pooler-config", args.pooler_config]
    return out


def role_names(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, role) of every worker, prefill before decode."""
    if args.colocated > 0:
        return [(f"worker-{i}", "worker") for i in range(args.colocated)]
    if getattr(args, "task", "generate") == "embed":
        raise ConfigError(
            "--task embed is served by colocated workers: add --colocated N (an embedding is "
            "one prefill, with nothing to hand to a decode worker)"
        )
    if args.prefill < 1 or args.decode < 1:
        raise ConfigError("--prefill and --decode must both be >= 1 (or use --colocated N)")
    return [(f"prefill-{i}", "prefill") for i in range(args.prefill)] + [
        (f"decode-{i}", "decode") for i in range(args.decode)
    ]


def tensor_parallel_sizes(args: argparse.Namespace, roles: Sequence[str]) -> list[int]:
    """Each worker's --tensor-parallel-size: its role's own flag, else the common one."""
    common = getattr(args, "tensor_parallel_size", 1)
    own = {r: getattr(args, f"{r}_tensor_parallel_size", None) for r in ("prefill", "decode")}
    if args.colocated > 0 and any(v is not None for v in own.values()):
        raise ConfigError(
            "--prefill-tensor-parallel-size and --decode-tensor-parallel-size are for "
            "disaggregated workers; colocated ones take --tensor-parallel-size"
        )
    return [own.get(r) or common for r in roles]


def _round_robin(n: int, slots: Sequence[tuple[str, ...]]) -> list[tuple[str, ...]]:
    return [slots[i % len(slots)] for i in range(n)]


def assign_gpus(
    roles: Sequence[str], gpus: Sequence[str], tp: int | Sequence[int] = 1
) -> list[tuple[str, ...]]:
    """GPUs per worker (``tp``: each worker's ranks, one GPU each): prefill and decode get
    disjoint GPUs when there are at least two slots; workers of different sizes take the
    GPUs in turn, each its own ``tp`` distinct ones."""
    if not gpus:
        return [() for _ in roles]
    sizes = [tp] * len(roles) if isinstance(tp, int) else list(tp)
    if len(set(sizes)) > 1:
        return _in_turn(sizes, gpus)
    tp = sizes[0] if sizes else 1
    slots = [tuple(gpus[i : i + tp]) for i in range(0, len(gpus) - tp + 1, tp)]
    if not slots:
        raise ConfigError(
            f"--tensor-parallel-size {tp} needs {tp} GPUs per worker but only {len(gpus)} "
            f"are available ({','.join(gpus)})"
        )
    n_prefill, n_decode = roles.count("prefill"), roles.count("decode")
    if n_prefill and n_decode and len(slots) >= 2:
        k = round(len(slots) * n_prefill / (n_prefill + n_decode))
        k = min(max(k, 1), len(slots) - 1)
        placed = iter(_round_robin(n_prefill, slots[:k]) + _round_robin(n_decode, slots[k:]))
        return [next(placed) for _ in roles]
    return _round_robin(len(roles), slots)


def _in_turn(sizes: Sequence[int], gpus: Sequence[str]) -> list[tuple[str, ...]]:
    out, at = [], 0
    for size in sizes:
        if size > len(gpus):
            raise ConfigError(
                f"--tensor-parallel-size {size} needs {size} GPUs per worker but only "
                f"{len(gpus)} are available ({','.join(gpus)})"
            )
        out.append(tuple(gpus[(at + i) % len(gpus)] for i in range(size)))
        at = (at + size) % len(gpus)
    return out


def _resolve_device(requested: str, gpus: Sequence[str]) -> tuple[str, Sequence[str]]:
    if requested == "auto":
        return ("cuda" if gpus else "cpu"), gpus
    if requested.startswith("cpu"):
        return requested, []
    return ("cuda" if gpus else requested), gpus  # ids are renumbered by CUDA_VISIBLE_DEVICES


def _worker_env(
    placed: tuple[str, ...], n_workers: int, cpu_count: int, environ: Mapping[str, str]
) -> dict[str, str]:
    if placed:
        return {"CUDA_VISIBLE_DEVICES": ",".join(placed)}
    if "OMP_NUM_THREADS" in environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, cpu_count // max(1, n_workers)))}


def _otlp_env(args: argparse.Namespace) -> dict[str, str]:
    """A worker's traces go where --otlp-endpoint sends the gateway's: the workers take no such
    flag, they read the OpenTelemetry variables (services.common.tracing). The traces' own
    variable too, so that the flag wins over one in the launcher's environment, as it does in
    the gateway."""
    endpoint = getattr(args, "otlp_endpoint", None)
    if not endpoint:
        return {}
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint}


GPU_MEMORY_CEILING = 0.9  # --gpu-memory-utilization's default: what workers of a GPU share
# a prefill worker sharing its GPU with a decode worker keeps this many steps' tokens of KV
# (--max-total-tokens): prompts in flight until their KV has moved, and a prefix cache. The
# engine never makes a pool smaller than one --max-model-len sequence, and tandem up asks at
# least a full step beside one block per seat (the warm-up's largest step runs then, so the
# memory the prefill worker reports holds its activation peak). 8B shape, --max-model-len 4608,
# 8192-token steps: 32k tokens, 4.3 GB of the ~43 GB an even split gave it (at the model's own
# 131072 it is one such sequence, 16 GiB); the decode worker, whose pool bounds how many
# requests run, gets the rest (docs/benchmarks.md, W4)
PREFILL_POOL_STEPS = 4


def prefill_pool_tokens(args: argparse.Namespace) -> int:
    """The --max-total-tokens of a prefill worker that shares its GPU with a decode worker."""
    budget = getattr(args, "max_num_batched_tokens", None) or GPU_TOKEN_BUDGET
    seats = getattr(args, "max_num_seqs", 256) * getattr(args, "block_size", 16)
    return max(PREFILL_POOL_STEPS * budget, budget + seats)


def _memory_overrides(args: argparse.Namespace, sharing: int) -> dict[str, object]:
    if sharing > 1 and args.gpu_memory_utilization == GPU_MEMORY_CEILING:
        return {"gpu_memory_utilization": round(GPU_MEMORY_CEILING / sharing, 3)}
    return {}


def _memory_flags_default(args: argparse.Namespace) -> bool:
    """Whether the user left every KV-pool sizing flag alone (then tandem up may size pools)."""
    return (
        args.gpu_memory_utilization == GPU_MEMORY_CEILING
        and getattr(args, "kv_cache_gib", None) is None
        and getattr(args, "num_blocks", None) is None
        and getattr(args, "max_total_tokens", None) is None
    )


def fill_plan(
    roles: Sequence[str], placement: Sequence[tuple[str, ...]], names: Sequence[str]
) -> dict[int, tuple[tuple[str, ...], int]]:
    """Decode workers that share a GPU with prefill workers: index -> (the prefill workers
    on its GPUs, the most decode workers on one of its GPUs)."""
    out = {}
    for i, (role, placed) in enumerate(zip(roles, placement, strict=True)):
        if role != "decode" or not placed:
            continue
        before = tuple(
            names[j]
            for j, r in enumerate(roles)
            if r == "prefill" and set(placement[j]) & set(placed)
        )
        if before:
            share = max(
                sum(r == "decode" and g in p for r, p in zip(roles, placement, strict=True))
                for g in placed
            )
            out[i] = (before, share)
    return out


def fill_utilization(
    worker: Worker, workers: Sequence[Worker], ready: Mapping[str, Mapping[str, object]]
) -> float | None:
    """A late decode worker's --gpu-memory-utilization: on each of its GPUs, what
    ``GPU_MEMORY_CEILING`` of it the ready prefill workers there leave (their ready files'
    ``gpu_bytes`` of ``gpu_total_bytes``), split between the ``fill_share`` decode workers; the
    least over its GPUs (0 or less: nothing is left). None when a prefill worker reported no
    figures (keep the plan's split). A tensor-parallel prefill worker reports its first rank's
    figures for each of its GPUs."""
    by_name = {w.spec.name: w for w in workers}
    lefts = []
    for gpu in worker.gpus:
        used, total = 0, 0
        for name in worker.fill_after:
            if gpu not in by_name[name].gpus:
                continue
            facts = ready.get(name) or {}
            got, size = facts.get("gpu_bytes"), facts.get("gpu_total_bytes")
            if not isinstance(got, int) or not isinstance(size, int) or size <= 0:
                return None
            used, total = used + got, size
        if total:
            lefts.append((GPU_MEMORY_CEILING - used / total) / worker.fill_share)
    if not lefts:
        return None
    return min(GPU_MEMORY_CEILING, math.floor(min(lefts) * 1000) / 1000)


def with_flag(argv: Sequence[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value set to ``value`` (replaced where present, else added)."""
    out = list(argv)
    if flag in out[:-1]:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def _media_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's image URL fetching flags and its body limit (inline images travel in the
    body), and its Responses store's bounds, those given."""
    flags = []
    domains = getattr(args, "allowed_media_domains", None)
    if domains:
        flags += ["--allowed-media-domains", *domains]
    if getattr(args, "media_allow_http", False):
        flags.append("--media-allow-http")
    defaults = {"media_fetch_timeout": MEDIA_FETCH_TIMEOUT_S, "media_max_bytes": MEDIA_MAX_BYTES,
                "max_body_bytes": MAX_BODY_BYTES, "responses_store_size": RESPONSES_STORE_SIZE,
                "responses_store_max_bytes": RESPONSES_STORE_MAX_BYTES}  # fmt: skip
    for name, default in defaults.items():
        value = getattr(args, name, default)
        if value != default:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def _request_limit_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's SLO targets and request and connection limits, those given (tandem up
    once refused them, so a topology it started kept the 600 s request timeout and 4096
    connections whatever its operator needed)."""
    probe = argparse.ArgumentParser(add_help=False)
    add_request_limit_args(probe)
    flags = []
    for action in probe._actions:
        value = getattr(args, action.dest, action.default)
        if value != action.default:
            flags += [action.option_strings[0], str(value)]
    return flags


def _cors_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's CORS flags, those given (each list as the JSON it was given as)."""
    flags = []
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        values = list(getattr(args, name, CORS_ANY))
        if values != list(CORS_ANY):
            flags += ["--" + name.replace("_", "-"), json.dumps(values)]
    if getattr(args, "allow_credentials", False):
        flags.append("--allow-credentials")
    return flags


# --local-prefill-queue when a prefill and a decode worker share each decode worker's GPU: one
# H200, 4096:256 prompts, goodput against colocated's 0.99x / 0.84x at 4 / 8 req/s with it, 0.98x /
# 0.15x without; 1024:128 at 16 / 32 req/s 1.00x / 0.96x (docs/benchmarks.md, W4). Two engines
# that take turns on one GPU prefill faster in the decode worker, whose decodes ride along.
SHARED_GPU_LOCAL_PREFILL_QUEUE = 1
# --local-prefill-decode-load there too: a prompt is prefilled by its decode worker while that
# worker has another request (gateway.workers.prefill_choice says why). With both, one H200:
# 1.00x / 0.99x colocated's goodput at 4 / 8 req/s of 4096:256, 1.00x at 4-32 req/s of
# 1024:128 (docs/benchmarks.md, W4)
SHARED_GPU_LOCAL_PREFILL_DECODE_LOAD = 1


def _shared_gpu(device: str, workers: Sequence[Worker]) -> bool:
    """Whether every decode worker shares a GPU with a prefill worker."""
    prefill_gpus = {g for w in workers if w.role == "prefill" for g in w.gpus}
    decodes = [w for w in workers if w.role == "decode"]
    return device == "cuda" and bool(decodes) and all(set(w.gpus) & prefill_gpus for w in decodes)


def shared_gpu_rule(
    requested: int | None, shared_default: int, device: str, workers: Sequence[Worker]
) -> int:
    """A conditional-disaggregation threshold for the gateway (--local-prefill-queue,
    --local-prefill-decode-load): what the user asked for, else (None) ``shared_default`` when
    every decode worker shares a GPU with a prefill worker, else 0 (always disaggregate: on its
    own GPU a decode worker keeps decode steps free of prefill)."""
    if requested is not None:
        return requested
    return shared_default if _shared_gpu(device, workers) else 0


def _check_gateway_flags(args: argparse.Namespace) -> None:
    """What the gateway would refuse, refused before any model loads (exit 2, as it would)."""
    check_drain_timeout(float(getattr(args, "drain_timeout", 30.0)))
    check_worker_stall_timeout(float(getattr(args, "worker_stall_timeout", WORKER_STALL_TIMEOUT_S)))
    check_send_timeout(float(getattr(args, "send_timeout", SEND_TIMEOUT_S)))
    check_metrics_prefix(getattr(args, "metrics_prefix", "tandem:"))
    check_parser_flags(args)
    parse_default_chat_template_kwargs(getattr(args, "default_chat_template_kwargs", None))


def build_plan(
    args: argparse.Namespace,
    gpus: Sequence[str],
    cpu_count: int,
    run_dir: Path,
    program: Sequence[str] = DEFAULT_PROGRAM,
    environ: Mapping[str, str] | None = None,
) -> Plan:
    environ = {} if environ is None else environ
    lora = LoRAConfig.from_args(args)  # bad LoRA flags end here, not in every worker
    parse_mm_limit(getattr(args, "limit_mm_per_prompt", None))  # nor the gateway's
    _check_gateway_flags(args)
    for domain in getattr(args, "allowed_media_domains", None) or ():
        media_domain(domain)
    device, gpus = _resolve_device(args.device, gpus)
    names = role_names(args)
    roles = [r for _, r in names]
    sizes = tensor_parallel_sizes(args, roles)
    if lora is not None:
        lora.check_with(max(sizes), getattr(args, "task", "generate"))
        lora.check_names(*base_model_names(args.model, args.served_model_name))
        lora.check_directories()
    placement = assign_gpus(roles, gpus, sizes)
    users = Counter(g for p in placement for g in p)
    fills = fill_plan(roles, placement, [n for n, _ in names])
    fill = device == "cuda" and _memory_flags_default(args)
    feeds = {p for before, _ in fills.values() for p in before} if fill else set()
    workers = []
    for i, ((name, role), placed, tp) in enumerate(zip(names, placement, sizes, strict=True)):
        overrides = _memory_overrides(args, max((users[g] for g in placed), default=1))
        overrides["tensor_parallel_size"] = tp
        if role == "prefill":  # it decodes nothing: a draft model there held memory for nothing
            overrides["speculative_config"] = None
        if name in feeds:
            overrides["max_total_tokens"] = prefill_pool_tokens(args)
        argv = [*program, role, *engine_flags(args, overrides), "--device", device]
        argv += ["--host", LOOPBACK, "--port", "0", "--worker-id", name]
        argv += task_flags(args)
        stall = getattr(args, "engine_stall_timeout", ENGINE_STALL_TIMEOUT_S)
        if stall != ENGINE_STALL_TIMEOUT_S:
            argv += ["--engine-stall-timeout", str(stall)]
        if role == "prefill" and getattr(args, "kv_checksum", False):
            argv.append("--kv-checksum")
        if role == "prefill" and getattr(args, "kv_streaming", "auto") != "auto":
            argv += ["--kv-streaming", args.kv_streaming]
        ready = run_dir / f"{name}.json"
        env = _worker_env(placed, sum(sizes), cpu_count, environ)  # threads per rank
        env |= _otlp_env(args)
        after, share = fills.get(i, ((), 1)) if fill else ((), 1)
        spec = ChildSpec(name, [*argv, "--ready-file", str(ready)], env, ready)
        workers.append(Worker(spec, role, placed, after, share))
    gateway_ready = run_dir / "gateway.json"
    gateway = [*program, "gateway", "--host", args.host, "--port", str(args.port)]
    gateway += ["--model", args.model]
    if args.served_model_name:
        gateway += ["--served-model-name", *args.served_model_name]
    if getattr(args, "max_local_prefill_tokens", 0):
        gateway += ["--max-local-prefill-tokens", str(args.max_local_prefill_tokens)]
    for flag, shared_default in (
        ("local_prefill_queue", SHARED_GPU_LOCAL_PREFILL_QUEUE),
        ("local_prefill_decode_load", SHARED_GPU_LOCAL_PREFILL_DECODE_LOAD),
    ):
        value = shared_gpu_rule(getattr(args, flag, 0), shared_default, device, workers)
        if value:
            gateway += ["--" + flag.replace("_", "-"), str(value)]
    if getattr(args, "enable_auto_tool_choice", False):
        gateway.append("--enable-auto-tool-choice")
    if getattr(args, "generation_config", "auto") != "auto":
        gateway += ["--generation-config", args.generation_config]
    for flag in ("tool_call_parser", "reasoning_parser", "limit_mm_per_prompt",
                 "override_generation_config", "chat_template",
                 "default_chat_template_kwargs"):  # fmt: skip
        if getattr(args, flag, None):
            gateway += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    gateway += _media_flags(args)
    gateway += _cors_flags(args)
    gateway += _request_limit_flags(args)
    if getattr(args, "otlp_endpoint", None):
        gateway += ["--otlp-endpoint", args.otlp_endpoint]
    drain_timeout_s = float(args.drain_timeout)
    gateway += ["--drain-timeout", str(drain_timeout_s)]
    stall_s = float(getattr(args, "worker_stall_timeout", WORKER_STALL_TIMEOUT_S))
    gateway += ["--worker-stall-timeout", str(stall_s)]
    if getattr(args, "metrics_prefix", "tandem:") != "tandem:":
        gateway += ["--metrics-prefix", args.metrics_prefix]
    send_timeout_s = float(getattr(args, "send_timeout", SEND_TIMEOUT_S))
    if send_timeout_s != SEND_TIMEOUT_S:
        gateway += ["--send-timeout", str(send_timeout_s)]
    gateway += ["--ready-file", str(gateway_ready)]
    # The key travels in the environment (read by the gateway), not on a command line `ps` shows.
    gateway_env = {"TANDEM_API_KEY": args.api_key} if args.api_key else {}
    prepare = [sys.executable, "-m", "deploy.prepare", "--model", args.model]
    return Plan(
        prepare,
        workers,
        gateway,
        gateway_env,
        gateway_ready,
        device,
        args.host,
        args.port,
        args.model,
        drain_timeout_s,
        getattr(args, "task", "generate"),
    )


def gateway_spec(plan: Plan, ports: Mapping[str, int], tokenizer_dir: str | None) -> ChildSpec:
    """The gateway's command line, once every worker has reported its port (name -> port)."""
    argv = list(plan.gateway_argv)
    if tokenizer_dir:
        argv += ["--tokenizer", tokenizer_dir]
    for worker in plan.workers:
        argv += [f"--{worker.role}", f"{LOOPBACK}:{ports[worker.spec.name]}"]
    return ChildSpec("gateway", argv, plan.gateway_env, plan.gateway_ready_file, stop_tier=0)
