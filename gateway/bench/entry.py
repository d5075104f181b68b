"""The `gateway-bench` console script: checks the `bench` extra before loading the
benchmark, so that a core install answers with the command that adds it (exit status 2)
instead of an import traceback."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gateway.extras import MissingExtra


def main(argv: Sequence[str] | None = None) -> int:
    try:
        from gateway.bench.cli import main as bench_main
    except MissingExtra as exc:
        print(f"gateway-bench: {exc}", file=sys.stderr)
        return 2
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
