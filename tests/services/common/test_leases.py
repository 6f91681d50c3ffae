"""Leases: an owner's sign of life keeps its state; silence past the timeout lapses it."""

from __future__ import annotations

import pytest

from services.common import leases as leases_module
from services.common.leases import Leases


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(leases_module.time, "monotonic", fake)
    return fake


def test_an_owner_lapses_only_after_the_timeout_of_silence(clock: Clock) -> None:
    leases = Leases(timeout_s=5.0)
    leases.renew("gw-a")
    clock.now += 4.9
    assert not leases.lapsed("gw-a")
    leases.renew("gw-a")  # a poll
    clock.now += 4.9
    assert not leases.lapsed("gw-a")
    clock.now += 0.2
    assert leases.lapsed("gw-a")
    assert leases.lapsed("never-seen")
    assert not leases.lapsed("")  # no owner: no lease to lapse


def test_long_gone_owners_are_forgotten(clock: Clock) -> None:
    leases = Leases(timeout_s=1.0)
    leases.renew("old")
    clock.now += 11
    leases.renew("new")
    leases.forget_lapsed()
    assert set(leases._seen) == {"new"}


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="lease-timeout"):
        Leases(0)
