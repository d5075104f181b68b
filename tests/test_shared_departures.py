"""A replica that departs and comes back under the same name (a new server, its cache
empty) within the Redis replay window (gateway/shared/departures.py): the departure is
recorded in Redis, bounded in count and time; an instance that starts afterwards replays
the other facts but none about that replica from before its departure, and running
instances skip such a fact arriving late (a lagging instance's). The record's bounds by
table; the rest on a real redis-server with two gateway instances on loopback replicas."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.proxy.app import GatewayApp, Services
from gateway.routing.affinity import ResponseAffinity
from gateway.routing.facts import Departed, Fact, Response, Sent, Trust
from gateway.settings import ReplicaSettings, Settings
from gateway.shared.config import RedisSettings
from gateway.shared.departures import (
    MAX_DEPARTED,
    Departures,
    departed_key,
    load_departures,
    write_departures,
)
from tests.proxy_fakes import chat
from tests.redis_server import needs_redis, redis_server
from tests.servers import free_port
from tests.test_fleet_sources_loopback import pods, settings, until

KEEP_S = 600.0


# ---- the record (pure) --------------------------------------------------------------------

@pytest.mark.parametrize(("departed", "fact", "at", "now", "stands"), [
    ([], Sent("r1", [1]), 100.0, 100.0, True),  # never departed
    ([("r1", 50.0)], Sent("r1", [1]), 49.0, 100.0, False),  # before its departure
    ([("r1", 50.0)], Sent("r1", [1]), 51.0, 100.0, True),  # after: the new server's
    ([("r1", 50.0)], Sent("r2", [1]), 49.0, 100.0, True),  # another replica
    ([("r1", 50.0)], Trust("r1", 0.5), 49.0, 100.0, False),  # every kind of fact
    ([("r1", 50.0)], Response("resp_1", "r1"), 49.0, 100.0, False),
    ([("r1", 50.0), ("r1", 40.0)], Sent("r1", [1]), 45.0, 100.0, False),  # the later stands
    ([("r1", 40.0), ("r1", 50.0)], Sent("r1", [1]), 45.0, 100.0, False),
    ([("r1", 50.0)], Sent("r1", [1]), 49.0, 50.0 + KEEP_S + 1, True),  # forgotten past keep_s
    ([("r1", 10.0)], Sent("r1", [1]), 9.0, 10.0 + KEEP_S + 1, True),  # recorded too late
    ([("r1", 50.0)], Departed("r1"), 10.0, 100.0, True),  # a departure always stands
])
def test_a_fact_stands_unless_from_before_its_replicas_departure(
        departed: list[tuple[str, float]], fact: Fact, at: float, now: float,
        stands: bool) -> None:
    d = Departures(MAX_DEPARTED, KEEP_S)
    for name, when in departed:
        d.record(name, when, min(now, when + 1))
    assert d.screen(fact, at, now) is stands


def test_a_departure_fact_is_recorded_and_the_record_is_bounded() -> None:
    d = Departures(3, KEEP_S)
    assert d.screen(Departed("r1"), 50.0, 60.0)
    assert not d.screen(Sent("r1", [1]), 49.0, 60.0)
    for i, name in enumerate(("r2", "r3", "r4")):
        d.record(name, 51.0 + i, 60.0)
    assert len(d) == 3  # the oldest (r1) went
    assert d.screen(Sent("r1", [1]), 49.0, 60.0)
    assert not d.screen(Sent("r2", [1]), 50.0, 60.0)
    d.record("r5", 60.0 + KEEP_S, 60.0 + KEEP_S)  # the others expire as it comes
    assert len(d) == 1


# ---- the record in Redis ------------------------------------------------------------------

@needs_redis
class FutureScores:
    """A Redis reader whose departed set holds `r1` dated `at` (a writer's clock ahead)."""

    def __init__(self, at: float) -> None:
        self.at = at

    async def zrevrangebyscore(self, *_: object, **__: object) -> list[tuple[bytes, float]]:
        return [(b"r1", self.at)]


@pytest.mark.parametrize("skew_s", [0.0, 30.0, 300.0])
async def test_a_starting_instance_caps_a_loaded_departure_at_its_own_clock(
        skew_s: float) -> None:
    """The Redis set keeps the writer's time (ZADD GT); an instance that starts with it
    records no departure later than its own `now`, so a fresh fact about the returned
    replica stands on it as on a running instance (tests/test_review37b_departures.py)."""
    now = 1_000.0
    d = Departures(MAX_DEPARTED, KEEP_S)
    await d.load(FutureScores(now + skew_s), departed_key("t"), lambda: now, 5.0)
    assert d.void("r1", now - 1, now)  # the old server's facts are still void
    assert d.screen(Sent("r1", [1]), now + 5, now + 5)


async def test_the_record_in_redis_is_bounded_in_time_and_count() -> None:
    pytest.importorskip("redis")
    from redis.asyncio import Redis

    port, key, now = free_port(), departed_key("t"), 10_000.0
    with redis_server(port):
        store = Redis.from_url(f"redis://127.0.0.1:{port}/0")
        try:
            async def write(batch: list[tuple[Fact, float]], at: float) -> None:
                async with store.pipeline(transaction=False) as pipe:
                    write_departures(pipe, key, batch, at, KEEP_S)
                    await pipe.execute()

            await write([(Departed("old"), now - KEEP_S - 1), (Departed("r1"), now),
                         (Sent("r9", [1]), now)], now)
            await write([(Departed("r1"), now - 5)], now)  # an earlier sighting: kept later
            assert await load_departures(store, key, now, KEEP_S, 5.0) == [("r1", now)]
            assert await store.zcard(key) == 1  # the one older than keep_s went
            assert 0 < await store.pttl(key) <= KEEP_S * 1000
            await store.zadd(key, {b"\xff": now, b"x" * 1000: now})  # no names: left out
            assert await load_departures(store, key, now, KEEP_S, 5.0) == [("r1", now)]
            await write([(Departed(f"p{i}"), now + 1 + i) for i in range(MAX_DEPARTED + 2)],
                        now)
            assert await store.zcard(key) == MAX_DEPARTED  # the oldest went
            got = await load_departures(store, key, now, KEEP_S, 5.0)
            assert len(got) == MAX_DEPARTED and got[0] == (f"p{MAX_DEPARTED + 1}",
                                                          now + MAX_DEPARTED + 2)
            await write([], now)  # a batch without departures writes nothing
            assert await store.zcard(key) == MAX_DEPARTED
        finally:
            await store.aclose()


# ---- two instances on a real redis-server ---------------------------------------------------

@contextlib.asynccontextmanager
async def client(app: GatewayApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw", timeout=30) as c:
        yield c


def departed_facts(services: Services) -> float:
    return services.metrics.registry.get_sample_value(
        "gateway_shared_facts_total", {"direction": "in", "result": "departed"}) or 0.0


@needs_redis
async def test_a_replica_back_under_its_name_is_cold_to_every_instance() -> None:
    pytest.importorskip("redis")
    from redis.asyncio import Redis

    from gateway.shared.redis_state import SharedState

    ports, redis_port = (free_port(), free_port()), free_port()
    r0, r1 = (ReplicaSettings(name=f"r{i}", url=f"http://127.0.0.1:{p}")
              for i, p in enumerate(ports))
    redis = RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0", replay_s=KEEP_S)
    both = dataclasses.replace(settings(grace_s=0.0), replicas=(r0, r1), redis=redis)
    current: dict[str, Settings] = {"settings": both}
    a = GatewayApp(both, reload=lambda: current["settings"])
    b = GatewayApp(both)
    with redis_server(redis_port):
        store = Redis.from_url(redis.url or "")
        async with pods() as pool, a.running(), client(a) as ca:
            for p in ports:
                await pool.start("127.0.0.1", p)
            sa = a.services
            assert sa is not None and sa.shared is not None
            shared_a = sa.shared
            await until("both up in a", lambda: {r.name for r in sa.fleet.healthy()}
                        == {"r0", "r1"})

            # a routes sessions to both replicas (round robin): facts in the stream
            where: dict[str, str] = {}
            for i in range(8):
                body = chat(messages=[{"role": "user", "content": f"{i} " + "hello " * 400}])
                r = await ca.post("/v1/chat/completions", json=body,
                                  headers={"x-session-id": f"s{i}"})
                assert r.status_code == 200, r.text
                where[f"s{i}"] = r.headers["x-gateway-replica"]
            assert set(where.values()) == {"r0", "r1"}
            await until("a's facts written", lambda: shared_a.written >= len(where))

            # r1 departs from a (a reload without it), then a new server comes back under
            # its name (a reload with it): it is probed and up again in a
            before = time.time()
            written = shared_a.written
            current["settings"] = dataclasses.replace(both, replicas=(r0,))
            assert await a.reload_settings()
            await until("r1 departed from a", lambda: "r1" not in sa.fleet.replicas)
            await until("the departure written", lambda: shared_a.written > written)
            # recorded in Redis, for no longer than the replay window
            at = await store.zscore(departed_key(redis.prefix), "r1")
            assert at is not None and at >= before
            assert 0 < await store.pttl(departed_key(redis.prefix)) <= KEEP_S * 1000
            current["settings"] = both
            assert await a.reload_settings()
            await until("r1 up again in a", lambda: any(
                r.name == "r1" for r in sa.fleet.healthy()))

            # b starts now: it replays a's facts about r0, none about r1's old server
            async with b.running():
                sb = b.services
                assert sb is not None and sb.shared is not None
                assert {r.name for r in sb.fleet.healthy()} == {"r0", "r1"}
                assert sb.router.indexed_blocks("r0") > 0
                assert sb.router.indexed_blocks("r1") == 0
                for session, replica in where.items():
                    assert sb.router.session_replica(session) == (
                        "r0" if replica == "r0" else None), session
                assert departed_facts(sb) >= 1

                # a lagging instance's fact about r1's old server, dated before the
                # departure, arrives after it: neither running instance applies it; its
                # next fact, about the new server, both do
                clock = {"now": before - 1.0}
                lagging = SharedState(redis, lambda fact, at: None, ResponseAffinity(),
                                      lambda: clock["now"])
                await lagging.start()
                try:
                    seen = departed_facts(sa), departed_facts(sb)
                    lagging.publish(Sent("r1", [11, 12, 13], "late"))
                    await until("the late fact written", lambda: lagging.written >= 1)
                    clock["now"] = time.time()
                    lagging.publish(Sent("r1", [21, 22, 23], "fresh"))
                    for s in (sa, sb):
                        await until("the fresh fact applied",
                                    lambda s=s: s.router.session_replica("fresh") == "r1")
                        assert s.router.session_replica("late") is None
                    assert departed_facts(sa) == seen[0] + 1
                    assert departed_facts(sb) == seen[1] + 1
                finally:
                    await lagging.aclose()
        await store.aclose()
