"""The ``tandem`` parser: flag validation and help text (no process is started)."""

from __future__ import annotations

import argparse

import pytest

from services.cli import build_parser

PORT_FLAGS = [
    ["up", "--port"],
    ["gateway", "--port"],
    ["prefill", "--port"],
    ["decode", "--port"],
    ["worker", "--port"],
    ["decode", "--port", "0", "--kv-port"],
    ["bench", "disagg", "--port"],
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


def test_help_names_each_worker_role_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "worker worker" not in out
    assert "run a colocated worker (gRPC)" in out
    assert "run a prefill worker (gRPC)" in out
