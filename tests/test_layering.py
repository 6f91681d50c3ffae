"""The layering rules of docs/architecture.md, checked on the source (every import statement,
top-level or inside a function, and every ``importlib`` call with a first-party name).

- The gateway (its bench/ subpackage included) imports no torch and no worker code: only
  itself and the generated protos.
- The scheduler (services/scheduling) imports no torch: it is tested and reasoned about as
  plain Python.
- Nothing imports deploy/ except deploy itself and the CLI entry (services/cli.py).
- First-party modules are imported by name, never through ``importlib``, so that grep, mypy and
  a reader all see the dependency.
- Within the gateway, imports form no cycle, and each module only imports modules of its own
  layer or of the layers listed below it (``GATEWAY_LAYERS``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("protos", "services", "kernels", "kvtransfer", "gateway", "deploy")
TORCH = ("torch", "triton")


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module (or module.name for ``from m import name``), dotted
    line: int
    via_importlib: bool = False


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    files = []
    for package in FIRST_PARTY:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" not in path.parts and not path.name.endswith(
                ("_pb2.py", "_pb2_grpc.py")
            ):
                files.append(path)
    return files


def _absolute(source: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = source.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(path: Path) -> Iterator[Import]:
    source = module_name(path)
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(source, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(source, path.name == "__init__.py", node.level, node.module)
            for alias in node.names:
                yield Import(source, f"{base}.{alias.name}" if base else alias.name, node.lineno)
        elif isinstance(node, ast.Call) and _is_importlib_call(node.func):
            arg = node.args[0] if node.args else None
            name = _literal_prefix(arg)
            if name is not None:
                yield Import(source, name, node.lineno, via_importlib=True)


def _is_importlib_call(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr in ("import_module", "find_spec")


def _literal_prefix(arg: ast.expr | None) -> str | None:
    """The module name an importlib call asks for, or its constant start for an f-string."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values:
        first = arg.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


ALL_IMPORTS = [imp for path in source_files() for imp in imports_of(path)]


def _top(name: str) -> str:
    return name.split(".")[0]


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _show(found: list[Import]) -> str:
    return "\n".join(f"{i.source}:{i.line} imports {i.target}" for i in found)


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The rules below are only as good as the import scan: it must see relative imports,
    imports inside functions and importlib calls with constant or f-string names."""
    package = ROOT / "gateway"
    sample = package / "_layering_sample.py"
    assert not sample.exists()
    sample.write_text(
        "import importlib\n"
        "from .errors import ConfigError\n"
        "def f():\n"
        "    import torch\n"
        "    from services.config import EngineConfig\n"
        "    importlib.import_module(f'kernels.{1}')\n"
    )
    try:
        found = {(i.target, i.via_importlib) for i in imports_of(sample)}
    finally:
        sample.unlink()
    assert ("gateway.errors.ConfigError", False) in found
    assert ("torch", False) in found
    assert ("services.config.EngineConfig", False) in found
    assert ("kernels.", True) in found


def test_gateway_imports_no_torch_and_no_worker_code() -> None:
    bad = [
        i
        for i in ALL_IMPORTS
        if _in(i.source, "gateway")
        and (
            _top(i.target) in TORCH
            or _top(i.target) in {"services", "kernels", "kvtransfer", "deploy"}
        )
    ]
    assert not bad, "the gateway must not import torch or worker code:\n" + _show(bad)


def test_scheduling_imports_no_torch() -> None:
    bad = [
        i
        for i in ALL_IMPORTS
        if _in(i.source, "services.scheduling")
        and (_top(i.target) in TORCH or _top(i.target) in {"kernels", "kvtransfer"})
    ]
    assert not bad, "services/scheduling must stay torch-free:\n" + _show(bad)


def test_only_the_cli_entry_imports_deploy() -> None:
    bad = [
        i
        for i in ALL_IMPORTS
        if _top(i.target) == "deploy" and not _in(i.source, "deploy") and i.source != "services.cli"
    ]
    assert not bad, "only services/cli.py may import deploy/:\n" + _show(bad)


def test_no_importlib_for_first_party_modules() -> None:
    bad = [i for i in ALL_IMPORTS if i.via_importlib and _top(i.target) in FIRST_PARTY]
    assert not bad, "import first-party modules by name, not through importlib:\n" + _show(bad)


def test_importing_the_gateway_loads_no_torch() -> None:
    """What the static rules promise, checked in a fresh interpreter: the gateway's server,
    its app and its load generator start without torch (and start fast)."""
    code = (
        "import sys\n"
        "import gateway.http.server, gateway.http.app, gateway.bench.serve, services.cli\n"
        "import services.scheduling.scheduler\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.mark.parametrize(
    "module",
    ["services.engine.tp_layout", "services.engine.speculative", "services.engine.draft_tables",
     "services.engine.mrope", "services.config", "services.model_files"],
)  # fmt: skip
def test_torch_free_engine_modules_import_alone(module: str) -> None:
    """The engine's plain-data modules import first and alone in a fresh interpreter (a
    tensor-parallel rank's child process unpickles through them): without torch, and without
    an import cycle (tp_layout importing the quantization package, which imports the TP
    layers, which import tp_layout, failed only in such a child, and its parent then waited
    for it in Gloo)."""
    code = (
        f"import sys\nimport {module}\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "assert not loaded, loaded[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.mark.parametrize(
    "module",
    ["services.engine.tp_follower", "services.engine.tp_kv", "services.engine.tp_group",
     "services.engine.quantization.apply", "services.engine.lora.manager",
     "services.engine.draft_proposer"],
)  # fmt: skip
def test_modules_a_child_process_starts_from_import_first(module: str) -> None:
    """No import cycle hides behind the order the tests happen to import in: the modules a
    rank's child process (or a test's) starts from import first in a fresh interpreter."""
    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True, timeout=120)


# the gateway's subpackages, top layer first: a module may import its own subpackage and those
# listed after it, never one listed before it (the HTTP surface sits on the request flows, the
# flows on the worker connections, everything on observability and the shared core)
GATEWAY_LAYERS = (
    "gateway.http",
    "gateway.flows",
    "gateway.workers",
    "gateway.observability",
)
GATEWAY_CORE = "gateway.core"


def _gateway_unit(name: str) -> str | None:
    for unit in (*GATEWAY_LAYERS, GATEWAY_CORE):
        if _in(name, unit):
            return unit
    return None


def _gateway_module_of(target: str, modules: set[str]) -> str | None:
    """``gateway.flows.chat.prepare_chat`` -> ``gateway.flows.chat`` (the longest module prefix)."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


GATEWAY_MODULES = {
    module_name(p)
    for p in source_files()
    if _in(module_name(p), "gateway") and "bench" not in p.parts
}


def gateway_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in GATEWAY_MODULES}
    for i in ALL_IMPORTS:
        if i.source in graph:
            target = _gateway_module_of(i.target, GATEWAY_MODULES)
            # a package's __init__ re-exporting is not an edge back from its own modules
            if target is not None and target != i.source and not _in(i.source, target):
                graph[i.source].add(target)
    return graph


def test_gateway_modules_sit_in_the_layer_subpackages() -> None:
    loose = sorted(m for m in GATEWAY_MODULES if m != "gateway" and _gateway_unit(m) is None)
    assert not loose, f"gateway modules outside {(*GATEWAY_LAYERS, GATEWAY_CORE)}: {loose}"


def test_gateway_imports_point_down_the_layers() -> None:
    order = {unit: k for k, unit in enumerate(GATEWAY_LAYERS)}
    order[GATEWAY_CORE] = len(GATEWAY_LAYERS)
    bad = []
    for source, targets in gateway_graph().items():
        s = _gateway_unit(source)
        for target in targets:
            t = _gateway_unit(target)
            if s is not None and t is not None and order[t] < order[s]:
                bad.append(f"{source} imports {target} (a layer above it)")
    assert not bad, "\n".join(bad)


def test_gateway_imports_have_no_cycle() -> None:
    graph = gateway_graph()
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            pytest.fail("gateway import cycle: " + " -> ".join(cycle))
