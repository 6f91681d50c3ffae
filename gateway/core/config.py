"""The gateway's frozen configuration and where it comes from (flags, a worker file)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.core import generation_defaults
from protos.auth import token_from
from protos.errors import ConfigError
from protos.roles import Role

# a Prometheus metric name; a --metrics-prefix must be one, so every prefixed name is one too
METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
MEDIA_FETCH_TIMEOUT_S = 5.0
MEDIA_MAX_BYTES = 20 * 1024 * 1024
MAX_BODY_BYTES = 4 * 1024 * 1024  # inline (data URL) images travel in the body
RESPONSES_STORE_SIZE = 1000  # responses the Responses API keeps (per gateway)
RESPONSES_STORE_MAX_BYTES = 256 * 1024 * 1024
SEND_TIMEOUT_S = 60.0  # --send-timeout's default, nginx's send_timeout
# `tandem up` binds the gateway's port before it starts anything and hands the listening socket
# to the gateway it starts: the descriptor's number, in the gateway's environment
LISTEN_FD_ENV = "TANDEM_LISTEN_FD"
# --worker-stall-timeout's default: health polls unanswered this long and the worker is lost.
# Workers answer health and load polls on their event loop, not on the engine thread, so a
# long engine step (a big prefill) does not delay them; only a frozen or hung process (or a
# loop starved for this long) stays silent, and its requests would otherwise hang until the
# gRPC keepalive fails them (some 40 s after its last bytes)
WORKER_STALL_TIMEOUT_S = 10.0
# where the gateway's API key comes from, first found wins: --api-key, then these variables
# (Tandem's own, then vLLM's, so a vLLM setup that sets only VLLM_API_KEY stays closed)
API_KEY_ENV = ("TANDEM_API_KEY", "VLLM_API_KEY")
# CORS, vLLM's flags and defaults (--allowed-origins, --allowed-methods, --allowed-headers: a JSON
# list each; --allow-credentials): any origin, method and header
CORS_ANY = ("*",)
# response headers a browser's script may read beside the CORS-safelisted ones
CORS_EXPOSE_HEADERS = ("x-tandem-timing",)
# an origin as browsers send it: scheme://host[:port], no path ("null" for opaque origins)
ORIGIN = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#\s]+")
# an HTTP method or header name: an RFC 9110 token
TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


@dataclass(frozen=True)
class WorkerSpec:
    role: Role  # a string given here is parsed (Role.parse: "worker" and "both" mean colocated)
    address: str  # host:port of its gRPC server

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"worker address must be HOST:PORT, got {self.address!r}")
        if not 0 < int(port) < 65536:
            raise ConfigError(f"worker port must be 1-65535, got {self.address!r}")


@dataclass(frozen=True)
class DiscoverySpec:
    role: Role
    host: str  # a DNS name: a headless Service has one record per pod
    port: int  # the workers' gRPC port

    @classmethod
    def parse(cls, text: str) -> DiscoverySpec:
        """``ROLE=HOST:PORT``; ROLE is prefill, decode or colocated."""
        role, sep, target = text.partition("=")
        host, colon, port = target.rpartition(":")
        if not sep or role not in set(Role) or not colon or not host or not port.isdigit():
            raise ConfigError(
                f"--discover takes ROLE=HOST:PORT with ROLE prefill, decode or colocated "
                f"(e.g. decode=decode.tandem.svc.cluster.local:50051), got {text!r}"
            )
        if not 0 < int(port) < 65536:
            raise ConfigError(f"--discover port must be 1-65535, got {port}")
        return cls(Role(role), host.strip("[]"), int(port))


@dataclass(frozen=True)
class GatewayConfig:
    tokenizer: str  # a directory with tokenizer.json (and tokenizer_config.json)
    model: str = "embedded"
    served_model_name: str | None = None
    # vLLM's further --served-model-name names: accepted and listed beside the first
    served_model_aliases: tuple[str, ...] = ()
    chat_template: str | None = None  # a Jinja file that replaces the tokenizer's template
    # a special token typed in a message acts as one (else it is text, as OpenAI treats it)
    allow_special_tokens_in_messages: bool = False
    limit_mm_per_prompt: int | None = None  # images per prompt (None: as many as fit)
    # image URLs the gateway fetches (gateway.flows.image_fetch): hosts (exact, "*.suffix" for
    # its subdomains, "*" for any); none: http(s) image URLs are refused, only data URLs serve
    allowed_media_domains: tuple[str, ...] = ()
    media_allow_http: bool = False  # https only unless set
    media_fetch_timeout_s: float = MEDIA_FETCH_TIMEOUT_S  # per image, redirects included
    media_max_bytes: int = MEDIA_MAX_BYTES  # per fetched image
    workers: tuple[WorkerSpec, ...] = ()
    # DNS names listing workers (a Kubernetes headless Service), resolved every interval
    discover: tuple[DiscoverySpec, ...] = ()
    discover_interval_s: float = 5.0
    api_key: str | None = None
    # CORS (vLLM's --allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials)
    allowed_origins: tuple[str, ...] = CORS_ANY
    allowed_methods: tuple[str, ...] = CORS_ANY
    allowed_headers: tuple[str, ...] = CORS_ANY
    allow_credentials: bool = False
    internal_token: str = ""  # sent to the workers on every gRPC call (protos.auth)
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 40.0
    request_timeout_s: float = 600.0
    max_body_bytes: int = MAX_BODY_BYTES
    # HTTP connection guard (gateway.http.http_protocol): totals, not gaps between reads
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    send_timeout_s: float = SEND_TIMEOUT_S  # a client reading nothing this long; 0: no limit
    max_connections: int = 4096
    otlp_endpoint: str | None = None
    metrics_prefix: str = "tandem:"  # "vllm:" makes vLLM's dashboards and alert rules work
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    # health polls unanswered this long: the worker is lost, its in-flight requests fail now
    worker_stall_timeout_s: float = WORKER_STALL_TIMEOUT_S
    rpc_timeout_s: float = 5.0  # unary calls: Reserve, Abort
    # a leak guard for when the gateway itself dies; normal paths abort reservations explicitly.
    # A reservation lives the request's remaining time (--request-timeout), at least this long:
    # it must outlast the prefill's queueing and compute of a long prompt
    reserve_ttl_s: float = 60.0
    kv_wait_s: float = 10.0
    # conditional disaggregation: a prompt of at most this many tokens is prefilled by the decode
    # worker it was admitted to (no prefill worker, no KV transfer); 0: always disaggregate
    max_local_prefill_tokens: int = 0
    # ... and any prompt while every healthy prefill worker has at least this many requests
    # waiting or in prefill (gateway.workers.prefill_choice); 0: off
    local_prefill_queue: int = 0
    # ... and any prompt while its decode worker has at least this many other requests; 0: off
    local_prefill_decode_load: int = 0
    drain_timeout_s: float = 30.0
    prefix_blocks: int = 4  # leading blocks hashed for prefix-cache affinity
    max_fanout: int = 256  # n x number of prompts
    # the Responses API's store (gateway.flows.response_store): responses kept, 0 none
    responses_store_size: int = RESPONSES_STORE_SIZE
    responses_store_max_bytes: int = RESPONSES_STORE_MAX_BYTES  # their JSON, all together
    # tool calling under tool_choice "auto": which parser reads calls out of the model's text
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # gateway.flows.tool_parsers.PARSERS
    reasoning_parser: str | None = None  # gateway.flows.reasoning.PARSERS
    # vLLM's --default-chat-template-kwargs: the chat template's variables every request gets,
    # under its own chat_template_kwargs (enable_thinking: false, ...)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # the model's recommended sampling defaults (gateway.core.generation_defaults): what a
    # request leaves out; max_new_tokens is the default max_tokens
    generation_defaults: dict[str, float | int] = field(default_factory=dict)

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
            "--media-fetch-timeout": self.media_fetch_timeout_s,
            "--media-max-bytes": self.media_max_bytes,
            "--responses-store-max-bytes": self.responses_store_max_bytes,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.slo_ttft_ms <= 0 or self.slo_tpot_ms <= 0:
            raise ConfigError("--slo-ttft-ms and --slo-tpot-ms must be positive")
        at_least_zero = {
            "--max-local-prefill-tokens": self.max_local_prefill_tokens,
            "--local-prefill-queue": self.local_prefill_queue,
            "--local-prefill-decode-load": self.local_prefill_decode_load,
            "--responses-store-size": self.responses_store_size,
        }
        for name, count in at_least_zero.items():
            if count < 0:
                raise ConfigError(f"{name} must be >= 0, got {count}")
        check_send_timeout(self.send_timeout_s)
        check_drain_timeout(self.drain_timeout_s)
        check_worker_stall_timeout(self.worker_stall_timeout_s)
        domains = tuple(dict.fromkeys(media_domain(d) for d in self.allowed_media_domains))
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            object.__setattr__(self, name, cors_list(name, getattr(self, name)))
        object.__setattr__(self, "allowed_media_domains", domains)
        check_metrics_prefix(self.metrics_prefix)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the base model is served under, the first its main one."""
        return (self.model_name, *self.served_model_aliases)


def check_send_timeout(seconds: float) -> None:
    if not 0 <= seconds < math.inf:
        raise ConfigError(f"--send-timeout must be a finite number of seconds >= 0 (0: no limit), "
                          f"got {seconds}")  # fmt: skip


def check_drain_timeout(seconds: float) -> None:
    """``--drain-timeout``: a finite number of seconds >= 0 (NaN would never end a drain)."""
    if not 0 <= seconds < math.inf:
        raise ConfigError(f"--drain-timeout must be a finite number of seconds >= 0, got {seconds}")


def check_worker_stall_timeout(seconds: float) -> None:
    """``--worker-stall-timeout``: a finite number of seconds > 0."""
    if not 0 < seconds < math.inf:
        raise ConfigError(
            f"--worker-stall-timeout must be a finite number of seconds > 0, got {seconds}"
        )


def check_metrics_prefix(prefix: str) -> None:
    """``--metrics-prefix``: a Prometheus metric name, so every prefixed name is one too."""
    if not METRIC_NAME.fullmatch(prefix):
        raise ConfigError(
            "--metrics-prefix must be a Prometheus metric name: a letter, '_' or ':' first, "
            f"then letters, digits, '_' or ':' (such as tandem: or vllm:), got {prefix!r}"
        )


# chat_template_kwargs keys that are no template variable of a request's own choosing
_NOT_DEFAULT_KWARGS = ("messages", "documents", "tools", "add_generation_prompt",
                       "continue_final_message")  # fmt: skip


def parse_default_chat_template_kwargs(text: str | None) -> dict[str, Any]:
    """``--default-chat-template-kwargs``: a JSON object of chat template variables (vLLM's
    flag), which a request's ``chat_template_kwargs`` override key by key."""
    if not text:
        return {}
    flag = "--default-chat-template-kwargs"
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not valid JSON: {e.msg}") from None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{flag} must be a JSON object, such as '{{\"enable_thinking\": false}}'")
    given = [k for k in _NOT_DEFAULT_KWARGS if k in kwargs]
    if given:
        raise ConfigError(f"{flag}: {', '.join(given)} cannot have a server default (each is "
                          "the request's own: its fields or its messages)")  # fmt: skip
    return kwargs


WORKER_FILE_KEYS = ("prefill", "decode", "worker", "workers")


def load_worker_file(path: str) -> list[WorkerSpec]:
    """Workers from YAML or JSON: ``{prefill: [HOST:PORT], decode: [...], worker: [...]}``
    or ``{workers: [{role, address}, ...]}``."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from e
    data: Any
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml  # optional: only YAML worker files need it
        except ImportError as e:
            raise ConfigError(f"{path}: YAML needs pyyaml (pip install pyyaml) or use JSON") from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:  # its text spans lines: the problem and where, in one
            mark = getattr(e, "problem_mark", None)
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            problem = getattr(e, "problem", None) or " ".join(str(e).split())
            raise ConfigError(f"--config {path} is not valid YAML: {problem}{where}") from e
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config {path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of roles to worker addresses")
    unknown = [str(key) for key in data if key not in WORKER_FILE_KEYS]
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
            f"{', '.join(WORKER_FILE_KEYS)}"
        )
    for key in WORKER_FILE_KEYS:
        if data.get(key) is not None and not isinstance(data[key], list):
            raise ConfigError(f"{path}: {key!r} must be a list, got {data[key]!r}")
    specs = [
        WorkerSpec(role=Role.parse(key), address=str(address))
        for key in ("prefill", "decode", "worker")
        for address in data.get(key) or []
    ]
    for entry in data.get("workers") or []:
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: each entry of 'workers' needs role and address")
        specs.append(
            WorkerSpec(role=Role.parse(str(entry.get("role"))), address=str(entry.get("address")))
        )
    return specs


def workers_from_args(args: argparse.Namespace) -> tuple[WorkerSpec, ...]:
    specs = [WorkerSpec(Role.PREFILL, a) for a in args.prefill]
    specs += [WorkerSpec(Role.DECODE, a) for a in args.decode]
    specs += [WorkerSpec(Role.COLOCATED, a) for a in args.worker]
    if args.config:
        specs += load_worker_file(args.config)
    return tuple(dict.fromkeys(specs))


def check_topology(config: GatewayConfig) -> None:
    """ConfigError when the fixed worker list can serve no request: a colocated worker serves
    alone; a prefill worker needs a decode worker to hand its KV to, and a decode worker
    serves only requests a prefill worker began. With --discover the lists change as workers
    come and go: nothing to check at start."""
    if config.discover:
        return
    roles = {spec.role for spec in config.workers}
    if Role.COLOCATED in roles or {Role.PREFILL, Role.DECODE} <= roles:
        return
    if not roles:
        raise ConfigError(
            "no workers: give --worker HOST:PORT (colocated), or --prefill and --decode, "
            "or --config FILE or --discover ROLE=HOST:PORT"
        )
    have, missing = (
        (Role.PREFILL, Role.DECODE) if Role.PREFILL in roles else (Role.DECODE, Role.PREFILL)
    )
    raise ConfigError(
        f"{have} workers but no {missing} worker: a disaggregated request needs both (add "
        f"--{missing} HOST:PORT, or use colocated workers: --worker HOST:PORT)"
    )


def parse_mm_limit(text: str | None) -> int | None:
    """``--limit-mm-per-prompt`` (vLLM's JSON, e.g. '{"image": 2}', or its newer form
    '{"image": {"count": 2}}'): images per prompt. Video and audio are not supported, so their
    only limit is 0 (vLLM's way of turning them off, '{"image": 2, "video": 0}', is taken)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--limit-mm-per-prompt must be JSON like '{{\"image\": 2}}': {e}") from e
    if not isinstance(value, dict):
        raise ConfigError(f"--limit-mm-per-prompt must be a JSON object like "
                          f"'{{\"image\": 2}}', got {text!r}")  # fmt: skip
    unknown = sorted(set(value) - {"image", "video", "audio"})
    if unknown:
        raise ConfigError(f"--limit-mm-per-prompt: unknown modality {unknown[0]!r} (image, video "
                          "or audio)")  # fmt: skip
    limits = {name: _mm_count(name, limit) for name, limit in value.items()}
    if any(count for name, count in limits.items() if name != "image"):
        raise ConfigError(
            "--limit-mm-per-prompt takes only an image limit, e.g. '{\"image\": 2}' (video and "
            f"audio are not supported: their limit can only be 0), got {text!r}"
        )
    return limits.get("image")


def _mm_count(name: str, limit: object) -> int:
    if isinstance(limit, dict):  # vLLM's {"count": N, "width": ...}: the rest sizes its profiling
        if set(limit) != {"count"}:
            raise ConfigError(
                f"--limit-mm-per-prompt {name}: only count is supported in the object form "
                f'(\'{{"{name}": {{"count": 2}}}}\'), got {sorted(limit)}'
            )
        limit = limit["count"]
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ConfigError(f"--limit-mm-per-prompt {name} must be a count >= 0, got {limit!r}")
    return limit


def media_domain(entry: str) -> str:
    """One ``--allowed-media-domains`` entry, normalized as the fetcher compares hosts: lower
    case, no trailing dot, an IPv6 literal without brackets. A URL, a port or a path is refused:
    the list names hosts (the scheme is --media-allow-http's, any port is allowed)."""
    host = entry.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    bad = not host or not host.isascii() or any(c in host for c in "/@?#[] \t")
    wildcard = host.startswith("*.") and "*" not in host[2:] and len(host) > 2
    if host == "*" or wildcard:
        return host
    if bad or "*" in host or host.count(":") == 1:
        raise ConfigError(
            "--allowed-media-domains takes host names (images.example.com, *.example.com for "
            "its subdomains, an IP address, or * for any host; IDNs in their xn-- form), not "
            f"URLs or host:port, got {entry!r}"
        )
    return host


def api_key_from(flag: str | None, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The gateway's API key and where it came from: ``--api-key``, else the first of
    :data:`API_KEY_ENV` set to a non-empty value; (None, None): no key, the API is open. An
    empty variable is unset (compose passes both on, empty by default); an empty or blank flag
    is a ConfigError: given on purpose, it would otherwise open the API without a word."""
    if flag is not None and not flag.strip():
        raise ConfigError(
            f"--api-key {flag!r} is empty: give a non-empty key, or leave the flag out (the "
            f"API is then open unless {' or '.join(API_KEY_ENV)} is set)"
        )
    if flag is not None:
        return flag, "--api-key"
    for name in API_KEY_ENV:
        if environ.get(name):
            return environ[name], name
    return None, None


def cors_list(name: str, values: Any) -> tuple[str, ...]:
    """One CORS list (``name``: the GatewayConfig field, ``allowed_origins`` ...), checked:
    strings, each "*", or an origin (scheme://host[:port], or "null") for origins, a token for
    methods (upper-cased, as browsers send them) and headers."""
    flag = "--" + name.replace("_", "-")
    if isinstance(values, str) or not isinstance(values, list | tuple):
        raise ConfigError(f"{flag} takes a JSON list of strings, got {values!r}")
    out = []
    for value in values:
        if not isinstance(value, str):
            raise ConfigError(f"{flag} takes a JSON list of strings, got {value!r} in it")
        if value == "*":
            out.append(value)
        elif name == "allowed_origins":
            if value != "null" and not ORIGIN.fullmatch(value):
                raise ConfigError(
                    f"{flag}: {value!r} is not an origin: give scheme://host[:port] without a "
                    'path or a trailing slash (e.g. "https://app.example.com"), or "*" for any'
                )
            out.append(value)
        elif not TOKEN.fullmatch(value):
            what = "an HTTP method" if name == "allowed_methods" else "a header name"
            raise ConfigError(f'{flag}: {value!r} is not {what} (or "*" for any)')
        else:
            out.append(value.upper() if name == "allowed_methods" else value)
    return tuple(out)


def parse_cors_list(flag: str, text: str) -> tuple[str, ...]:
    """``--allowed-origins`` / ``--allowed-methods`` / ``--allowed-headers``: vLLM's JSON list,
    e.g. '["https://app.example.com"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{flag} takes a JSON list of strings such as '[\"https://app.example.com\"]' or "
            f"'[\"*\"]', got {text!r} ({e.msg})"
        ) from None
    return cors_list(flag.removeprefix("--").replace("-", "_"), value)


def config_from_args(
    args: argparse.Namespace,
    tokenizer_dir: str,
    default_name: str | None = None,
    model_dir: str | None = None,
) -> GatewayConfig:
    """``model_dir``: the model's files, where ``--generation-config auto`` reads
    generation_config.json (None: no such directory)."""
    names = args.served_model_name or []
    if isinstance(names, str):  # one name, as a caller building the namespace may give it
        names = [names]
    return GatewayConfig(
        tokenizer=tokenizer_dir,
        model=args.model,
        served_model_name=names[0] if names else default_name,
        served_model_aliases=tuple(dict.fromkeys(n for n in names[1:] if n != names[0])),
        chat_template=args.chat_template,
        allow_special_tokens_in_messages=getattr(args, "allow_special_tokens_in_messages", False),
        limit_mm_per_prompt=parse_mm_limit(getattr(args, "limit_mm_per_prompt", None)),
        allowed_media_domains=tuple(getattr(args, "allowed_media_domains", None) or ()),
        media_allow_http=getattr(args, "media_allow_http", False),
        media_fetch_timeout_s=getattr(args, "media_fetch_timeout", MEDIA_FETCH_TIMEOUT_S),
        media_max_bytes=getattr(args, "media_max_bytes", MEDIA_MAX_BYTES),
        workers=workers_from_args(args),
        discover=tuple(DiscoverySpec.parse(d) for d in getattr(args, "discover", None) or ()),
        discover_interval_s=getattr(args, "discover_interval", 5.0),
        api_key=api_key_from(args.api_key, os.environ)[0],
        allowed_origins=tuple(getattr(args, "allowed_origins", CORS_ANY)),
        allowed_methods=tuple(getattr(args, "allowed_methods", CORS_ANY)),
        allowed_headers=tuple(getattr(args, "allowed_headers", CORS_ANY)),
        allow_credentials=getattr(args, "allow_credentials", False),
        internal_token=token_from(getattr(args, "internal_token", None)),
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        request_timeout_s=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        send_timeout_s=getattr(args, "send_timeout", SEND_TIMEOUT_S),
        max_connections=args.max_connections,
        otlp_endpoint=args.otlp_endpoint,
        metrics_prefix=getattr(args, "metrics_prefix", "tandem:"),
        drain_timeout_s=getattr(args, "drain_timeout", 30.0),
        worker_stall_timeout_s=getattr(args, "worker_stall_timeout", WORKER_STALL_TIMEOUT_S),
        max_local_prefill_tokens=getattr(args, "max_local_prefill_tokens", 0),
        local_prefill_queue=getattr(args, "local_prefill_queue", 0),
        local_prefill_decode_load=getattr(args, "local_prefill_decode_load", 0),
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
        default_chat_template_kwargs=parse_default_chat_template_kwargs(
            getattr(args, "default_chat_template_kwargs", None)
        ),
        responses_store_size=getattr(args, "responses_store_size", RESPONSES_STORE_SIZE),
        responses_store_max_bytes=getattr(
            args, "responses_store_max_bytes", RESPONSES_STORE_MAX_BYTES
        ),
        generation_defaults=generation_defaults.load(
            getattr(args, "generation_config", "auto") or "auto",
            model_dir,
            getattr(args, "override_generation_config", None),
        ),
    )
