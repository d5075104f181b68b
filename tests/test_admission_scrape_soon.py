"""A guess that a scrape could raise asks for that scrape at once (engine.py
`scrape_teaches`, fleetview.py, monitor.py `scrape_soon`): by table, what teaches; in the
gate, when it asks; in the monitor, against a real /metrics server on loopback, one scrape
of a replica at a time (one asked meanwhile runs once after) and at most one asked soon
every `SOON_SPACING_S`."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.engine import Capacity, Scrape, learn, scrape_teaches
from gateway.admission.gate import Ask, Gate
from gateway.proxy.client import AiohttpUpstream, ClientLimits
from gateway.replicas.fleet import Fleet, Replica
from gateway.replicas.monitor import SOON_SPACING_S, FleetMonitor
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings, Settings
from gateway.usage.config import UsageConfig
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.snapshot import EngineSnapshot


def scrape(running: float | None = 0, waiting: float | None = 0, own: int = 0,
           ts: float = 10.0, kv: float | None = None) -> Scrape:
    return Scrape(ts, running, waiting, kv, own)


@pytest.mark.parametrize(("before", "seen", "rising"), [
    (Capacity(), scrape(running=4), True),  # the first figure: it took 4
    (Capacity(1.0, None, 4, most_taken=4), scrape(running=4), False),  # the same: no rise
    (Capacity(1.0, None, 4, most_taken=4), scrape(running=2, own=9), True),  # took 9
    # a queue beside a count above what it took: it took more (the queue is the newest)
    (Capacity(1.0, None, 4, most_taken=4), scrape(running=6, waiting=3, own=9), True),
    # what this gateway had there counts as taken only where none waited
    (Capacity(1.0, None, 4, most_taken=4), scrape(running=4, waiting=3, own=9), False),
    (Capacity(1.0, None, 4, most_taken=4), scrape(running=None), False),  # no figure
])
def test_a_fold_says_whether_it_raised_what_the_engine_took(
        before: Capacity, seen: Scrape, rising: bool) -> None:
    assert learn(before, seen).rising is rising


TOOK_4 = Capacity(1.0, None, 4, most_taken=4)  # guess 8


@pytest.mark.parametrize(("cap", "seen", "own", "teaches"), [
    (TOOK_4, scrape(running=4), 5, True),  # more there than it took, none waiting
    (TOOK_4, scrape(running=4), 4, False),  # no more than it took: nothing to learn
    (TOOK_4, None, 5, True),  # not scraped since its restart: anything teaches
    (TOOK_4, scrape(running=4, waiting=2), 5, False),  # a queue at a flat count: full
    (Capacity(1.0, None, 4, most_taken=4, rising=True),  # a queue beside a growing
     scrape(running=4, waiting=2), 5, True),  # count: the newest, not yet begun
    (Capacity(1.0, 4, 4, most_taken=4), scrape(running=4), 9, False),  # learnt: no guess
    (Capacity(1.0, 4, 4, most_taken=4, probing=True), scrape(running=4), 9, False),
    (Capacity(), None, 9, False),  # no running count ever: no guess to raise
    (TOOK_4, scrape(running=4, waiting=math.nan), 5, False),  # no count: nothing to learn
    (TOOK_4, scrape(running=None), 5, False),  # no running figure either
])
def test_what_a_scrape_now_could_teach(cap: Capacity, seen: Scrape | None, own: int,
                                       teaches: bool) -> None:
    assert scrape_teaches(cap, seen, own) is teaches


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ask(text: str) -> Ask:
    return Ask({"model": "m", "messages": [{"role": "user", "content": text}]}, "chat", "m",
               None, None, None, None, 0.0)


def test_the_gate_asks_for_a_scrape_while_its_sends_outgrow_what_the_engine_took() -> None:
    async def run() -> list[list[str]]:
        routing = RoutingConfig()
        router = Router(routing)
        fleet = Fleet([ReplicaSettings(name="a", url="http://a:8000", models=("m",))])
        a = fleet.replicas["a"]
        a.healthy = True
        clock = Clock()
        asked: list[str] = []

        def soon(r: Replica) -> bool:
            asked.append(r.name)
            return True

        g = Gate(AdmissionConfig(enabled=True, recheck_s=0.001), routing, router,
                 GatewayMetrics(), clock, clock, fleet=fleet, scrape_interval_s=1.0,
                 scrape_soon=soon)

        def scraped(running: float, waiting: float) -> None:
            clock.t += 0.5
            fleet.set_snapshot("a", EngineSnapshot(clock.t, None, running, waiting, None,
                                                   None, None, None, None, None),
                               clock.t, a.in_flight)

        seen: list[list[str]] = []

        async def send(text: str) -> None:  # its admission reads the load before it
            asked.clear()
            await g.admit(ask(text), [a])
            seen.append(sorted(set(asked)))
            a.in_flight += 1

        a.in_flight = 4
        scraped(4, 0)  # it took the 4 there (none waiting): held to 8 (6 for `normal`)
        await send("r0")  # 4 there: no more than it took
        await send("r1")  # 5 there: a scrape could show it took 5
        scraped(6, 0)  # it took all 6: held to 12
        await send("r2")  # 6 there, 6 taken
        await send("r3")  # 7 there
        scraped(6, 2)  # 8 there, a queue beside a flat count: the engine is full
        await send("r4")
        await g.aclose()
        return seen
    assert asyncio.run(run()) == [[], ["a"], [], ["a"], []]


class MetricsServer:
    """A /metrics on loopback whose answers wait for `release`; counts the GETs."""

    def __init__(self) -> None:
        self.gets = 0
        self.got = asyncio.Event()
        self.release = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET /metrics"):
                self.gets += 1
                self.got.set()
                await self.release.wait()
            body = b"vllm:num_requests_running 3.0\nvllm:num_requests_waiting 0.0\n"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                         % (len(body), body))
            await writer.drain()
        finally:
            writer.close()


def test_the_monitor_scrapes_a_replica_once_at_a_time_and_soon_at_most_so_often() -> None:
    async def run() -> None:
        server = MetricsServer()
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        settings = Settings(replicas=(ReplicaSettings(name="a", url=f"http://127.0.0.1:{port}"),),
                            usage=UsageConfig(startup_probe=False))
        fleet = Fleet(settings.replicas)
        a = fleet.replicas["a"]
        a.healthy = True
        clock = Clock()
        upstream = AiohttpUpstream(ClientLimits())
        monitor = FleetMonitor(fleet, upstream, Router(RoutingConfig()), GatewayMetrics(),
                               settings, clock)
        try:
            assert monitor.scrape_soon(a)
            await asyncio.wait_for(server.got.wait(), 10)
            assert not monitor.scrape_soon(a)  # one in flight already
            # the periodic one, asked meanwhile: it returns at once, and runs once after
            await asyncio.wait_for(monitor.scrape(a), 10)
            assert server.gets == 1 and a.snapshot is None
            server.release.set()
            for _ in range(1000):  # both answers land (bounded: 10 s)
                if a.snapshot is not None and server.gets == 2 and not monitor._scraping:
                    break
                await asyncio.sleep(0.01)
            assert a.snapshot is not None and a.snapshot.num_requests_running == 3
            assert server.gets == 2  # not one GET per ask: the asks meanwhile were one
            clock.t += SOON_SPACING_S * 0.9
            assert not monitor.scrape_soon(a)  # too soon after the last one asked
            clock.t += SOON_SPACING_S * 0.2
            server.got.clear()
            assert monitor.scrape_soon(a)
            await asyncio.wait_for(server.got.wait(), 10)
            assert server.gets == 3
            a.healthy = False
            clock.t += SOON_SPACING_S * 2
            assert not monitor.scrape_soon(a)  # a replica down is not scraped soon
        finally:
            await monitor.aclose()
            await upstream.aclose()
            srv.close()
            await srv.wait_closed()
    asyncio.run(run())
