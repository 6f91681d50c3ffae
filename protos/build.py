"""Regenerate the Python code for the .proto files (``make protos``).

The generated modules are committed so a clean checkout imports without grpcio-tools.
Generate with ``grpcio-tools==1.73.1`` (protobuf 6.31 gencode): its runtime-version guards
accept protobuf >= 6.31 (7.x included) and grpcio >= 1.73.1, which covers our CPU
environment and the GPU image; ``tests/protos/test_generated.py`` keeps that true.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "protos").glob("*.proto"))


TOOLS_VERSION = "1.73.1"


def main() -> int:
    from importlib.metadata import version

    from grpc_tools import protoc

    found = version("grpcio-tools")
    if found != TOOLS_VERSION:  # a newer one writes gencode older protobuf runtimes refuse
        print(f"protos/build.py: grpcio-tools {found} found, {TOOLS_VERSION} needed (make "
              "protos installs it beside the venv)", file=sys.stderr)  # fmt: skip
        return 2

    args = ["protoc", f"-I{ROOT}", f"--python_out={ROOT}", f"--pyi_out={ROOT}"]
    args += [f"--grpc_python_out={ROOT}", *PROTOS]
    return protoc.main(args)


if __name__ == "__main__":
    sys.exit(main())
