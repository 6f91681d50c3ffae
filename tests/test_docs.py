"""The documentation stays true to the code: cheap static checks, no model, no network.

A newcomer reads README.md and a reviewer reads docs/; both go stale silently. These tests fail
when a module is added without a sentence in docs/architecture.md, a `tandem` command or a flag is
renamed, a metric or an HTTP route appears without being documented, a link breaks, or a raw
benchmark result stops parsing.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "services", "kernels", "kvtransfer", "gateway", "deploy")
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
MARKDOWN = [README, *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def module_files() -> list[str]:
    """Every Python module of ours, minus generated protobuf code and empty package markers."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            generated = path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
            empty_marker = path.name == "__init__.py" and not path.read_text().strip()
            if "__pycache__" not in path.parts and not generated and not empty_marker:
                found.append(path.relative_to(ROOT).as_posix())
    return found


def test_every_module_has_a_sentence_in_the_architecture_doc() -> None:
    text = ARCHITECTURE.read_text()
    protos = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "protos").glob("*.proto"))]
    missing = [m for m in [*module_files(), *protos] if f"`{m}`" not in text]
    assert not missing, f"describe these in docs/architecture.md: {missing}"


def test_the_module_scan_sees_the_packages() -> None:
    """Guards the test above against passing because it found nothing."""
    modules = module_files()
    for expected in ("services/cli.py", "gateway/http/app.py", "kvtransfer/sender.py"):
        assert expected in modules


def commands(
    parser: argparse.ArgumentParser, prefix: str = "tandem"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from commands(sub, f"{prefix} {name}")


def test_every_tandem_command_is_in_the_readme() -> None:
    text = README.read_text()
    names = [name for name, _ in commands(build_parser())]
    assert "tandem bench serve" in names and "tandem up" in names
    missing = [name for name in names if f"`{name}" not in text]
    assert not missing, f"document these commands in README.md: {missing}"


def readme_sections(*titles: str) -> str:
    """The text of the README's level-2 sections whose heading contains one of ``titles``."""
    parts = re.split(r"^## ", README.read_text(), flags=re.M)
    return "\n".join(p for p in parts if any(t in p.splitlines()[0] for t in titles))


def test_flags_in_the_cli_and_configuration_sections_exist() -> None:
    known = {"--help"}
    for _, parser in commands(build_parser()):
        for action in parser._actions:
            known.update(s for s in action.option_strings if s.startswith("--"))
    text = readme_sections("CLI reference", "Configuration")
    assert "--max-model-len" in text, "the sections were not found"
    unknown = sorted(set(FLAG.findall(text)) - known)
    assert not unknown, f"README.md documents flags the CLI does not have: {unknown}"


def test_every_metric_is_documented_and_every_documented_metric_exists() -> None:
    from gateway.observability.metrics import GatewayMetrics

    exported = {family.name for family in GatewayMetrics("m").registry.collect()}
    names = re.findall(r"tandem:[a-z0-9_]+", README.read_text())
    # a counter may be named with the _total its samples carry; a histogram's name may end in it
    documented = {name if name in exported else name.removesuffix("_total") for name in names}
    assert exported - documented == set(), "metrics missing from README.md"
    assert documented - exported == set(), "README.md names metrics that do not exist"


def test_every_http_route_is_documented() -> None:
    found = re.findall(r'Route\(\s*"([^"]+)"', (ROOT / "gateway" / "http" / "app.py").read_text())
    routes = [re.sub(r"\{(\w+):\w+\}", r"{\1}", r) for r in found]  # {model:path} -> {model}
    assert "/v1/chat/completions" in routes
    text = README.read_text()
    missing = [r for r in routes if f"{r}`" not in text]
    assert not missing, f"document these routes in README.md: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), flags=re.M)}


def test_slug_matches_github() -> None:
    assert slug("W6 cost of the HTTP + gRPC path") == "w6-cost-of-the-http--grpc-path"
    assert slug("One request, end to end (disaggregated)") == "one-request-end-to-end-disaggregated"


def resolves(doc: Path, target: str) -> bool:
    """A link from ``doc`` reaches an existing file (and heading, for ``.md#anchor``)."""
    path_part, _, anchor = target.partition("#")
    dest = (doc.parent / path_part).resolve() if path_part else doc
    if not dest.exists():
        return False
    return not anchor or dest.suffix != ".md" or anchor in anchors(dest)


@pytest.mark.parametrize("doc", MARKDOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_local_links_resolve(doc: Path) -> None:
    local = [t for t in LINK.findall(doc.read_text()) if not re.match(r"[a-z]+:", t)]
    broken = [t for t in local if not resolves(doc, t)]
    assert not broken, f"{doc.name}: broken links {broken}"


def benchmark_files() -> list[Path]:
    return sorted((ROOT / "docs" / "benchmarks").glob("*.json"))


def test_benchmark_results_parse_and_are_linked() -> None:
    files = benchmark_files()
    assert files, "docs/benchmarks/ holds the raw results"
    text = BENCHMARKS.read_text()
    for path in files:
        data = json.loads(path.read_text())
        assert isinstance(data, dict) and data, f"{path.name} is empty"
        assert f"benchmarks/{path.name}" in text, f"docs/benchmarks.md does not link {path.name}"


TORCH_FREE = ("gateway", "deploy", "protos", "services/scheduling", "services/config.py",
              "services/cli.py", "services/model_files.py")  # fmt: skip
OWN_IMPORTS = {"kernels": {"kernels"}, "kvtransfer": {"kvtransfer", "kernels"}}


# torch-free at import only: its handlers import their command's modules when they run
LAZY_HANDLERS = ("services/cli.py",)


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree)
    if path.relative_to(ROOT).as_posix() in LAZY_HANDLERS:
        nodes = (
            n for top in tree.body if not isinstance(top, ast.FunctionDef) for n in ast.walk(top)
        )
    for node in nodes:
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def python_files(relative: str) -> list[Path]:
    base = ROOT / relative
    return [base] if base.is_file() else sorted(base.rglob("*.py"))


@pytest.mark.parametrize("part", TORCH_FREE)
def test_layering_torch_free_parts_import_no_torch(part: str) -> None:
    offenders = [
        p.relative_to(ROOT).as_posix()
        for p in python_files(part)
        if imported_roots(p) & {"torch", "triton", "kernels", "kvtransfer"}
    ]
    assert not offenders, f"docs/architecture.md says these stay torch-free: {offenders}"


def test_layering_gateway_uses_no_engine_code() -> None:
    for path in python_files("gateway"):
        source = path.read_text()
        assert "services.engine" not in source and "services.prefill" not in source, path.name


@pytest.mark.parametrize("package", sorted(OWN_IMPORTS))
def test_layering_kernels_and_kvtransfer_depend_on_little(package: str) -> None:
    ours = set(PACKAGES)
    for path in python_files(package):
        extra = (imported_roots(path) & ours) - OWN_IMPORTS[package]
        assert not extra, f"{path.relative_to(ROOT)} imports {extra}"
