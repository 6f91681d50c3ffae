"""The KV rendezvous with an internal token: both ends prove it; a replayed hello is refused."""

from __future__ import annotations

import time

import pytest

from kvtransfer import KvReceiver, KvSender, ReceiverOptions, SenderOptions, TransferError
from kvtransfer.auth import HelloChecker, hello_proof
from tests.kvtransfer.peer import make_caches

pytestmark = pytest.mark.timeout(120)
TOKEN = "s3cret-token"


def _send(rx: KvReceiver, sender_token: str, tid: str) -> None:
    opts = SenderOptions(timeout_s=5, auth_token=sender_token)
    with KvSender(make_caches(1, 8), f"sender-{tid}", opts) as sender:
        sender.send(rx.endpoint, tid, [1])


def test_only_a_sender_with_the_token_gets_a_pair() -> None:
    rx = KvReceiver(make_caches(0, 8, zero=True), ReceiverOptions(auth_token=TOKEN))
    try:
        for i, token in enumerate(("", "wrong-token")):
            rx.expect(f"t{i}", [0], deadline_s=30)
            with pytest.raises(TransferError, match="did not prove the internal token"):
                _send(rx, token, f"t{i}")
        handle = rx.expect("ok", [2], deadline_s=30)
        _send(rx, TOKEN, "ok")
        assert handle.wait(5).ok
    finally:
        rx.close()


def test_a_sender_with_a_token_sends_nothing_to_a_receiver_without_it() -> None:
    rx = KvReceiver(make_caches(0, 8, zero=True))  # no token: it cannot prove one
    try:
        handle = rx.expect("t", [0], deadline_s=30)
        with pytest.raises(TransferError, match=r"receiver .* did not prove the internal token"):
            _send(rx, TOKEN, "t")
        assert not handle.done()  # not a byte arrived
    finally:
        rx.close()


def test_a_replayed_or_stale_hello_is_refused() -> None:
    checker = HelloChecker(TOKEN)
    now = time.time()
    proof = hello_proof(TOKEN, "prefill-0", "gen1", now)
    assert checker.refusal("prefill-0", "gen1", now, proof) == ""
    assert "replay" in checker.refusal("prefill-0", "gen1", now, proof)
    old = now - 600
    assert "stale" in checker.refusal(
        "prefill-0", "gen2", old, hello_proof(TOKEN, "prefill-0", "gen2", old)
    )
    assert "did not prove" in checker.refusal("prefill-1", "gen3", now, proof)  # bound to its id
    assert HelloChecker("").refusal("x", "g", 0.0, "") == ""  # no token: nothing to check
