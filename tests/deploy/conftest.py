from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAKE_CHILD = [sys.executable, "-m", "tests.deploy.fake_child"]


def child_env(**extra: str) -> dict[str, str]:
    """Environment for processes that import the project from the repository root."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **extra}


def disagg_args(*flags: str) -> argparse.Namespace:
    """`tandem bench disagg`'s parsed flags."""
    from services.cli import build_parser

    return build_parser().parse_args(["bench", "disagg", *flags])
