"""How the suite shares the machine: `make test` runs it on two pytest-xdist workers
(``-n 2 --dist loadgroup``, one per core of a CI machine).

Every test that starts serving processes (workers, gateways, ``tandem up``: ~2 GiB each) goes to one
xdist group, ``processes``, so those tests run one at a time as they would without xdist: memory stays
where it was, and the session fleet of ``tests/services/procs.py`` is started once, in one xdist
worker. Every other test module is a group of its own, so its module fixtures (a loaded model, a
started fake stack) are set up once. Without xdist (a plain ``pytest``) the groups mean nothing.
"""

from __future__ import annotations

import pytest

PROCESSES = "processes"

# Modules whose tests start real serving processes without the `fleet` fixture (which marks the
# others: tests/services/procs.py).
SERVING_MODULES = frozenset(
    {
        "tests/deploy/test_up_e2e.py",
        "tests/deploy/test_up_scale_e2e.py",
        "tests/deploy/bench/test_disagg.py",
    }
)


def starts_serving_processes(item: pytest.Item) -> bool:
    path = item.nodeid.split("::", 1)[0]
    return "fleet" in getattr(item, "fixturenames", ()) or path in SERVING_MODULES


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        group = PROCESSES if starts_serving_processes(item) else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
