"""The worker process's GIL switch interval, from ``TANDEM_SWITCH_INTERVAL_MS``."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from services.common.runtime import SWITCH_INTERVAL_ENV, gil_switch_interval
from services.config import ConfigError


@pytest.fixture(autouse=True)
def _restore_the_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_unset_leaves_pythons_interval_and_a_value_sets_it(
    monkeypatch: pytest.MonkeyPatch, _restore_the_interval: float
) -> None:
    monkeypatch.delenv(SWITCH_INTERVAL_ENV, raising=False)
    gil_switch_interval()
    assert sys.getswitchinterval() == _restore_the_interval
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, "20")
    gil_switch_interval()
    assert sys.getswitchinterval() == pytest.approx(0.02)


@pytest.mark.parametrize("raw", ["0", "-1", "fast", "5000"])
def test_a_bad_value_is_a_config_error_that_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, raw: str, _restore_the_interval: float
) -> None:
    monkeypatch.setenv(SWITCH_INTERVAL_ENV, raw)
    with pytest.raises(ConfigError, match=SWITCH_INTERVAL_ENV):
        gil_switch_interval()
    assert sys.getswitchinterval() == _restore_the_interval
