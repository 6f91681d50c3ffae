"""deploy/k8s: valid Kubernetes objects, command lines the CLI accepts, names and ports that agree."""

from __future__ import annotations

import argparse
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.core.config import DiscoverySpec
from services.cli import build_parser
from tests.deploy.conftest import REPO

K8S = REPO / "deploy" / "k8s"
KUBERNETES_VERSION = "1.31"
FIELD_VALUES = {"metadata.name": "pod-0", "status.podIP": "10.1.2.3"}
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def kustomization() -> Obj:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization: Obj) -> list[Obj]:
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    return docs


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name} missing"
    return matches[0]


def containers(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    return [
        (o, c)
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        for c in o["spec"]["template"]["spec"]["containers"]
    ]


def env_values(objects: list[Obj], container: Obj) -> dict[str, str]:
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        values.update(find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        values[var["name"]] = var.get("value") or FIELD_VALUES.get(field, "")
    return values


def args_of(objects: list[Obj], container: Obj) -> argparse.Namespace:
    """The container's args as Kubernetes expands $(VAR), parsed by `tandem` (the entrypoint)."""
    values = env_values(objects, container)

    def expand(arg: str) -> str:
        def one(m: re.Match[str]) -> str:
            assert m.group(1) in values, f"$({m.group(1)}) is not defined for {container['name']}"
            return values[m.group(1)]

        return re.sub(r"\$\((\w+)\)", one, arg)

    return build_parser().parse_args([expand(a) for a in container["args"]])


def test_kustomization_lists_every_manifest(kustomization: Obj) -> None:
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)


def test_every_object_is_valid_for_kubernetes(objects: list[Obj]) -> None:
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert "namespace" not in obj["metadata"]  # the base is namespace-free


def test_every_container_runs_a_valid_tandem_command(objects: list[Obj]) -> None:
    roles = {o["metadata"]["name"]: args_of(objects, c).command for o, c in containers(objects)}
    assert roles == {"prefill": "prefill", "decode": "decode", "gateway": "gateway"}


def test_gateway_discovers_every_worker_pod_through_its_roles_headless_service(
    objects: list[Obj],
) -> None:
    """--discover ROLE=SERVICE:PORT: the Service is headless (one DNS record per pod, ready or
    not: the gateway health-checks workers itself), fronts that role's StatefulSet, and the port
    is the one its workers serve gRPC on; so scaling a StatefulSet needs nothing else."""
    deployment = find(objects, "Deployment", "gateway")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    gateway = args_of(objects, container)
    specs = {spec.role: spec for spec in map(DiscoverySpec.parse, gateway.discover)}
    assert set(specs) == {"prefill", "decode"} and len(gateway.discover) == 2
    assert not (gateway.prefill or gateway.decode or gateway.worker or gateway.config)
    for role, spec in specs.items():
        service = find(objects, "Service", spec.host)
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True
        sts = find(objects, "StatefulSet", role)
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        (worker,) = sts["spec"]["template"]["spec"]["containers"]
        args = args_of(objects, worker)
        assert args.command == role and args.port == spec.port and args.host == "0.0.0.0"
        assert spec.port in [p["port"] for p in service["spec"]["ports"]]


def test_workers_autoscale_on_their_own_queues(objects: list[Obj]) -> None:
    for role in ("prefill", "decode"):
        hpa = find(objects, "HorizontalPodAutoscaler", role)
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == ("StatefulSet", role)
        find(objects, "StatefulSet", role)
        selectors = [
            m["external"]["metric"]["selector"]["matchLabels"] for m in hpa["spec"]["metrics"]
        ]
        assert selectors and all(sel == {"role": role} for sel in selectors)
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300


def test_probes_check_the_serving_ports(objects: list[Obj]) -> None:
    for obj, container in containers(objects):
        args = args_of(objects, container)
        ports = {p["containerPort"] for p in container["ports"]}
        assert args.port in ports
        probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        if args.command == "gateway":
            assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": args.port}
            assert {p.get("tcpSocket", p.get("httpGet", {})).get("port") for p in probes} == {
                args.port
            }
        else:
            assert all(p["grpc"]["port"] == args.port for p in probes), obj["metadata"]["name"]


def test_workers_get_a_gpu_and_decode_advertises_its_kv_endpoint(objects: list[Obj]) -> None:
    for role in ("prefill", "decode"):
        (container,) = find(objects, "StatefulSet", role)["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        args = args_of(objects, container)
        assert args.device == "cuda" and args.worker_id == FIELD_VALUES["metadata.name"]
        if role == "decode":
            assert args.kv_host == FIELD_VALUES["status.podIP"]
            assert args.kv_port in {p["containerPort"] for p in container["ports"]}


def test_services_select_the_pods_they_front(objects: list[Obj]) -> None:
    for service in (o for o in objects if o["kind"] == "Service"):
        workload = next(
            o for o in objects
            if o["kind"] in ("Deployment", "StatefulSet") and o["metadata"]["name"] == service["metadata"]["name"]
        )  # fmt: skip
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        port_names = {
            p["name"]
            for c in workload["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= port_names


def test_referenced_volumes_and_autoscaling_target_exist(objects: list[Obj]) -> None:
    for obj in (o for o in objects if o["kind"] in ("Deployment", "StatefulSet")):
        for volume in obj["spec"]["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                find(objects, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    hpa = find(objects, "HorizontalPodAutoscaler", "gateway")
    target = find(
        objects, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"]
    )
    (container,) = target["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"]  # CPU utilisation needs a request


def test_one_image_everywhere_and_the_same_as_compose(
    objects: list[Obj], kustomization: Obj
) -> None:
    assert {c["image"] for _, c in containers(objects)} == {"tandem"}
    (image,) = kustomization["images"]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    compose_images = {s["image"] for s in compose["services"].values()}
    assert compose_images == {"${TANDEM_IMAGE:-" + f"{image['newName']}:{image['newTag']}" + "}"}


def test_model_cache_is_on_the_shared_volume(objects: list[Obj]) -> None:
    for obj, container in containers(objects):
        cache = env_values(objects, container)["TANDEM_CACHE_DIR"]
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        assert any(cache.startswith(m) for m in mounts), obj["metadata"]["name"]


def test_worker_ports_admit_only_the_pods_that_need_them(objects: list[Obj]) -> None:
    """gRPC API: gateway pods only. KV transfers: prefill and decode pods admit each other on
    every port (None below): beside the decode pod's KV port, the pair's rendezvous store and
    its Gloo/NCCL connections use ports picked at start, opened from either side."""

    def component(selector: Obj) -> str:
        return str(selector["matchLabels"]["app.kubernetes.io/component"])

    admitted: dict[tuple[str, int | None], set[str]] = {}
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        target = component(policy["spec"]["podSelector"])
        for rule in policy["spec"]["ingress"]:
            sources = {component(peer["podSelector"]) for peer in rule["from"]}
            for port in rule.get("ports") or [{"port": None}]:
                admitted.setdefault((target, port["port"]), set()).update(sources)
    expected: dict[tuple[str, int | None], set[str]] = {}
    for role, sources in (("prefill", {"gateway"}), ("decode", {"gateway"})):
        (container,) = find(objects, "StatefulSet", role)["spec"]["template"]["spec"]["containers"]
        expected[(role, args_of(objects, container).port)] = sources
    expected[("decode", None)] = {"prefill"}
    expected[("prefill", None)] = {"decode"}
    assert admitted == expected
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    }
    for name in ("prefill", "decode", "gateway"):  # the selectors match the real pods
        assert pods[name]["app.kubernetes.io/component"] == name
