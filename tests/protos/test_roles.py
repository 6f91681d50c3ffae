"""One name per worker role; the older spellings still parse, anything else is a clear error."""

from __future__ import annotations

import pytest

from protos.errors import ConfigError
from protos.roles import Role


def test_roles_and_their_older_spellings() -> None:
    assert [r.value for r in Role] == ["prefill", "decode", "colocated"]
    assert Role.parse("colocated") is Role.COLOCATED
    assert Role.parse("both") is Role.COLOCATED  # what workers reported before
    assert Role.parse("worker") is Role.COLOCATED  # the command and the worker-file key
    assert Role.parse("prefill") is Role.PREFILL and Role.parse("decode") is Role.DECODE
    assert Role.COLOCATED == "colocated"  # a str: labels, logs and the wire read it as is


@pytest.mark.parametrize("bad", ["", "Prefill", "decoder", "both "])
def test_an_unknown_role_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match="worker role must be one of prefill, decode, colocated"):
        Role.parse(bad)
