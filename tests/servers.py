"""Real servers on loopback for tests: free ports, subprocesses started with the installed
console scripts (`gateway sim`, `gateway serve`), readiness polling and guaranteed cleanup.

Every wait is bounded in time; every process is terminated (then killed) on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

# How long a killed process may take to be reaped. SIGKILL cannot be caught, but the kernel
# tears the process down only when it runs again: on 2 cores under two CPU vLLM engines
# (the realvllm tier) a gateway's SIGKILL once went unreaped for over 10 s. A wait this long
# still ends, and reports a process that really does not go.
KILLED_WAIT_S = 120.0

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> int:
    """First of n consecutive free ports (the simulator binds P..P+n-1)."""
    for _ in range(200):
        base = free_port()
        ok = True
        for p in range(base, base + n):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout}s: {last}")


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=KILLED_WAIT_S)


def stop_group(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """Stops `proc` and every process of the session it leads (it was started with
    `start_new_session`): a server that forks workers (vLLM's API server and its engine
    core) leaves none behind, even when it has to be killed before it could stop them."""

    def signal_all(sig: signal.Signals) -> bool:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return False  # nothing of the group is left
        return True

    signal_all(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout  # its children's own shutdown, bounded
    while signal_all(signal.SIGCONT) and time.monotonic() < deadline:
        time.sleep(0.1)
    signal_all(signal.SIGKILL)
    if proc.poll() is None:
        proc.wait(timeout=KILLED_WAIT_S)


def script(name: str) -> list[str]:
    """The console script next to this interpreter (installed by pip install -e .)."""
    path = Path(sys.executable).parent / name
    if path.exists():
        return [str(path)]
    module = {"gateway": "gateway.cli", "gateway-bench": "gateway.bench.cli"}[name]
    return [sys.executable, "-m", module]


@contextlib.contextmanager
def running(
    argv: Sequence[str],
    ready_urls: Sequence[str],
    timeout: float = 30.0,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    group: bool = False,
) -> Iterator[subprocess.Popen[bytes]]:
    """Start argv, wait until every ready URL answers 200, stop it on exit (with `group`,
    it and every process it started: `stop_group`)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    out = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, env=full_env,
                            start_new_session=group)  # fmt: skip
    try:
        for url in ready_urls:
            wait_http(url, timeout=timeout, proc=proc)
        yield proc
    finally:
        if group:
            stop_group(proc)
        else:
            stop(proc)
        if log_path:
            out.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def sim(replicas: int = 2, extra: Sequence[str] = ()) -> Iterator[list[str]]:
    """`gateway sim` on consecutive free ports; yields the replica base URLs."""
    port = free_ports(replicas)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(replicas)]
    argv = [*script("gateway"), "sim", "--replicas", str(replicas), "--port", str(port), *extra]
    with running(argv, [u + "/health" for u in urls]):
        yield urls


@contextlib.contextmanager
def gateway(backends: Sequence[str], extra: Sequence[str] = (),
            env: dict[str, str] | None = None) -> Iterator[str]:
    """`gateway serve` in front of the given backends; yields its base URL."""
    port = free_port()
    argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port)]
    for b in backends:
        argv += ["--backend", b]
    argv += list(extra)
    url = f"http://127.0.0.1:{port}"
    with running(argv, [url + "/ready"], env=env):
        yield url
