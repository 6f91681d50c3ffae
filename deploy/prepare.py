"""``tandem up``'s prepare step, run once before any worker starts: the model's files made ready
(a GGUF converted to a safetensors directory, once, under a lock) by ``services.model_files``,
in a child that ends with its parent."""

from __future__ import annotations

import sys

from deploy.supervisor import follow_parent
from services.model_files import main as prepare_main


def main(argv: list[str] | None = None) -> int:
    follow_parent()
    return prepare_main(argv)


if __name__ == "__main__":
    sys.exit(main())
