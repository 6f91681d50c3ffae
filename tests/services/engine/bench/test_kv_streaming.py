"""The KV-streaming measurement runs end to end on a short prompt (its figure needs thousands of
tokens: ``python -m services.engine.bench.kv_streaming``)."""

from __future__ import annotations

import pytest

from services.engine.bench.kv_streaming import main

pytestmark = pytest.mark.timeout(120)


def test_both_paths_deliver_the_kv_and_report_their_times(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--prompt-len", "40", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert '"tail_over_whole"' in out and "bar 15%" in out
