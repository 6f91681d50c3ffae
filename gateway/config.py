"""The gateway's frozen configuration and where it comes from (flags, a worker file)."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from gateway.discovery import DiscoverySpec
from services.common.auth import token_from
from services.config import ConfigError

ROLES = ("prefill", "decode", "both")
# a Prometheus metric name; a --metrics-prefix must be one, so every prefixed name is one too
METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # prefill | decode | both (a colocated worker)
    address: str  # host:port of its gRPC server

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"worker role must be one of {', '.join(ROLES)}, got {self.role!r}")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"worker address must be HOST:PORT, got {self.address!r}")


@dataclass(frozen=True)
class GatewayConfig:
    tokenizer: str  # a directory with tokenizer.json (and tokenizer_config.json)
    model: str = "embedded"
    served_model_name: str | None = None
    chat_template: str | None = None  # a Jinja file that replaces the tokenizer's template
    # a special token typed in a message acts as one (else it is text, as OpenAI treats it)
    allow_special_tokens_in_messages: bool = False
    workers: tuple[WorkerSpec, ...] = ()
    # DNS names listing workers (a Kubernetes headless Service), resolved every interval
    discover: tuple[DiscoverySpec, ...] = ()
    discover_interval_s: float = 5.0
    api_key: str | None = None
    internal_token: str = ""  # sent to the workers on every gRPC call (services.common.auth)
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 40.0
    request_timeout_s: float = 600.0
    max_body_bytes: int = 4 * 1024 * 1024
    # HTTP connection guard (gateway.http_protocol): totals, not gaps between reads
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096
    otlp_endpoint: str | None = None
    metrics_prefix: str = "tandem:"  # "vllm:" makes vLLM's dashboards and alert rules work
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    rpc_timeout_s: float = 5.0  # unary calls: Reserve, Abort
    # a leak guard for when the gateway itself dies; normal paths abort reservations explicitly.
    # A reservation lives the request's remaining time (--request-timeout), at least this long:
    # it must outlast the prefill's queueing and compute of a long prompt
    reserve_ttl_s: float = 60.0
    kv_wait_s: float = 10.0
    # conditional disaggregation: a prompt of at most this many tokens is prefilled by the decode
    # worker it was admitted to (no prefill worker, no KV transfer); 0: always disaggregate
    max_local_prefill_tokens: int = 0
    drain_timeout_s: float = 30.0
    prefix_blocks: int = 4  # leading blocks hashed for prefix-cache affinity
    max_fanout: int = 256  # n x number of prompts
    # tool calling under tool_choice "auto": which parser reads calls out of the model's text
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # gateway.tool_parsers.PARSERS
    reasoning_parser: str | None = None  # gateway.reasoning.PARSERS

    def __post_init__(self) -> None:
        positive = {
            "--request-timeout": self.request_timeout_s,
            "--max-body-bytes": self.max_body_bytes,
            "--header-timeout": self.header_timeout_s,
            "--body-timeout": self.body_timeout_s,
            "--max-connections": self.max_connections,
            "health interval": self.health_interval_s,
            "--discover-interval": self.discover_interval_s,
            "health timeout": self.health_timeout_s,
            "rpc timeout": self.rpc_timeout_s,
            "reserve ttl": self.reserve_ttl_s,
            "kv wait": self.kv_wait_s,
            "prefix blocks": self.prefix_blocks,
            "max fanout": self.max_fanout,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.slo_ttft_ms <= 0 or self.slo_tpot_ms <= 0:
            raise ConfigError("--slo-ttft-ms and --slo-tpot-ms must be positive")
        if self.max_local_prefill_tokens < 0:
            raise ConfigError(
                f"--max-local-prefill-tokens must be >= 0, got {self.max_local_prefill_tokens}"
            )
        if self.drain_timeout_s < 0:
            raise ConfigError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        self._check_parsers()
        if not METRIC_NAME.fullmatch(self.metrics_prefix):
            raise ConfigError(
                "--metrics-prefix must be a Prometheus metric name: a letter, '_' or ':' first, "
                f"then letters, digits, '_' or ':' (such as tandem: or vllm:), "
                f"got {self.metrics_prefix!r}"
            )

    def _check_parsers(self) -> None:
        from gateway import reasoning, tool_parsers

        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError(
                "--enable-auto-tool-choice needs --tool-call-parser "
                f"({', '.join(tool_parsers.PARSERS)})"
            )
        for flag, name, known in (
            ("--tool-call-parser", self.tool_call_parser, tool_parsers.PARSERS),
            ("--reasoning-parser", self.reasoning_parser, reasoning.PARSERS),
        ):
            if name is not None and name not in known:
                raise ConfigError(f"{flag} must be one of {', '.join(known)}, got {name!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def load_worker_file(path: str) -> list[WorkerSpec]:
    """Workers from YAML or JSON: ``{prefill: [HOST:PORT], decode: [...], worker: [...]}``
    or ``{workers: [{role, address}, ...]}``."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    data: Any
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml  # optional: only YAML worker files need it
        except ImportError as e:
            raise ConfigError(f"{path}: YAML needs pyyaml (pip install pyyaml) or use JSON") from e
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of roles to worker addresses")
    specs = [
        WorkerSpec(role="both" if key == "worker" else key, address=str(address))
        for key in ("prefill", "decode", "worker")
        for address in data.get(key) or []
    ]
    for entry in data.get("workers") or []:
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: each entry of 'workers' needs role and address")
        specs.append(WorkerSpec(role=str(entry.get("role")), address=str(entry.get("address"))))
    return specs


def workers_from_args(args: argparse.Namespace) -> tuple[WorkerSpec, ...]:
    specs = [WorkerSpec("prefill", a) for a in args.prefill]
    specs += [WorkerSpec("decode", a) for a in args.decode]
    specs += [WorkerSpec("both", a) for a in args.worker]
    if args.config:
        specs += load_worker_file(args.config)
    return tuple(dict.fromkeys(specs))


def config_from_args(
    args: argparse.Namespace, tokenizer_dir: str, default_name: str | None = None
) -> GatewayConfig:
    return GatewayConfig(
        tokenizer=tokenizer_dir,
        model=args.model,
        served_model_name=args.served_model_name or default_name,
        chat_template=args.chat_template,
        allow_special_tokens_in_messages=getattr(args, "allow_special_tokens_in_messages", False),
        workers=workers_from_args(args),
        discover=tuple(DiscoverySpec.parse(d) for d in getattr(args, "discover", None) or ()),
        discover_interval_s=getattr(args, "discover_interval", 5.0),
        api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None,
        internal_token=token_from(getattr(args, "internal_token", None)),
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        otlp_endpoint=args.otlp_endpoint,
        metrics_prefix=getattr(args, "metrics_prefix", "tandem:"),
        drain_timeout_s=getattr(args, "drain_timeout", 30.0),
        max_local_prefill_tokens=getattr(args, "max_local_prefill_tokens", 0),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
    )
