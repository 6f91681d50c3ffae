"""Container health checks without extra binaries: exit 0 when healthy, 1 otherwise.

    python -m deploy.healthcheck --grpc 127.0.0.1:50051      # grpc.health.v1 Check == SERVING
    python -m deploy.healthcheck --http http://127.0.0.1:8000/health   # HTTP 2xx

With neither flag it reads TANDEM_HEALTHCHECK (``grpc://HOST:PORT`` or an ``http(s)://`` URL), so
one Dockerfile HEALTHCHECK serves every role; when that is unset too there is nothing to check.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence

ENV_VAR = "TANDEM_HEALTHCHECK"


def check_grpc(target: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{target}: {exc.code().name} {exc.details() or ''}".strip()
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{target}: {status}"


def check_http(url: str, timeout_s: float = 3.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return 200 <= response.status < 300, f"{url}: HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f"{url}: {exc}"


def check_url(url: str, timeout_s: float = 3.0) -> tuple[bool, str]:
    if url.startswith("grpc://"):
        return check_grpc(url.removeprefix("grpc://"), timeout_s=timeout_s)
    return check_http(url, timeout_s)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.healthcheck", description=__doc__)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--grpc", metavar="HOST:PORT", help="grpc.health.v1 check")
    target.add_argument("--http", metavar="URL", help="HTTP GET, healthy on 2xx")
    p.add_argument("--service", default="", help="gRPC health service name ('' = the server)")
    p.add_argument("--timeout", type=float, default=3.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.grpc:
        ok, detail = check_grpc(args.grpc, args.service, args.timeout)
    elif args.http:
        ok, detail = check_http(args.http, args.timeout)
    elif os.environ.get(ENV_VAR):
        ok, detail = check_url(os.environ[ENV_VAR], args.timeout)
    else:
        ok, detail = True, f"nothing to check ({ENV_VAR} is not set)"
    print(("healthy: " if ok else "unhealthy: ") + detail)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
