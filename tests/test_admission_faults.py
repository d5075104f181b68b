"""The admission queue under faults, on loopback with real `gateway sim` replicas (one
process each, so one can be killed by its process id) and a gateway with nothing
configured for admission but `enabled = true`: a replica killed while 20 requests wait
receives none of them; one started while they wait serves them; a `low` flood does not
hold the class above it (bench/bench_admission_flood.py measures the same at length)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import orjson
from aiohttp import web

from tests.servers import free_port, gateway, running, script
from tests.sim_http import MODEL

# probes and scrapes often, so the test waits little; no retry elsewhere, so a request
# sent to a dead replica is answered as an error rather than hidden by a retry
ENV = {"GATEWAY_HEALTH_INTERVAL_S": "0.2", "GATEWAY_HEALTH_TIMEOUT_S": "0.5",
       "GATEWAY_USAGE__SCRAPE_INTERVAL_S": "0.2", "GATEWAY_RETRIES": "0",
       "GATEWAY_ADMISSION__ENABLED": "true"}
ENGINE = ["--max-num-seqs", "4"]
LONG = 4000  # tokens a holder asks for: minutes of decoding at --speed 1


@contextlib.contextmanager
def replica_with(port: int, extra: list[str]) -> Iterator[tuple[str, int]]:
    """One `gateway sim` replica in its own process: (url, pid)."""
    url = f"http://127.0.0.1:{port}"
    argv = [*script("gateway"), "sim", "--replicas", "1", "--port", str(port), *extra]
    with running(argv, [url + "/health"]) as proc:
        yield url, proc.pid


def replica(port: int) -> contextlib.AbstractContextManager[tuple[str, int]]:
    return replica_with(port, ENGINE)


def until(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def admission(url: str) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(url + "/stats", timeout=10).json()["admission"]
    return stats


def queued(url: str) -> int:
    return int(admission(url)["queued"]["normal"])


def body(text: str, max_tokens: int, stream: bool = False) -> bytes:
    return orjson.dumps({"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                         "messages": [{"role": "user", "content": text}]})


def hold(url: str, text: str) -> socket.socket:
    """A long stream sent on a raw socket, left open (closing it ends the request)."""
    port = int(url.rsplit(":", 1)[1])
    data = body(text, LONG, stream=True)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                 b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                 % (len(data), data))
    return sock


def fill(url: str, replicas: int) -> list[socket.socket]:
    """Holders until one has to wait in the gateway (every replica is full) and the
    replicas up have shown what they run at once (their queues held the extra holders):
    from then on nothing frees room but the holders' end."""
    holders: list[socket.socket] = []
    for i in range(40):
        holders.append(hold(url, f"holder {i} " * 20))
        with contextlib.suppress(AssertionError):
            until(lambda: queued(url) > 0, timeout=1.0)
            break
    else:
        raise AssertionError("the replicas never filled")
    until(lambda: [r["seq_limit"] for r in admission(url)["replicas"].values()
                   ].count(4) == replicas)
    return holders


def wait_queued(url: str, n: int, waiters: list[Future[tuple[int, str]]]) -> None:
    until(lambda: queued(url) >= n)
    assert not any(w.done() for w in waiters)


def ask(url: str, i: int) -> tuple[int, str]:
    with httpx.Client(timeout=120) as c:
        r = c.post(url + "/v1/chat/completions", content=body(f"waiter {i} says hi", 4),
                   headers={"content-type": "application/json"})
    return r.status_code, r.headers.get("x-gateway-replica", "")


def finished(url: str) -> float:
    """The replica's own count of requests it finished (vLLM's request_success_total)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_success_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_replica_killed_while_requests_wait_receives_none_of_them() -> None:
    port_a, port_b = free_port(), free_port()
    with replica(port_a) as (a, _), replica(port_b) as (b, pid_b), \
            gateway([a, b], env=ENV) as url, ThreadPoolExecutor(20) as pool:
        holders = fill(url, 2)
        waiters = [pool.submit(ask, url, i) for i in range(20)]
        wait_queued(url, 20, waiters)
        on_a = finished(a)
        os.kill(pid_b, signal.SIGKILL)  # its streams break; the 20 still wait
        until(lambda: f"127.0.0.1:{port_b}" not in httpx.get(
            url + "/ready", timeout=10).json()["healthy"])
        for s in holders:  # a frees its sequences: the waiters may go there
            s.close()
        answers = [w.result(timeout=120) for w in waiters]
        assert answers == [(200, f"127.0.0.1:{port_a}")] * 20
        assert finished(a) - on_a >= 20  # a received them all


def test_a_replica_started_while_requests_wait_serves_them() -> None:
    port_a, port_b = free_port(), free_port()
    b = f"http://127.0.0.1:{port_b}"
    with replica(port_a) as (a, _), gateway([a, b], env=ENV) as url, \
            ThreadPoolExecutor(20) as pool:
        holders = fill(url, 1)  # a alone is up: it holds them, b is down
        waiters = [pool.submit(ask, url, i) for i in range(20)]
        wait_queued(url, 20, waiters)
        with replica(port_b):
            # a stays full for minutes: only b can serve them, and it does
            answers = [w.result(timeout=120) for w in waiters]
            assert answers == [(200, f"127.0.0.1:{port_b}")] * 20
            assert finished(b) >= 20
        for s in holders:
            s.close()


# priorities at the defaults --------------------------------------------------------------

def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def ttft(client: httpx.AsyncClient, url: str, cls: str, text: str) -> float:
    start = time.monotonic()
    async with client.stream(
            "POST", url + "/v1/chat/completions",
            content=body(text, 4 if cls != "low" else 32, stream=True),
            headers={"x-gateway-priority": cls, "content-type": "application/json"}) as r:
        assert r.status_code == 200, await r.aread()
        first = None
        async for line in r.aiter_lines():
            if first is None and '"content"' in line:
                first = time.monotonic() - start
    assert first is not None
    return first


async def flood(url: str, n_high: int) -> tuple[list[float], list[float], list[float]]:
    """`high` alone, then 40 `low` clients beside 2 `high` ones: times to first token of
    `high` alone, and of `high` and `low` answers whose first token came after a warm-up
    (the engines showed what they run, and `high` has been coming for a while)."""
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        alone = [await ttft(client, url, "high", f"alone {i}") for i in range(n_high)]
        loaded: list[float] = []
        lows: list[float] = []
        stop = asyncio.Event()
        measuring = asyncio.Event()

        async def one(cls: str, i: int, out: list[float]) -> None:
            n = 0
            while not stop.is_set():
                t = await ttft(client, url, cls, f"{cls} {i} {n}")
                n += 1
                if measuring.is_set() and not stop.is_set():
                    out.append(t)
                    if len(loaded) >= n_high:
                        stop.set()

        tasks = [asyncio.create_task(one("low", i, lows)) for i in range(40)]
        tasks += [asyncio.create_task(one("high", i, loaded)) for i in range(2)]
        for _ in range(600):
            s = await client.get(url + "/stats")
            reps = s.json()["admission"]["replicas"].values()
            if len(reps) == 2 and all(r["seq_limit"] == 4 for r in reps):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(2.0)
        measuring.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
    return alone, loaded, lows


def test_a_low_flood_does_not_hold_the_class_above_it() -> None:
    """Two replicas with --max-num-seqs 4, admission on and nothing else configured: 40
    clients flood `low`; `high` (granted `normal` by the default cap: still the class
    above) keeps its time to first token far below `low`'s."""
    with contextlib.ExitStack() as stack:
        port = free_port()
        while True:  # two consecutive ports for one simulator process
            with contextlib.suppress(OSError), socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
                break
            port = free_port()
        urls = [f"http://127.0.0.1:{port + i}" for i in range(2)]
        stack.enter_context(running(
            [*script("gateway"), "sim", "--replicas", "2", "--port", str(port), *ENGINE],
            [u + "/health" for u in urls]))
        # probes given time: a flooded simulator on a loaded machine answers /health late,
        # and this test is about the queue, not about marking replicas down
        env = {**ENV, "GATEWAY_HEALTH_TIMEOUT_S": "5"}
        url = stack.enter_context(gateway(urls, env=env))
        alone, loaded, lows = asyncio.run(flood(url, 40))
    unloaded_p90, high_p90, low_p90 = (quantile(alone, 0.9), quantile(loaded, 0.9),
                                       quantile(lows, 0.9))
    print(f"high p90 unloaded {unloaded_p90:.3f} s, flooded {high_p90:.3f} s; "
          f"low p90 {low_p90:.3f} s ({len(lows)} answers)")
    # The queue's failure is `high` waiting as `low` does (main before the fix: 3.5 s, as
    # `low`). Compared as a ratio within one run, so that a loaded machine slows both sides
    # alike: an absolute slack over the unloaded figure failed at a load average of 6-10
    # (`high` 0.33 s, `low` 2.07 s, unloaded 0.013 s).
    assert high_p90 < low_p90 / 4, (alone, loaded, lows)


# a scrape that starts failing ----------------------------------------------------------

class ScrapedBackend:
    """An OpenAI-shaped backend whose `/metrics` says what the test sets (KV usage 0.98,
    one request running) until `fail()`, then answers 500; chat requests whose message
    starts with `hold` wait until `release()`, others are answered at once."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.labels: list[str] = []
        self.metrics_ok = True
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._gate: asyncio.Event | None = None

    def fail(self) -> None:
        self.metrics_ok = False

    def release(self) -> None:
        assert self._gate is not None
        self._loop.call_soon_threadsafe(self._gate.set)

    async def _infer(self, request: web.Request) -> web.Response:
        text = orjson.loads(await request.read())["messages"][0]["content"]
        self.labels.append(text)
        if text.startswith("hold"):
            assert self._gate is not None
            await asyncio.wait_for(self._gate.wait(), 60)
        return web.json_response({
            "id": "c", "object": "chat.completion", "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}})

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.metrics_ok:
            return web.Response(status=500)
        return web.Response(text=(
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}",engine="0"}} 0.98\n'
            f'vllm:num_requests_running{{model_name="{MODEL}",engine="0"}} 1\n'
            f'vllm:num_requests_waiting{{model_name="{MODEL}",engine="0"}} 0\n'))

    async def _start(self) -> None:
        self._gate = asyncio.Event()

        async def ok(request: web.Request) -> web.Response:
            return web.Response()

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL}]})

        app = web.Application()
        app.router.add_get("/health", ok)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", self._infer)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.2)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __enter__(self) -> ScrapedBackend:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_scrape_that_starts_failing_does_not_keep_the_gate_throttled() -> None:
    """The holder is `high`: while `high` comes, a full cache holds `normal` in the gateway
    (room.py, "The KV usage steers, and holds none"; without it the waiters would be
    steered to the one replica's engine queue, and nothing would wait here)."""
    env = {**ENV, "GATEWAY_ADMISSION__DEFAULT_PRIORITY_CAP": "high"}
    with ScrapedBackend() as backend, gateway([backend.url], env=env) as url, \
            ThreadPoolExecutor(4) as pool:
        name = f"127.0.0.1:{backend.port}"  # scraped before the gateway is ready
        holder = pool.submit(httpx.post, url + "/v1/chat/completions",
                             content=body("hold the replica", 1), timeout=60,
                             headers={"content-type": "application/json",
                                      "x-gateway-priority": "high"})
        until(lambda: "hold the replica" in backend.labels)
        waiters = [pool.submit(ask, url, i) for i in range(3)]
        until(lambda: queued(url) == 3)  # KV usage 0.98: no room beside the holder
        assert admission(url)["replicas"][name]["source"] == "engine"
        backend.fail()  # from now on every scrape fails: 0.98 is all the gateway knows
        # three scrape intervals later it is not used: the waiters go, the holder held
        answers = [w.result(timeout=30) for w in waiters]
        assert answers == [(200, name)] * 3 and not holder.done()
        seen = admission(url)["replicas"][name]
        assert seen["source"] == "gateway" and seen["snapshot_age_s"] > 0.6
        backend.release()
        assert holder.result(timeout=30).status_code == 200


# non-streamed prompts of ~5k tokens ------------------------------------------------------

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "river", "stone", "cloud")


def big(i: int) -> str:
    """~5k tokens (one per word for the simulator's tokenizer), its own from the start."""
    return f"document {i}: " + " ".join(WORDS[j % len(WORDS)] for j in range(5000))


def send_big(url: str, i: int, stream: bool) -> int:
    with httpx.Client(timeout=120) as c:
        r = c.post(url + "/v1/chat/completions", content=body(big(i), 1500, stream=stream),
                   headers={"content-type": "application/json"})
        return r.status_code


def test_large_non_streamed_prompts_are_not_shed_where_streamed_ones_are_not() -> None:
    """16 prompts of ~5k tokens at once to one replica, answered at length (1500 tokens,
    over 10 s): a non-streamed answer's first byte is its last, so its prefill must end when
    the engine shows it began; were it the last byte, the default prefill room (16k
    tokens for `normal`: 4 such prompts) would send them 4 at a time, one answer's time
    apart, and the last ones would wait past `normal`'s 30 s and be shed."""
    port = free_port()
    results: dict[bool, list[int]] = {}
    with replica_with(port, ["--kv-blocks", "8192"]) as (a, _), \
            gateway([a], env=ENV) as url, ThreadPoolExecutor(16) as pool:
        for stream in (True, False):
            futures = [pool.submit(send_big, url, i + (100 if stream else 0), stream)
                       for i in range(16)]
            results[stream] = [f.result(timeout=300) for f in futures]
        shed = admission(url)["shed"]
    assert results[True] == [200] * 16, results
    assert results[False] == [200] * 16, (results, shed)
