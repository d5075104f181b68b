"""Subprocesses for `compare`: `gateway sim` and `gateway serve`, on loopback.

`Managed` is a context manager: it starts argv with its output to a log file, waits until
every ready URL answers 200 (bounded by `timeout_s`, failing early if the process exits),
and always stops the process on exit (SIGTERM, then SIGKILL after a grace period).
Commands run as `python -m gateway.cli ...` with this interpreter, so no PATH lookup.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType


def free_ports(n: int, attempts: int = 200) -> int:
    """First of n consecutive free loopback ports."""
    for _ in range(attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on 127.0.0.1")


def gateway_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", *args]


class Managed:
    def __init__(
        self,
        argv: Sequence[str],
        ready_urls: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.argv = list(argv)
        self.ready_urls = list(ready_urls)
        self.log_path = log_path
        self.env = env or {}
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Managed:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env}
            )
        try:
            for url in self.ready_urls:
                self._wait(url)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait(self, url: str) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{' '.join(self.argv[2:4])} exited with {self.proc.returncode} before "
                    f"{url} was ready; log: {self.log_path}\n{self.tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            time.sleep(0.1)
        raise TimeoutError(
            f"{url} not ready after {self.timeout_s}s ({last}); log: {self.log_path}"
        )

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 10.0) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace_s)


@contextlib.contextmanager
def local_redis(log_path: Path, timeout_s: float = 10.0) -> Iterator[str]:
    """A redis-server of this machine's on a free loopback port (no persistence), for
    gateways that share routing state; yields its URL, stops it by pid on exit."""
    server = shutil.which("redis-server")
    if server is None:
        raise RuntimeError("--gateways N with shared state needs redis-server "
                           "(apt-get install redis-server), or pass --no-shared-state")
    port = free_ports(1)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited; see {log_path}")
            with contextlib.suppress(OSError), \
                    socket.create_connection(("127.0.0.1", port), 0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not answer")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
