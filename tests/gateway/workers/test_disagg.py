"""The disaggregated flow's guard on a lost decode worker (``_Run.unless_decode_lost``): a
prefill that fails because its KV could not reach the decode side is reported as the decode
worker gone once the health poll sees it, whichever side noticed first."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.core.errors import APIError
from gateway.workers.disagg import _Run
from gateway.workers.rpc_errors import UpstreamError

POLL_S = 0.05


def _run(lost: asyncio.Event) -> _Run:
    ctx: Any = SimpleNamespace(config=SimpleNamespace(health_interval_s=POLL_S))
    run = _Run(ctx, item=None, parent=None, prefill=None)  # type: ignore[arg-type]
    run.decode = SimpleNamespace(  # type: ignore[assignment]
        until_lost=lost.wait,
        name="decode-1",
        address="decode:1",
        last_error="health poll failed: UNAVAILABLE",
    )
    return run


def _prefill_error(status: str) -> UpstreamError:
    api = APIError(
        502, f"Prefill on worker p:1 failed ({status}): KV transfer ...", code="worker_error"
    )
    return UpstreamError(api, retryable=True, address="p:1", status=status)


async def _fails(status: str) -> None:
    raise _prefill_error(status)


async def test_a_refused_kv_transfer_is_the_decode_worker_gone_once_the_poll_sees_it() -> None:
    lost = asyncio.Event()
    asyncio.get_running_loop().call_later(POLL_S, lost.set)  # the poll notices after the prefill
    with pytest.raises(UpstreamError) as err:
        await _run(lost).unless_decode_lost(_fails("ABORTED"))
    assert err.value.api_error.code == "worker_unavailable" and err.value.worker_down
    assert "decode-1" in err.value.api_error.message  # its name: the client sees no address
    assert "decode:1" not in err.value.api_error.message and "decode:1" in err.value.detail


async def test_a_refused_transfer_to_a_live_decode_worker_keeps_its_error() -> None:
    """No death seen within the grace (two polls): the prefill worker's own error."""
    with pytest.raises(UpstreamError) as err:
        await _run(asyncio.Event()).unless_decode_lost(_fails("ABORTED"))
    assert err.value.api_error.code == "worker_error"


async def test_other_prefill_errors_pass_at_once() -> None:
    lost = asyncio.Event()
    lost.set()  # even with the decode worker gone: an INTERNAL is the prefill worker's own
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(UpstreamError) as err:
        await _run(lost).unless_decode_lost(_fails("INTERNAL"))
    assert err.value.api_error.code == "worker_error" and loop.time() - t0 < POLL_S


async def test_a_lost_decode_worker_ends_a_step_still_running() -> None:
    lost = asyncio.Event()
    asyncio.get_running_loop().call_later(POLL_S, lost.set)
    with pytest.raises(UpstreamError) as err:
        await _run(lost).unless_decode_lost(asyncio.sleep(30))
    assert err.value.api_error.code == "worker_unavailable"


async def test_a_step_that_succeeds_returns_its_value() -> None:
    async def value() -> int:
        return 7

    assert await _run(asyncio.Event()).unless_decode_lost(value()) == 7
