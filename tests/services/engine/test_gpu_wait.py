"""Step results reach the host as lists, several tensors and dtypes in one read."""

from __future__ import annotations

import pytest
import torch

from services.engine.gpu_wait import GpuReader

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_reads_several_tensors_of_several_dtypes(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reader = GpuReader(torch.device(device))
    ids = torch.arange(5, device=device) * 7
    vals = torch.linspace(-1, 1, 6, device=device).view(2, 3)
    top = torch.arange(6, device=device).view(3, 2)
    for _ in range(2):  # the second read reuses the pinned buffers
        got = reader.read(ids, vals, top)
        assert got == [ids.tolist(), vals.tolist(), top.tolist()]
    big = torch.arange(5000, device=device)  # grows past the first buffer
    assert reader.read(big, ids) == [big.tolist(), ids.tolist()]


@pytest.mark.parametrize("device", DEVICES)
def test_a_started_read_returns_its_values_after_the_pending_work(device: str) -> None:
    """start() queues a launched step's tokens' copy; finish() runs the host work left by
    while_waiting, then returns them. The next start reuses the buffer (and grows it)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reader = GpuReader(torch.device(device))
    ran: list[str] = []
    for n in (3, 2000):
        tokens = torch.arange(n, device=device) * 3
        ticket = reader.start(tokens)
        reader.while_waiting(lambda: ran.append("work"))
        assert reader.finish(ticket) == tokens.tolist()
    assert ran == ["work", "work"]
    other = torch.arange(4, device=device, dtype=torch.int32)
    assert reader.finish(reader.start(other)) == [0, 1, 2, 3]


class _Refused(RuntimeError):
    pass


@pytest.mark.parametrize("device", DEVICES)
def test_values_the_check_refuses_are_not_returned(device: str) -> None:
    """``check`` runs once the values are on the host, before either read returns them (a
    tensor-parallel step whose collectives were aborted: its tokens are garbage)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reader = GpuReader(torch.device(device))
    tokens = torch.arange(4, device=device)
    assert reader.read(tokens) == [[0, 1, 2, 3]]  # no check
    calls: list[int] = []

    def refuse() -> None:
        calls.append(1)
        raise _Refused("aborted")

    reader.check = refuse
    with pytest.raises(_Refused):
        reader.read(tokens)
    with pytest.raises(_Refused):
        reader.finish(reader.start(tokens))
    assert len(calls) == 2
    reader.check = lambda: None
    assert reader.finish(reader.start(tokens)) == [0, 1, 2, 3]


def test_a_failed_wait_is_checked_too() -> None:
    """An aborted collective may make the wait itself raise a plain error: the check runs then
    as well, so the caller gets the check's error (the rank that died), not the plain one."""
    from services.engine.gpu_wait import Ticket

    class FailingEvent:
        def synchronize(self) -> None:
            raise RuntimeError("NCCL communicator was aborted")

    reader = GpuReader(torch.device("cpu"))
    reader._ahead_event = FailingEvent()  # type: ignore[assignment]

    def refuse() -> None:
        raise _Refused("rank 1 exited")

    reader.check = refuse
    with pytest.raises(_Refused):
        reader.finish(Ticket(view=torch.zeros(2)))
    reader.check = None
    with pytest.raises(RuntimeError, match="aborted"):
        reader.finish(Ticket(view=torch.zeros(2)))
