"""Repair opentelemetry-proto's generated modules after `xds-protos` overwrote them.

`xds-protos` (the `epp` extra: Envoy's ext_proc messages) ships its own, older copy of
OpenTelemetry's generated modules under the same paths as `opentelemetry-proto` (the
`otel` extra's OTLP exporter), e.g. `opentelemetry/proto/common/v1/common_pb2.py`.
Whichever package pip installs last owns those files: when it is `xds-protos`, the OTLP
exporter cannot import (`InstrumentationScope` is missing) and tracing cannot start. The
Envoy messages the picker uses import none of those modules, so reinstalling
`opentelemetry-proto` (its installed version, without dependencies) repairs the one and
leaves the other working:

    python -m gateway.tracing.protofix      # says what it found; repairs when needed

`gateway serve` with `[tracing] enabled` refuses to start on a broken copy, naming this.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from importlib import metadata

DIST = "opentelemetry-proto"
MODULE = "opentelemetry.proto.common.v1.common_pb2"
MARKER = "InstrumentationScope"  # in every opentelemetry-proto since 1.12, in no xds copy
REPAIR = f"python -m {__name__}"


def installed_version() -> str | None:
    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return None


def overwritten() -> bool:
    """True when the generated module on disk is not opentelemetry-proto's own."""
    try:
        module = importlib.import_module(MODULE)
    except ImportError:
        return False  # not installed at all: the missing extra is said elsewhere
    return not hasattr(module, MARKER)


def repair_command(version: str, python: str = sys.executable) -> list[str]:
    """The pip call that puts back opentelemetry-proto's own files (pure)."""
    return [python, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps",
            f"{DIST}=={version}"]


def broken_message() -> str:
    return (f"[tracing] enabled: {DIST}'s generated modules were overwritten by another "
            f"package's older copy (xds-protos, from the epp extra), so the OTLP exporter "
            f"cannot import; run `{REPAIR}` in this environment")


def _check_in_fresh_interpreter(python: str) -> bool:
    code = f"import {MODULE} as m, sys; sys.exit(0 if hasattr(m, {MARKER!r}) else 1)"
    return subprocess.run([python, "-c", code], check=False, timeout=60).returncode == 0


def main() -> int:
    version = installed_version()
    if version is None:
        print(f"{DIST} is not installed: nothing to repair")
        return 0
    if not overwritten():
        print(f"{DIST} {version}: its own modules are in place")
        return 0
    print(f"{DIST} {version}: its modules were overwritten; reinstalling it", flush=True)
    subprocess.run(repair_command(version), check=True, timeout=600)
    if not _check_in_fresh_interpreter(sys.executable):
        print(f"{DIST} is still not importable as itself after the reinstall", file=sys.stderr)
        return 1
    print(f"{DIST} {version}: repaired")
    return 0


if __name__ == "__main__":
    sys.exit(main())
