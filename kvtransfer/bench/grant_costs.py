"""What a grant costs the decode side (kvtransfer.grants), on one GPU: giving one (the
synchronous write of its fence slot, in ``KvReceiver.expect(..., grant=True)``: a decode
worker's Reserve) and taking one back (the compare-and-swap a cancel or a header-path claim of a
granted transfer runs), host time per call, medians.

    python -m kvtransfer.bench.grant_costs [--iters 200] [--json-out grants.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from kvtransfer.bench.host_costs import median_us
from kvtransfer.grants import GrantTable


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--json-out", default="")
    args = parser.parse_args(argv)
    if args.iters < 2:
        parser.error("--iters must be at least 2")
    if not torch.cuda.is_available():
        raise SystemExit("grant_costs needs a GPU (grants exist only where a pool is shared)")
    table = GrantTable(torch.device("cuda"), 4096)
    blocks = list(range(64))
    given = []

    def give() -> None:
        grant = table.grant(blocks)
        assert grant is not None
        given.append(grant)

    rows = {"grant (expect, grant=True)": median_us(give, args.iters)}
    pending = iter(list(given))
    rows["revoke a granted one (cancel, header claim)"] = median_us(
        lambda: table.revoke(next(pending)), args.iters
    )
    landed = iter(list(given))
    rows["phase read"] = median_us(lambda: table.phase(next(landed)), args.iters)
    for grant in given:
        table.release(grant)
    print(f"{'operation':<46}{'median us':>10}")
    for name, us in rows.items():
        print(f"{name:<46}{us:>10.1f}")
    if args.json_out:
        doc = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "iters": args.iters, "median_us": rows}  # fmt: skip
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
