"""A child started with parent_death_env() ends when its parent dies, and passes nothing on."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from deploy.procfs import alive
from tests.deploy.conftest import child_env

PARENT = """
import os, subprocess, sys, time
from deploy.supervisor import parent_death_env
code = ("import os, time; from deploy.supervisor import follow_parent; follow_parent(); "
        "print(os.environ.get('TANDEM_PARENT_PID', 'gone'), flush=True); time.sleep(60)")
child = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **parent_death_env()},
                         stdout=sys.stdout, start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_gets_sigterm_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], env={**os.environ, **child_env()},
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert parent.stdout is not None
    lines = {parent.stdout.readline().strip(), parent.stdout.readline().strip()}
    assert "gone" in lines  # the variable is not inherited further
    child = int(next(x for x in lines if x.isdigit()))
    assert alive(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), "the child outlived its parent"
