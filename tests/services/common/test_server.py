"""What every worker role shares (``services.common.runtime``), checked on real processes:
the ready file, grpc.health.v1, reflection (only when asked for), GetLoad, Abort of unknown ids, and start-up
failures (NOT_SERVING while loading, exit code 2 with a message on a bad configuration)."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from tests.services.clients import Conn
from tests.services.procs import Fleet, fleet

__all__ = ["fleet"]
pytestmark = pytest.mark.slow

SERVICES = {
    "prefill": "tandem.v1.PrefillService",
    "decode": "tandem.v1.DecodeService",
    "worker": "tandem.v1.WorkerService",
}
ROLE_REPORTED = {"prefill": "prefill", "decode": "decode", "worker": "colocated"}


@pytest.mark.parametrize("role", ["prefill", "decode", "worker"])
async def test_ready_file_health_reflection_and_load(fleet: Fleet, role: str) -> None:
    (proc,) = fleet.shared(role)
    assert proc.ready["pid"] == proc.pid and proc.ready["port"] > 0
    assert proc.ready["worker_id"].startswith(ROLE_REPORTED[role])
    if role == "decode":
        assert proc.ready["kv_endpoint"] == f"127.0.0.1:{proc.ready['kv_port']}"
    async with Conn(proc.address, role) as conn:
        for service in ("", SERVICES[role]):
            reply = await conn.health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        load = await conn.load()
        assert (load.role, load.worker_id) == (ROLE_REPORTED[role], proc.ready["worker_id"])
        assert (load.model, load.block_size, load.max_model_len) == (
            "SmolLM2-135M-Instruct",
            16,
            1024,
        )
        assert (load.total_blocks, load.vocab_size, load.draining) == (256, 49152, False)
        assert load.scheduling_policy == "fcfs"  # the default: the gateway refuses priorities
        assert len(load.instance) == 32 and load.instance != load.worker_id  # this run's id
        assert (await conn.load()).instance == load.instance
        assert not await conn.abort("never-seen")
    # off unless --grpc-reflection
    with grpc.insecure_channel(proc.address) as channel, pytest.raises(grpc.RpcError) as info:
        ProtoReflectionDescriptorDatabase(channel).get_services()
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _reflected(address: str) -> set[str] | None:
    with grpc.insecure_channel(address) as channel:
        try:
            return set(ProtoReflectionDescriptorDatabase(channel).get_services())
        except grpc.RpcError:
            return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _status(address: str) -> int | None:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=0.5
            )
        except grpc.aio.AioRpcError:
            return None
        return int(reply.status)


async def test_not_serving_while_loading_and_exit_2_on_a_bad_configuration(fleet: Fleet) -> None:
    """The pool (16 blocks) cannot hold one 1024-token sequence: the model loads, then the worker
    refuses to serve, says which flag to change, and exits 2 without a traceback."""
    port = free_port()
    proc = fleet.spawn(
        "prefill", "--port", str(port), "--num-blocks", "16", "--grpc-reflection",
        name="bad-config",
    )  # fmt: skip
    seen: set[int | None] = set()
    reflected: set[str] | None = None
    deadline = time.monotonic() + 120
    while proc.alive and time.monotonic() < deadline:
        seen.add(await _status(f"127.0.0.1:{port}"))
        if reflected is None and health_pb2.HealthCheckResponse.NOT_SERVING in seen:
            reflected = await asyncio.to_thread(_reflected, f"127.0.0.1:{port}")
        await asyncio.sleep(0.05)
    # asked for, reflection lists the services (from the start: while the model loads)
    assert reflected is not None
    assert {SERVICES["prefill"], "grpc.health.v1.Health"} <= reflected
    assert await asyncio.to_thread(proc.wait_exit, 10) == 2
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    assert health_pb2.HealthCheckResponse.SERVING not in seen
    log = proc.log()
    assert "--max-model-len" in log and "--num-blocks" in log
    assert "Traceback" not in log
    assert not proc.ready_file.exists()
