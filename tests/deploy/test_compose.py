"""docker-compose.yml: valid Compose, command lines the CLI accepts, names and ports that agree."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from services.cli import build_parser
from services.config import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET
from tests.deploy.conftest import REPO

COMPOSE = REPO / "docker-compose.yml"
CPU_OVERRIDE = REPO / "deploy" / "compose.cpu.yaml"
# The Compose Specification schema as vendored by check-jsonschema 0.39.0 (Apache-2.0, see
# data/LICENSE.compose-spec); it comes from the compose-spec project.
SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"
VARIABLE = re.compile(r"\$\{(\w+)(:?-([^}]*))?\}")


class _ComposeLoader(yaml.SafeLoader):
    """SafeLoader that accepts Compose's !reset and !override merge tags."""


def _tagged(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    return None  # `!reset null`: the key is dropped


_ComposeLoader.add_multi_constructor("!", _tagged)


def load(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)


def defaults(value: str) -> str:
    """Interpolate as Compose does with an empty environment: ${VAR:-default} -> default."""
    return VARIABLE.sub(lambda m: m.group(3) or "", value)


def command(service: dict[str, Any]) -> argparse.Namespace:
    return build_parser().parse_args([defaults(part) for part in service["command"]])


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load(COMPOSE)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def workers(services: dict[str, dict[str, Any]]) -> dict[str, argparse.Namespace]:
    parsed = {name: command(svc) for name, svc in services.items()}
    return {
        name: args
        for name, args in parsed.items()
        if args.command in ("prefill", "decode", "worker")
    }


@pytest.mark.parametrize("path", [COMPOSE, CPU_OVERRIDE], ids=["compose", "cpu-override"])
def test_files_follow_the_compose_specification(path: Path) -> None:
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(load(path)), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


REQUIRED = re.compile(r"\$\{(\w+):\?([^}]+)\}")


def test_every_variable_has_a_default_but_the_internal_token() -> None:
    for path in (COMPOSE, CPU_OVERRIDE):
        for m in VARIABLE.finditer(path.read_text()):
            assert m.group(2), f"{path.name}: ${{{m.group(1)}}} has no default"
        required = {m.group(1) for m in REQUIRED.finditer(path.read_text())}
        assert required <= {"TANDEM_INTERNAL_TOKEN"}, required


@pytest.mark.parametrize("generated", [False, True], ids=["docker-compose.yml", "tandem-compose"])
def test_no_worker_starts_without_the_internal_token(generated: bool) -> None:
    """An empty token would leave every worker's gRPC API and KV rendezvous open to anything on
    the compose network (any caller could reserve all KV): compose refuses to start without it
    (``${VAR:?message}``), saying how to make one."""
    doc = rendered("--gpus", "4")[1] if generated else load(COMPOSE)
    for name, service in doc["services"].items():
        token = service["environment"]["TANDEM_INTERNAL_TOKEN"]
        m = REQUIRED.fullmatch(token)
        assert m and m.group(1) == "TANDEM_INTERNAL_TOKEN", (name, token)
        assert "openssl rand" in m.group(2)


def test_every_command_is_a_valid_tandem_command_line(services: dict[str, dict[str, Any]]) -> None:
    roles = {name: command(svc).command for name, svc in services.items()}
    assert roles == {"prefill-0": "prefill", "decode-0": "decode", "gateway": "gateway"}


def test_gateway_targets_are_workers_of_that_role_on_their_serving_port(
    services: dict[str, dict[str, Any]],
) -> None:
    gateway = command(services["gateway"])
    targets = [(t, "prefill") for t in gateway.prefill] + [(t, "decode") for t in gateway.decode]
    by_name = workers(services)
    assert sorted(t.rsplit(":", 1)[0] for t, _ in targets) == sorted(by_name)  # every worker used
    for target, role in targets:
        host, port = target.rsplit(":", 1)
        assert by_name[host].command == role
        assert by_name[host].port == int(port)
        assert by_name[host].host == "0.0.0.0"  # reachable on the compose network


def test_gateway_waits_for_every_worker_to_be_healthy(services: dict[str, dict[str, Any]]) -> None:
    depends = services["gateway"]["depends_on"]
    assert set(depends) == set(workers(services))
    assert all(d["condition"] == "service_healthy" for d in depends.values())


def test_health_checks_probe_the_serving_ports(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        args = command(svc)
        test = svc["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "deploy.healthcheck"]
        if args.command == "gateway":
            assert test[4:] == ["--http", f"http://127.0.0.1:{args.port}/health"]
        else:
            assert test[4:] == ["--grpc", f"127.0.0.1:{args.port}"], name
        assert svc["healthcheck"]["start_period"]  # model loading takes time


def test_only_the_gateway_port_is_published(services: dict[str, dict[str, Any]]) -> None:
    published = {name: svc.get("ports") for name, svc in services.items() if svc.get("ports")}
    assert list(published) == ["gateway"]
    (mapping,) = published["gateway"]
    assert defaults(mapping).split(":")[-1] == str(command(services["gateway"]).port)


def test_decode_advertises_a_kv_endpoint_prefill_can_resolve(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, args in workers(services).items():
        assert args.worker_id == name
        if args.command == "decode":
            assert args.kv_host == name and args.kv_port not in (0, args.port)


def test_workers_are_pinned_to_distinct_gpus(services: dict[str, dict[str, Any]]) -> None:
    pinned = {}
    for name in workers(services):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        pinned[name] = tuple(defaults(d) for d in device["device_ids"])
    assert len(set(pinned.values())) == len(pinned)
    assert all(services[n]["ipc"] == "host" for n in pinned)


def test_workers_share_the_engine_configuration(services: dict[str, dict[str, Any]]) -> None:
    per_worker = {name: vars(args) for name, args in workers(services).items()}
    # decode-only flags (kv_host, kv_port, lease_timeout) and prefill-only ones (kv_checksum,
    # kv_streaming) too
    skip = {"command", "worker_id", "kv_host", "kv_port", "lease_timeout", "kv_checksum",
            "kv_streaming"}  # fmt: skip
    shared = [{k: v for k, v in d.items() if k not in skip} for d in per_worker.values()]
    assert all(s == shared[0] for s in shared)
    assert command(services["gateway"]).model == shared[0]["model"]


def test_one_image_built_from_the_dockerfile_and_a_model_cache_volume(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    images = {svc["image"] for svc in services.values()}
    assert len(images) == 1
    for svc in services.values():
        assert (REPO / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        assert "model-cache:/models/cache" in svc["volumes"]
    assert "model-cache" in compose["volumes"]


def test_cpu_override_keeps_the_commands_but_drops_gpus(
    services: dict[str, dict[str, Any]],
) -> None:
    override = load(CPU_OVERRIDE)["services"]
    assert set(override) == set(workers(services))
    for name, svc in override.items():
        assert svc["deploy"] is None
        cpu, gpu = vars(command(svc)), vars(command(services[name]))
        assert cpu.pop("device") == "cpu"
        gpu.pop("device")
        # the CPU's own step budget (a GPU-sized step would take seconds there)
        budgets = (cpu.pop("max_num_batched_tokens"), gpu.pop("max_num_batched_tokens"))
        assert budgets == (CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET)
        assert cpu == gpu


# ---- tandem compose (deploy/compose.py): the same file for any number of GPUs -------------


def rendered(*flags: str) -> tuple[str, dict[str, Any]]:
    from deploy.compose import main

    args = build_parser().parse_args(["compose", *flags])
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    text = out.getvalue()
    return text, yaml.load(text, Loader=_ComposeLoader)


def test_compose_for_8_gpus_pins_each_worker_and_the_gateway_knows_them_all() -> None:
    text, doc = rendered("--gpus", "8", "--prefill", "2", "--decode", "6")
    assert text.startswith("# Generated by: tandem compose --gpus 8 --prefill 2 --decode 6\n")
    schema = json.loads(SCHEMA.read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    services = doc["services"]
    parsed = workers(services)
    names = [f"prefill-{i}" for i in range(2)] + [f"decode-{i}" for i in range(6)]
    assert list(parsed) == names
    gpus = []
    for name, args in parsed.items():
        svc = services[name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        gpus += device["device_ids"]
        assert (args.command, args.worker_id, args.device) == (name.split("-")[0], name, "cuda")
        assert svc["healthcheck"]["test"][-2:] == ["--grpc", f"127.0.0.1:{args.port}"]
        if args.command == "decode":  # prefill workers reach its KV rendezvous by service name
            assert (args.kv_host, args.kv_port) == (name, 50061)
            assert str(args.kv_port) in svc["expose"]
    assert gpus == [str(i) for i in range(8)]  # one GPU each, none shared
    gateway = command(services["gateway"])
    assert gateway.prefill == [f"prefill-{i}:50051" for i in range(2)]
    assert gateway.decode == [f"decode-{i}:50051" for i in range(6)]
    assert services["gateway"]["depends_on"] == {n: {"condition": "service_healthy"} for n in names}
    assert services["gateway"]["ports"] == ["${TANDEM_PORT:-8000}:8000"]
    # the same engine configuration everywhere, and the same as the shipped file's
    skip = {"command", "worker_id", "kv_host", "kv_port", "lease_timeout", "kv_checksum",
            "kv_streaming"}  # fmt: skip
    shipped = next(iter(workers(load(COMPOSE)["services"]).values()))
    for args in parsed.values():
        assert {k: v for k, v in vars(args).items() if k not in skip} == {
            k: v for k, v in vars(shipped).items() if k not in skip
        }


def test_compose_takes_ranges_ids_and_colocated_workers() -> None:
    _, doc = rendered("--gpus", "2-4", "--colocated", "3", "--port", "9000")
    services = doc["services"]
    assert list(workers(services)) == ["worker-0", "worker-1", "worker-2"]
    ids = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n, s in services.items() if n != "gateway"]  # fmt: skip
    assert ids == [["2"], ["3"], ["4"]]
    assert command(services["gateway"]).worker == [f"worker-{i}:50051" for i in range(3)]
    assert services["gateway"]["ports"] == ["${TANDEM_PORT:-9000}:8000"]
    _, doc = rendered("--gpus", "0,2", "--prefill", "1", "--decode", "1")
    ids = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n, s in doc["services"].items() if n != "gateway"]  # fmt: skip
    assert ids == [["0"], ["2"]]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--gpus", "2", "--prefill", "2", "--decode", "2"], "4 workers need 4 GPUs"),
        (["--gpus", "3", "--tensor-parallel-size", "2"], "2 workers need 4 GPUs (2 each)"),
        (["--gpus", "4", "--prefill", "0"], "--prefill >= 1 and --decode >= 1"),
        (["--gpus", "4", "--colocated", "2", "--prefill", "1"], "replaces --prefill/--decode"),
        (["--gpus", "5-3"], "runs backwards"),
        (["--gpus", "0,0"], "distinct ids"),
        (["--gpus", "0"], "at least one GPU"),
        (["--gpus", "abc", "--colocated", "1"], "or GPU UUIDs, GPU-... or MIG-..."),
        (["--gpus", "-1"], "got '-1'"),
        (["--gpus", "2", "--colocated", "1", "--image", ""], "--image must name an image"),
        (["--gpus", "2", "--lora-modules", "sql=/x"], "--lora-modules needs --enable-lora"),
        (
            ["--gpus", "2", "--enable-lora", "--lora-modules", "sql=/nonexistent/sql"],
            "/nonexistent/sql is not a peft adapter directory",
        ),
        (
            [
                "--gpus",
                "4",
                "--tensor-parallel-size",
                "2",
                "--enable-lora",
                "--allow-runtime-lora-updating",
            ],
            "--allow-runtime-lora-updating (adapters loaded at run time) with",
        ),
    ],
)
def test_compose_refuses_impossible_shapes_with_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from deploy.compose import main

    assert main(build_parser().parse_args(["compose", *flags])) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem compose: error: ") and message in err and "Traceback" not in err


def test_compose_with_tensor_parallelism_gives_each_worker_its_own_gpus() -> None:
    """`--tensor-parallel-size 2`: each worker reserves two GPUs of its own and runs two ranks."""
    text, doc = rendered("--gpus", "4", "--tensor-parallel-size", "2")
    assert "--tensor-parallel-size 2" in text.splitlines()[0]
    schema = json.loads(SCHEMA.read_text())
    assert not list(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    services = doc["services"]
    parsed = workers(services)
    assert {n: a.tensor_parallel_size for n, a in parsed.items()} == {"prefill-0": 2, "decode-0": 2}
    ids = [services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
           for n in parsed]  # fmt: skip
    assert ids == [["0", "1"], ["2", "3"]]


def test_compose_mounts_each_lora_adapter_read_only_and_serves_it_from_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--lora-modules NAME=HOST_PATH`: the containers cannot see the host's path, so each
    worker binds it read-only at /lora/NAME and its command names that path."""
    for d in ("adapters/sql", "odd dir $1"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "adapter_config.json").write_text("{}")
        (tmp_path / d / "adapter_model.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)  # a relative path: the compose file's directory may differ
    text, doc = rendered("--gpus", "3", "--decode", "2", "--enable-lora", "--lora-modules",
                         "sql=adapters/sql", f"we/ird={tmp_path / 'odd dir $1'}",
                         "--max-loras", "2", "--allow-runtime-lora-updating")  # fmt: skip
    schema = json.loads(SCHEMA.read_text())
    assert not list(jsonschema.Draft202012Validator(schema).iter_errors(doc))
    services = doc["services"]
    parsed = workers(services)
    assert list(parsed) == ["prefill-0", "decode-0", "decode-1"]
    hosts = {
        "/lora/sql": str(tmp_path / "adapters/sql"),
        "/lora/1-we_ird": str(tmp_path / "odd dir $1"),
    }
    for name, args in parsed.items():
        assert (args.enable_lora, args.max_loras, args.allow_runtime_lora_updating) == (
            True,
            2,
            True,
        )
        assert args.lora_modules == ["sql=/lora/sql", "we/ird=/lora/1-we_ird"]
        volumes = services[name]["volumes"]
        assert volumes[:2] == [
            "model-cache:/models/cache",
            "${TANDEM_MODELS_DIR:-./models}:/models/local:ro",
        ]
        binds = {v["target"]: v for v in volumes[2:]}
        assert set(binds) == set(hosts)
        for inside, bind in binds.items():  # $$ is Compose's escape for a literal $
            assert bind["type"] == "bind" and bind["read_only"] is True
            assert bind["source"].replace("$$", "$") == hosts[inside]
        assert not any(str(tmp_path) in part for part in services[name]["command"])
    assert "volumes" not in services["gateway"] or "/lora" not in str(
        services["gateway"]["volumes"]
    )
    assert "load it as /models/local/" in text  # where runtime loads find their adapters


def test_gpus_are_indices_or_uuids_as_the_container_runtime_takes_them() -> None:
    from deploy.compose import parse_gpus

    uuids = "GPU-8f3c1a2b-1d2e-4f5a-9b8c-0123456789ab,MIG-GPU-8f3c1a2b-1d2e/1/0"
    assert parse_gpus(uuids) == uuids.split(",")
    assert parse_gpus("2-4") == ["2", "3", "4"] and parse_gpus("0, 2") == ["0", "2"]
