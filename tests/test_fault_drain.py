"""SIGTERM to `gateway serve` with requests in flight, on loopback, in front of a real
`gateway sim` slowed down so a stream lasts seconds.

What a rolling restart needs: the listening socket closes at once (new connections are
refused, so a load balancer moves on), the streams in flight run to their end within
`server.shutdown_grace_s`, the streams still open when it runs out end with an OpenAI error
event and `[DONE]` (not a cut connection), and the process exits with status 0."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from gateway.settings import parse_settings
from tests.servers import free_port, running, script, sim

MODEL = "Qwen/Qwen2.5-7B-Instruct"
# 0.5x real time: about 16 ms per generated token on the simulated H100
SLOW = ["--speed", "0.5"]
ENV = {"GATEWAY_HEALTH_INTERVAL_S": "0.2", "GATEWAY_USAGE__STARTUP_PROBE": "false"}


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    with sim(1, SLOW) as (url,):
        yield url


class Stream(threading.Thread):
    """One streamed chat completion read to its end in a thread; `first` is set at its
    first event."""

    def __init__(self, base: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.max_tokens = base, max_tokens
        self.first = threading.Event()
        self.events: list[bytes] = []
        self.status = 0
        self.ended_at = 0.0
        self.failure: BaseException | None = None

    def run(self) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": "drain me"}]}
        try:
            with httpx.stream("POST", self.base + "/v1/chat/completions", json=body,
                              timeout=30) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.events.append(line.encode())
                        self.first.set()
        except httpx.HTTPError as exc:
            self.failure = exc
        self.ended_at = time.monotonic()
        self.first.set()


def refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def wait_refused(port: int, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if refused(port):
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"port {port} still accepts {timeout}s after SIGTERM")


def errors(events: list[bytes]) -> list[dict[str, object]]:
    out = []
    for e in events:
        if e.startswith(b"data: {") and b'"error"' in e:
            out.append(orjson.loads(e[6:])["error"])
    return out


def gateway_argv(port: int, backend: str) -> list[str]:
    return [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--backend", backend]


def test_sigterm_lets_streams_in_flight_finish_and_exits_0(replica: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**ENV, "GATEWAY_SHUTDOWN_GRACE_S": "15"}
    with running(gateway_argv(port, replica), [base + "/ready"], env=env) as proc:
        streams = [Stream(base, 120) for _ in range(2)]  # about 2 s each
        for s in streams:
            s.start()
        for s in streams:
            assert s.first.wait(10)
        term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        refused_after = wait_refused(port, 2.0)  # new connections refused at once
        assert proc.wait(20) == 0
        exited = time.monotonic()
        for s in streams:
            s.join(10)
            assert s.failure is None and s.status == 200
            assert s.events[-1] == b"data: [DONE]" and not errors(s.events)
            assert len(s.events) >= 120  # every token arrived
            assert s.ended_at <= exited
        assert exited - term < 15  # it did not sit out the grace period once done
        print(f"\ndrain: streams done and exit 0 {exited - term:.2f} s after SIGTERM, new "
              f"connections refused after {refused_after:.3f} s")


class Plain(threading.Thread):
    """One non-streamed chat completion in a thread."""

    def __init__(self, base: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base, self.max_tokens = base, max_tokens
        self.response: httpx.Response | None = None

    def run(self) -> None:
        body = {"model": MODEL, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": "drain me too"}]}
        self.response = httpx.post(self.base + "/v1/chat/completions", json=body, timeout=30)


def test_requests_past_the_grace_period_end_with_an_error(replica: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**ENV, "GATEWAY_SHUTDOWN_GRACE_S": "1"}
    with running(gateway_argv(port, replica), [base + "/ready"], env=env) as proc:
        stream = Stream(base, 2000)  # about 30 s: far past the grace period
        stream.start()
        plain = Plain(base, 2000)
        plain.start()
        assert stream.first.wait(10)
        time.sleep(0.3)  # the plain request is in flight too
        term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert time.monotonic() - term < 6
        plain.join(10)
        assert plain.response is not None and plain.response.status_code == 503
        assert plain.response.json()["error"]["code"] == "gateway_shutdown"
        stream.join(10)
        assert not stream.is_alive()
        assert stream.failure is None, stream.failure
        assert stream.events[-1] == b"data: [DONE]"
        (error,) = errors(stream.events)
        assert error["code"] == "gateway_shutdown"
        assert set(error) == {"message", "type", "param", "code"}
    # the replica saw the request go: nothing is left running there
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        metrics = httpx.get(replica + "/metrics", timeout=5).text
        running_now = [line for line in metrics.splitlines()
                       if line.startswith("vllm:num_requests_running")]
        if running_now and all(line.endswith(" 0.0") for line in running_now):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the replica still runs the cut stream: {running_now}")


def test_sigint_drains_the_same_way(replica: str) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with running(gateway_argv(port, replica), [base + "/ready"], env=ENV) as proc:
        stream = Stream(base, 60)
        stream.start()
        assert stream.first.wait(10)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        stream.join(10)
        assert stream.events[-1] == b"data: [DONE]" and not errors(stream.events)


def test_the_shipped_deployments_drain_before_they_are_killed() -> None:
    """The grace period of each shipped settings file ends before its orchestrator's
    SIGKILL (Kubernetes: after the preStop pause)."""
    root = Path(__file__).resolve().parent.parent / "deploy"
    compose = yaml.safe_load((root / "compose.yaml").read_text())
    stop = compose["services"]["gateway"]["stop_grace_period"]
    toml = (root / "gateway" / "gateway.toml").read_text()
    assert parse_settings(toml, {}).server.shutdown_grace_s < int(stop.rstrip("s"))

    docs = {d["kind"]: d for d in yaml.safe_load_all(
        (root / "k8s" / "gateway-deployment.yaml").read_text()) if d}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    configmap = yaml.safe_load((root / "k8s" / "gateway-configmap.yaml").read_text())
    grace = parse_settings(configmap["data"]["gateway.toml"], {}).server.shutdown_grace_s
    assert pause + grace < pod["terminationGracePeriodSeconds"]
