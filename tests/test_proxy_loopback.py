"""The gateway as a real server on loopback in front of `gateway sim` subprocesses (and a
tiny fault-injecting backend): transparency, usage-chunk handling, disconnect cancellation,
retries, health flapping, error statuses, and the official openai client end to end."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from tests.servers import free_port, running, script, sim

MODEL = "Qwen/Qwen2.5-7B-Instruct"
FAST = {"GATEWAY_HEALTH_INTERVAL_S": "0.2", "GATEWAY_HEALTH_TIMEOUT_S": "0.5",
        "GATEWAY_USAGE__SCRAPE_INTERVAL_S": "0.2"}


@contextlib.contextmanager
def gateway_proc(backends: list[str], env: dict[str, str] | None = None,
                 extra: tuple[str, ...] = ()) -> Iterator[str]:
    port = free_port()
    argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port), *extra]
    for b in backends:
        argv += ["--backend", b]
    url = f"http://127.0.0.1:{port}"
    with running(argv, [url + "/ready"], env={**FAST, **(env or {})}):
        yield url


@pytest.fixture(scope="module")
def sims() -> Iterator[list[str]]:
    with sim(2, ["--speed", "50", "--timing-comments"]) as urls:
        yield urls


@pytest.fixture(scope="module")
def usage_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("usage") / "usage.jsonl"


@pytest.fixture(scope="module")
def gw(sims: list[str], usage_log: Path) -> Iterator[str]:
    with gateway_proc(sims, {"GATEWAY_USAGE__LOG_PATH": str(usage_log)}) as url:
        yield url


def _mask(data: bytes) -> bytes:
    data = re.sub(rb'"(chatcmpl|cmpl)-[0-9a-zA-Z-]+"', b'"ID"', data)
    data = re.sub(rb'"created":\d+', b'"created":0', data)
    data = re.sub(rb'"cached_tokens":\d+', b'"cached_tokens":0', data)
    data = re.sub(rb'"created_cache_tokens":\d+', b'"created_cache_tokens":0', data)
    return re.sub(rb"sim-timing \{[^\n]*\}", b"sim-timing {}", data)


def _records(path: Path, request_id: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            found = [orjson.loads(line) for line in path.read_bytes().splitlines() if line]
            found = [r for r in found if r["request_id"] == request_id]
            if found:
                return found
        time.sleep(0.05)
    return []


def body(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "seed": 7, **extra}


@pytest.mark.parametrize(("stream", "stream_options"),
                         [(False, None), (True, None), (True, {"include_usage": True})])
def test_transparent_relay_and_usage_chunk(
    gw: str, sims: list[str], usage_log: Path, stream: bool, stream_options: Any
) -> None:
    extra: dict[str, Any] = {"stream": stream}
    if stream_options is not None:
        extra["stream_options"] = stream_options
    req = body(f"transparency {stream} {stream_options} " * 20, **extra)
    rid = f"t-{stream}-{stream_options is not None}"
    with httpx.Client(timeout=10) as c:
        via = c.post(gw + "/v1/chat/completions", json=req, headers={"x-request-id": rid})
        replica = via.headers["x-gateway-replica"]
        direct = c.post(f"http://{replica}/v1/chat/completions", json=req,
                        headers={"x-request-id": rid})
    assert via.status_code == direct.status_code == 200
    expected = _mask(direct.content)
    if stream and stream_options is None:
        # Known gap: vLLM 0.32 puts system_fingerprint on the usage chunk when there is one,
        # so the chunk the gateway asked for and strips takes it along. Exactly that differs.
        expected = re.sub(rb',"system_fingerprint":"[^"]*"\}(\n\n(?::[^\n]*\n\n)*data: \[DONE\])',
                          rb"}\1", expected)
    assert _mask(via.content) == expected
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert via.headers["x-request-id"] == rid
    if stream:
        has_usage = b'"choices":[]' in via.content
        assert has_usage == (stream_options is not None)
    (rec,) = _records(usage_log, rid)
    assert rec["status"] == 200 and rec["stream"] is stream and rec["replica"] == replica
    assert rec["prompt_tokens"] and rec["completion_tokens"] == 8
    assert rec["cached_tokens"] is not None


def _running(sim_url: str) -> float:
    text = httpx.get(sim_url + "/metrics", timeout=5).text
    m = re.search(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert m, "sim exports vllm:num_requests_running"
    return float(m.group(1))


def test_client_disconnect_cancels_upstream(usage_log: Path) -> None:
    with sim(1, ["--speed", "1"]) as (sim_url,), gateway_proc(
        [sim_url], {"GATEWAY_USAGE__LOG_PATH": str(usage_log)}
    ) as url:
        req = body("cancel me " * 50, max_tokens=5000, stream=True)
        with httpx.Client(timeout=10) as c, c.stream(
            "POST", url + "/v1/chat/completions", json=req, headers={"x-request-id": "cancel-1"}
        ) as r:
            chunks = r.iter_raw()
            next(chunks)
            next(chunks)
            assert _running(sim_url) == 1
        deadline = time.monotonic() + 5
        while _running(sim_url) != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(sim_url) == 0
        (rec,) = _records(usage_log, "cancel-1")
        assert rec["status"] == 499
        metrics = httpx.get(url + "/metrics").text
        assert re.search(r'gateway_replica_in_flight\{replica="[^"]+"\} 0\.0', metrics)


class FaultBackend:
    """An OpenAI-shaped backend on loopback whose inference answer is chosen per test:
    `500` (engine error), `close` (drops the connection), `hang` (never answers)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hits = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    async def _infer(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        await request.read()
        if self.mode == "500":
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        if self.mode == "close":
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        await asyncio.sleep(30)
        return web.Response()

    async def _start(self) -> None:
        async def health(request: web.Request) -> web.Response:
            return web.Response()

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL}]})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", self._infer)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.2)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> FaultBackend:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_500_is_relayed_from_the_replica_that_answered_it(sims: list[str]) -> None:
    """The replica received the request: it is never sent to another one (a request reaches
    each engine at most once); its answer goes to the client as is."""
    with FaultBackend("500") as bad, gateway_proc(
        [bad.url, sims[0]], extra=("--policy", "round_robin")
    ) as url, httpx.Client(timeout=10) as c:
        statuses = []
        for i in range(4):
            r = c.post(url + "/v1/chat/completions", json=body(f"once {i}"))
            statuses.append(r.status_code)
            if r.status_code == 500:
                assert r.json() == {"error": {"message": "boom", "code": 500}}
            else:
                assert r.headers["x-gateway-replica"] == sims[0].split("//")[1]
        assert bad.hits == statuses.count(500) >= 1  # round robin sent some there
        assert statuses.count(200) >= 1


@pytest.mark.parametrize(("mode", "status"), [("close", 502), ("hang", 504), ("500", 500)])
def test_upstream_failure_statuses(mode: str, status: int) -> None:
    with FaultBackend(mode) as bad, gateway_proc(
        [bad.url], {"GATEWAY_READ_TIMEOUT_S": "0.5"}
    ) as url:
        r = httpx.post(url + "/v1/chat/completions", json=body("x"), timeout=10)
        assert r.status_code == status
        error = r.json()["error"]
        assert error["message"]
        if mode == "500":
            assert r.json() == {"error": {"message": "boom", "code": 500}}  # passed through


def test_gateway_error_statuses_on_a_real_server(sims: list[str]) -> None:
    env = {"GATEWAY_AUTH__KEYS": "sk-good=team", "GATEWAY_MAX_BODY_BYTES": "2000"}
    with gateway_proc(sims, env) as url, httpx.Client(timeout=10) as c:
        good = {"authorization": "Bearer sk-good"}
        assert c.post(url + "/v1/chat/completions", json=body("x")).status_code == 401
        assert c.post(url + "/v1/chat/completions", json=body("x" * 3000),
                      headers=good).status_code == 413
        r = c.post(url + "/v1/chat/completions", content=b"{", headers=good)
        assert r.status_code == 400
        r = c.post(url + "/v1/chat/completions", json=body("x", model="other"), headers=good)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert c.post(url + "/v1/chat/completions", json=body("x"), headers=good).status_code == 200


def _healthy(url: str) -> list[str]:
    return sorted(httpx.get(url + "/ready", timeout=5).json()["healthy"])


def _wait_healthy(url: str, expected: list[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _healthy(url) != sorted(expected) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _healthy(url) == sorted(expected)


def test_health_flapping() -> None:
    port_b = free_port()
    b = f"http://127.0.0.1:{port_b}"
    argv_b = [*script("gateway"), "sim", "--replicas", "1", "--port", str(port_b),
              "--speed", "100"]
    # b up, then stopped while the gateway runs, then back
    with sim(1, ["--speed", "100"]) as (a,), gateway_proc(
        [a, b], extra=("--policy", "round_robin")
    ) as url:
        names = [a[7:], b[7:]]
        with running(argv_b, [b + "/health"]):
            _wait_healthy(url, names)
        _wait_healthy(url, [a[7:]])
        with httpx.Client(timeout=10) as c:
            for i in range(3):
                r = c.post(url + "/v1/chat/completions", json=body(f"flap {i}"))
                assert r.status_code == 200 and r.headers["x-gateway-replica"] == a[7:]
        with running(argv_b, [b + "/health"]):
            _wait_healthy(url, names)
            with httpx.Client(timeout=10) as c:
                used = {c.post(url + "/v1/chat/completions", json=body(f"back {i}"))
                        .headers["x-gateway-replica"] for i in range(4)}
            assert used == set(names)


def test_openai_client_end_to_end(gw: str) -> None:
    client = openai.OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0, timeout=10)
    models = [m.id for m in client.models.list()]
    assert models == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens == 5
    pieces = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True))
    assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert all(p.usage is None for p in pieces)
    with_usage = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert with_usage[-1].usage is not None and with_usage[-1].usage.prompt_tokens > 0
    completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert completion.choices[0].text and completion.usage
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model",
                                       messages=[{"role": "user", "content": "x"}])


def test_zero_config_serve_fronts_an_embedded_simulator() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running([*script("gateway"), "serve", "--port", str(port)], [url + "/ready"]):
        assert len(httpx.get(url + "/ready").json()["healthy"]) == 4
        r = httpx.post(url + "/v1/chat/completions", json=body("hello"), timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0
