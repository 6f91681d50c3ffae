"""How the suite shares the machine: `make test` runs it on two pytest-xdist workers
(``-n 2``, one per core of a CI machine), scheduled by :class:`OneServingModuleAtATime`.

Every module that starts serving processes (workers, gateways, ``tandem up``: ~2 GiB each) is in
:data:`SERVING_MODULES`, and they all form one unit of work, run one test at a time in one xdist
worker as they would without xdist: memory stays where it was, and the session fleet of
``tests/services/procs.py`` is started once. Every other module is a unit of its own, so its
module fixtures (a loaded model, a fake stack) are set up once. Without xdist (a plain
``pytest``) nothing here applies.

(xdist's own ``--dist loadgroup`` cannot do this under pytest 9: it renames items through
``Item._nodeid``, which pytest 9 no longer reads, so every test became a group of its own and
two xdist workers started two fleets.)
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests import triton_interpreter

PROCESSES = "processes"

# Modules whose tests start real serving processes: the users of the `fleet` fixture
# (tests/services/procs.py; test_the_serving_modules_are_all_listed keeps this list complete),
# and those that start `tandem up`, `tandem bench disagg` or workers of their own.
SERVING_MODULES = frozenset(
    {
        "tests/deploy/bench/test_disagg.py",
        "tests/deploy/test_up_e2e.py",
        "tests/deploy/test_up_lora_e2e.py",
        "tests/deploy/test_up_scale_e2e.py",
        "tests/deploy/test_up_tp_e2e.py",
        "tests/gateway/test_e2e_embeddings.py",
        "tests/gateway/test_e2e_lm_eval.py",
        "tests/gateway/test_e2e_prompt_logprobs.py",
        "tests/gateway/test_e2e_real.py",
        "tests/gateway/test_e2e_responses.py",
        "tests/gateway/test_e2e_speculative.py",
        "tests/gateway/test_e2e_stop_strings.py",
        "tests/gateway/test_e2e_structured.py",
        "tests/gateway/test_e2e_text_fidelity.py",
        "tests/gateway/test_e2e_vision.py",
        "tests/protos/test_auth.py",
        "tests/services/common/test_runtime.py",
        "tests/services/common/test_server.py",
        "tests/services/decode/test_server.py",
        "tests/services/prefill/test_server.py",
        "tests/services/test_gpu_disagg.py",
        "tests/services/worker/bench/test_stream_cost.py",
        "tests/services/worker/test_server.py",
    }
)


def unit_of(nodeid: str) -> str:
    """The unit of work a test belongs to: every serving module together, else its module."""
    module = nodeid.split("::", 1)[0]
    return PROCESSES if module in SERVING_MODULES else module


def pytest_configure(config: pytest.Config) -> None:
    # the Triton interpreter without the work it throws away (tests/triton_interpreter.py)
    triton_interpreter.install()


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class OneServingModuleAtATime(LoadScopeScheduling):
        """xdist's per-module scheduling, with every serving module in one unit (run first:
        units go out largest first, and it is by far the largest)."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return OneServingModuleAtATime(config, log)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])
