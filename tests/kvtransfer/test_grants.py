"""Blocks granted ahead, fenced (kvtransfer.grants): the states a grant goes through, taking
it back against a copy, and the grant as plain data. The fence's GPU atomics are tested
against their reference in tests/kernels/test_triton_block_copy.py; the two processes on one
GPU in tests/kvtransfer/test_gpu.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kernels.block_copy import RefBlockCopier
from kvtransfer.grants import CLAIMED, GRANTED, LANDED, REVOKED, Grant, GrantTable

CPU = torch.device("cpu")


def pools() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    src = [torch.randn((2, 8, 2, 1, 4), generator=gen) for _ in range(2)]
    return src, [torch.zeros_like(c) for c in src]


def push(table: GrantTable, grant: Grant, src: list[torch.Tensor], dst: list[torch.Tensor], ids: list[int]) -> None:  # fmt: skip
    meta = torch.tensor([grant.token, grant.slot, len(ids), *ids, *grant.blocks])
    RefBlockCopier(dst).push_from(RefBlockCopier(src), meta, table.fence)


def test_a_grant_lands_once_and_a_late_copy_of_it_writes_nothing() -> None:
    table, (src, dst) = GrantTable(CPU, 2), pools()
    grant = table.grant([5, 1])
    assert grant is not None and grant.blocks == (5, 1) and table.phase(grant) == GRANTED
    push(table, grant, src, dst, [0, 3])
    assert table.phase(grant) == LANDED
    assert torch.equal(dst[1][:, 5], src[1][:, 0]) and torch.equal(dst[0][:, 1], src[0][:, 3])
    table.settle(grant, 1.0)  # landed: nothing to take back
    assert table.phase(grant) == LANDED
    table.release(grant)
    again = table.grant([5, 1])  # the slot again, for another transfer
    assert again is not None and again.slot == grant.slot and again.token != grant.token
    before = [c.clone() for c in dst]
    push(table, grant, [torch.ones_like(c) for c in src], dst, [0, 3])  # the old grant, late
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))
    assert table.phase(again) == GRANTED


def test_revoked_before_the_copy_runs_nothing_is_written() -> None:
    table, (src, dst) = GrantTable(CPU, 1), pools()
    grant = table.grant([2])
    assert grant is not None
    assert table.revoke(grant) == GRANTED  # taken back: no copy of it will ever write
    push(table, grant, src, dst, [0])
    assert table.phase(grant) == REVOKED and all(not c.any() for c in dst)
    assert table.revoke(grant) == REVOKED  # idempotent


def test_settle_waits_for_a_claimed_copy_to_land() -> None:
    table = GrantTable(CPU, 1)
    grant = table.grant([0])
    assert grant is not None
    table.fence[grant.slot, 0] = grant.token + CLAIMED  # a copy claimed it and is writing
    assert table.revoke(grant) == CLAIMED and table.phase(grant) == CLAIMED  # cannot take it

    def land() -> None:
        time.sleep(0.05)
        table.fence[grant.slot, 0] = grant.token + LANDED

    lander = threading.Thread(target=land)
    start = time.monotonic()  # before the lander's sleep begins: it cannot land sooner
    lander.start()
    table.settle(grant, 5.0)
    assert table.phase(grant) == LANDED and time.monotonic() - start >= 0.04
    lander.join()


def test_settle_gives_up_on_a_copy_that_never_lands(caplog: pytest.LogCaptureFixture) -> None:
    table = GrantTable(CPU, 1)
    grant = table.grant([0])
    assert grant is not None
    table.fence[grant.slot, 0] = grant.token + CLAIMED  # its sender died with the copy queued
    table.settle(grant, 0.05)
    assert "did not land" in caplog.text


def test_slots_run_out_and_come_back() -> None:
    table = GrantTable(CPU, 2)
    a, b = table.grant([0]), table.grant([1])
    assert a is not None and b is not None and a.slot != b.slot
    assert table.grant([2]) is None  # every slot taken: the sender asks as usual
    assert table.grant([]) is None  # nothing to grant
    table.settle(a, 1.0)
    table.release(a)
    c = table.grant([2])
    assert c is not None and c.slot == a.slot and c.token > b.token
    with pytest.raises(ValueError, match="slots"):
        GrantTable(CPU, 0)


def test_a_slot_that_holds_another_grant_is_refused_loudly() -> None:
    table = GrantTable(CPU, 1)
    grant = table.grant([0])
    assert grant is not None
    table.fence[grant.slot, 0] = grant.token + 40  # not this grant's token: a bug, not a race
    with pytest.raises(RuntimeError, match="not grant"):
        table.phase(grant)


def test_grants_travel_as_plain_data() -> None:
    grant = Grant("pool-a", 3, 8, (4, 0, 9))
    assert Grant.from_json(grant.to_json()) == grant
    good = grant.to_json()
    for bad in (
        [1],
        {**good, "extra": 1},
        {**good, "pool": ""},
        {**good, "slot": -1},
        {**good, "slot": True},
        {**good, "token": 6},  # not a multiple of 4: not a token
        {**good, "blocks": []},
        {**good, "blocks": [1, "2"]},
        {**good, "blocks": [-1]},
    ):
        with pytest.raises(ValueError, match="grant"):
            Grant.from_json(bad)
