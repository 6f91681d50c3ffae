"""The control plane must import and schedule with torch unimportable (gateway, CLI, tests)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

PROGRAM = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    class NoTorch:
        blocked = ("torch", "triton", "numpy")

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.blocked:
                raise ImportError(f"{name} must not be imported by the control plane")
            return None

    sys.meta_path.insert(0, NoTorch())
    for name in NoTorch.blocked:
        sys.modules.pop(name, None)
    try:
        import torch
    except ImportError:
        pass
    else:
        raise SystemExit("the torch blocker does not block")

    import services.config
    import services.scheduling
    names = [m.name for m in pkgutil.iter_modules(services.scheduling.__path__)]
    for name in names:
        importlib.import_module(f"services.scheduling.{name}")

    from services.config import SchedulerConfig
    from services.scheduling.kv_manager import KVCacheManager
    from services.scheduling.outputs import SampledToken
    from services.scheduling.request import Request
    from protos.sampling_params import SamplingParams
    from services.scheduling.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(), KVCacheManager(8, 16))
    sched.add(Request("r", [1, 2, 3], SamplingParams(max_tokens=2)))
    while sched.has_unfinished:
        out = sched.schedule()
        sched.update(out, {r.request_id: [SampledToken(7)] for r in out.requests if r.sample})
    assert sched.kv.all_free()
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in NoTorch.blocked)
    assert not leaked, leaked
    print("imported", *sorted(names))
    """
)


def test_scheduling_and_config_import_and_run_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    imported = set(result.stdout.split()[1:])
    expected = {"block_pool", "kv_manager", "outputs", "request", "scheduler"}
    assert expected <= imported
