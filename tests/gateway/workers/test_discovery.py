"""Workers found by DNS (--discover): they join and leave without a gateway restart."""

from __future__ import annotations

import httpx
import pytest

from gateway.core.config import DiscoverySpec, WorkerSpec
from gateway.workers.discovery import resolve_dns, worker_address
from services.config import ConfigError
from tests.gateway.stack import Stack

pytestmark = pytest.mark.timeout(60)
PROMPT = "Hello world, this is a test of the gateway"


def test_discovery_specs_parse_and_bad_ones_say_what_to_write() -> None:
    assert DiscoverySpec.parse("decode=decode.ns.svc.cluster.local:50051") == DiscoverySpec(
        "decode", "decode.ns.svc.cluster.local", 50051
    )
    assert DiscoverySpec.parse("colocated=w:1").role == "colocated"
    assert DiscoverySpec.parse("prefill=[::1]:7").host == "::1"
    for bad in ("decode", "gpu=x:1", "decode=x", "decode=x:port", "decode=:1", "decode=x:0"):
        with pytest.raises(ConfigError, match="--discover"):
            DiscoverySpec.parse(bad)


def test_addresses_are_host_port_with_brackets_for_ipv6() -> None:
    assert worker_address("10.0.0.7", 50051) == "10.0.0.7:50051"
    assert worker_address("fd00::7", 50051) == "[fd00::7]:50051"


async def test_the_real_resolver_answers_for_localhost() -> None:
    assert "127.0.0.1:50051" in await resolve_dns("localhost", 50051)


def test_workers_join_and_leave_with_their_dns_records(tokenizer_dir: str) -> None:
    discover = (
        DiscoverySpec("prefill", "prefill.test", 1),
        DiscoverySpec("decode", "decode.test", 1),
    )
    stack = Stack(
        tokenizer_dir, ["prefill", "decode", "decode"], list_workers=False,
        discover=discover, discover_interval_s=3600.0,
    ).start()  # fmt: skip
    try:
        prefill, d0, d1 = stack.workers
        records: dict[str, list[str]] = {"prefill": [prefill.address], "decode": [d0.address]}
        failing = False

        async def resolver(host: str, port: int) -> list[str]:
            if failing:
                raise OSError("temporary failure in name resolution")
            return list(records[host.split(".")[0]])

        registry = stack.state.registry
        registry._resolver = resolver

        def listed() -> list[tuple[str, str, str]]:
            workers = httpx.get(f"{stack.base_url}/workers").json()["workers"]
            return [(w["name"], w["role"], w["address"]) for w in workers]

        def ask() -> int:
            body = {"prompt": PROMPT, "max_tokens": 3}
            return httpx.post(f"{stack.base_url}/v1/completions", json=body).status_code

        assert listed() == []  # the real lookup of *.test found nothing: nothing to serve
        stack.run(registry.refresh())
        assert listed() == [
            ("prefill-0", "prefill", prefill.address), ("decode-0", "decode", d0.address)
        ]  # fmt: skip
        assert ask() == 200 and len(d0.records.reservations) + len(d0.records.decode_calls) > 0

        records["decode"] = [d0.address, d1.address]  # scaled up
        stack.run(registry.refresh())
        assert [n for n, _, _ in listed()] == ["prefill-0", "decode-0", "decode-1"]

        records["decode"] = [d1.address]  # decode-0's pod went away
        stack.run(registry.refresh())
        assert listed() == [
            ("prefill-0", "prefill", prefill.address), ("decode-1", "decode", d1.address)
        ]  # fmt: skip
        calls_before = len(d0.records.decode_calls)
        assert ask() == 200
        assert len(d0.records.decode_calls) == calls_before and d1.records.decode_calls

        failing = True  # a DNS hiccup keeps what there is
        stack.run(registry.refresh())
        assert [n for n, _, _ in listed()] == ["prefill-0", "decode-1"]
        assert httpx.get(f"{stack.base_url}/health").json()["workers"]["total"] == 2
    finally:
        stack.stop()


def test_listed_and_discovered_workers_serve_side_by_side(tokenizer_dir: str) -> None:
    stack = Stack(
        tokenizer_dir, ["colocated"], list_workers=False, discover_interval_s=3600.0,
        dead=[WorkerSpec("colocated", "127.0.0.1:1")],
        discover=(DiscoverySpec("colocated", "workers.test", 1),),
    ).start()  # fmt: skip
    try:
        (worker,) = stack.workers

        async def resolver(host: str, port: int) -> list[str]:
            return [worker.address]

        stack.state.registry._resolver = resolver
        stack.run(stack.state.registry.refresh())
        names = [w["name"] for w in httpx.get(f"{stack.base_url}/workers").json()["workers"]]
        assert names == ["colocated-0", "colocated-1"]  # the listed one keeps its name
        body = {"prompt": PROMPT, "max_tokens": 2}
        assert httpx.post(f"{stack.base_url}/v1/completions", json=body).status_code == 200
    finally:
        stack.stop()
