"""tests/conftest.py's scheduling: every module that starts serving processes is listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import PROCESSES, SERVING_MODULES, unit_of

REPO = Path(__file__).resolve().parents[1]


def test_the_serving_modules_are_all_listed(request: pytest.FixtureRequest) -> None:
    """Each collected test that uses the session fleet is in a listed module (a plain run of
    the whole suite sees every test; a run of some files checks those)."""
    unlisted = {
        item.nodeid.split("::", 1)[0]
        for item in request.session.items
        if "fleet" in getattr(item, "fixturenames", ())
    } - SERVING_MODULES
    assert not unlisted, f"add to tests/conftest.py's SERVING_MODULES: {sorted(unlisted)}"
    missing = [m for m in SERVING_MODULES if not (REPO / m).is_file()]
    assert not missing, f"SERVING_MODULES names files that do not exist: {missing}"


def test_serving_modules_share_one_unit_and_the_rest_go_by_module() -> None:
    assert unit_of("tests/gateway/test_e2e_real.py::test_x[a-b]") == PROCESSES
    assert unit_of("tests/deploy/test_up_e2e.py::test_y") == PROCESSES
    assert unit_of("tests/kernels/test_ops.py::test_z") == "tests/kernels/test_ops.py"
