"""`gateway.tracing.protofix`: xds-protos (the epp extra) ships an older copy of
opentelemetry-proto's generated modules; the gateway says so at start-up and the module
repairs it."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
from prometheus_client import CollectorRegistry

from gateway.extras import MissingExtra
from gateway.tracing import protofix
from gateway.tracing.config import TracingSettings
from gateway.tracing.otel import build


@pytest.mark.parametrize(("version", "python", "expected"), [
    ("1.45.2", "/v/bin/python", ["/v/bin/python", "-m", "pip", "install", "--quiet",
                                 "--force-reinstall", "--no-deps", "opentelemetry-proto==1.45.2"]),
    ("1.27.0", "py", ["py", "-m", "pip", "install", "--quiet", "--force-reinstall",
                      "--no-deps", "opentelemetry-proto==1.27.0"]),
])
def test_the_repair_reinstalls_the_installed_version_alone(
        version: str, python: str, expected: list[str]) -> None:
    assert protofix.repair_command(version, python) == expected


def test_this_environment_has_its_own_copy() -> None:
    # the README's test command ran the repair before the suite: the exporter imports
    assert not protofix.overwritten()
    module = __import__(protofix.MODULE, fromlist=[protofix.MARKER])
    assert hasattr(module, protofix.MARKER)


def _xds_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    real = protofix.importlib.import_module

    def fake(name: str, package: str | None = None) -> types.ModuleType:
        if name == protofix.MODULE:
            return types.ModuleType(name)  # the xds copy: no InstrumentationScope
        return real(name, package)

    monkeypatch.setattr(protofix.importlib, "import_module", fake)


def test_an_overwritten_copy_is_seen_and_tracing_refuses_to_start_naming_the_repair(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _xds_copy(monkeypatch)
    assert protofix.overwritten()
    with pytest.raises(MissingExtra, match=r"python -m gateway\.tracing\.protofix"):
        build(TracingSettings(enabled=True), {}, CollectorRegistry())


def test_the_command_says_all_is_in_place_here() -> None:
    out = subprocess.run([sys.executable, "-m", "gateway.tracing.protofix"], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    assert "its own modules are in place" in out
