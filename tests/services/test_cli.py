"""The ``tandem`` parser: flag validation and help text (no process is started)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from services.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]

PORT_FLAGS = [
    ["up", "--port"],
    ["serve", "--port"],
    ["gateway", "--port"],
    ["prefill", "--port"],
    ["decode", "--port"],
    ["worker", "--port"],
    ["decode", "--port", "0", "--kv-port"],
    ["bench", "disagg", "--port"],
    ["compose", "--gpus", "0", "--port"],
]


def _port_flags_in(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> set[str]:
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= _port_flags_in(sub, (*path, name))
        elif any(o.endswith("port") for o in action.option_strings):
            found.add(" ".join((*path, action.option_strings[0])))
    return found


def test_every_port_flag_is_covered_here() -> None:
    expected = {" ".join([*f[:-3], f[-1]] if "0" in f else f) for f in PORT_FLAGS}
    assert _port_flags_in(build_parser()) == expected


@pytest.mark.parametrize("flag", PORT_FLAGS, ids=" ".join)
@pytest.mark.parametrize("value", ["99999", "65536", "-1", "http"])
def test_port_flags_out_of_range_are_an_argparse_error(
    flag: list[str], value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag[-1]}: expected a port number (0-65535), got '{value}'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag", PORT_FLAGS, ids=" ".join)
@pytest.mark.parametrize("value", ["0", "65535"])
def test_port_flags_accept_the_whole_range(flag: list[str], value: str) -> None:
    args = build_parser().parse_args([*flag, value])
    assert getattr(args, flag[-1].lstrip("-").replace("-", "_")) == int(value)


@pytest.mark.parametrize("value", ["abc", "0", "-3", "1.5"])
def test_positive_int_errors_read_well(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "--prompt", "hi", "--max-tokens", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --max-tokens: expected a positive integer, got '{value}'" in err
    assert "_positive_int" not in err


ENGINE_COMMANDS = {"up": [], "serve": [], "worker": ["--port", "0"], "prefill": ["--port", "0"],
                   "decode": ["--port", "0"], "generate": ["--prompt", "hi"]}  # fmt: skip


@pytest.mark.parametrize("command", sorted(ENGINE_COMMANDS))
@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--max-num-seqs", "1000000000", "expected at most 65536 (the engine sizes each step's"),
        ("--max-num-seqs", "65537", "expected at most 65536"),
        ("--max-num-batched-tokens", "1048577", "expected at most 1048576 tokens"),
        ("--max-num-batched-tokens", "2M", "expected at most 1048576 tokens"),
        ("--max-num-seqs", "0", "expected a positive integer"),
    ],
)
def test_batch_limits_past_the_engines_bounds_are_an_argparse_error(
    command: str, flag: str, value: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--max-num-seqs 1000000000 was an out-of-memory traceback once the model had loaded (the
    step buffers are sized for it); now refused at parse time, so tandem up starts nothing."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, *ENGINE_COMMANDS[command], flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {words}" in err
    assert "Traceback" not in err
    bounds = ["--max-num-seqs", "65536", "--max-num-batched-tokens", "1M"]
    args = build_parser().parse_args([command, *ENGINE_COMMANDS[command], *bounds])
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (65536, 1048576)


@pytest.mark.parametrize("role", ["prefill", "decode", "worker"])
@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                     "allocate memory: you tried to allocate 32000000000 bytes."),
        MemoryError(),
        type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate"),
    ],
    ids=["cpu", "python", "cuda"],
)  # fmt: skip
def test_a_worker_out_of_memory_as_it_starts_exits_2_in_one_line(
    role: str, failure: BaseException, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """Flags within the bounds can still ask for more memory than the machine has: the worker's
    allocation failure is one line naming the flags to lower, not a traceback."""
    import importlib

    from services.cli import HANDLERS

    module = importlib.import_module(f"services.{role}.server")

    def fail(args: argparse.Namespace) -> int:
        raise failure

    monkeypatch.setattr(module, "main", fail)
    args = argparse.Namespace(command=role, max_num_seqs=4096)
    assert HANDLERS[role](args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem {role}: error: out of memory (")
    assert "lower --max-num-seqs (4096), --max-num-batched-tokens or --max-model-len" in err
    assert err.count("\n") == 1


def test_a_worker_failing_otherwise_still_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.worker.server
    from services.cli import HANDLERS

    def fail(args: argparse.Namespace) -> int:
        raise RuntimeError("something else broke")

    monkeypatch.setattr(services.worker.server, "main", fail)
    with pytest.raises(RuntimeError, match="something else broke"):
        HANDLERS["worker"](argparse.Namespace(command="worker"))


@pytest.mark.parametrize("command", ["up", "gateway"])
@pytest.mark.parametrize(
    "flag", ["--local-prefill-queue", "--max-local-prefill-tokens", "--local-prefill-decode-load"]
)
@pytest.mark.parametrize("value", ["-1", "x", "2.5"])
def test_conditional_disaggregation_flags_take_counts_from_zero(
    command: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([command, flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected an integer >= 0, got '{value}'" in err
    assert "Traceback" not in err
    assert getattr(build_parser().parse_args([command, flag, "0"]), flag[2:].replace("-", "_")) == 0


def test_help_names_each_worker_role_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "worker worker" not in out
    assert "run a colocated worker (gRPC)" in out
    assert "run a prefill worker (gRPC)" in out


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command that takes options: ("gateway",), ("bench", "serve"), ... with its parser."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append(((*path, name), sub))
                found += _commands(sub, (*path, name))
    return found


COMMANDS = _commands(build_parser())


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def test_the_walk_sees_every_command() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"up", "gateway", "generate", "bench serve", "bench disagg", "bench kernels"} <= names
    assert sum(len(_options(p)) for _, p in COMMANDS) > 100


@pytest.mark.parametrize(("path", "parser"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_option_has_help(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    missing = [a.option_strings[0] for a in _options(parser) if not (a.help or "").strip()]
    assert not missing, f"tandem {' '.join(path)}: options without help: {missing}"


HelpOf = Callable[[tuple[str, ...]], str]


@pytest.fixture
def help_of(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> HelpOf:
    """``tandem PATH --help`` on a terminal too wide to wrap a line (argparse reads COLUMNS)."""
    monkeypatch.setenv("COLUMNS", "10000")

    def run(path: tuple[str, ...]) -> str:
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args([*path, "--help"])
        assert exc.value.code == 0
        return capsys.readouterr().out

    return run


def _entries(help_text: str) -> dict[str, str]:
    """The help of each option, unwrapped, by its first flag: '--port' -> '--port PORT HTTP ...'."""
    options = help_text.split("\n\n", 1)[1]  # past the usage, which names every flag too
    entries: dict[str, str] = {}
    current: list[str] = []
    for line in [*options.splitlines(), "end:"]:
        if line.startswith("  -") or not line.startswith(" "):  # a new option, a group title
            if current:
                entries[current[0].split()[0].rstrip(",")] = " ".join(" ".join(current).split())
            current = [line] if line.startswith("  -") else []
        elif current:
            current.append(line)
    return entries


@pytest.mark.parametrize(("path", "parser"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_help_shows_every_default(
    path: tuple[str, ...], parser: argparse.ArgumentParser, help_of: HelpOf
) -> None:
    text = help_of(path)
    assert text.startswith(f"usage: tandem {' '.join(path)} ")
    entries = _entries(text)
    for action in _options(parser):
        entry = entries[action.option_strings[0]]
        assert " ".join((action.help or "").split()[:3]).replace("%%", "%") in entry
        if action.default is None or action.default is False or action.default == []:
            continue  # nothing to show: the help says what an unset option means
        shown = f"(default: {action.default})"
        assert shown in entry, f"tandem {' '.join(path)} --help: {entry!r} lacks {shown}"


def test_help_shows_no_meaningless_default(help_of: HelpOf) -> None:
    out = help_of(("decode",))
    assert "(default: None)" not in out and "(default: False)" not in out
    assert "(default: 16)" in out and "(default: 6.0)" in out and "(default: True)" in out
    out = help_of(("gateway",))
    assert "(default: [])" not in out and "(default: 4194304)" in out


@pytest.mark.parametrize("path", [("gateway",), ("bench", "serve"), ("decode", "--port", "0")])
def test_an_unknown_flag_shows_the_subcommands_usage(
    path: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*path, "--bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    command = " ".join(p for p in path if not p.startswith("-") and p != "0")
    assert err.startswith(f"usage: tandem {command} [-h]"), err
    assert f"tandem {command}: error: unrecognized arguments: --bogus" in err
    assert "{up," not in err and "Traceback" not in err


def test_an_unknown_flag_from_the_command_line() -> None:
    """``tandem gateway --bogus`` as a user types it: the gateway's usage, exit 2."""
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", "gateway", "--bogus"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("usage: tandem gateway [-h]"), res.stderr
    assert res.stderr.rstrip().endswith("tandem gateway: error: unrecognized arguments: --bogus")
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_errors_other_than_unknown_flags_still_name_the_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tandem bench [-h]") and "tandem bench: error:" in err


@pytest.mark.parametrize("command", [["up"], ["decode", "--port", "0"], ["bench", "offline"]])
def test_seed_is_the_engines_seed_and_dummy_weight_seed_its_own_flag(command: list[str]) -> None:
    from services.engine.llm import config_from_args

    parse = build_parser().parse_args
    args = parse(command)
    assert (args.seed, args.dummy_weight_seed) == (None, None)
    args = parse([*command, "--seed", "7"])
    assert (args.seed, args.dummy_weight_seed) == (7, None)
    assert config_from_args(args).model.seed == 7
    assert config_from_args(args).model.weights_seed == 7  # vLLM's dummy weights follow it
    args = parse([*command, "--dummy-weight-seed", "3", "--seed", "7"])
    assert (config_from_args(args).model.seed, config_from_args(args).model.weights_seed) == (7, 3)


def test_seed_and_dummy_weight_seed_help_say_what_they_are(help_of: HelpOf) -> None:
    entries = _entries(help_of(("prefill",)))
    assert "--load-format dummy" in entries["--dummy-weight-seed"]
    assert "random seed" in entries["--seed"] and "without a seed of their own" in entries["--seed"]


def test_parse_args_still_returns_the_namespace() -> None:
    args = build_parser().parse_args(["bench", "serve", "--num-prompts", "3"])
    assert (args.command, args.bench, args.num_prompts) == ("bench", "serve", 3)


# every command's handler and the function it imports when it runs
HANDLER_TARGETS = {
    "up": ("deploy.launcher", "main"),
    "serve": ("deploy.launcher", "main"),
    "prefill": ("services.prefill.server", "main"),
    "decode": ("services.decode.server", "main"),
    "worker": ("services.worker.server", "main"),
    "compose": ("deploy.compose", "main"),
    "generate": ("services.engine.offline_cli", "main"),
    "bench serve": ("gateway.bench.serve", "main"),
    "bench offline": ("services.engine.bench.in_process", "main_offline"),
    "bench latency": ("services.engine.bench.in_process", "main_latency"),
    "bench disagg": ("deploy.bench.disagg", "main"),
    "bench kernels": ("kernels.bench.roofline", "main"),
}


@pytest.mark.parametrize("command", sorted(HANDLER_TARGETS))
def test_each_command_runs_its_module(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handlers import their module by name when they run (no importlib, nothing at import
    of the CLI): each one reaches the function it names, with the parsed flags."""
    import importlib

    from services.cli import HANDLERS

    module_name, func = HANDLER_TARGETS[command]
    module = importlib.import_module(module_name)
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(module, func, lambda args: seen.append(args) or 0)
    args = argparse.Namespace(command=command)
    assert HANDLERS[command](args) == 0
    assert seen == [args]


def test_the_gateway_command_resolves_its_tokenizer_and_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gateway imports nothing of services: `tandem gateway` resolves the tokenizer
    directory, the served name and the model's directory (its generation_config.json's) first,
    and a model without a tokenizer is a clean exit 2."""
    import gateway.http.server
    from services.cli import HANDLERS

    calls: list[tuple[str, str, str | None]] = []
    monkeypatch.setattr(
        gateway.http.server,
        "main",
        lambda args, tok, name, model_dir: calls.append((tok, name, model_dir)) or 0,
    )
    model = tmp_path / "My-Model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    args = argparse.Namespace(model=str(model), tokenizer=None)
    assert HANDLERS["gateway"](args) == 0
    assert calls == [(str(model), str(model), str(model))]
    missing = argparse.Namespace(model=str(tmp_path / "nothing"), tokenizer=None)
    assert HANDLERS["gateway"](missing) == 2
    assert "cannot find a tokenizer for --model" in capsys.readouterr().err
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["up", "--task", "embed"], "--task embed is served by colocated workers"),
        (["prefill", "--port", "0", "--task", "embed"], "served by a colocated worker"),
        (["prefill", "--port", "0", "--speculative-config", '{"method": "ngram"}'],
         "--speculative-config is for decode and colocated workers"),
        (["worker", "--port", "0", "--pooler-config", '{"pooling_type": "MEAN"}'],
         "--pooler-config is for --task embed"),
    ],
)  # fmt: skip
def test_task_embed_outside_a_colocated_worker_exits_2(argv: list[str], message: str) -> None:
    """Refused before anything starts or loads, with one line that says what to do."""
    done = subprocess.run([sys.executable, "-m", "services.cli", *argv], cwd=ROOT, timeout=120,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stdout + done.stderr


def test_a_bad_pooler_config_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["worker", "--port", "0", "--pooler-config", '{"x": 1}'])
    assert exit_.value.code == 2
    assert "key(s) not supported: x" in capsys.readouterr().err


@pytest.mark.parametrize("role", ["prefill", "decode", "worker"])
def test_a_worker_whose_model_cannot_be_split_exits_2_naming_the_cause(
    role: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Workers run several ranks; one whose heads do not split over them (the embedded model:
    3 KV heads, 9 query heads over 4 ranks) says why and exits 2 before any rank starts."""
    from services.cli import HANDLERS

    args = build_parser().parse_args([role, "--port", "0", "--tensor-parallel-size", "4"])
    assert HANDLERS[role](args) == 2
    err = capsys.readouterr().err  # an error, on stderr
    assert "--tensor-parallel-size 4: 3 KV heads and 9 query heads cannot be split" in err


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--prefill", "3"], "--prefill is"),
        (["--decode", "2", "--kv-checksum"], "--decode, --kv-checksum are"),
        (["--kv-streaming", "off"], "--kv-streaming is"),
        (["--max-local-prefill-tokens", "64"], "--max-local-prefill-tokens is"),
        (["--local-prefill-queue", "0"], "--local-prefill-queue is"),
        (["--local-prefill-decode-load", "2"], "--local-prefill-decode-load is"),
        (["--prefill", "1"], "--prefill is"),  # given, though at its default
        (["--decode=1"], "--decode is"),
        (["--kv-stream", "auto"], "--kv-streaming is"),  # an abbreviation argparse takes
    ],
)
def test_up_refuses_prefill_and_decode_flags_beside_colocated(
    extra: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["up", "--colocated", "1", *extra])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tandem up [-h]")
    assert f"tandem up: error: --colocated replaces --prefill/--decode: {named} for prefill" in err


def test_up_refuses_a_config_files_prefill_flag_beside_colocated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    (tmp_path / "up.yaml").write_text("colocated: 1\nprefill: 1\n")
    with pytest.raises(SystemExit) as exc:
        main(["up", "--config", str(tmp_path / "up.yaml")])
    assert exc.value.code == 2
    assert "--colocated replaces --prefill/--decode: --prefill is" in capsys.readouterr().err


def test_up_with_colocated_alone_passes_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import deploy.launcher
    from services.cli import main

    seen: list[argparse.Namespace] = []

    def launch(args: argparse.Namespace) -> int:
        seen.append(args)
        return 0

    monkeypatch.setattr(deploy.launcher, "main", launch)
    assert main(["up", "--colocated", "2", "--max-num-seqs", "8"]) == 0
    assert main(["up", "--prefill", "2", "--kv-checksum"]) == 0
    assert [a.colocated for a in seen] == [2, 0]


def test_up_colocated_takes_a_count_from_zero(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["up", "--colocated", "-1"])
    assert exc.value.code == 2
    assert "argument --colocated: expected an integer >= 0, got '-1'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["latency", "offline"])
@pytest.mark.parametrize("value", ["0", "abc", "-4", "1,,2", ""])
def test_batch_sizes_are_positive_integers(
    command: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", command, "--batch-sizes", value])
    assert exc.value.code == 2
    assert "expected positive integers separated by commas" in capsys.readouterr().err


def test_batch_sizes_parse_to_a_list() -> None:
    latency = build_parser().parse_args(["bench", "latency", "--batch-sizes", "1,8"])
    assert latency.batch_sizes == [1, 8]
    assert build_parser().parse_args(["bench", "latency"]).batch_sizes == [1, 64, 256]
    assert build_parser().parse_args(["bench", "offline"]).batch_sizes is None


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--batch-sizes", "2"], "--batch-sizes is the transformers peer's"),
        (["--peer-num-prompts", "2"], "--peer-num-prompts is the transformers peer's"),
    ],
)
def test_offline_peer_flags_without_the_peer_exit_2(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.cli import main

    assert main(["bench", "offline", *flags]) == 2  # before any engine is built
    err = capsys.readouterr().err
    assert err.startswith(f"tandem bench offline: error: {words}") and "Traceback" not in err


@pytest.mark.parametrize("argv", [["serve", "/models/x"], ["serve", "--model", "/models/x"],
                                  ["up", "/models/x"], ["up", "--model", "/models/x"]])  # fmt: skip
def test_serve_is_tandem_up_with_the_model_first_as_vllm_takes_it(argv: list[str]) -> None:
    from services.cli import HANDLERS

    args = build_parser().parse_args([*argv, "--decode", "2"])
    assert args.model == "/models/x" and args.decode == 2 and args.prefill == 1
    assert HANDLERS[args.command] is HANDLERS["up"]  # one launcher


def test_serve_refuses_two_different_models(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "/a", "--model", "/b"])
    assert exc.value.code == 2
    assert "give it once, as MODEL or as --model" in capsys.readouterr().err


def test_serve_help_says_it_is_vllms_serve(help_of: HelpOf) -> None:
    assert "vLLM's `serve`" in help_of(("serve",))


def test_serve_from_the_command_line_checks_flags_as_up_does() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "m", "--colocated", "1", "--decode", "2"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2 and "--colocated replaces" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ["up", "-tp", "2"],
            "-tp is a vLLM flag Tandem does not support; use --tensor-parallel-size",
        ),
        (["serve", "m", "--swap-space", "4"], "use --kv-offloading-size"),
        (["up", "-O3"], "-O is a vLLM flag Tandem does not support; use --enforce-eager"),
        (["up", "--ssl-keyfile=k.pem"], "--ssl-keyfile is a vLLM flag Tandem does not support"),
        (["up", "--disable-log-requests"], "--disable-log-requests is a vLLM flag Tandem does not"),
        (["up", "--no-enable-chunked-prefill"], "Tandem always chunks long prompts"),
        (["up", "-pp", "2"], "-pp is a vLLM flag Tandem does not support"),
        (["gateway", "-tp", "2"], "-tp is a vLLM flag Tandem does not support\n"),
    ],
)
def test_a_vllm_flag_tandem_lacks_is_named_as_such(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: unrecognized arguments:" in err and words in err + "\n", err


def test_the_gateway_names_no_replacement_it_does_not_have(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "-tp", "2"])
    assert "--tensor-parallel-size" not in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--trust-remote-code", "--enable-chunked-prefill"])
def test_vllm_flags_asking_for_what_tandem_does_anyway_are_accepted_with_one_line(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(["serve", "m", flag])
    assert args.model == "m"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"tandem serve: {flag}: ")


def test_trust_remote_code_says_why_nothing_is_trusted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    build_parser().parse_args(["up", "--trust-remote-code"])
    assert "Tandem runs no code from model repositories; nothing to trust" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(("given", "dtype"), [("half", "float16"), ("float", "float32"),
                                              ("bfloat16", "bfloat16"), ("auto", "auto")])  # fmt: skip
def test_vllms_dtype_aliases_name_the_same_dtype(given: str, dtype: str) -> None:
    assert build_parser().parse_args(["up", "--dtype", given]).dtype == dtype


def test_load_format_safetensors_is_hf_and_pt_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert build_parser().parse_args(["up", "--load-format", "safetensors"]).load_format == "hf"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["up", "--load-format", "pt"])
    assert exc.value.code == 2
    assert "convert the checkpoint to safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_what_get_version_reports(flag: str) -> None:
    from gateway.http.admin_api import version

    res = subprocess.run(
        [sys.executable, "-m", "services.cli", flag],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0 and res.stdout == f"tandem {version()}\n", res.stderr


@pytest.mark.parametrize("command", [("up",), ("gateway",)])
def test_reasoning_parser_help_lists_every_registered_parser(
    command: tuple[str, ...], help_of: HelpOf
) -> None:
    from gateway.flows.reasoning import PARSERS

    entry = " ".join(_entries(help_of(command))["--reasoning-parser"].split())
    assert len(PARSERS) >= 3
    for name in PARSERS:
        assert name in entry


@pytest.mark.parametrize("role", ["prefill", "decode", "worker", "gateway"])
def test_a_ready_file_that_cannot_be_written_is_refused_before_anything_loads(
    role: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked as the flags are parsed (exit 2), not once the model has loaded."""
    for path, words in (
        (tmp_path / "no" / "r.json", "its directory"),
        (tmp_path, "is a directory"),
    ):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args([role, "--port", "0", "--ready-file", str(path)])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --ready-file:" in err and words in err
    args = build_parser().parse_args([role, "--port", "0", "--ready-file", str(tmp_path / "r")])
    assert args.ready_file == str(tmp_path / "r")


# Number flags whose bad values once passed the parser: a worker's --kv-timeout 0 was a
# traceback after the model loaded, its --drain-timeout -1 was taken, and a gateway's
# --discover-interval nan broke its discovery loop (--request-timeout nan, inf: never enforced)
SECONDS_FLAGS = [
    (["prefill", "--port", "0"], "--kv-timeout", ["0", "-3", "nan", "inf"]),
    (["decode", "--port", "0"], "--kv-timeout", ["0", "nan"]),
    (["worker", "--port", "0"], "--drain-timeout", ["-1", "nan", "inf"]),
    (["decode", "--port", "0"], "--drain-timeout", ["-1", "nan"]),
    (["gateway"], "--drain-timeout", ["-1", "nan"]),
    (["gateway"], "--request-timeout", ["0", "-1", "nan", "inf"]),
    (["gateway"], "--header-timeout", ["0", "nan"]),
    (["gateway"], "--body-timeout", ["-1", "nan"]),
    (["gateway"], "--discover-interval", ["0", "nan", "inf"]),
    (["gateway"], "--slo-ttft-ms", ["0", "-1", "nan"]),
    (["gateway"], "--slo-tpot-ms", ["nan", "inf"]),
    (["gateway"], "--max-connections", ["0", "-5", "x"]),
]


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [(c, f, v) for c, f, values in SECONDS_FLAGS for v in values],
    ids=lambda x: " ".join(x) if isinstance(x, list) else str(x),
)
def test_time_and_count_flags_refuse_what_cannot_work(
    command: list[str], flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*command, flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected" in err and repr(value) in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("command", "flag", "value", "expected"),
    [(["worker", "--port", "0"], "--drain-timeout", "0", 0.0),
     (["prefill", "--port", "0"], "--kv-timeout", "2.5", 2.5),
     (["gateway"], "--request-timeout", "30", 30.0),
     (["gateway"], "--slo-tpot-ms", "25", 25.0),
     (["gateway"], "--max-connections", "8", 8)],
)  # fmt: skip
def test_time_and_count_flags_take_good_values(
    command: list[str], flag: str, value: str, expected: float
) -> None:
    args = build_parser().parse_args([*command, flag, value])
    assert getattr(args, flag[2:].replace("-", "_")) == expected
