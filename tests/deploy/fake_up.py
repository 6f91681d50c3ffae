"""`tandem up` with every child replaced by tests/deploy/fake_child.py (run with ``-m``).

Same flags as `tandem up`; FAKE_READY_TIMEOUT and FAKE_GRACE shorten the waits.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path

from deploy.gpus import detect_gpus
from deploy.launcher import gateway_key, run
from deploy.plan import build_plan
from services.cli import build_parser

FAKE = (sys.executable, "-m", "tests.deploy.fake_child")


def main() -> int:
    args = build_parser().parse_args(["up", *sys.argv[1:]])
    run_dir = Path(tempfile.mkdtemp(prefix="fake-up-"))
    try:
        gpus = detect_gpus(args.gpus, environ={})
        plan = build_plan(args, gpus, 2, run_dir, program=FAKE, environ=os.environ)
        plan = dataclasses.replace(plan, prepare_argv=[*FAKE, "prepare"])
        api_key, key_env = gateway_key(args.api_key, os.environ)
        return run(
            plan,
            Path(args.log_dir),
            api_key,
            ready_timeout_s=float(os.environ.get("FAKE_READY_TIMEOUT", "30")),
            grace_s=float(os.environ.get("FAKE_GRACE", "5")),
            key_env=key_env,
        )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
