"""``tandem compose``: a docker-compose.yml for N GPUs of one host, one worker per GPU (or per
``--tensor-parallel-size`` GPUs).

    tandem compose --gpus 8 --prefill 2 --decode 6 > docker-compose.yml
    docker compose up --build -d

Writes the same services as the repository's docker-compose.yml (a gateway, workers built from
one image, the model cache volume, gRPC health checks, the internal token from the environment),
with as many prefill, decode or colocated workers as asked, each pinned to its own GPU, and a
gateway that lists every one of them and starts once they are all healthy. Engine knobs stay
environment variables (TANDEM_MODEL, TANDEM_DTYPE, ...), as in the shipped file.

LoRA (``--enable-lora --lora-modules NAME=PATH ...``, vLLM's flags): PATH is a directory on the
host, which no container sees; each worker mounts it read-only at ``/lora/NAME`` and serves it
from there, so the file names container paths only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from services.config import ConfigError, LoRAConfig

GRPC_PORT = 50051
KV_PORT = 50061
HTTP_PORT = 8000
LORA_DIR = "/lora"  # each --lora-modules directory, mounted read-only in every worker
_RANGE = re.compile(r"^(\d+)-(\d+)$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
# a GPU as the NVIDIA container runtime takes it: its index or its UUID (nvidia-smi -L)
_GPU_ID = re.compile(r"^(\d+|(GPU|MIG)-[A-Za-z0-9/-]+)$")


def parse_gpus(text: str) -> list[str]:
    """'8' -> 0..7; '2-5' -> 2..5; '0,2,4' -> those (ids as CUDA names them)."""
    text = text.strip()
    if text.isdigit():
        count = int(text)
        if count < 1:
            raise ConfigError("--gpus must name at least one GPU")
        return [str(i) for i in range(count)]
    if m := _RANGE.match(text):
        first, last = int(m.group(1)), int(m.group(2))
        if last < first:
            raise ConfigError(f"--gpus range {text!r} runs backwards")
        return [str(i) for i in range(first, last + 1)]
    ids = [item.strip() for item in text.split(",") if item.strip()]
    if not ids or len(set(ids)) != len(ids) or not all(map(_GPU_ID.match, ids)):
        raise ConfigError(
            "--gpus must be a count, a range (0-7) or distinct ids (0,2,4; or GPU UUIDs, "
            f"GPU-... or MIG-..., as nvidia-smi -L lists them), got {text!r}"
        )
    return ids


@dataclass(frozen=True)
class ComposeSpec:
    prefill: int
    decode: int
    colocated: int
    gpus: tuple[str, ...]
    port: int = HTTP_PORT
    image: str = "tandem:latest"
    tensor_parallel_size: int = 1  # ranks (GPUs) per worker
    lora: LoRAConfig | None = None  # --enable-lora; its modules' paths are the host's

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ConfigError("worker counts must be >= 0")
        if self.colocated == 0 and (self.prefill < 1 or self.decode < 1):
            raise ConfigError("a disaggregated topology needs --prefill >= 1 and --decode >= 1")
        if self.colocated and (self.prefill or self.decode):
            raise ConfigError("--colocated replaces --prefill/--decode: give one or the other")
        if not self.image or any(c.isspace() for c in self.image):
            raise ConfigError(f"--image must name an image (tandem:latest), got {self.image!r}")
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ConfigError("--tensor-parallel-size must be at least 1")
        if len(self.workers) * tp > len(self.gpus):
            each = "one each" if tp == 1 else f"{tp} each"
            raise ConfigError(
                f"{len(self.workers)} workers need {len(self.workers) * tp} GPUs ({each}), "
                f"--gpus gives {len(self.gpus)}"
            )
        if self.lora is not None:  # refused here, not by every container at its start
            self.lora.check_with(tp, "generate")
            self.lora.check_directories()

    @property
    def placement(self) -> list[tuple[str, ...]]:
        """Each worker's GPUs (``tensor_parallel_size`` of them, none shared)."""
        tp = self.tensor_parallel_size
        return [self.gpus[i * tp : (i + 1) * tp] for i in range(len(self.workers))]

    @property
    def lora_mounts(self) -> list[tuple[str, str, str]]:
        """(adapter, host directory, directory in the container) of each --lora-modules."""
        if self.lora is None:
            return []
        out = []
        for i, (name, path) in enumerate(self.lora.modules):
            safe = _UNSAFE.sub("_", name)
            if safe != name or safe.startswith("."):  # not a plain file name: numbered
                safe = f"{i}-{safe}"
            out.append((name, str(Path(path).resolve()), f"{LORA_DIR}/{safe}"))
        return out

    @property
    def workers(self) -> list[tuple[str, str]]:
        """(service name, role) in order: prefill, decode, colocated."""
        return (
            [(f"prefill-{i}", "prefill") for i in range(self.prefill)]
            + [(f"decode-{i}", "decode") for i in range(self.decode)]
            + [(f"worker-{i}", "worker") for i in range(self.colocated)]
        )


# required (compose refuses to start without it): an empty token leaves the workers open to
# anything on the compose network
_TOKEN = (
    "${TANDEM_INTERNAL_TOKEN:?set TANDEM_INTERNAL_TOKEN to a shared secret the workers require "
    "(openssl rand -hex 32)}"
)
_HEAD = """\
# Generated by: tandem compose {argv}
# Tandem on one host: a gateway and {summary}, {per_worker} each.
#
#   docker compose up --build -d          then   curl http://localhost:{port}/v1/models
#
# Configure with environment variables (or an .env file next to this one), as in the repository's
# docker-compose.yml: TANDEM_MODEL, TANDEM_MODELS_DIR, TANDEM_PORT, TANDEM_API_KEY,
# TANDEM_INTERNAL_TOKEN (required), TANDEM_DTYPE, TANDEM_LOAD_FORMAT, TANDEM_GPU_MEMORY_UTILIZATION,
# TANDEM_MAX_NUM_SEQS, TANDEM_MAX_NUM_BATCHED_TOKENS, TANDEM_BLOCK_SIZE.
# Another shape: run `tandem compose` again with other --gpus/--prefill/--decode.

name: tandem

x-tandem: &tandem
  image: ${{TANDEM_IMAGE:-{image}}}
  build:
    context: .
    dockerfile: deploy/Dockerfile
  ipc: host  # shared memory for torch/NCCL between processes and containers
  restart: unless-stopped
  stop_grace_period: 45s  # workers drain in-flight requests for up to --drain-timeout (30 s)
  volumes:
    - model-cache:/models/cache
    - ${{TANDEM_MODELS_DIR:-./models}}:/models/local:ro
  environment:
    TANDEM_CACHE_DIR: /models/cache
    NCCL_DEBUG: ${{NCCL_DEBUG:-WARN}}
    TANDEM_INTERNAL_TOKEN: {token}

x-worker: &worker
  <<: *tandem
  expose: ["{grpc}"]
  healthcheck:
    test: ["CMD", "python", "-m", "deploy.healthcheck", "--grpc", "127.0.0.1:{grpc}"]
    interval: 10s
    timeout: 5s
    retries: 3
    start_period: 900s  # model loading (and the one-time GGUF conversion on a fresh volume)
    start_interval: 5s

services:
"""

_RUNTIME_LORA = """\
# Runtime LoRA loads (POST /v1/load_lora_adapter) name a directory the workers' containers see:
# put the adapter under TANDEM_MODELS_DIR and load it as /models/local/<its directory>.
"""

_ENGINE = [
    "--model=${TANDEM_MODEL:-embedded}",
    "--load-format=${TANDEM_LOAD_FORMAT:-auto}",
    "--dtype=${TANDEM_DTYPE:-auto}",
    "--device=cuda",
    "--gpu-memory-utilization=${TANDEM_GPU_MEMORY_UTILIZATION:-0.9}",
    "--max-num-seqs=${TANDEM_MAX_NUM_SEQS:-256}",
    "--max-num-batched-tokens=${TANDEM_MAX_NUM_BATCHED_TOKENS:-8192}",
    "--block-size=${TANDEM_BLOCK_SIZE:-16}",
]


def _literal(text: str) -> str:
    """``text`` as a YAML scalar Compose reads back unchanged (quoted, no interpolation)."""
    return json.dumps(text.replace("$", "$$"))


def _lora_args(spec: ComposeSpec) -> list[str]:
    if spec.lora is None:
        return []
    args = ["--enable-lora"]
    if spec.lora.modules:
        args += [
            "--lora-modules",
            *(_literal(f"{n}={inside}") for n, _, inside in spec.lora_mounts),
        ]
    args += [f"--max-loras={spec.lora.max_loras}", f"--max-lora-rank={spec.lora.max_lora_rank}"]
    if spec.lora.allow_runtime_updating:
        args.append("--allow-runtime-lora-updating")
    return args


def _volumes(spec: ComposeSpec) -> str:
    """The anchor's volumes and a read-only bind of each adapter directory (a service's own
    ``volumes`` replaces the merged list, so the anchor's are repeated)."""
    if not spec.lora_mounts:
        return ""
    binds = "".join(
        f"      - type: bind\n        source: {_literal(host)}\n        target: {inside}\n"
        "        read_only: true\n"
        for _, host, inside in spec.lora_mounts
    )
    return ("    volumes:  # the model volumes, and each LoRA adapter directory (read-only)\n"
            "      - model-cache:/models/cache\n"
            "      - ${TANDEM_MODELS_DIR:-./models}:/models/local:ro\n" + binds)  # fmt: skip


def _worker(name: str, role: str, gpus: tuple[str, ...], spec: ComposeSpec) -> str:
    args = [role, *_ENGINE, *_lora_args(spec), "--host=0.0.0.0", f"--port={GRPC_PORT}"]
    if len(gpus) > 1:  # rank r on the r-th GPU the container sees
        args.append(f"--tensor-parallel-size={len(gpus)}")
    expose = ""
    if role == "decode":  # prefill workers reach its KV rendezvous by service name
        args += [f"--kv-host={name}", f"--kv-port={KV_PORT}"]
        expose = f'    expose: ["{GRPC_PORT}", "{KV_PORT}"]\n'
    args.append(f"--worker-id={name}")
    command = "".join(f"      - {a}\n" for a in args)
    ids = ", ".join(f'"{g}"' for g in gpus)
    return (
        f"  {name}:\n    <<: *worker\n{expose}{_volumes(spec)}    command:\n{command}"
        "    deploy:\n      resources:\n        reservations:\n          devices:\n"
        f"            - driver: nvidia\n              device_ids: [{ids}]\n"
        "              capabilities: [gpu]\n\n"
    )


def _gateway(spec: ComposeSpec) -> str:
    flag = {"prefill": "--prefill", "decode": "--decode", "worker": "--worker"}
    args = ["gateway", "--model=${TANDEM_MODEL:-embedded}", "--host=0.0.0.0", f"--port={HTTP_PORT}"]
    args += [f"{flag[role]}={name}:{GRPC_PORT}" for name, role in spec.workers]
    command = "".join(f"      - {a}\n" for a in args)
    depends = "".join(
        f"      {name}:\n        condition: service_healthy\n" for name, _ in spec.workers
    )
    return (
        f"  gateway:\n    <<: *tandem\n    command:\n{command}"
        "    environment:\n      TANDEM_CACHE_DIR: /models/cache\n"
        "      TANDEM_API_KEY: ${TANDEM_API_KEY:-}\n"
        f"      TANDEM_INTERNAL_TOKEN: {_TOKEN}\n"
        f'    ports:\n      - "${{TANDEM_PORT:-{spec.port}}}:{HTTP_PORT}"  # the only published port\n'
        f"    depends_on:\n{depends}"
        "    healthcheck:\n"
        f'      test: ["CMD", "python", "-m", "deploy.healthcheck", "--http", '
        f'"http://127.0.0.1:{HTTP_PORT}/health"]\n'
        "      interval: 10s\n      timeout: 5s\n      retries: 3\n"
        "      start_period: 120s\n      start_interval: 2s\n\n"
    )


def render(spec: ComposeSpec, argv: str = "") -> str:
    counts = [(spec.prefill, "prefill"), (spec.decode, "decode"), (spec.colocated, "colocated")]
    summary = " + ".join(f"{n} {what}" for n, what in counts if n) + " workers"
    head = _HEAD.format(
        argv=argv, summary=summary, port=spec.port, image=spec.image, grpc=GRPC_PORT, token=_TOKEN,
        per_worker="one GPU" if spec.tensor_parallel_size == 1
        else f"{spec.tensor_parallel_size} GPUs (tensor parallel)",
    )  # fmt: skip
    body = "".join(
        _worker(name, role, gpus, spec)
        for (name, role), gpus in zip(spec.workers, spec.placement, strict=True)
    )
    if spec.lora is not None and spec.lora.allow_runtime_updating:
        head = head.replace("\nname: tandem", _RUNTIME_LORA + "\nname: tandem", 1)
    return head + body + _gateway(spec) + "volumes:\n  model-cache:\n"


def main(args: argparse.Namespace) -> int:
    default = 0 if args.colocated else 1
    prefill = default if args.prefill is None else args.prefill
    decode = default if args.decode is None else args.decode
    try:
        spec = ComposeSpec(
            prefill=prefill,
            decode=decode,
            colocated=args.colocated,
            gpus=tuple(parse_gpus(args.gpus)),
            port=args.port,
            image=args.image,
            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
            lora=LoRAConfig.from_args(args),
        )
    except ConfigError as e:
        print(f"tandem compose: error: {e}", file=sys.stderr)
        return 2
    shape = (
        f"--colocated {args.colocated}"
        if args.colocated
        else f"--prefill {prefill} --decode {decode}"
    )
    argv = f"--gpus {args.gpus} {shape}"
    if spec.tensor_parallel_size > 1:
        argv += f" --tensor-parallel-size {spec.tensor_parallel_size}"
    if spec.lora is not None:
        argv += " --enable-lora"
        if spec.lora.modules:
            argv += " --lora-modules " + " ".join(f"{n}={p}" for n, p in spec.lora.modules)
    sys.stdout.write(render(spec, argv))
    return 0
