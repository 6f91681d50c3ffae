"""vLLM ``serve`` flags as a vLLM user writes them (no process is started)."""

from __future__ import annotations

import json

import pytest

from services.cli import build_parser


@pytest.mark.parametrize(
    ("given", "tokens"),
    [("32768", 32768), ("32k", 32000), ("32K", 32768), ("25.6k", 25600), ("1m", 1000000),
     ("1M", 1048576), (" 4K", 4096)],
)  # fmt: skip
@pytest.mark.parametrize("flag", ["--max-model-len", "--max-num-batched-tokens"])
@pytest.mark.parametrize(
    "command", [["serve", "/m"], ["worker", "--port", "0"], ["generate", "--prompt", "hi"]]
)
def test_token_counts_take_vllms_suffixes(
    command: list[str], flag: str, given: str, tokens: int
) -> None:
    """As vLLM's human-readable integers: a lower-case suffix is decimal, an upper-case one
    binary (vLLM's `--max-model-len 32k` was an error here)."""
    args = build_parser().parse_args([*command, flag, given])
    assert getattr(args, flag[2:].replace("-", "_")) == tokens


@pytest.mark.parametrize(
    ("given", "message"),
    [("1.5K", "a binary suffix (K) takes a whole number, got '1.5K'; did you mean 1.5k?"),
     ("0", "expected a positive number of tokens, got '0'"),
     ("0k", "expected a positive number of tokens, got '0k'"),
     ("32x", "expected a positive number of tokens (e.g. 4096, 32k or 32K), got '32x'"),
     ("-1", "expected a positive number of tokens")],
)  # fmt: skip
def test_a_bad_token_count_is_one_argparse_error(
    given: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "/m", f"--max-model-len={given}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --max-model-len: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["serve", "/m"], ["up"], ["worker", "--port", "0"]])
def test_tokenizer_outside_the_gateway_says_where_the_tokenizer_comes_from(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's --tokenizer was a bare "unrecognized arguments" here."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*command, "--tokenizer", "/tok"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--tokenizer is a vLLM flag Tandem does not support; use a model directory" in err


def test_the_gateway_keeps_its_own_tokenizer_flag() -> None:
    assert build_parser().parse_args(["gateway", "--tokenizer", "/tok"]).tokenizer == "/tok"


@pytest.mark.parametrize("given", ["1.5", "0", "-0.1", "nan", "90%"])
def test_gpu_memory_utilization_outside_0_1_is_refused_when_parsed(
    given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was refused only by each worker once started (tandem up had prepared the model and
    started them first); vLLM refuses it when it reads its config."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "/m", "--gpu-memory-utilization", given])
    assert exc.value.code == 2
    assert f"expected a fraction in (0, 1] such as 0.9, got {given!r}" in capsys.readouterr().err


def test_gpu_memory_utilization_takes_a_fraction() -> None:
    args = build_parser().parse_args(["serve", "/m", "--gpu-memory-utilization", "1"])
    assert args.gpu_memory_utilization == 1.0


CONFIG = """\
# vLLM's serve --config form
model: /models/from-file
port: 6379
max_model_len: 32k
served-model-name: [chat, chat-v2]
enable-prefix-caching: false
enforce-eager: true
speculative-config: {method: ngram, num_speculative_tokens: 3}
"""


@pytest.mark.parametrize("command", ["serve", "up"])
def test_a_config_file_gives_flags_the_command_line_overrides(
    command: str, tmp_path: pytest.TempPathFactory
) -> None:
    """vLLM's `serve --config config.yaml`: long flag names (dashes or underscores) to values;
    the command line wins over the file (`serve MODEL` over its model too)."""
    path = tmp_path / "config.yaml"  # type: ignore[operator]
    path.write_text(CONFIG)
    args = build_parser().parse_args([command, "--config", str(path), "--port", "7000"])
    assert args.model == "/models/from-file" and args.port == 7000 and args.max_model_len == 32000
    assert args.served_model_name == ["chat", "chat-v2"] and args.enforce_eager
    assert args.enable_prefix_caching is False
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    named = build_parser().parse_args([command, "/models/cli", f"--config={path}"])
    assert named.model == "/models/cli" and named.port == 6379


@pytest.mark.parametrize(
    ("text", "message"),
    [("- a\n- b\n", "must be a YAML mapping of flag names to values"),
     ("port: [1, 2\n", "is not valid YAML"),
     ("no-such-flag: 1\n", "'no-such-flag' is not a flag of tandem serve"),
     ("root-path: /api\n", "--root-path is a vLLM flag Tandem does not support"),
     ("config: other.yaml\n", "a config file cannot name another"),
     ("enforce-eager: 1\n", "enforce-eager is a switch: true or false, got 1"),
     ("max-model-len: true\n", "max-model-len takes a value (max-model-len: VALUE), got True")],
)  # fmt: skip
def test_a_bad_config_file_is_one_argparse_error(
    text: str, message: str, tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"  # type: ignore[operator]
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--config", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--config", str(tmp_path / "missing.yaml")])  # type: ignore[operator]
    assert "cannot read it" in capsys.readouterr().err


def test_a_config_file_that_is_not_utf8_is_one_argparse_error(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "binary.yaml"  # type: ignore[operator]
    path.write_bytes(b"port: 1\n\xff\xfe\n")  # was a UnicodeDecodeError traceback, exit 1
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--config", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--config {path} is not UTF-8 text" in err and "Traceback" not in err
