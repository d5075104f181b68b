"""The `gateway-bench` console script: a core install answers --help and --version, and a
command that needs the `bench` extra (its charts) answers with the command that adds it
(exit status 2) instead of an import traceback."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gateway.extras import MissingExtra


def main(argv: Sequence[str] | None = None) -> int:
    from gateway.bench.cli import main as bench_main

    try:
        return bench_main(argv)
    except MissingExtra as exc:
        print(f"gateway-bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
