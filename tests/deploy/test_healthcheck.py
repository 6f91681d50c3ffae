from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deploy.healthcheck import main


@pytest.fixture
def grpc_health() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(grace=None)


class _Status(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_base() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


def test_grpc_serving_is_healthy(grpc_health, capsys) -> None:
    target, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["--grpc", target]) == 0
    assert "SERVING" in capsys.readouterr().out


def test_grpc_not_serving_while_loading_is_unhealthy(grpc_health, capsys) -> None:
    target, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["--grpc", target]) == 1
    assert "NOT_SERVING" in capsys.readouterr().out


def test_grpc_nobody_listening_is_unhealthy(grpc_health) -> None:
    target, _ = grpc_health
    dead = target.rsplit(":", 1)[0] + ":1"
    assert main(["--grpc", dead, "--timeout", "1"]) == 1


def test_http_2xx_is_healthy_and_503_is_not(http_base: str) -> None:
    assert main(["--http", f"{http_base}/health"]) == 0
    assert main(["--http", f"{http_base}/draining"]) == 1


def test_environment_names_the_target(grpc_health, http_base: str, monkeypatch) -> None:
    target, servicer = grpc_health
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    monkeypatch.setenv("TANDEM_HEALTHCHECK", f"grpc://{target}")
    assert main([]) == 0
    monkeypatch.setenv("TANDEM_HEALTHCHECK", f"{http_base}/nope")
    assert main([]) == 1
    monkeypatch.delenv("TANDEM_HEALTHCHECK")
    assert main([]) == 0
