"""`gateway serve` in front of real vLLM replicas for the tier, with a usage log to read back
(complete once the gateway has stopped: the sink flushes on shutdown)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.servers import ROOT, free_port, running, script

# Where each gateway's output goes (beside the engines' logs: a failing test's report shows
# the tails of both, tests/realvllm/conftest.py)
LOGS = ROOT / "build" / "realvllm" / "logs"


@contextlib.contextmanager
def fronted(urls: list[str], usage_log: Path, *extra: str,
            env: dict[str, str] | None = None) -> Iterator[str]:
    """`gateway serve --backend ...` with a usage log (and `env`, e.g. `GATEWAY_*` settings);
    yields its base URL (no /v1)."""
    port = free_port()
    argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
    for u in urls:
        argv += ["--backend", u]
    url = f"http://127.0.0.1:{port}"
    LOGS.mkdir(parents=True, exist_ok=True)
    with running(argv, [url + "/ready"], 60, log_path=LOGS / f"gateway-{port}.log",
                 env={**(env or {}), "GATEWAY_USAGE__LOG_PATH": str(usage_log)}):
        yield url


def records(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def wait_healthy(url: str, count: int, timeout: float = 120.0) -> None:
    """Until the gateway at `url` has `count` healthy replicas: `/ready` answers once one
    is, and a P/D gateway whose prefill replica is not up yet serves on D alone (a CI run's
    first turn in token mode, whose start-up takes longer, did)."""
    deadline = time.monotonic() + timeout
    while True:
        healthy = httpx.get(url + "/ready", timeout=30).json().get("healthy", [])
        if len(healthy) >= count:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}: {len(healthy)} of {count} replicas healthy")
        time.sleep(0.2)
