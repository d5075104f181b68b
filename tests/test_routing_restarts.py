"""Restart detection: which sightings of a replica's restart are new (routing/restarts.py,
by table), and, in process against a MockUpstream with an injected clock, that a
crash-looping replica has its index cleared at every restart: two new process start times
10 s apart, or (llama.cpp, no start time) counters going backwards twice 10 s apart, clear
it twice; the same restart told again by another instance's `Restarted` fact does not.
`fleet.counters_reset` by table: a test that fails if it always said False."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gateway.proxy.app import GatewayApp, create_app
from gateway.replicas.fleet import counters_reset
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.facts import Restarted
from gateway.routing.restarts import SAME_RESTART_S, START_SKEW_S, RestartMark, settle
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from gateway.usage.snapshot import EngineSnapshot
from tests.test_failure_memory import BODY, JSON_H, MODELS, Clock
from tests.upstream_double import MockReply, MockRequest, MockUpstream

L, R = True, False  # seen by this instance (local) or told by another one's fact (remote)


def mark(at: float, started: float | None = None, local: bool = L) -> RestartMark:
    return RestartMark(at, started, local)


@pytest.mark.parametrize(("last", "seen", "new", "kept"), [
    (None, mark(5.0, 100.0), True, mark(5.0, 100.0)),
    # start times on both sides: they alone decide, however close in time
    (mark(0.0, 100.0), mark(10.0, 200.0), True, mark(10.0, 200.0)),  # a crash loop
    (mark(0.0, 100.0), mark(3.0, 100.0, R), False, mark(0.0, 100.0)),  # another's sight
    (mark(5.0, 100.0, R), mark(3.0, 100.0), False, mark(3.0, 100.0)),  # first sight kept
    (mark(10.0, 200.0), mark(12.0, 100.0, R), False, mark(10.0, 200.0)),  # superseded
    # this instance lagging behind another's newer sight: its old one changes nothing
    (mark(10.0, 200.0, R), mark(12.0, 100.0), False, mark(10.0, 200.0, R)),
    # a newer start told with an earlier time: facts before the later time stay void
    (mark(10.0, 100.0), mark(8.0, 200.0, R), True, mark(10.0, 200.0, R)),
    (mark(0.0, 100.0), mark(500.0, 100.0, R), False, mark(0.0, 100.0)),  # same, late
    # this instance's own signs without a start time fire once per restart
    (mark(0.0), mark(10.0), True, mark(10.0)),
    (mark(10.0), mark(5.0), False, mark(10.0)),
    (mark(10.0), mark(10.0), False, mark(10.0)),  # two signs of one restart at one moment
    # another instance's sight without a start time: by proximity
    (mark(0.0), mark(5.0, None, R), False, mark(0.0)),
    (mark(0.0, None, R), mark(5.0), False, mark(0.0)),  # now known to this instance
    (mark(0.0), mark(SAME_RESTART_S, None, R), True, mark(SAME_RESTART_S, None, R)),
    (mark(100.0), mark(100.0 - SAME_RESTART_S, None, R), False, mark(100.0)),  # old news
    # one with a start time, one without (KV events, then /metrics): by proximity
    (mark(0.0), mark(4.0, 100.0), False, mark(0.0, 100.0)),
    (mark(0.0, 100.0), mark(4.0), False, mark(0.0, 100.0)),
    (mark(0.0, 100.0), mark(70.0), True, mark(70.0)),
])
def test_settle(last: RestartMark | None, seen: RestartMark, new: bool,
                kept: RestartMark) -> None:
    assert settle(last, seen) == (new, kept)


def test_after_a_remote_sight_this_instances_own_next_sign_is_new() -> None:
    _, first = settle(mark(0.0, None, R), mark(2.0))  # the same restart, seen here too
    assert first.local
    assert settle(first, mark(12.0)) == (True, mark(12.0))  # the next crash


def signed(at: float, *signs: str) -> RestartMark:
    return RestartMark(at, None, True, frozenset(signs))


@pytest.mark.parametrize(("steps", "new"), [
    # One restart of a vLLM without a start time (multiprocess metrics): its KV event
    # sequence starts again at once, its counters go backwards at the next scrape. Two
    # signs of one restart: one clear (a second dropped the bindings made in between).
    ([signed(0.0, "events"), signed(5.0, "counters")], [True, False]),
    # a crash loop: the same sign again is a new restart, however soon
    ([signed(0.0, "counters"), signed(10.0, "counters")], [True, True]),
    ([signed(0.0, "events"), signed(5.0, "counters"), signed(15.0, "events")],
     [True, False, True]),
    ([signed(0.0, "events"), signed(5.0, "counters"), signed(15.0, "counters")],
     [True, False, True]),
    # different signs far apart: two restarts
    ([signed(0.0, "events"), signed(SAME_RESTART_S, "counters")], [True, True]),
    # down too long, then the counters of the same comeback
    ([signed(0.0, "down"), signed(0.5, "counters")], [True, False]),
])
def test_two_signs_of_one_restart_clear_once(steps: list[RestartMark],
                                             new: list[bool]) -> None:
    last: RestartMark | None = None
    got = []
    for seen in steps:
        fresh, last = settle(last, seen)
        got.append(fresh)
    assert got == new


@pytest.mark.parametrize("poison", [1e300, 1e15, 10_000.0])
def test_a_start_time_after_its_sighting_freezes_no_detection(poison: float) -> None:
    """A `Restarted` fact whose start time lies after the moment it was seen (another
    version's bug, or anyone who can write the Redis stream: facts.py) must not stand as
    the latest process start: every real restart after it would be "superseded" and never
    clear the index again. Such a start time is read as none (beyond START_SKEW_S)."""
    new, kept = settle(None, mark(0.0, poison, R))
    assert new and kept.started is None
    assert settle(kept, mark(100.0, 200.0)) == (True, mark(100.0, 200.0))  # a real one
    # A start time within the allowed skew of the sighting is the engine's own.
    assert settle(None, mark(0.0, START_SKEW_S)) == (True, mark(0.0, START_SKEW_S))


def snapshot(prompt: float | None = None, gen: float | None = None,
             queries: float | None = None) -> EngineSnapshot:
    return EngineSnapshot(ts=0.0, kv_cache_usage=None, num_requests_running=None,
                          num_requests_waiting=None, prefix_cache_queries_total=queries,
                          prefix_cache_hits_total=None, prompt_tokens_total=prompt,
                          generation_tokens_total=gen, num_gpu_blocks=None, block_size=None)


@pytest.mark.parametrize(("prev", "cur", "reset"), [
    (None, snapshot(5.0), False),  # the first scrape
    (snapshot(100.0), snapshot(5.0), True),  # prompt tokens went backwards
    (snapshot(gen=100.0), snapshot(gen=99.0), True),
    (snapshot(queries=100.0), snapshot(queries=0.0), True),
    (snapshot(100.0, 50.0), snapshot(100.0, 50.0), False),  # idle
    (snapshot(100.0, 50.0), snapshot(150.0, 60.0), False),  # busy
    (snapshot(100.0), snapshot(None), False),  # gone from /metrics: no verdict
    (snapshot(None), snapshot(5.0), False),
    (snapshot(100.0, 50.0), snapshot(200.0, 10.0), True),  # any one counter suffices
])
def test_counters_reset(prev: EngineSnapshot | None, cur: EngineSnapshot, reset: bool) -> None:
    assert counters_reset(prev, cur) is reset


def routed(router: Router, now: float) -> int:
    plan = router.decide(BODY, "chat", "m", None, [ReplicaState("r", 0)], now)
    plan.outcome.first_token_at = now
    router.report(plan, now)
    return router.indexed_blocks("r")


def test_two_restarts_ten_seconds_apart_both_clear_the_index() -> None:
    router = Router(RoutingConfig())
    router.add_replica("r")
    assert routed(router, 1000.0) > 0
    router.replica_restarted("r", 1000.0, started=990.0)
    assert router.indexed_blocks("r") == 0
    assert routed(router, 1005.0) > 0
    router.apply(Restarted("r", 990.0), 1002.0)  # another instance saw the same one
    assert router.indexed_blocks("r") > 0
    router.replica_restarted("r", 1010.0, started=1008.0)  # the next crash
    assert router.indexed_blocks("r") == 0
    assert routed(router, 1012.0) > 0
    router.apply(Restarted("r", 1015.0), 1016.0)  # and another, seen elsewhere first
    assert router.indexed_blocks("r") == 0


def test_a_restart_is_published_with_its_start_time() -> None:
    told: list[object] = []
    router = Router(RoutingConfig(), publish=told.append)
    router.add_replica("r")
    router.replica_restarted("r", 1000.0, started=990.0)
    router.replica_restarted("r", 1001.0, started=990.0)  # the same one, seen again
    router.replica_restarted("r", 1010.0)  # counters alone, within 60 s: the same one
    assert told == [Restarted("r", 990.0)]


@dataclass
class Engine:
    """/metrics as vLLM (a start time) or llama.cpp (counters only) shows it."""

    started: float | None = 5000.0
    prompt_tokens: float = 1000.0

    async def handle(self, req: MockRequest) -> MockReply:
        path = req.url.split(".test", 1)[1]
        if path == "/health":
            return MockReply(200, JSON_H, [b"{}"])
        if path == "/v1/models":
            return MockReply(200, JSON_H, [MODELS])
        if path == "/metrics":
            text = f"llamacpp:prompt_tokens_total {self.prompt_tokens}\n"
            if self.started is not None:
                text += f"process_start_time_seconds {self.started}\n"
            return MockReply(200, [("content-type", "text/plain")], [text.encode()])
        return MockReply(404, JSON_H, [b"{}"])


def app_for(engine: Engine, clock: Clock) -> GatewayApp:
    settings = Settings(
        replicas=(ReplicaSettings(name="r", url="http://r.test", models=("m",)),),
        server=ServerSettings(health_interval_s=3600),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=3600))
    return create_app(settings, upstream=MockUpstream(engine.handle), clock=clock)


@pytest.mark.parametrize("signal", ["start time", "counters"])
async def test_a_crash_looping_replica_is_forgotten_at_every_restart(signal: str) -> None:
    engine, clock = Engine(started=5000.0 if signal == "start time" else None), Clock()
    app = app_for(engine, clock)
    async with app.running():
        s = app.services
        assert s is not None
        for restart in range(3):  # scrapes 10 s apart, each after a crash
            assert routed(s.router, clock()) > 0
            await s.monitor.scrape_all()  # no restart yet: kept
            assert s.router.indexed_blocks("r") > 0
            clock.now += 10
            if engine.started is not None:
                engine.started = clock.now - 1
                engine.prompt_tokens += 500  # a start time alone tells it
            else:
                engine.prompt_tokens = 10.0 * restart  # counters start over
            await s.monitor.scrape_all()
            assert s.router.indexed_blocks("r") == 0, restart
            engine.prompt_tokens += 100


async def test_kv_events_then_counters_of_one_restart_clear_once() -> None:
    """A vLLM without a start time (multiprocess metrics): the KV feed tells the restart at
    once (`replica_restarted(name, now)`, as app.py wires it), the next scrape shows the
    counters gone backwards; what was routed in between is kept. The next crash's counters
    clear again."""
    engine, clock = Engine(started=None), Clock()
    app = app_for(engine, clock)
    async with app.running():
        s = app.services
        assert s is not None
        await s.monitor.scrape_all()
        clock.now += 10
        s.router.replica_restarted("r", clock())  # the KV event sequence started over
        assert routed(s.router, clock()) > 0
        clock.now += 5
        engine.prompt_tokens = 10.0  # the same restart, at the next scrape
        await s.monitor.scrape_all()
        assert s.router.indexed_blocks("r") > 0
        clock.now += 10
        engine.prompt_tokens = 1.0  # the next crash
        await s.monitor.scrape_all()
        assert s.router.indexed_blocks("r") == 0


def test_a_replica_that_left_leaves_no_restart_behind() -> None:
    """`remove_replica`: everything about it goes, its last restart too (pods come and go
    under an InferencePool, each with its own name: the map is bounded by the fleet)."""
    router = Router(RoutingConfig())
    for name in ("a", "b"):
        router.add_replica(name)
        router.replica_restarted(name, 1000.0, started=990.0)
    router.remove_replica("a")
    assert set(router._restarted) == {"b"}
