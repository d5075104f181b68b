"""Review 63 of the scrape asked soon (engine.py `scrape_teaches`, `Capacity.rising`,
fleetview.py, monitor.py `scrape_soon` and one scrape of a replica at a time), as an
outsider tries to break it.

- In the monitor (in process, a MockUpstream whose answers the test holds and lets go):
  two scrapes never land out of order (no false restart), a replica's departure cancels
  its soon scrape, and the cases where skipping a scrape because one of that *name* is in
  flight skips one that mattered: a replica replaced under its name while the old one's
  scrape hangs (the joiner's first scrape, the one that learns its KV capacity, is
  skipped), and the health probe's "back after a hiccup" scrape behind a scrape that then
  fails (the restart check it was for waits a scrape interval).
- In the fleet view, simulated (the real `FleetView`, a clock the test moves, the
  monitor's spacing rule): soon scrapes stop once a vLLM-like engine shows its queue
  (cache free or full), and keep going as long as load lasts where a scrape can never
  teach (no waiting count exported, a running count gone to no figure, a /metrics that
  started failing while the guess grew): ~3 GETs a second a replica instead of one in
  five seconds. Against the real monitor, the last case counted in GETs.
- The bound the guess exists for (a flood sent at most twice what the engine was seen to
  take in) holds with the soon scrapes too; they only reach it sooner.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import pytest

import gateway.admission.engine as engine_mod
from gateway.admission.fleetview import FleetView
from gateway.replicas.fleet import Fleet
from gateway.replicas.monitor import SOON_SPACING_S, FleetMonitor
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.snapshot import EngineSnapshot
from tests.upstream_double import MockReply, MockRequest, MockUpstream

TEXT_H = [("content-type", "text/plain")]


def metrics(running: float = 3, waiting: float = 0, prompt_total: float = 1000,
            start: float = 1.7e9, blocks: int | None = None) -> bytes:
    text = (f"vllm:num_requests_running {running}\nvllm:num_requests_waiting {waiting}\n"
            f"vllm:prompt_tokens_total {prompt_total}\nprocess_start_time_seconds {start}\n")
    if blocks is not None:
        text += f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{blocks}"}} 1.0\n'
    return text.encode()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Replicas:
    """A MockUpstream: each host's paths answer what `answers[(host, path)]` returns when
    the GET arrives; a GET of /metrics whose host is in `hold` is answered when the test
    sets that event."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], Callable[[], MockReply]] = {}
        self.hold: dict[str, asyncio.Event] = {}
        self.gets: list[str] = []
        self.arrived = asyncio.Event()
        self.upstream = MockUpstream(self.handle)

    async def handle(self, req: MockRequest) -> MockReply:
        host, path = req.url.removeprefix("http://").split(".test", 1)
        self.gets.append(f"{host} {path}")
        self.arrived.set()
        answer = self.answers.get((host, path))  # what it answers as it was when asked
        reply = (MockReply(200, [("content-type", "application/json")], [b"{}"])
                 if answer is None else answer())
        gate = self.hold.get(host)
        if gate is not None and path == "/metrics":
            await gate.wait()
        return reply


def monitor_for(replicas: Replicas, names: dict[str, str],
                clock: Clock) -> tuple[Fleet, FleetMonitor, Router]:
    settings = Settings(
        replicas=tuple(ReplicaSettings(name=n, url=f"http://{host}.test", models=("m",))
                       for n, host in names.items()),
        server=ServerSettings(health_timeout_s=2.0, unhealthy_after=2),
        usage=UsageConfig(startup_probe=False))
    fleet = Fleet(settings.replicas)
    for r in fleet.replicas.values():
        r.healthy = True
    router = Router(RoutingConfig())
    monitor = FleetMonitor(fleet, replicas.upstream, router, GatewayMetrics(), settings,
                           clock)  # type: ignore[arg-type]
    return fleet, monitor, router


async def until(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


# --- the monitor: one scrape of a replica at a time ----------------------------------------


async def test_an_older_answer_never_lands_after_a_newer_one_as_a_false_restart() -> None:
    """A soon scrape asked first answers last with higher counters... or lower: either
    way, the periodic scrape asked meanwhile is skipped, so no counter goes backwards
    between two stored scrapes of one process (before the change both were stored, the
    older last: read as a restart, the router's memory of the replica cleared)."""
    replicas = Replicas()
    clock = Clock()
    fleet, monitor, router = monitor_for(replicas, {"a": "a"}, clock)
    a = fleet.replicas["a"]
    replicas.answers[("a", "/metrics")] = lambda: MockReply(200, TEXT_H, [metrics(
        prompt_total=1000 if len(replicas.gets) == 1 else 2000)])
    replicas.hold["a"] = asyncio.Event()
    try:
        assert monitor.scrape_soon(a)
        await asyncio.wait_for(replicas.arrived.wait(), 5)
        await asyncio.wait_for(monitor.scrape(a), 5)  # the periodic one, meanwhile
        replicas.hold["a"].set()
        await until(lambda: a.snapshot is not None and not monitor._soon)
        await asyncio.wait_for(monitor.scrape(a), 5)  # the next one: counters forward
        assert a.snapshot is not None and a.snapshot.prompt_tokens_total == 2000
        assert router.restarts("a") == 0
    finally:
        await monitor.aclose()


async def test_a_departure_cancels_its_soon_scrape_and_forgets_when_it_was_asked() -> None:
    replicas = Replicas()
    clock = Clock()
    fleet, monitor, _ = monitor_for(replicas, {"a": "a"}, clock)
    a = fleet.replicas["a"]
    replicas.hold["a"] = asyncio.Event()  # never let go: the departure ends it
    try:
        assert monitor.scrape_soon(a)
        await asyncio.wait_for(replicas.arrived.wait(), 5)
        task = monitor._soon["a"]
        fleet.remove("a")
        monitor.forget_replica("a")
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
        assert task.cancelled()
        assert not monitor._soon and not monitor._scraping and not monitor._asked
    finally:
        await monitor.aclose()


async def test_soon_asked_twice_at_once_or_beside_a_periodic_scrape_starts_none_more() -> None:
    """`scrape_soon` says True only when it started a scrape: not for a second call before
    the first task ran (its ask time is not on record yet), nor beside a periodic scrape
    in flight."""
    replicas = Replicas()
    clock = Clock()
    fleet, monitor, _ = monitor_for(replicas, {"a": "a"}, clock)
    a = fleet.replicas["a"]
    replicas.hold["a"] = asyncio.Event()
    try:
        assert monitor.scrape_soon(a)
        assert not monitor.scrape_soon(a)  # same turn of the loop
        await asyncio.wait_for(replicas.arrived.wait(), 5)
        replicas.hold["a"].set()
        await until(lambda: not monitor._soon and not monitor._scraping)
        assert replicas.gets == ["a /metrics"]
        replicas.hold["a"].clear()
        replicas.arrived.clear()
        periodic = asyncio.create_task(monitor.scrape(a))
        await asyncio.wait_for(replicas.arrived.wait(), 5)
        clock.t += SOON_SPACING_S * 2
        assert not monitor.scrape_soon(a)  # the periodic one is in flight
        replicas.hold["a"].set()
        await asyncio.wait_for(periodic, 5)
    finally:
        replicas.hold["a"].set()
        await monitor.aclose()


async def test_a_replica_down_is_not_scraped_soon() -> None:
    replicas = Replicas()
    fleet, monitor, _ = monitor_for(replicas, {"a": "a"}, Clock())
    a = fleet.replicas["a"]
    a.healthy = False
    try:
        assert not monitor.scrape_soon(a)
        await asyncio.sleep(0.01)
        assert replicas.gets == [] and not monitor._soon
    finally:
        await monitor.aclose()


async def test_the_old_soon_scrapes_end_leaves_the_new_replicas_own_on_record() -> None:
    """The departed replica's soon scrape, cancelled, ends one loop turn after a new
    replica of its name asked its own: its done callback must not drop the new one's
    (aclose would then leave it running, and a second could start beside it)."""
    replicas = Replicas()
    clock = Clock()
    fleet, monitor, _ = monitor_for(replicas, {"a": "old"}, clock)
    replicas.hold["old"] = asyncio.Event()
    replicas.hold["new"] = asyncio.Event()
    try:
        assert monitor.scrape_soon(fleet.replicas["a"])
        await asyncio.wait_for(replicas.arrived.wait(), 5)
        fleet.remove("a")
        monitor.forget_replica("a")  # cancels the old one's
        new = fleet.add(ReplicaSettings(name="a", url="http://new.test", models=("m",)))
        new.healthy = True
        await asyncio.sleep(0)  # the old task ends; its done callback is next
        assert monitor.scrape_soon(new)
        task = monitor._soon["a"]
        await asyncio.sleep(0.01)
        assert monitor._soon.get("a") is task
    finally:
        replicas.hold["new"].set()
        await monitor.aclose()


async def test_aclose_cancels_a_soon_scrape_in_flight() -> None:
    replicas = Replicas()
    fleet, monitor, _ = monitor_for(replicas, {"a": "a"}, Clock())
    replicas.hold["a"] = asyncio.Event()
    assert monitor.scrape_soon(fleet.replicas["a"])
    await asyncio.wait_for(replicas.arrived.wait(), 5)
    task = monitor._soon["a"]
    await asyncio.wait_for(monitor.aclose(), 5)
    assert task.cancelled() and not monitor._soon and not monitor._scraping


async def test_a_replica_replaced_under_its_name_gets_its_own_first_scrape() -> None:
    replicas = Replicas()
    clock = Clock()
    fleet, monitor, _ = monitor_for(replicas, {"a": "old"}, clock)
    old = fleet.replicas["a"]
    replicas.hold["old"] = asyncio.Event()  # the old address no longer answers
    replicas.answers[("new", "/metrics")] = lambda: MockReply(
        200, TEXT_H, [metrics(blocks=1000)])
    periodic = asyncio.create_task(monitor.scrape(old))
    try:
        await asyncio.wait_for(replicas.arrived.wait(), 5)
        # the departure and the join, as membership.py `reconcile` does for a replace
        fleet.remove("a")
        monitor.forget_replica("a")
        new = fleet.add(ReplicaSettings(name="a", url="http://new.test", models=("m",)),
                        joining=True)
        await asyncio.wait_for(monitor.scrape(new), 5)  # membership `_join`'s scrape
        assert "new /metrics" in replicas.gets
        assert new.capacity_tokens() == 16_000
    finally:
        replicas.hold["old"].set()
        await asyncio.wait_for(periodic, 5)
        await monitor.aclose()


async def test_the_hiccup_scrape_behind_a_failing_one_still_reads_the_metrics() -> None:
    replicas = Replicas()
    clock = Clock()
    fleet, monitor, router = monitor_for(replicas, {"a": "a"}, clock)
    a = fleet.replicas["a"]
    replicas.answers[("a", "/metrics")] = lambda: MockReply(200, TEXT_H, [metrics()])
    await asyncio.wait_for(monitor.scrape(a), 5)  # the engine as it was: started 1.7e9
    assert a.start_time == 1.7e9
    # a soon scrape goes out while the engine restarts: it will get a 503 back
    replicas.hold["a"] = asyncio.Event()
    replicas.answers[("a", "/metrics")] = lambda: MockReply(503, TEXT_H, [b""])
    clock.t += 1.0
    assert monitor.scrape_soon(a)
    await asyncio.wait_for(until(lambda: len(replicas.gets) == 2), 5)
    try:
        a.failures = 1  # a failed health probe meanwhile (below unhealthy_after)
        # the engine is back, restarted: its next /metrics shows the new process
        assert await asyncio.wait_for(monitor.probe(a), 5)
        replicas.answers[("a", "/metrics")] = lambda: MockReply(
            200, TEXT_H, [metrics(prompt_total=10, start=1.8e9)])
        replicas.hold["a"].set()
        await until(lambda: not monitor._soon)
        # the restart is seen without waiting for the periodic scrape (bounded: 2 s)
        await until(lambda: router.restarts("a") == 1, timeout_s=2.0)
    finally:
        replicas.hold["a"].set()
        await monitor.aclose()


async def test_a_wall_clock_step_back_does_not_stop_soon_scrapes() -> None:
    replicas = Replicas()
    clock = Clock()
    fleet, monitor, _ = monitor_for(replicas, {"a": "a"}, clock)
    a = fleet.replicas["a"]
    replicas.answers[("a", "/metrics")] = lambda: MockReply(200, TEXT_H, [metrics()])
    try:
        await asyncio.wait_for(monitor.scrape(a), 5)
        clock.t -= 3600.0  # the wall clock stepped back an hour
        await asyncio.sleep(SOON_SPACING_S * 1.2)  # and the spacing passed, really
        assert monitor.scrape_soon(a)
    finally:
        await monitor.aclose()


def test_the_engine_docstring_states_the_spacing_the_monitor_uses() -> None:
    doc = " ".join((engine_mod.__doc__ or "").split())
    assert SOON_SPACING_S == 0.5 or "every half second" not in doc


def test_a_scrape_without_a_running_figure_ends_the_rise() -> None:
    """A fold that learnt nothing (no running figure) says the guess is not growing: a
    queue shown beside it asks for no scrape soon."""
    cap = engine_mod.learn(engine_mod.Capacity(1.0, None, 4, most_taken=4),
                           engine_mod.Scrape(2.0, 6, 3, None, 9))
    assert cap.rising
    blank = engine_mod.Scrape(3.0, math.nan, 3, None, 12)
    cap = engine_mod.learn(cap, blank)
    assert not cap.rising and not engine_mod.scrape_teaches(cap, blank, 12)


# --- the fleet view, simulated: when do soon scrapes stop? ---------------------------------

Engine = Callable[[int], tuple[float | None, float | None, float | None]]


def simulate(engine: Engine, demand: int, seconds: float = 60.0,
             metrics_ok: Callable[[float], bool] = lambda t: True,
             soon: bool = True) -> tuple[list[float], list[tuple[float, int | None, int]]]:
    """One replica under `demand` requests the gate would send; the gate fills the room
    (`seq_limit`) at each look (every 50 ms); a scrape every 5 s, and one at once
    whenever the fleet view asks soon and the monitor's rule lets it (`SOON_SPACING_S`
    from the last one asked), answered at once with what `engine(in_flight)` shows
    (running, waiting, KV usage) unless `metrics_ok(t)` is false (a failed scrape: the
    last one stays). Returns when each soon scrape was asked and (t, limit, in flight)."""
    fleet = Fleet([ReplicaSettings(name="a", url="http://a.test", models=("m",))])
    a = fleet.replicas["a"]
    a.healthy = True
    clock = Clock()
    t0 = clock.t
    asked = [-math.inf]
    asked_soon: list[float] = []
    seen: list[tuple[float, int | None, int]] = []

    def scrape_now() -> None:
        asked[0] = clock.t
        if metrics_ok(clock.t - t0):
            running, waiting, kv = engine(a.in_flight)
            fleet.set_snapshot("a", EngineSnapshot(clock.t, kv, running, waiting, None, None,
                                                   None, None, None, None),
                               clock.t, a.in_flight)

    def scrape_soon(_: object) -> bool:
        if clock.t - asked[0] < SOON_SPACING_S:
            return False
        asked_soon.append(clock.t - t0)
        scrape_now()
        return True

    view = FleetView(fleet, Router(RoutingConfig()), clock, 15.0, None,
                     scrape_soon=scrape_soon if soon else None)
    periodic = 0.0
    while clock.t - t0 < seconds:
        if clock.t - t0 >= periodic:
            scrape_now()
            periodic += 5.0
        limit = view.load(a, a.in_flight).seq_limit
        a.in_flight = min(demand, demand if limit is None else limit)
        seen.append((clock.t - t0, limit, a.in_flight))
        clock.t += 0.05
    return asked_soon, seen


L = 16  # the engine's --max-num-seqs


def vllm(n: int) -> tuple[float | None, float | None, float | None]:
    return min(n, L), max(0, n - L), 0.3


def late(asked: list[float]) -> int:
    return sum(1 for t in asked if t >= 30.0)


def test_a_vllm_like_engine_stops_the_soon_scrapes_once_it_shows_its_queue() -> None:
    asked, seen = simulate(vllm, 200)
    assert len(asked) <= 4 and late(asked) == 0
    assert seen[-1][1] == L  # its limit learnt (SATURATION_S on the periodic scrapes)
    # never sent more than twice what it was seen to take in
    assert max(n for _, _, n in seen) <= 2 * L


def test_an_engine_full_by_its_cache_stops_them_too() -> None:
    asked, _ = simulate(lambda n: (min(n, 5), max(0, n - 5), 0.97), 200)
    assert len(asked) <= 4 and late(asked) == 0


def test_an_engine_showing_no_running_stops_them_once_the_guess_passes_the_load() -> None:
    asked, seen = simulate(lambda n: (0, 0, 0.3), 200)
    assert late(asked) == 0 and seen[-1][1] is not None and seen[-1][1] >= 200


def test_soon_scrapes_reach_the_same_room_sooner_and_no_further() -> None:
    """The `low` flood case the guess exists for: the engine's own first-come queue
    holds at most what the engine was seen to take (here L) with soon scrapes as without,
    and the soon scrapes do not keep more there for longer once the limit is learnt."""
    asked, fast = simulate(vllm, 200)
    _, slow = simulate(vllm, 200, soon=False)

    def queued(seen: list[tuple[float, int | None, int]]) -> float:  # request-seconds
        return sum(max(0, n - L) for _, _, n in seen) * 0.05

    assert max(n for _, _, n in fast) == max(n for _, _, n in slow) == 2 * L
    assert fast[-1][1] == slow[-1][1] == L
    reach = next(t for t, _, n in fast if n == 2 * L)
    assert reach < next(t for t, _, n in slow if n == 2 * L)
    assert reach < 2.0 and asked
    assert queued(fast) <= queued(slow) + 5.0  # no longer a queue in the engine


PERSISTENT = {
    # waiting not exported (a vLLM fork, a renamed metric): what this gateway had there
    # never counts as taken, running stops at L, the gate fills 2L
    "no waiting count": (lambda n: (min(n, L), None, 0.3), lambda t: True),
    "waiting nan": (lambda n: (min(n, L), math.nan, 0.3), lambda t: True),
    # a running count shown once, then no figure (NaN, missing)
    "running gone to no figure": (lambda n: (min(n, L) if n < 5 else math.nan, 0, 0.3),
                                  lambda t: True),
    # /metrics fails (5xx, timeouts under load) from 0.6 s in, while the guess grew
    "metrics failing mid-ramp": (vllm, lambda t: t < 0.6),
}


@pytest.mark.parametrize("case", sorted(PERSISTENT))
def test_soon_scrapes_that_teach_nothing_stop(case: str) -> None:
    engine, ok = PERSISTENT[case]
    asked, _ = simulate(engine, 200, metrics_ok=ok)
    assert late(asked) <= 2, f"{late(asked)} soon scrapes in the last 30 s"


def test_soon_scrapes_of_a_failing_metrics_page_counted_on_the_real_monitor() -> None:
    """No periodic loop runs here: every GET counted is a soon one."""
    async def run() -> int:
        replicas = Replicas()
        clock = Clock()
        fleet, monitor, router = monitor_for(replicas, {"a": "a"}, clock)
        a = fleet.replicas["a"]
        view = FleetView(fleet, router, clock, 15.0, None, scrape_soon=monitor.scrape_soon)
        replicas.answers[("a", "/metrics")] = lambda: MockReply(200, TEXT_H, [metrics(
            running=4, waiting=0)])
        a.in_flight = 4
        try:
            await asyncio.wait_for(monitor.scrape(a), 5)  # took 4: guess 8
            replicas.answers[("a", "/metrics")] = lambda: MockReply(500, TEXT_H, [b""])
            a.in_flight = 8  # the gate filled the guess
            before = len(replicas.gets)
            for _ in range(40):  # 2 s of looks, every 50 ms
                view.load(a, a.in_flight)
                clock.t += 0.05
                await asyncio.sleep(0.005)
            await until(lambda: not monitor._soon)
            return len(replicas.gets) - before
        finally:
            await monitor.aclose()
    gets = asyncio.run(run())
    assert gets <= 2, f"{gets} GETs of a failing /metrics in 2 s"
