"""A fleet that follows its sources while a load runs, on real loopback replicas: scaling
2 -> 3 -> 1 through a DNS name (answered by the resolver seam) and through SIGHUP's reload
of an edited settings file (the reload handler in process, and once through a real signal
to a `gateway serve` process).

Shown each time: no request fails (no retries: a request sent to a replica that left and
stopped listening would fail), no request begun after a replica left is answered by it,
the new replica answers nothing before its first health probe and then answers requests,
and the departed replicas' metric series and every map of the services forget them. A
replica that flaps (leaves and comes back within the grace period) keeps what the router
learned of it.

The DNS replicas share one port on three loopback addresses (127.0.0.1-3: a DNS name gives
addresses, its port is the name's), all of them on `lo`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from gateway.proxy.app import GatewayApp
from gateway.replicas.fleet import Replica
from gateway.routing.config import RoutingConfig
from gateway.settings import (
    DiscoverySettings,
    ServerSettings,
    Settings,
    parse_settings,
)
from gateway.usage.config import UsageConfig
from tests.held_names import names_held
from tests.proxy_fakes import COMPLETION, MODEL, chat
from tests.recording_replica import Recorder
from tests.servers import free_port, running, script

DEADLINE_S = 30.0
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
# what a replica's engine reports of its KV cache (4096 blocks of 16 tokens)
ENGINE_METRICS = ('vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1\n'
                  "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")


class Pods:
    """Loopback replicas, one aiohttp site per address; what each was asked, in order."""

    def __init__(self) -> None:
        self.seen: dict[str, list[str]] = {}  # "host:port" -> ["health", "chat", ...]
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        self.sites: dict[str, web.TCPSite] = {}

    @staticmethod
    def _addr(request: web.Request) -> str:
        host, port = request.transport.get_extra_info("sockname")[:2]  # type: ignore[union-attr]
        return f"{host}:{port}"

    async def _health(self, request: web.Request) -> web.Response:
        self.seen.setdefault(self._addr(request), []).append("health")
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=ENGINE_METRICS)

    async def _chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.seen.setdefault(self._addr(request), []).append("chat")
        return web.Response(body=COMPLETION, content_type="application/json")

    async def start(self, host: str, port: int) -> str:
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        self.sites[f"{host}:{port}"] = site
        return f"{host}:{port}"

    async def stop(self, addr: str) -> None:
        await self.sites.pop(addr).stop()


@contextlib.asynccontextmanager
async def pods() -> AsyncIterator[Pods]:
    p = Pods()
    await p.runner.setup()
    try:
        yield p
    finally:
        await p.runner.cleanup()


async def until(what: str, ok: Callable[[], bool]) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + DEADLINE_S
    while not ok():
        assert loop.time() < end, f"not within {DEADLINE_S} s: {what}"
        await asyncio.sleep(0.01)


def port_on_every_host() -> int:
    """A port free on each of HOSTS."""
    import socket

    for _ in range(50):
        port = free_port()
        try:
            for host in HOSTS:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every loopback address")


def settings(**discovery: object) -> Settings:
    server = ServerSettings(health_interval_s=0.05, health_timeout_s=1.0, models_refresh_s=0.2,
                            unhealthy_after=1, retries=0)
    return Settings(
        replicas=(), server=server,
        usage=UsageConfig(startup_probe=False, scrape_interval_s=0.05),
        routing=RoutingConfig(policy="round_robin"),
        discovery=DiscoverySettings(**discovery))  # type: ignore[arg-type]


@dataclasses.dataclass
class Load:
    """Requests in a loop: (begun at, replica that answered, status) each."""
    client: httpx.AsyncClient
    done: list[tuple[float, str, int]] = dataclasses.field(default_factory=list)
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    workers: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)

    def start(self, n: int = 4) -> None:
        self.workers = [asyncio.create_task(self.worker()) for _ in range(n)]

    async def worker(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            begun = loop.time()
            r = await self.client.post("/v1/chat/completions", json=chat())
            self.done.append((begun, r.headers.get("x-gateway-replica", ""), r.status_code))
            await asyncio.sleep(0.002)  # the in-process transport may never yield otherwise

    async def more(self, n: int) -> None:
        """Wait for n more answers."""
        target = len(self.done) + n
        await until(f"{n} more answers", lambda: len(self.done) >= target)


async def scale(app: GatewayApp, pool: Pods, load: Load, names: dict[str, str],
                set_members: Callable[[list[str]], Awaitable[None]]) -> None:
    """2 -> 3 -> 1 replicas (the names' pods), checked as the module docstring says."""
    services = app.services
    assert services is not None
    fleet = services.fleet
    first, second, third = list(names)

    def healthy() -> set[str]:
        return {r.name for r in fleet.healthy()}

    # what the fleet knew of each replica as it went up (its KV capacity, from /metrics)
    capacity_when_up: dict[str, int | None] = {}
    on_transition = services.monitor.on_transition

    async def spy(replica: Replica, transition: str) -> None:
        if transition == "up":
            capacity_when_up.setdefault(replica.name, replica.capacity_tokens())
        await on_transition(replica, transition)

    services.monitor.on_transition = spy  # type: ignore[method-assign]

    await set_members([first, second])
    await until("two healthy", lambda: healthy() == {first, second})
    load.start()
    await load.more(20)

    await set_members([first, second, third])
    await until("the third healthy", lambda: third in healthy())
    await until("the third answers", lambda: any(r == third for _, r, _ in load.done))
    seen = pool.seen[names[third]]
    assert seen.index("health") < seen.index("chat"), seen[:5]  # probed before routed
    assert capacity_when_up[third] == 4096 * 16  # its capacity learned before it was routed

    await set_members([third])
    loop = asyncio.get_running_loop()
    await until("the first two leave", lambda: {first, second}.isdisjoint(
        n for n, r in fleet.replicas.items() if r.leaving_since is None))
    left_at = loop.time()
    await until("the first two depart", lambda: set(fleet.replicas) == {third})
    for name in (first, second):
        await pool.stop(names[name])  # gone for good: a request sent there would fail
    await load.more(40)
    load.stop.set()

    assert Counter(s for _, _, s in load.done) == {200: len(load.done)}
    late = [(t, r) for t, r, _ in load.done if t > left_at and r in (first, second)]
    assert late == []
    assert {r for _, r, _ in load.done} == {first, second, third}
    text = (await load.client.get("/metrics")).text
    labels = set(re.findall(r'replica="([^"]*)"', text))
    assert labels <= {third, "none", "departed"}, labels
    assert names_held(services, [first, second]) == []
    assert names_held(app.sources, [first, second]) == []


@contextlib.asynccontextmanager
async def loaded(app: GatewayApp) -> AsyncIterator[Load]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                 timeout=DEADLINE_S) as client:
        load = Load(client)
        try:
            yield load
        finally:
            load.stop.set()
            await asyncio.gather(*load.workers)


async def test_scaling_through_a_dns_name() -> None:
    port = port_on_every_host()
    answers: list[str] = []

    async def resolve(host: str, asked: int) -> list[str]:
        assert (host, asked) == ("vllm.test", port)
        return list(answers)

    app = GatewayApp(settings(dns=(f"vllm.test:{port}",), dns_interval_s=0.05, grace_s=0.0),
                     resolver=resolve)
    async with pods() as pool, app.running():
        names = {f"{h}:{port}": await pool.start(h, port) for h in HOSTS}

        async def set_members(members: list[str]) -> None:
            answers[:] = [m.rsplit(":", 1)[0] for m in members]

        async with loaded(app) as load:
            await scale(app, pool, load, names, set_members)


async def test_scaling_through_a_reloaded_settings_file(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    base = settings(grace_s=0.0)

    def reload() -> Settings:
        return dataclasses.replace(base, replicas=parse_settings(path.read_text(), {}).replicas)

    app = GatewayApp(base, reload=reload)
    async with pods() as pool, app.running():
        names = {f"r{i}": await pool.start("127.0.0.1", free_port()) for i in range(3)}

        async def set_members(members: list[str]) -> None:
            path.write_text("".join(f'[[replicas]]\nname = "{m}"\nurl = "http://{names[m]}"\n'
                                    for m in members))
            assert await app.reload_settings()

        async with loaded(app) as load:
            await scale(app, pool, load, names, set_members)


async def test_a_flapping_replica_keeps_what_was_learned() -> None:
    port = port_on_every_host()
    answers = ["127.0.0.1", "127.0.0.2"]

    async def resolve(host: str, asked: int) -> list[str]:
        return list(answers)

    app = GatewayApp(settings(dns=(f"vllm.test:{port}",), dns_interval_s=0.05, grace_s=60.0),
                     resolver=resolve)
    async with pods() as pool, app.running():
        for h in HOSTS[:2]:
            await pool.start(h, port)
        services = app.services
        assert services is not None
        fleet, router = services.fleet, services.router
        a, b = f"127.0.0.1:{port}", f"127.0.0.2:{port}"
        await until("both healthy", lambda: len(fleet.healthy()) == 2)
        forgot: list[str] = []  # every way the router drops what it learned of a replica
        for method in ("remove_replica", "replica_restarted"):
            original = getattr(router, method)

            def spy(name: str, *args: object, _original: Any = original, **kw: object) -> Any:
                forgot.append(name)
                return _original(name, *args, **kw)

            setattr(router, method, spy)
        replica = fleet.replicas[b]
        answers[:] = ["127.0.0.1"]
        await until("b leaving", lambda: replica.leaving_since is not None)
        assert not replica.healthy and fleet.candidates(MODEL) == [fleet.replicas[a]]
        answers[:] = ["127.0.0.1", "127.0.0.2"]
        await until("b back", lambda: replica.healthy)
        assert fleet.replicas[b] is replica and forgot == []  # not learned from scratch
        # a leave past the grace period is a departure: nothing kept
        answers[:] = ["127.0.0.1"]
        await until("b leaving", lambda: replica.leaving_since is not None)
        assert app.sources is not None
        app.sources.membership.discovery = DiscoverySettings(grace_s=0.0)
        await until("b departed", lambda: b not in fleet.replicas)
        assert forgot == [b]


def _config(path: Path, replicas: dict[str, str]) -> None:
    path.write_text(
        "[server]\nhealth_interval_s = 0.1\nunhealthy_after = 1\n"
        "[usage]\nstartup_probe = false\n[discovery]\ngrace_s = 0\n"
        + "".join(f'[[replicas]]\nname = "{n}"\nurl = "{u}"\n' for n, u in replicas.items()))


def _get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=5)


def _wait(what: str, ok: Callable[[], bool], proc: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + DEADLINE_S
    while not ok():
        assert proc.poll() is None, "the gateway exited"
        assert time.monotonic() < end, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.05)


def test_sighup_to_a_gateway_process(tmp_path: Path) -> None:
    a, b = Recorder(), Recorder()
    with a.serving(), b.serving():
        urls = {"a": f"http://127.0.0.1:{a.port}", "b": f"http://127.0.0.1:{b.port}"}
        path = tmp_path / "gateway.toml"
        _config(path, {"a": urls["a"]})
        port = free_port()
        gw = f"http://127.0.0.1:{port}"
        argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port),
                "--config", str(path)]
        log = tmp_path / "gateway.log"
        with running(argv, [gw + "/ready"], env={"GATEWAY_LOG_LEVEL": "warning"},
                     log_path=log) as proc:
            def healthy() -> list[str]:
                return list(_get(gw + "/ready").json()["healthy"])

            assert healthy() == ["a"]
            _config(path, urls)
            proc.send_signal(signal.SIGHUP)
            _wait("b joins", lambda: sorted(healthy()) == ["a", "b"], proc)
            _config(path, {"b": urls["b"]})
            os.kill(proc.pid, signal.SIGHUP)
            _wait("a departs", lambda: 'replica="a"' not in _get(gw + "/metrics").text
                  and healthy() == ["b"], proc)
            r = httpx.post(gw + "/v1/chat/completions", json=chat(model="m"), timeout=10)
            assert r.status_code == 200 and r.headers["x-gateway-replica"] == "b"
            # an invalid file is refused; the running fleet stays
            path.write_text("[discovery]\ngrace_s = -1\n")
            proc.send_signal(signal.SIGHUP)
            _wait("the reload refused", lambda: "settings not reloaded" in log.read_text(),
                  proc)
            assert healthy() == ["b"]


def test_serve_follows_a_dns_name_and_starts_no_simulator() -> None:
    """`gateway serve --dns localhost:PORT`: the real resolver's loopback address is the
    fleet (no [[replicas]] and no embedded simulator in its place)."""
    replica = Recorder()
    with replica.serving():
        port = free_port()
        gw = f"http://127.0.0.1:{port}"
        argv = [*script("gateway"), "serve", "--host", "127.0.0.1", "--port", str(port),
                "--dns", f"localhost:{replica.port}"]
        with running(argv, [gw + "/ready"], env={"GATEWAY_LOG_LEVEL": "warning"}):
            assert _get(gw + "/ready").json()["healthy"] == [f"127.0.0.1:{replica.port}"]
            r = httpx.post(gw + "/v1/chat/completions", json=chat(model="m"), timeout=10)
            assert r.headers["x-gateway-replica"] == f"127.0.0.1:{replica.port}"
