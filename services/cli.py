"""The ``tandem`` command: one parser for every role, handlers imported lazily.

The parser itself is torch-free so ``tandem gateway`` and ``tandem bench serve`` start fast and the
deployment tests can check every command line in docker-compose and Kubernetes against it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any


def _pin_gpus(args: argparse.Namespace) -> None:
    """A worker on ``--device cuda:N`` sees its GPUs only (services.device_pin), before torch."""
    import os

    from services.device_pin import gpu_count, pin_device

    device = getattr(args, "device", None)
    if device is None:  # parsed without the engine flags: nothing to pin
        return
    tp = getattr(args, "tensor_parallel_size", 1)
    args.device, visible = pin_device(device, tp, os.environ, gpu_count())
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        print(f"tandem {args.command}: --device {device}: this worker sees only GPU "
              f"{visible} (CUDA_VISIBLE_DEVICES), as {args.device}", file=sys.stderr)  # fmt: skip


def _up(args: argparse.Namespace) -> int:
    from deploy.launcher import main

    return main(args)


def _prefill(args: argparse.Namespace) -> int:
    _pin_gpus(args)
    from services.prefill.server import main

    return _out_of_memory_exits_2(main, args)


def _decode(args: argparse.Namespace) -> int:
    _pin_gpus(args)
    from services.decode.server import main

    return _out_of_memory_exits_2(main, args)


def _worker(args: argparse.Namespace) -> int:
    _pin_gpus(args)
    from services.worker.server import main

    return _out_of_memory_exits_2(main, args)


def _out_of_memory_exits_2(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:  # fmt: skip
    """``run(args)`` (a worker), with an allocation that fails as it starts (buffers sized by the
    batch flags, the KV pool) said in one line naming the flags, and status 2: the flags ask for
    more memory than there is. The engine's own step failures end the worker elsewhere."""
    try:
        return run(args)
    except (MemoryError, RuntimeError) as exc:
        if not _is_out_of_memory(exc):
            raise
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"tandem {args.command}: error: out of memory ({why}): lower --max-num-seqs "
              f"({getattr(args, 'max_num_seqs', '?')}), --max-num-batched-tokens or "
              "--max-model-len, or the KV pool (--gpu-memory-utilization, --kv-cache-gib, "
              "--num-blocks)", file=sys.stderr)  # fmt: skip
        return 2


def _is_out_of_memory(exc: BaseException) -> bool:
    """Python's MemoryError, torch's OutOfMemoryError (a GPU's), or the RuntimeError of torch's
    CPU and pinned-memory allocators (told by their message: torch is not imported here)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return "can't allocate memory" in text or "CUDA error: out of memory" in text


def _gateway(args: argparse.Namespace) -> int:
    """The gateway imports nothing of services: its model name and tokenizer are resolved here."""
    from gateway.http.server import main
    from protos.errors import ConfigError
    from services.model_files import gateway_tokenizer_dir, model_files_dir, served_model_name

    try:
        tokenizer_dir = gateway_tokenizer_dir(args.model, args.tokenizer)
    except ConfigError as e:
        print(f"tandem gateway: error: {e}", file=sys.stderr)
        return 2
    model_dir = model_files_dir(args.model, args.tokenizer, tokenizer_dir)
    return main(args, tokenizer_dir, served_model_name(args.model), model_dir)


def _compose(args: argparse.Namespace) -> int:
    from deploy.compose import main

    return main(args)


def _generate(args: argparse.Namespace) -> int:
    from services.engine.offline_cli import main

    return main(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from gateway.bench.serve import main

    return main(args)


def _bad_input_exits_2(command: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:  # fmt: skip
    """``run(args)``, with a ConfigError it raises as ``command: error: ...`` and status 2."""
    from protos.errors import ConfigError

    try:
        return run(args)
    except ConfigError as e:
        print(f"{command}: error: {e}", file=sys.stderr)
        return 2


def _bench_offline(args: argparse.Namespace) -> int:
    from services.engine.bench.in_process import main_offline

    return _bad_input_exits_2("tandem bench offline", main_offline, args)


def _bench_latency(args: argparse.Namespace) -> int:
    from services.engine.bench.in_process import main_latency

    return _bad_input_exits_2("tandem bench latency", main_latency, args)


def _bench_disagg(args: argparse.Namespace) -> int:
    from deploy.bench.disagg import main

    return main(args)


def _bench_kernels(args: argparse.Namespace) -> int:
    from kernels.bench.roofline import main

    return main(args)


# each command's handler imports its module only when it runs, so `tandem gateway` loads no torch
HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "up": _up,
    "serve": _up,  # vLLM's name: the same launcher
    "prefill": _prefill,
    "decode": _decode,
    "worker": _worker,
    "gateway": _gateway,
    "compose": _compose,
    "generate": _generate,
    "bench serve": _bench_serve,
    "bench offline": _bench_offline,
    "bench latency": _bench_latency,
    "bench disagg": _bench_disagg,
    "bench kernels": _bench_kernels,
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default after its help, except where there is none to show (None,
    False, an empty list) or the help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        default = action.default
        if default is None or default is False or default == [] or "(default" in help:
            return help
        return super()._get_help_string(action)


class TandemParser(argparse.ArgumentParser):
    """An unrecognized argument is reported by the deepest subcommand selected, with its usage
    (``usage: tandem gateway ...``, ``tandem gateway: error: ...``), not the top-level usage.
    ``expanded_argv``: the arguments it last parsed, a ``--config`` file's flags in place."""

    expanded_argv: Sequence[str] = ()

    def parse_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> Any:
        args = list(sys.argv[1:] if args is None else args)
        if args and args[0] in CONFIG_FILE_COMMANDS and self.prog == "tandem":
            command = next(subcommands(self)).choices[args[0]]
            try:
                args = with_config_file(args, command)
            except ConfigFileError as e:
                command.error(str(e))
        self.expanded_argv = args  # with its --config file's flags (check_up reads them)
        parsed, extras = self.parse_known_args(args, namespace)
        chosen = selected(self, parsed)
        for flag, note in VLLM_NO_OPS.items():
            if flag in extras:  # a vLLM flag that asks for what Tandem does anyway
                extras.remove(flag)
                print(f"{chosen.prog}: {flag}: {note}", file=sys.stderr)
        if extras:
            hints = [vllm_hint(arg, chosen) for arg in extras if arg.startswith("-")]
            text = "".join(f"\n  {h}" for h in hints if h)
            chosen.error(f"unrecognized arguments: {' '.join(extras)}{text}")
        model_tag = getattr(parsed, "model_tag", None)
        if model_tag is not None:  # `tandem serve MODEL`, as vLLM takes it
            if parsed.model not in ("embedded", model_tag):
                chosen.error(f"the model is given twice ({model_tag} and --model {parsed.model}): "
                             "give it once, as MODEL or as --model")  # fmt: skip
            parsed.model = model_tag
        return parsed


# vLLM's `serve --config FILE.yaml`: the commands that read flags from a YAML file
CONFIG_FILE_COMMANDS = ("up", "serve")


class ConfigFileError(ValueError):
    """A ``--config`` file that cannot be read as flags: what is wrong with it."""


def with_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` (a command and its flags) with the flags of its ``--config FILE`` in place of
    that option, as vLLM's ``serve --config`` reads them: a YAML mapping of long flag names
    (``max-model-len`` or ``max_model_len``) to values; true is a switch given, false one not
    given (``--no-X`` where the flag has that form), a list the flag's values, a mapping its
    JSON. Flags on the command line win over the file's (they come after them), and a MODEL
    or ``--model`` given there over the file's ``model``."""
    at = next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")),
              None)  # fmt: skip
    if at is None:
        return argv
    if "=" in argv[at]:
        path, rest = argv[at].split("=", 1)[1], argv[:at] + argv[at + 1 :]
    elif at + 1 < len(argv):
        path, rest = argv[at + 1], argv[:at] + argv[at + 2 :]
    else:
        raise ConfigFileError("--config needs a YAML file of flags (vLLM's serve --config)")
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            table = yaml.safe_load(f)
    except OSError as e:
        raise ConfigFileError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigFileError(
            f"--config {path} is not UTF-8 text (byte {e.start}): give a YAML file of flags"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigFileError(f"--config {path} is not valid YAML: {e}") from None
    if table is None:
        table = {}
    if not isinstance(table, dict):
        raise ConfigFileError(f"--config {path} must be a YAML mapping of flag names to values "
                              f"(max-model-len: 4096), got a {type(table).__name__}")  # fmt: skip
    given_model = any(a == "--model" or a.startswith("--model=") for a in rest)
    known, _ = parser.parse_known_args(rest[1:])
    if getattr(known, "model_tag", None) is not None:
        given_model = True
    flags: list[str] = []
    for key, value in table.items():
        name = str(key).strip().lstrip("-").replace("_", "-")
        if name == "config":
            raise ConfigFileError(f"--config {path}: a config file cannot name another")
        if name == "model" and given_model:
            continue  # the command line's model wins
        flag = f"--{name}"
        if flag not in parser._option_string_actions:
            hint = vllm_hint(flag, parser)
            raise ConfigFileError(f"--config {path}: {name!r} is not a flag of {parser.prog}"
                                  + (f" ({hint})" if hint else ""))  # fmt: skip
        switch = parser._option_string_actions[flag].nargs == 0  # --enforce-eager, not a value
        if switch != isinstance(value, bool) and value is not None:
            raise ConfigFileError(
                f"--config {path}: {name} is a switch: true or false, got {value!r}"
                if switch
                else f"--config {path}: {name} takes a value ({name}: VALUE), got {value!r}"
            )
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            if f"--no-{name}" in parser._option_string_actions:
                flags.append(f"--no-{name}")
        elif isinstance(value, list):
            flags += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return [rest[0], *flags, *rest[1:]]


# vLLM `serve` flags Tandem takes without a flag of its own: what it does anyway, said once
VLLM_NO_OPS = {
    "--trust-remote-code": "Tandem runs no code from model repositories; nothing to trust",
    "--enable-chunked-prefill": "Tandem always chunks long prompts (--max-num-batched-tokens "
    "tokens a step); nothing to enable",
}

# vLLM `serve` flags Tandem does not take: what to use instead (None: nothing)
VLLM_FLAGS: dict[str, str | None] = {
    "-tp": "--tensor-parallel-size",
    "-dp": "--colocated N or --decode N (N workers; the gateway spreads requests over them)",
    "--data-parallel-size": "--colocated N or --decode N (N workers; the gateway spreads "
    "requests over them)",
    "-pp": "--tensor-parallel-size (Tandem splits a model by tensor parallelism only)",
    "--pipeline-parallel-size": "--tensor-parallel-size (Tandem splits a model by tensor "
    "parallelism only)",
    "--no-enable-chunked-prefill": "--max-num-batched-tokens to size the chunk (Tandem always "
    "chunks long prompts)",
    "--disable-log-requests": None,
    "--enable-log-requests": None,
    "--disable-log-stats": None,
    "--uvicorn-log-level": None,
    "--max-logprobs": None,
    "--root-path": None,
    "--response-role": None,
    "--ssl-keyfile": "a TLS-terminating reverse proxy in front of the gateway",
    "--ssl-certfile": "a TLS-terminating reverse proxy in front of the gateway",
    "--download-dir": "a local model directory as MODEL or --model (Tandem downloads nothing)",
    "--revision": "the revision's local directory as MODEL or --model (Tandem downloads nothing)",
    "--swap-space": "--kv-offloading-size GIB, the nearest: host memory for the prefix "
    "cache's evicted blocks",
    "--disable-frontend-multiprocessing": None,
    "--runner": "--task generate or --task embed",
    "--tokenizer-mode": None,
    "--tokenizer": "a model directory with its tokenizer files beside config.json (the workers "
    "and the gateway read the model's own; `tandem gateway --tokenizer` alone takes another)",
    "--max-seq-len-to-capture": None,
    "-O": "--enforce-eager to run without CUDA graphs (Tandem has no compilation levels)",
    "--compilation-config": "--enforce-eager to run without CUDA graphs (Tandem has no "
    "compilation levels)",
}


def vllm_hint(arg: str, parser: argparse.ArgumentParser) -> str | None:
    """What to say of ``arg`` when it is a vLLM ``serve`` flag this command does not take."""
    flag = arg.split("=", 1)[0]
    if flag.startswith("-O") and not flag.startswith("--"):
        flag = "-O"  # -O3, -O.level=3
    if flag not in VLLM_FLAGS:
        return None
    instead = VLLM_FLAGS[flag]
    text = f"{flag} is a vLLM flag Tandem does not support"
    if instead is None:
        return text
    first = instead.split()[0]
    if first.startswith("--") and first not in parser._option_string_actions:
        return text  # what replaces it is not this command's
    return f"{text}; use {instead}"


class _Version(argparse.Action):
    """``--version``: the version GET /version reports (imported only when asked)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:  # fmt: skip
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from gateway.http.admin_api import version

        print(f"tandem {version()}")
        parser.exit()


def subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse._SubParsersAction]:
    return (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def selected(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The deepest (sub)parser that ``args`` chose, ``parser`` itself when it has none."""
    for action in subcommands(parser):
        name = getattr(args, action.dest, None)
        if name in action.choices:
            return selected(action.choices[name], args)
    return parser


def _every_parser(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in subcommands(parser):
        # the subcommand's one-line help becomes the description its own --help shows
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, sub in action.choices.items():
            if sub.description is None:
                sub.description = helps.get(name)
            yield from _every_parser(sub)


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _int(text, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _ready_file(text: str) -> str:
    """argparse type: a file this process can write (checked before a model loads, not when it
    is ready): its directory exists and is writable, and it is not a directory itself."""
    path = Path(text).expanduser()
    parent = path.parent
    if path.is_dir():  # "" too: the current directory
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: give a file's path")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: its directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {parent}")
    return str(path)


_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _tokens(text: str) -> int:
    """argparse type: a positive token count, plain or as vLLM writes one: 32k is 32000, 32K
    32768 (25.6k too; a binary suffix takes a whole number only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match is None:
        value = _int(text, "a positive number of tokens (e.g. 4096, 32k or 32K)")
    else:
        number, suffix = match.groups()
        if suffix in _DECIMAL_SUFFIXES:
            value = int(float(number) * _DECIMAL_SUFFIXES[suffix])
        elif "." in number:
            raise argparse.ArgumentTypeError(
                f"a binary suffix ({suffix}) takes a whole number, got {text!r}; did you mean "
                f"{number}{suffix.lower()}?"
            )
        else:
            value = int(number) * _BINARY_SUFFIXES[suffix]
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of tokens, got {text!r}")
    return value


def _number(text: str, accept: Callable[[float], bool], wanted: str) -> float:
    """argparse type: a finite number that ``accept`` takes (nan and inf never pass)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and accept(value)):
        raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
    return value


def _fraction(text: str) -> float:
    """argparse type: a fraction in (0, 1], checked before any worker starts."""
    return _number(text, lambda v: 0.0 < v <= 1.0, "a fraction in (0, 1] such as 0.9")


def _non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (0 usually turns something off)."""
    value = _int(text, "an integer >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _seconds_or_off(text: str) -> float:
    """argparse type: a number of seconds >= 0 (0 turns something off)."""
    return _number(text, lambda v: v >= 0, "seconds >= 0 (0: off)")


def _positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    return _number(text, lambda v: v > 0, "a positive number of seconds")


def _drain_seconds(text: str) -> float:
    """argparse type: --drain-timeout, a number of seconds >= 0 (0: no grace)."""
    return _number(text, lambda v: v >= 0, "a finite number of seconds >= 0 (0: no grace)")


def _positive_ms(text: str) -> float:
    """argparse type: a number of milliseconds > 0 (an SLO target)."""
    return _number(text, lambda v: v > 0, "a positive number of milliseconds")


def _batch_sizes(text: str) -> list[int]:
    """argparse type: comma-separated positive integers (1,64,256)."""
    try:
        sizes = [int(size) for size in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas (e.g. 1,64,256), got {text!r}"
        )
    return sizes


def _port(text: str) -> int:
    """argparse type for every port flag: 0-65535 (0 picks a free port)."""
    value = _int(text, "a port number (0-65535)")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (0-65535), got {text!r}")
    return value


DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's names


def _dtype(text: str) -> str:
    """argparse type of --dtype: vLLM's aliases (half, float) as the dtype they name."""
    return DTYPE_ALIASES.get(text, text)


def _load_format(text: str) -> str:
    """argparse type of --load-format: vLLM's safetensors is hf; .bin/.pt weights are refused."""
    if text in ("pt", "npcache"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: Tandem reads safetensors (a Hugging Face directory) or GGUF only; "
            "convert the checkpoint to safetensors"
        )
    return "hf" if text == "safetensors" else text


def add_model_args(p: argparse.ArgumentParser) -> None:
    from services.config import QUANTIZATION_METHODS

    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default="embedded",
        help="HF directory, .gguf file, a named config (llama-3.1-8b, ...) or 'embedded'",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        type=_load_format,
        choices=["auto", "dummy", "hf", "gguf"],
        help="where the weights come from: auto reads them from --model (hf and gguf do the "
        "same: the path decides); dummy makes random ones of the model's shape, for performance "
        "work (a named config always gets random weights); vLLM's safetensors is hf",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        type=_dtype,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and activation dtype; auto: float32 on the CPU, else bfloat16 (float16 for "
        "a float16 checkpoint); vLLM's half and float are float16 and float32",
    )
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATION_METHODS,
        help="quantized weights: fp8 (e4m3; a float checkpoint, or --load-format dummy, is "
        "quantized at load time), awq or gptq (4-bit checkpoints, group size 32, 64 or 128), "
        "compressed-tensors (llm-compressor's FP8 or W4A16 checkpoints); "
        "default: the checkpoint's quantization_config, if any. lm_head and the embeddings stay "
        "unquantized",
    )
    g.add_argument(
        "--max-model-len",
        type=_tokens,
        default=None,
        help="longest prompt + completion of one request, in tokens, as vLLM takes it: 32768, "
        "32k (32000) or 32K (32768) (default: the model's max_position_embeddings, at most "
        "131072; on the CPU at most 2048)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="the engine's random seed (as vLLM's): requests without a seed of their own sample "
        "the same output for the same sequence of requests, and the random weights of "
        "--load-format dummy and named configs follow it (default: none, a fresh draw each run)",
    )
    g.add_argument(
        "--dummy-weight-seed",
        type=int,
        default=None,
        help="seed of the random weights that --load-format dummy and named configs get (the "
        "same seed gives the same weights; default: --seed's, else 0)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help='the name clients put in "model" and /v1/models lists (default: the --model string '
        "for a model directory, as vLLM serves it; else the model's own name, e.g. "
        "SmolLM2-135M-Instruct); several names, as vLLM: each is accepted and listed, a "
        "response names the one asked for, metrics the first; only a gateway uses it (tandem "
        "up hands it to its gateway), the other commands ignore it",
    )


def _speculative_config(text: str) -> str:
    """Checked when parsed (so tandem up refuses it before starting anything); kept as JSON."""
    from services.config import ConfigError, SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config ")) from None
    return text


def _pooler_config(text: str) -> str:
    """Checked when parsed (so tandem up refuses it before starting anything); kept as JSON."""
    from services.config import ConfigError, PoolerConfig

    try:
        PoolerConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--pooler-config ")) from None
    return text


def add_task_args(p: argparse._ActionsContainer, colocated_only: str = "") -> None:
    """``--task`` and ``--pooler-config``: what a worker serves (vLLM's names)."""
    p.add_argument(
        "--task",
        choices=["generate", "embed"],
        default="generate",
        help="generate: /v1/completions and /v1/chat/completions; embed: /v1/embeddings (each "
        "prompt is prefilled and its final hidden states pooled into one vector; the other "
        f"endpoints answer 400){colocated_only}",
    )
    p.add_argument(
        "--pooler-config",
        type=_pooler_config,
        default=None,
        metavar="JSON",
        help='how --task embed pools, as vLLM takes it: \'{"pooling_type": "LAST", '
        "\"normalize\": true}' (the default for a causal LM: the last token's final hidden "
        "state, L2-normalized); pooling_type LAST, MEAN or CLS (the first token); MEAN and CLS "
        "compute every prompt whole (no prefix-cache hits)",
    )


def _max_num_seqs(text: str) -> int:
    """argparse type: --max-num-seqs, 1 to MAX_NUM_SEQS (services.config says why the bound)."""
    from services.config import MAX_NUM_SEQS

    value = _positive_int(text)
    if value > MAX_NUM_SEQS:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_NUM_SEQS} (the engine sizes each step's buffers for that "
            f"many sequences when it starts), got {text!r}"
        )
    return value


def _max_num_batched_tokens(text: str) -> int:
    """argparse type: --max-num-batched-tokens, 1 to MAX_NUM_BATCHED_TOKENS."""
    from services.config import MAX_NUM_BATCHED_TOKENS

    value = _tokens(text)
    if value > MAX_NUM_BATCHED_TOKENS:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_NUM_BATCHED_TOKENS} tokens (the engine sizes each step's "
            f"buffers for that many when it starts), got {text!r}"
        )
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from services.config import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS

    add_model_args(p)
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument(
        "--block-size",
        type=int,
        default=16,
        choices=[8, 16, 32, 64, 128],
        help="tokens per KV-cache block",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=_fraction,
        default=0.9,
        help="fraction (0-1] of the GPU's memory this worker may use: the KV pool gets what the "
        "weights, the CUDA context and an activation reserve leave of it; ignored on the CPU and "
        "under --kv-cache-gib or --num-blocks (tandem up divides the default between workers "
        "sharing a GPU)",
    )
    g.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="KV pool size in GiB, instead of --gpu-memory-utilization (default: from that on a "
        "GPU; on the CPU one sequence of --max-model-len)",
    )
    g.add_argument(
        "--kv-offloading-size",
        "--kv-offload-gib",
        dest="kv_offloading_gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="host memory (GiB) for the prefix cache's second tier: blocks the KV pool evicts "
        "are copied there and copied back on a later prefix hit instead of recomputed (pinned "
        "memory on a GPU; 0: off)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3"],
        help="KV cache element type: auto (the model's dtype) or fp8 (e4m3, scale 1.0: twice "
        "the blocks of a 16-bit cache in the same memory; a GPU needs compute capability 8.9+). "
        "Prefill and decode workers must agree",
    )
    g.add_argument(
        "--num-blocks",
        type=_positive_int,
        default=None,
        help="exact number of KV blocks; overrides --kv-cache-gib and --gpu-memory-utilization",
    )
    g.add_argument(
        "--max-total-tokens",
        type=_positive_int,
        default=None,
        help="at most this many tokens in the KV pool, whatever --gpu-memory-utilization or "
        "--kv-cache-gib would give (never fewer than one --max-model-len sequence; --num-blocks "
        "overrides it). tandem up sets it on a prefill worker that shares a GPU with a decode "
        "worker, which then gets the memory the prefill worker leaves",
    )
    g.add_argument(
        "--max-num-seqs",
        type=_max_num_seqs,
        default=256,
        help="most requests running in one batch (also the largest CUDA-graph batch); more "
        f"wait. At most {MAX_NUM_SEQS}: each step's buffers are sized for it when the worker "
        "starts",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=_max_num_batched_tokens,
        default=None,
        help="tokens per engine step, the chunk of a long prompt (8K or 8192; default: 8192 on a "
        "GPU, 128 on the CPU so a step, and so an abort or a new request's wait, stays short). "
        f"At most {MAX_NUM_BATCHED_TOKENS} (1M): each step's buffers are sized for it when the "
        "worker starts",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of equal prompt prefixes across requests (system prompts, "
        "multi-turn chat); --no-enable-prefix-caching turns it off",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and queue the next decode step while the GPU runs this one (steps "
        "with logprobs, penalties, logit_bias, min_tokens or a grammar run step by step); "
        "default: on a GPU (on the CPU a step queued ahead only holds the last one's tokens "
        "back); --no-async-scheduling waits for each step's tokens first",
    )
    g.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority"],
        help="fcfs: first come, first served; priority: by the request's priority field, lower "
        "first",
    )
    g.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        help="ranks (GPUs, or processes on the CPU) that split the model: rank 0 is the worker "
        "(or `tandem generate`) process, the others its child processes; a worker's KV "
        "transfers carry whole blocks, so prefill and decode workers may differ in it",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: run every decode step eagerly (slower; for debugging)",
    )
    g.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM takes it: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
        "(drafts from the request's own prompt and output) or "
        '\'{"method": "draft_model", "model": DIR_OR_NAME, "num_speculative_tokens": 4}\' '
        "(a smaller model with the same tokenizer, run greedily in the same worker with its "
        'own KV cache; "model" alone implies it); drafts are verified in one pass, where '
        "tokens are decoded: decode and colocated workers; disable_by_batch_size N turns "
        "drafting off from N decoding requests. Default: off",
    )

    add_lora_args(p)


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """vLLM's LoRA flags (every engine: workers, tandem up, tandem generate)."""
    g = p.add_argument_group("LoRA adapters")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters beside the base model: a request's model field names one "
        "(GET /v1/models lists them); a step may mix adapters and the base model",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters to serve, each a peft adapter directory (adapter_config.json and "
        "adapter_model.safetensors) under the name requests use (needs --enable-lora); an "
        'entry may also be vLLM\'s JSON: \'{"name": NAME, "path": PATH, "base_model_name": M}\' '
        "(M, where given, must be the served model: --model or --served-model-name)",
    )
    g.add_argument(
        "--max-loras",
        type=_positive_int,
        default=1,
        help="adapters resident on the device at once, and the most distinct adapters in one "
        "step; more may be registered (they take turns)",
    )
    g.add_argument(
        "--max-lora-rank",
        type=_positive_int,
        default=16,
        help="the largest adapter rank served (an adapter of a higher rank is refused at load)",
    )
    g.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); off: they are refused",
    )


INTERNAL_TOKEN_HELP = (
    "shared secret of the workers' gRPC API and KV rendezvous (default: $TANDEM_INTERNAL_TOKEN; "
    "none: unauthenticated, keep the ports on loopback); tandem up makes one per run"
)


KV_CHECKSUM_HELP = (
    "send a checksum of each KV chunk after it; the decode worker verifies it before the "
    "request runs, and a mismatch fails the transfer (both sides freed, counted in "
    "kv_transfer_failures). Costs a pass over the KV on each end"
)

KV_STREAMING = ["auto", "on", "off"]
KV_STREAMING_HELP = (
    "on: each prompt's KV leaves for the decode worker layer by layer while prefill computes "
    "its last chunk, so little is left to move after the first token; off: the whole KV is "
    "sent after the first token; auto (the default): off on a GPU (between two H200s streaming "
    "made decode steps up to 1.7x slower and gained no TTFT: docs/benchmarks.md), on on the CPU"
)


def add_server_args(p: argparse.ArgumentParser, role: str) -> None:
    add_engine_args(p)
    only = "" if role == "worker" else " (embed: colocated workers only, refused here)"
    add_task_args(p.add_argument_group("task"), only)
    g = p.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="gRPC bind address (0.0.0.0: every interface)"
    )
    g.add_argument("--port", type=_port, required=True, help="gRPC port (0 picks a free one)")
    g.add_argument("--worker-id", default=None, help=f"name of this {role} worker")
    g.add_argument("--internal-token", default=None, help=INTERNAL_TOKEN_HELP)
    g.add_argument(
        "--grpc-reflection",
        action="store_true",
        help="serve gRPC reflection (grpcurl, grpcui); off by default: it maps the internal API",
    )
    g.add_argument(
        "--drain-timeout",
        type=_drain_seconds,
        default=30.0,
        help="seconds in-flight requests get after SIGTERM",
    )
    if role in ("decode",):
        g.add_argument(
            "--lease-timeout", type=_positive_seconds, default=6.0,
            help="seconds an unclaimed reservation outlives its silent owner (a gateway polls "
            "every second; a dead one's reservations are freed this long after it stopped)",
        )  # fmt: skip
        g.add_argument("--kv-host", default=None, help="KV rendezvous address (default: --host)")
        g.add_argument("--kv-port", type=_port, default=0, help="KV rendezvous port (0 picks one)")
    g.add_argument(
        "--kv-timeout", type=_positive_seconds, default=10.0, help="seconds a KV transfer may take"
    )
    if role == "prefill":
        g.add_argument("--kv-checksum", action="store_true", help=KV_CHECKSUM_HELP)
        g.add_argument(
            "--kv-streaming", choices=KV_STREAMING, default="auto", help=KV_STREAMING_HELP
        )
    add_engine_stall_arg(g)
    g.add_argument(
        "--ready-file", type=_ready_file, default=None,
        help="write the bound ports here when ready",
    )  # fmt: skip


def reasoning_parsers() -> str:
    """The names --reasoning-parser takes, from the gateway's registry (torch-free)."""
    from gateway.flows.reasoning import PARSERS

    return ", ".join(sorted(PARSERS))


def add_output_parser_args(p: argparse.ArgumentParser, passed: str = "") -> None:
    """Tool calling and reasoning output: the gateway's flags (``tandem up`` passes them on)."""
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help=f'{passed}serve tool_choice "auto" (the default when a request gives tools): tool '
        "calls are read out of the model's text with --tool-call-parser; without it such requests "
        'get a 400 (tool_choice "required" or a named function always work)',
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help=f"{passed}how the model writes tool calls: hermes (<tool_call> JSON: Qwen, Hermes, "
        "SmolLM3), llama3_json (Llama 3.1+), mistral ([TOOL_CALLS]), qwen3_coder (<function=..> "
        "<parameter=..>: Qwen3-Coder), glm45 (<arg_key>/<arg_value>: GLM-4.5/4.6), deepseek_v3, "
        "deepseek_v31 (DeepSeek-V3/R1, V3.1), pythonic ([f(a=1)]: Llama 3.2/4)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help=f"{passed}put a reasoning model's thinking in message.reasoning_content: "
        f"{reasoning_parsers()} (deepseek_v3 thinks only when chat_template_kwargs sets "
        "thinking true, glm45 unless it sets it false); structured output then constrains only "
        "the answer",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help=f"{passed}the chat template's variables for every request, as vLLM's flag: "
        "'{\"enable_thinking\": false}' (Qwen3 answers without thinking unless a request's "
        "chat_template_kwargs says otherwise); a request's own keys win",
    )


MEDIA_MAX_BYTES = 20 * 1024 * 1024  # gateway.core.config's MEDIA_MAX_BYTES (not imported here)
MAX_BODY_BYTES = 4 * 1024 * 1024  # gateway.core.config's GatewayConfig.max_body_bytes
WORKER_STALL_TIMEOUT_S = 10.0  # gateway.core.config's WORKER_STALL_TIMEOUT_S (not imported here)
WORKER_STALL_HELP = (
    "seconds a worker may leave the gateway's health polls unanswered (frozen, hung) before the "
    "requests in flight on it end as a dead worker's do (a stream: an error frame, then [DONE]; "
    "else 503 worker_unavailable) and what they held elsewhere is aborted; it takes new requests "
    "again once it answers. Workers answer health polls on their event loop, not on the engine "
    "thread, so a long engine step does not delay them. Without this, such requests waited some "
    "40 s for the gRPC keepalive"
)


def add_engine_stall_arg(p: Any, passed: str = "") -> None:
    """``--engine-stall-timeout``: the workers' flag (``tandem up`` passes it on)."""
    from services.config import ENGINE_STALL_TIMEOUT_S

    p.add_argument(
        "--engine-stall-timeout",
        type=_seconds_or_off,
        default=ENGINE_STALL_TIMEOUT_S,
        metavar="SECONDS",
        help=passed + "seconds the engine may spend in one step before the worker stops serving "
        "(its health NOT_SERVING, with the engine thread's stack in its log): the gateway then "
        "ends or moves the requests on it as a dead worker's, and sends it new ones again once "
        "the step returns. A hung GPU kernel or collective would otherwise hold every request "
        "on the worker until its timeout; 0: never",
    )


SEND_TIMEOUT_S = 60.0  # gateway.core.config's GatewayConfig.send_timeout_s


def add_send_timeout_arg(p: argparse.ArgumentParser, passed: str = "") -> None:
    """``--send-timeout``: the gateway's flag (``tandem up`` passes it on)."""
    p.add_argument(
        "--send-timeout",
        type=_seconds_or_off,
        default=SEND_TIMEOUT_S,
        metavar="SECONDS",
        help=f"{passed}seconds a client may read nothing of a response the gateway has bytes "
        "for (its socket buffers full) before the connection is dropped and the request "
        "aborted, as nginx's send_timeout; 0: never (a client that stops reading holds its "
        "connection and request until it reads or leaves)",
    )


def add_otlp_arg(p: argparse.ArgumentParser, passed: str = "") -> None:
    """``--otlp-endpoint``: the gateway's flag (``tandem up`` passes it on, to its workers too)."""
    p.add_argument(
        "--otlp-endpoint",
        default=None,
        help=f"{passed}OTLP gRPC endpoint to export traces and metrics to (default: "
        "$OTEL_EXPORTER_OTLP_ENDPOINT; none: no export)",
    )


def add_worker_stall_arg(p: argparse.ArgumentParser, passed: str = "") -> None:
    """``--worker-stall-timeout``: the gateway's flag (``tandem up`` passes it on)."""
    p.add_argument(
        "--worker-stall-timeout",
        type=_positive_seconds,
        default=WORKER_STALL_TIMEOUT_S,
        help=passed + WORKER_STALL_HELP,
    )


def add_metrics_prefix_arg(p: argparse.ArgumentParser, passed: str = "") -> None:
    """``--metrics-prefix``: the gateway's flag (``tandem up`` passes it on)."""
    p.add_argument(
        "--metrics-prefix",
        default="tandem:",
        help=passed + "prefix of every Prometheus metric on /metrics (names, labels and buckets "
        "are vLLM V1's): vllm: makes vLLM's Grafana dashboards, alert rules and benchmark "
        "clients' server-metric summaries (aiperf's) work unchanged",
    )


RESPONSES_STORE_SIZE = 1000  # gateway.core.config's GatewayConfig.responses_store_size
RESPONSES_STORE_MAX_BYTES = 256 * 1024 * 1024  # ... and its responses_store_max_bytes


def add_responses_store_args(p: argparse.ArgumentParser, passed: str = "") -> None:
    """The Responses API's store of responses: the gateway's flags (``tandem up`` passes them
    on)."""
    p.add_argument(
        "--responses-store-size",
        type=_non_negative_int,
        default=RESPONSES_STORE_SIZE,
        metavar="N",
        help=f"{passed}responses of /v1/responses kept in the gateway's memory (store true, "
        "OpenAI's default) for previous_response_id and GET/DELETE /v1/responses/{id}, the "
        "least recently used dropped first; per gateway, so behind several gateways a "
        "conversation goes on through the one that made it. 0: none kept (store true is then "
        "a 400)",
    )
    p.add_argument(
        "--responses-store-max-bytes",
        type=_positive_int,
        default=RESPONSES_STORE_MAX_BYTES,
        metavar="BYTES",
        help=f"{passed}the kept responses' size in all (their JSON, input included; 256 MiB), "
        "the least recently used dropped first past it",
    )


def add_media_args(p: argparse.ArgumentParser, passed: str = "") -> None:
    """Image input limits and image URL fetching: the gateway's flags (``tandem up`` passes them
    on)."""
    p.add_argument(
        "--limit-mm-per-prompt",
        default=None,
        metavar="JSON",
        help=f"{passed}at most this many images per prompt, as vLLM's JSON: '{{\"image\": 2}}' "
        """or '{"image": {"count": 2}}' (video and audio are not supported: only a 0 limit, """
        """'{"image": 2, "video": 0}') (default: as many as fit the context); more get a 400""",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        action="extend",
        default=[],
        metavar="HOST",
        help=f"{passed}fetch image_url parts given as https URLs from these hosts only (exact "
        "names or IP addresses, *.example.com for its subdomains, * for any host); each "
        "redirect's target must be allowed too. Default: none, image URLs are refused (data "
        "URLs always work)",
    )
    p.add_argument(
        "--media-allow-http",
        action="store_true",
        help=f"{passed}fetch plain http image URLs too (default: https only)",
    )
    p.add_argument(
        "--media-fetch-timeout",
        type=_positive_seconds,
        default=5.0,
        metavar="SECONDS",
        help=f"{passed}seconds fetching one image URL may take in all, redirects included "
        "(else a 400)",
    )
    p.add_argument(
        "--media-max-bytes",
        type=_positive_int,
        default=MEDIA_MAX_BYTES,
        metavar="BYTES",
        help=f"{passed}largest image fetched from a URL, in bytes (20 MiB; past it the download "
        "stops and the request gets a 400)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=MAX_BODY_BYTES,
        metavar="BYTES",
        help=f"{passed}largest request body, in bytes (4 MiB; else 413); images sent inline as "
        "data URLs travel in it as base64, 4/3 of their size",
    )


def _generation_config(text: str) -> str:
    """argparse type of ``--generation-config``: auto, vllm, or a directory (made absolute)."""
    import os

    if text in ("auto", "vllm"):
        return text
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"takes auto, vllm or a directory holding generation_config.json, got {text!r}"
        )
    return os.path.abspath(text)


def _override_generation_config(text: str) -> str:
    """argparse type of ``--override-generation-config``: a JSON object of sampling keys,
    checked when parsed and passed on as given."""
    from gateway.core.generation_defaults import parse_override
    from protos.errors import ConfigError

    try:
        parse_override(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(
            str(e).removeprefix("--override-generation-config: ")
        ) from None
    return text


def add_generation_config_args(p: argparse.ArgumentParser, passed: str = "") -> None:
    """The model's recommended sampling defaults, vLLM's flags: the gateway's (``tandem up``
    passes them on)."""
    p.add_argument(
        "--generation-config",
        type=_generation_config,
        default="auto",
        metavar="auto|vllm|DIR",
        help=f"{passed}where requests' default sampling parameters come from, as in vLLM: auto "
        "reads the model's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty; max_new_tokens as the default max_tokens), vllm ignores it "
        "(neutral defaults: temperature 1, ...), DIR reads DIR/generation_config.json. A field "
        "the request sends always wins",
    )
    p.add_argument(
        "--override-generation-config",
        type=_override_generation_config,
        default=None,
        metavar="JSON",
        help=f"{passed}default sampling parameters that override or add to the generation "
        "config's, as a JSON object: '{\"temperature\": 0.5}' (keys: temperature, top_p, "
        "top_k, min_p, repetition_penalty, max_new_tokens)",
    )


def _cors_list(flag: str) -> Callable[[str], list[str]]:
    """argparse type of a CORS flag: vLLM's JSON list of strings, checked when parsed."""

    def parse(text: str) -> list[str]:
        from gateway.core.config import parse_cors_list
        from protos.errors import ConfigError

        try:
            return list(parse_cors_list(flag, text))
        except ConfigError as e:
            message = str(e).removeprefix(flag + ": ").removeprefix(flag + " ")
            raise argparse.ArgumentTypeError(message) from None

    return parse


def add_cors_args(p: argparse.ArgumentParser, passed: str = "") -> None:
    """CORS, vLLM's flags and defaults (any origin, method and header; no credentials): the
    gateway's flags (``tandem up`` passes them on)."""
    for name, what, example in (
        ("origins", "origins (scheme://host[:port]) browsers may call the API from", "https://app.example.com"),
        ("methods", "HTTP methods a cross-origin request may use", "POST"),
        ("headers", "request headers a cross-origin request may send", "Authorization"),
    ):  # fmt: skip
        p.add_argument(
            f"--allowed-{name}",
            type=_cors_list(f"--allowed-{name}"),
            default=["*"],
            metavar="JSON",
            help=f"{passed}CORS: the {what}, as vLLM's JSON list: '[\"{example}\"]'; "
            '["*"]: any, []: none',
        )
    p.add_argument(
        "--allow-credentials",
        action=argparse.BooleanOptionalAction,
        default=False,
        help=f"{passed}CORS: let browsers send cookies and HTTP auth on cross-origin requests "
        "(Access-Control-Allow-Credentials; with --allowed-origins '[\"*\"]' the caller's own "
        "origin is echoed back)",
    )


def _chat_template(text: str) -> str:
    """argparse type of ``--chat-template``: a file (made absolute, as the gateway tandem up
    starts may run elsewhere) or, as vLLM takes it, the template itself."""
    import os

    return os.path.abspath(text) if os.path.isfile(text) else text


def add_chat_template_arg(p: argparse.ArgumentParser, passed: str = "") -> None:
    p.add_argument(
        "--chat-template",
        type=_chat_template,
        default=None,
        metavar="FILE|TEMPLATE",
        help=passed + "the Jinja chat template to use instead of the tokenizer's: a file, or "
        "(as vLLM) the template itself, written on one line with \\n escapes",
    )


def add_request_limit_args(p: argparse.ArgumentParser, passed: str = "") -> None:
    """The gateway's SLO targets and its request and connection limits (``tandem up`` passes
    those given on to its gateway)."""
    p.add_argument(
        "--slo-ttft-ms",
        type=_positive_ms,
        default=1000.0,
        help=f"{passed}time-to-first-token target in ms: a request within it and --slo-tpot-ms "
        "counts in the request_goodput metric",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=_positive_ms,
        default=40.0,
        help=f"{passed}time-per-output-token target in ms (mean gap between tokens after the "
        "first)",
    )
    p.add_argument(
        "--request-timeout",
        type=_positive_seconds,
        default=600.0,
        help=f"{passed}seconds a request may take in all, queueing included; past it, it ends "
        "with 504",
    )
    p.add_argument(
        "--header-timeout",
        type=_positive_seconds,
        default=10.0,
        help=f"{passed}seconds a request's line and headers may take to arrive in all (else 408, "
        "closed)",
    )
    p.add_argument(
        "--body-timeout",
        type=_positive_seconds,
        default=60.0,
        help=f"{passed}seconds a request body may take to arrive in all (else the connection is "
        "closed)",
    )
    p.add_argument(
        "--max-connections",
        type=_positive_int,
        default=4096,
        help=f"{passed}open HTTP connections at most; one more is answered 503 and closed",
    )


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host", default="127.0.0.1", help="HTTP bind address (0.0.0.0: every interface)"
    )
    p.add_argument("--port", type=_port, default=8000, help="HTTP port (0 picks a free one)")
    p.add_argument("--model", default="embedded", help="model whose tokenizer the gateway uses")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: from --model)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help='the name clients put in "model" and /v1/models lists (default: the --model string '
        "for a model directory, as vLLM serves it; else the model's own name, e.g. "
        "SmolLM2-135M-Instruct); several names, as vLLM: each is accepted and listed, a "
        "response names the one asked for, metrics the first",
    )
    add_chat_template_arg(p)
    add_media_args(p)
    add_generation_config_args(p)
    p.add_argument(
        "--allow-special-tokens-in-messages",
        action="store_true",
        help="let special tokens typed inside chat messages (<|im_start|>...) act as control "
        "tokens; by default they are plain text, as OpenAI treats them",
    )
    p.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="gRPC address of a prefill worker (repeatable)",
    )
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="gRPC address of a decode worker (repeatable)",
    )
    p.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="gRPC address of a colocated worker (repeatable)",
    )
    p.add_argument(
        "--discover",
        action="append",
        default=[],
        metavar="ROLE=HOST:PORT",
        help="a DNS name whose records are workers of ROLE (prefill, decode or colocated), e.g. "
        "decode=decode.tandem.svc.cluster.local:50051 for a Kubernetes headless Service; "
        "resolved again every --discover-interval: workers that appear are used, those that "
        "leave are dropped (repeatable)",
    )
    p.add_argument(
        "--discover-interval",
        type=_positive_seconds,
        default=5.0,
        help="seconds between lookups of the --discover names",
    )
    p.add_argument("--config", default=None, help="YAML/JSON file listing workers")
    add_output_parser_args(p)
    p.add_argument(
        "--max-local-prefill-tokens",
        type=_non_negative_int,
        default=0,
        help="conditional disaggregation: prompts of at most this many tokens are prefilled by "
        "the decode worker itself (no prefill worker, no KV transfer); 0 always disaggregates",
    )
    p.add_argument(
        "--local-prefill-queue",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="conditional disaggregation: while every healthy prefill worker has at least N "
        "requests waiting or in prefill, any prompt is prefilled by the decode worker itself; "
        "0: off",
    )
    p.add_argument(
        "--local-prefill-decode-load",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="conditional disaggregation: while a request's decode worker has at least N other "
        "requests running or waiting, its prompt is prefilled by that decode worker itself "
        "(for decode workers that share their GPU with the prefill workers); 0: off",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on the API (default: $TANDEM_API_KEY, else "
        "$VLLM_API_KEY; neither: no key needed)",
    )
    add_cors_args(p)
    p.add_argument("--internal-token", default=None, help=INTERNAL_TOKEN_HELP)
    add_request_limit_args(p)
    add_send_timeout_arg(p)
    add_otlp_arg(p)
    add_metrics_prefix_arg(p)
    add_responses_store_args(p)
    p.add_argument(
        "--drain-timeout",
        type=_drain_seconds,
        default=30.0,
        help="seconds in-flight requests get after SIGTERM",
    )
    add_worker_stall_arg(p)
    p.add_argument(
        "--ready-file",
        type=_ready_file,
        default=None,
        help='write {"port", "host", "pid"} as JSON to this file once listening',
    )


def add_up_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_task_args(p, " (embed needs --colocated N: an embedding has no decode to disaggregate)")
    p.add_argument(
        "--kv-checksum", action="store_true", help=KV_CHECKSUM_HELP + " (prefill workers)"
    )
    p.add_argument("--kv-streaming", choices=KV_STREAMING, default="auto",
                   help=KV_STREAMING_HELP + " (prefill workers)")  # fmt: skip
    p.add_argument(
        "--max-local-prefill-tokens",
        type=_non_negative_int,
        default=0,
        help="conditional disaggregation (passed to the gateway): prompts of at most this many "
        "tokens are prefilled by the decode worker itself; 0 always disaggregates",
    )
    p.add_argument(
        "--local-prefill-queue",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="conditional disaggregation (passed to the gateway): while every prefill worker has "
        "at least N requests waiting or in prefill, prompts are prefilled by the decode worker "
        "itself; 0: off. Default: 1 when each decode worker shares its GPU with a prefill "
        "worker, else 0",
    )
    p.add_argument(
        "--local-prefill-decode-load",
        type=_non_negative_int,
        default=None,
        metavar="N",
        help="conditional disaggregation (passed to the gateway): while a request's decode "
        "worker has at least N other requests running or waiting, its prompt is prefilled by "
        "that decode worker; 0: off. Default: 1 when each decode worker shares its GPU with a "
        "prefill worker (a prefill on the same GPU takes it from the decodes either way), else 0",
    )
    add_output_parser_args(p, "(passed to the gateway) ")
    add_media_args(p, "(passed to the gateway) ")
    add_generation_config_args(p, "(passed to the gateway) ")
    add_chat_template_arg(p, "(passed to the gateway) ")
    p.add_argument("--port", type=_port, default=8000, help="gateway HTTP port")
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds the gateway gives in-flight requests on Ctrl-C/SIGTERM; the launcher waits "
        "that long plus a margin (at least TANDEM_UP_GRACE) before killing it",
    )
    add_worker_stall_arg(p, "(passed to the gateway) ")
    add_send_timeout_arg(p, "(passed to the gateway) ")
    add_request_limit_args(p, "(passed to the gateway) ")
    add_otlp_arg(p, "(passed to the gateway, and to the workers, whose traces it also gets, as "
                 "$OTEL_EXPORTER_OTLP_ENDPOINT) ")  # fmt: skip
    add_metrics_prefix_arg(p, "(passed to the gateway) ")
    add_responses_store_args(p, "(passed to the gateway) ")
    add_engine_stall_arg(p, "(passed to the workers) ")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument(
        "--colocated",
        type=_non_negative_int,
        default=0,
        help="number of colocated workers (replaces prefill/decode when > 0)",
    )
    p.add_argument("--gpus", default=None, help="comma-separated GPU ids to spread workers over")
    for role in ("prefill", "decode"):
        p.add_argument(
            f"--{role}-tensor-parallel-size",
            type=_positive_int,
            default=None,
            metavar="N",
            help=f"--tensor-parallel-size of the {role} workers only (default: "
            "--tensor-parallel-size)",
        )
    p.add_argument(
        "--api-key",
        default=None,
        help="the gateway requires 'Authorization: Bearer KEY' (handed to it in its environment, "
        "not on a command line; default: $TANDEM_API_KEY, else $VLLM_API_KEY; neither: no key "
        "needed)",
    )
    add_cors_args(p, "(passed to the gateway) ")
    p.add_argument(
        "--log-dir",
        default=None,
        help="directory for one log file per child (NAME.log) (default: a temporary one, removed "
        "after a clean exit)",
    )


def add_generate_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument(
        "--prompts-file", help='JSONL: {"prompt": ...} or {"messages": [...]} per line'
    )
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    p.add_argument(
        "--max-tokens", type=_positive_int, default=128, help="most tokens to generate per prompt"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling: keep the top tokens of this "
        "much probability, in (0, 1] (1: off)",
    )  # fmt: skip
    p.add_argument(
        "--top-k", type=int, default=0, help="sample among the k most likely tokens (0 or -1: off)"
    )
    p.add_argument(
        "--sampling-seed",
        "--sample-seed",
        dest="sampling_seed",
        type=int,
        default=None,
        help="seed of sampling, for the same output on every run at temperature > 0 (prompt i "
        "uses seed + i; default: none, a fresh draw each run)",
    )
    p.add_argument(
        "--lora-name",
        default=None,
        metavar="NAME",
        help="generate under this adapter of --lora-modules (default: the base model)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")


def add_bench_args(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    serve = bsub.add_parser("serve", help="serving benchmark against a running gateway")
    serve.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="the server's root URL (a trailing /v1 is fine)",
    )
    serve.add_argument(
        "--model",
        default=None,
        help='the "model" of every request (default: the first one /v1/models lists)',
    )
    serve.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory (or tokenizer.json) to make random text prompts of exactly "
        "--input-len tokens and count a file's (default: none: random token-id prompts, which "
        "only /v1/completions takes)",
    )
    serve.add_argument(
        "--endpoint",
        default="/v1/completions",
        choices=["/v1/completions", "/v1/chat/completions"],
        help="the API to load (chat needs --tokenizer or --prompts-file)",
    )
    serve.add_argument(
        "--input-len",
        type=_positive_int,
        default=1024,
        help="prompt tokens of each random prompt (unused with --prompts-file)",
    )
    serve.add_argument(
        "--output-len",
        type=_positive_int,
        default=128,
        help="tokens each request generates (EOS ignored; a prompts-file line's max_tokens wins)",
    )
    serve.add_argument(
        "--num-prompts",
        type=_positive_int,
        default=100,
        help="requests per rate (a prompts file is repeated or cut to this many)",
    )
    serve.add_argument(
        "--request-rate",
        action="append",
        default=None,
        help="requests/s of Poisson arrivals, or 'inf' (all at once); repeat, or give a comma "
        "list, for several rates (default: inf)",
    )
    serve.add_argument(
        "--max-concurrency",
        type=_positive_int,
        default=None,
        help="most requests in flight at once (default: no limit)",
    )
    serve.add_argument(
        "--prompts-file",
        default=None,
        help='JSONL of {"prompt": ...} or {"messages": [...]} (optional "max_tokens") per line, '
        "instead of random prompts",
    )
    serve.add_argument(
        "--slo-ttft-ms",
        type=_positive_ms,
        default=1000.0,
        help="time-to-first-token target in ms: goodput counts the requests within it and "
        "--slo-tpot-ms",
    )
    serve.add_argument(
        "--slo-tpot-ms",
        type=_positive_ms,
        default=40.0,
        help="time-per-output-token target in ms (mean gap between tokens after the first)",
    )
    serve.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random prompts and arrival times (the Nth rate, from 0, uses seed + N)",
    )
    serve.add_argument(
        "--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: none)"
    )
    serve.add_argument(
        "--json-out",
        default=None,
        help="write the config and one result per rate as JSON to this file (vllm bench serve's "
        "field names)",
    )
    serve.add_argument(
        "--plot",
        default=None,
        help="write a PNG of median/p90/p99 TTFT, TPOT, ITL and E2E latency against the rate to "
        "this file (needs matplotlib)",
    )
    for name in ("offline", "latency"):
        b = bsub.add_parser(name, help=f"{name} benchmark of the in-process engine")
        add_engine_args(b)
        offline = name == "offline"
        b.add_argument(
            "--num-prompts",
            type=_positive_int,
            default=256,
            help="random prompts, all submitted at once"
            if offline
            else "unused: the batches are --batch-sizes",
        )
        b.add_argument(
            "--input-len",
            type=_positive_int,
            default=1024,
            help="tokens of each random prompt"
            if offline
            else "context length of each sequence in the timed batches, in tokens",
        )
        b.add_argument(
            "--output-len",
            type=_positive_int,
            default=128,
            help="tokens generated per prompt (EOS ignored)"
            if offline
            else "decode steps timed per batch size",
        )
        b.add_argument(
            "--batch-sizes",
            type=_batch_sizes,
            default=None if offline else "1,64,256",
            help="with --compare-transformers: the transformers peer's batch sizes to sweep, "
            "each in its own process (default: 1,64,256)"
            if offline
            else "the decode batches to time, comma-separated",
        )
        if name == "offline":
            b.add_argument(
                "--image-size",
                type=_positive_int,
                default=None,
                metavar="PIXELS",
                help="a vision-language model (Qwen2-VL): each prompt opens with its own random "
                "PIXELS x PIXELS image (448: W1 with images); its tokens add to --input-len",
            )
            b.add_argument(
                "--compare-transformers",
                action="store_true",
                help="also time transformers generate, each batch size in its own fresh process "
                "before our engine starts; report the speed-up over its best",
            )
            b.add_argument(
                "--peer-num-prompts",
                type=_positive_int,
                default=None,
                metavar="N",
                help="with --compare-transformers: the peer times only the first N prompts "
                "(rounded up to whole batches; default: --num-prompts), to bound its sweep",
            )
        b.add_argument(
            "--json-out",
            default=None,
            help="also write the JSON report (printed anyway) to this file",
        )
    add_bench_disagg_args(
        bsub.add_parser("disagg", help="tandem up topologies under bench serve (W4, W6)")
    )
    k = bsub.add_parser("kernels", help="Triton kernels against the roofline (GPU)")
    k.add_argument("--json-out", default=None, help="also write the results as JSON to this file")
    k.add_argument("--check", action="store_true", help="correctness vs the torch references (GPU)")


def add_bench_disagg_args(d: argparse.ArgumentParser) -> None:
    add_engine_args(d)
    g = d.add_argument_group("benchmark")
    g.add_argument(
        "--topologies",
        default="disagg,colocated",
        help="disagg, colocated, disagg-local (disagg with --local-prefill-tokens), "
        "disagg-whole (disagg with --kv-streaming off: the whole KV after the first token), "
        "disagg-streamed (disagg with --kv-streaming on: the KV layer by layer) or none",
    )
    g.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=None,
        help="the disagg-local topology's --max-local-prefill-tokens: prompts of at most this "
        "many tokens are prefilled by the decode worker (default: 1024; only with disagg-local)",
    )
    g.add_argument(
        "--local-prefill-queue",
        type=int,
        default=None,
        help="the disagg-local topology's --local-prefill-queue: while every prefill worker has "
        "this many requests, prompts are prefilled by the decode worker (default: off; only "
        "with disagg-local)",
    )
    g.add_argument("--workloads", default="1024:128,4096:256", help="INPUT:OUTPUT,... lengths")
    g.add_argument(
        "--rates",
        action="append",
        default=None,
        help="request rates for every workload (2,4,8; 'inf' too) or for one (4096:256=1,2,4); "
        "repeatable",
    )
    g.add_argument("--num-prompts", type=_positive_int, default=200, help="most prompts per rate")
    g.add_argument(
        "--duration-s",
        type=float,
        default=30.0,
        help="send about rate x this many prompts per rate (0: always --num-prompts)",
    )
    g.add_argument("--min-prompts", type=_positive_int, default=16, help="fewest prompts per rate")
    g.add_argument(
        "--warmup-prompts",
        type=int,
        default=8,
        help="prompts sent before measuring, per topology and workload (0: no warm-up)",
    )
    g.add_argument("--gpus", default=None, help="GPU ids (default: all visible)")
    g.add_argument("--prefill-workers", type=_positive_int, default=None,
                   help="prefill workers of the disagg topology (default: half)")  # fmt: skip
    g.add_argument("--workers", type=_positive_int, default=2, help="workers without GPUs")
    g.add_argument("--port", type=_port, default=0, help="gateway HTTP port (0 picks a free one)")
    g.add_argument(
        "--out-dir",
        default="bench-disagg",
        help="directory for the per-run JSON, summary.json, summary.md, plots and logs",
    )
    g.add_argument("--time-budget-s", type=float, default=0.0,
                   help="skip the rates that would end past this (0: no limit)")  # fmt: skip
    g.add_argument(
        "--run-timeout-s", type=float, default=300.0, help="seconds one rate may run at most"
    )
    g.add_argument(
        "--ready-timeout-s",
        type=float,
        default=900.0,
        help="seconds a topology may take to start, model loading included",
    )
    g.add_argument(
        "--slo-ttft-ms",
        type=_positive_ms,
        default=1000.0,
        help="time-to-first-token target in ms: each rate's goodput and TTFT p90 are judged "
        "against it",
    )
    g.add_argument(
        "--slo-tpot-ms",
        type=_positive_ms,
        default=40.0,
        help="time-per-output-token target in ms: each rate's goodput and TPOT p90 are judged "
        "against it",
    )
    g.add_argument(
        "--prompt-seed",
        type=int,
        default=0,
        help="base seed of the prompts and arrival times (every workload and rate derives its own)",
    )
    g.add_argument("--stop-at-saturation", action=argparse.BooleanOptionalAction, default=True,
                   help="skip higher rates once under 10%% of requests meet the SLOs")  # fmt: skip
    g.add_argument("--gateway-overhead", action="store_true",
                   help="W6: in-process engine against gateway + --colocated 1, same workload")  # fmt: skip
    g.add_argument(
        "--overhead-num-prompts",
        type=_positive_int,
        default=None,
        help="prompts of the --gateway-overhead run (default: --num-prompts)",
    )
    g.add_argument("--synthetic-tokenizer", action=argparse.BooleanOptionalAction, default=True,
                   help="give a named config a word-level tokenizer so tokens stream as text")  # fmt: skip


def add_compose_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--gpus",
        required=True,
        help="the host's GPUs: a count (8 means 0-7), a range (0-7) or ids (0,2,4); one worker "
        "per GPU",
    )
    p.add_argument(
        "--prefill", type=int, default=None, help="prefill workers (default: 1, 0 with --colocated)"
    )
    p.add_argument(
        "--decode", type=int, default=None, help="decode workers (default: 1, 0 with --colocated)"
    )
    p.add_argument(
        "--colocated", type=int, default=0, help="colocated workers instead of prefill/decode"
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="ranks per worker: each worker gets N GPUs of --gpus (its own)",
    )
    p.add_argument("--port", type=_port, default=8000, help="the gateway's published HTTP port")
    p.add_argument(
        "--image", default="tandem:latest", help="image to run (TANDEM_IMAGE overrides it)"
    )
    # every worker serves the adapters; each --lora-modules directory (the host's) is mounted
    # read-only into the workers at /lora/NAME
    add_lora_args(p)


def build_parser() -> TandemParser:
    parser = TandemParser(prog="tandem", description="Disaggregated LLM serving")
    parser.add_argument("--version", "-V", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    add_up_args(sub.add_parser("up", help="gateway + prefill + decode workers on this machine"))
    add_up_args(sub.add_parser("serve", help="vLLM's `serve`: tandem serve MODEL [flags] is "
                               "tandem up --model MODEL [flags]"))  # fmt: skip
    for name in ("up", "serve"):
        sub.choices[name].add_argument(
            "model_tag", nargs="?", default=None, metavar="MODEL",
            help="the model, as --model takes it (vLLM's `serve MODEL`)",
        )  # fmt: skip
        sub.choices[name].add_argument(  # read before parsing: with_config_file
            "--config", metavar="FILE", default=None,
            help="flags from a YAML file, as vLLM's `serve --config`: long flag names to "
            "values; the command line wins over the file",
        )  # fmt: skip
    for role, what in (("prefill", "prefill"), ("decode", "decode"), ("worker", "colocated")):
        add_server_args(sub.add_parser(role, help=f"run a {what} worker (gRPC)"), role)
    add_gateway_args(sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway"))
    add_generate_args(sub.add_parser("generate", help="offline generation in this process"))
    add_compose_args(
        sub.add_parser("compose", help="print a docker-compose.yml for N GPUs, one worker each")
    )
    add_bench_args(sub)
    for each in _every_parser(parser):
        each.formatter_class = HelpFormatter
    return parser


# `tandem up` flags of the prefill/decode topology, which --colocated N replaces
DISAGGREGATED_ONLY = (
    "prefill", "decode", "kv_checksum", "kv_streaming", "max_local_prefill_tokens",
    "local_prefill_queue", "local_prefill_decode_load",
)  # fmt: skip


def check_up(
    args: argparse.Namespace, parser: argparse.ArgumentParser, argv: Sequence[str] = ()
) -> str | None:
    """Why ``tandem up``'s flags do not go together (None when they do): a prefill/decode flag
    beside --colocated N would be ignored, whether set away from its default or given at all
    in ``argv`` (the command line with its --config file's flags: ``--prefill 1`` too)."""
    if args.colocated == 0:
        return None
    words = {w.split("=", 1)[0] for w in argv if w.startswith("--")}

    def named(dest: str) -> bool:  # a flag of dest, or an abbreviation argparse took for one
        action = next(a for a in parser._actions if a.dest == dest)
        return any(o.startswith(w) and len(w) > 3 for w in words for o in action.option_strings)

    given = [
        "--" + dest.replace("_", "-")
        for dest in DISAGGREGATED_ONLY
        if getattr(args, dest) != parser.get_default(dest) or named(dest)
    ]
    if not given:
        return None
    return (
        f"--colocated replaces --prefill/--decode: {', '.join(given)} "
        f"{'is' if len(given) == 1 else 'are'} for prefill and decode workers only; give one "
        "or the other"
    )


def main(argv: Sequence[str] | None = None) -> int:
    from deploy.supervisor import follow_parent

    follow_parent()  # a child of `tandem up` (or of a test) ends with its parent
    parser = build_parser()
    args = parser.parse_args(argv)
    key = f"bench {args.bench}" if args.command == "bench" else args.command
    if key in ("up", "serve"):
        up = selected(parser, args)
        problem = check_up(args, up, parser.expanded_argv)
        if problem:
            up.error(problem)  # usage and the error on stderr, exit status 2
    return int(HANDLERS[key](args) or 0)


if __name__ == "__main__":
    sys.exit(main())
