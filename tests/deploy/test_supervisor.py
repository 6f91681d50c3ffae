from __future__ import annotations

import time
from pathlib import Path

import pytest

from deploy.procfs import alive
from deploy.supervisor import ChildFailedError, ChildSpec, Supervisor, read_ready_file
from tests.deploy.conftest import FAKE_CHILD, child_env


def fake(tmp_path: Path, name: str, role: str, tier: int = 1, **env: str) -> ChildSpec:
    ready = tmp_path / f"{name}.json"
    argv = [*FAKE_CHILD, role, "--port", "0", "--ready-file", str(ready)]
    return ChildSpec(name, argv, child_env(**env), ready, stop_tier=tier)


@pytest.fixture
def sup(tmp_path: Path):
    supervisor = Supervisor(tmp_path / "logs", grace_s=5.0)
    yield supervisor
    supervisor.shutdown()


def test_children_report_their_ports_and_are_gone_after_shutdown(
    sup: Supervisor, tmp_path: Path
) -> None:
    children = [sup.start(fake(tmp_path, n, "prefill")) for n in ("p0", "p1")]
    sup.wait_ready(children, timeout_s=20)
    ports = [c.ready["port"] for c in children if c.ready]
    assert len(set(ports)) == 2 and all(p > 0 for p in ports)
    sup.shutdown()
    assert all(not alive(c.proc.pid) for c in children)


def test_a_child_that_dies_before_ready_fails_with_its_log(sup: Supervisor, tmp_path: Path) -> None:
    ok = sup.start(fake(tmp_path, "p0", "prefill"))
    bad = sup.start(fake(tmp_path, "d0", "decode", FAKE_FAIL_ROLE="decode"))
    with pytest.raises(ChildFailedError, match=r"(?s)d0 exited with code 3.*boom: decode failed"):
        sup.wait_ready([ok, bad], timeout_s=20)


def test_a_child_that_never_gets_ready_times_out(sup: Supervisor, tmp_path: Path) -> None:
    spec = ChildSpec(
        "slow", [*FAKE_CHILD[:1], "-c", "import time; time.sleep(60)"], {}, tmp_path / "x"
    )
    with pytest.raises(ChildFailedError, match="slow was not ready after 1 s"):
        sup.wait_ready([sup.start(spec)], timeout_s=1)


def test_progress_names_the_children_still_loading(sup: Supervisor, tmp_path: Path) -> None:
    spec = ChildSpec(
        "slow", [*FAKE_CHILD[:1], "-c", "import time; time.sleep(60)"], {}, tmp_path / "x"
    )
    seen: list[str] = []
    with pytest.raises(ChildFailedError):
        sup.wait_ready(
            [sup.start(spec)], 0.5, lambda pending, _: seen.extend(c.name for c in pending), 0.1
        )
    assert seen and set(seen) == {"slow"}


def test_stubborn_children_and_their_children_are_killed(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "logs", grace_s=0.5)
    env = {"FAKE_IGNORE_TERM": "decode", "FAKE_GRANDCHILD": "decode"}
    child = sup.start(fake(tmp_path, "d0", "decode", **env))
    sup.wait_ready([child], timeout_s=20)
    grandchild = child.ready["grandchild"] if child.ready else 0
    assert alive(grandchild)
    start = time.monotonic()
    sup.shutdown()
    assert time.monotonic() - start < 8
    assert not alive(child.proc.pid)
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)


def test_lower_tiers_are_stopped_first(sup: Supervisor, tmp_path: Path) -> None:
    log = tmp_path / "terms.txt"
    worker = sup.start(fake(tmp_path, "p0", "prefill", FAKE_TERM_LOG=str(log)))
    gateway = sup.start(fake(tmp_path, "gw", "gateway", tier=0, FAKE_TERM_LOG=str(log)))
    sup.wait_ready([worker, gateway], timeout_s=20)
    sup.shutdown()
    assert log.read_text().split() == ["gateway", "prefill"]


def test_ready_files_may_hold_json_or_a_bare_port(tmp_path: Path) -> None:
    (tmp_path / "a").write_text('{"port": 5, "kv_port": 6}')
    (tmp_path / "b").write_text("8000\n")
    (tmp_path / "c").write_text("not yet")
    assert read_ready_file(tmp_path / "a") == {"port": 5, "kv_port": 6}
    assert read_ready_file(tmp_path / "b") == {"port": 8000}
    assert read_ready_file(tmp_path / "c") is None
    assert read_ready_file(tmp_path / "missing") is None


def test_restart_replaces_an_exited_child_and_its_ready_file(sup: Supervisor, tmp_path: Path) -> None:  # fmt: skip
    spec = fake(tmp_path, "d0", "decode")
    child = sup.start(spec)
    sup.wait_ready([child], timeout_s=20)
    with pytest.raises(RuntimeError, match="still running"):
        sup.restart(child, spec)
    child.proc.kill()
    child.proc.wait()
    assert spec.ready_file is not None and spec.ready_file.exists()
    again = sup.restart(child, spec)
    assert sup.children == [again] and child.log.closed
    sup.wait_ready([again], timeout_s=20)  # the new child's own ready file
    assert again.ready is not None and again.proc.pid != child.proc.pid
