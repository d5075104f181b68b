"""Shared routing state over time, through a real redis-server: facts are applied at the
time they happened, a (re)starting instance skips what is too old to matter, and a
replica's restart voids what other instances said about it before."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.routing.affinity import ResponseAffinity
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.facts import Restarted, Sent
from gateway.routing.router import Router
from gateway.shared.config import RedisSettings
from gateway.shared.redis_state import SharedState
from tests.redis_server import needs_redis, redis_server
from tests.servers import free_port

pytest.importorskip("redis")

NAMES = ["r1", "r2"]
IDLE = [ReplicaState(n, 0) for n in NAMES]


def router(**publish: Callable[..., None]) -> Router:
    r = Router(RoutingConfig(seed=3, policy="prefix"), publish=publish.get("publish"))
    for n in NAMES:
        r.add_replica(n)
    return r


def body(i: int, tag: str) -> dict[str, object]:
    return {"model": "m", "messages": [
        {"role": "system", "content": f"{tag} agent number {i}. " + "Be brief. " * 40},
        {"role": "user", "content": f"question {i} of {tag}"}]}


@pytest.fixture
async def redis_url() -> AsyncIterator[str]:
    port = free_port()
    with redis_server(port):
        yield f"redis://127.0.0.1:{port}/0"


async def until(cond: Callable[[], bool]) -> None:
    """Wait (20 s at most) for what the background loops do; polled, as they signal
    nothing."""
    deadline = time.monotonic() + 20.0
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def publish_old_sessions(url: str, ago: float) -> None:
    """Instance A, `ago` seconds in the past: 300 sessions sent to r1, 100 to r2."""
    def clock() -> float:
        return time.time() - ago

    a = SharedState(RedisSettings(url=url), lambda f, t: None, ResponseAffinity(), clock,
                    instance="A")
    old = router(publish=a.publish)
    await a.start()
    t = clock()
    for i in range(400):
        replica = "r1" if i < 300 else "r2"
        old.decide(body(i, "old"), "chat", "m", f"old-{i}", [ReplicaState(replica, 0)], t)
    await until(lambda: a.written >= 400)
    await a.aclose()


@needs_redis
@pytest.mark.parametrize("replay_s", [600.0, 7200.0], ids=["skipped", "applied at their time"])
async def test_restarted_instance_splits_new_sessions_evenly(redis_url: str,
                                                             replay_s: float) -> None:
    """The reproduction: sessions last seen an hour ago (300 on r1, 100 on r2), then an
    instance starts and places 40 new sessions on an idle fleet. Facts older than replay_s
    are skipped; younger ones are applied at their own time and weigh e^-60 each."""
    await publish_old_sessions(redis_url, 3600.0)
    b_router = router()
    b = SharedState(RedisSettings(url=redis_url, replay_s=replay_s), b_router.apply,
                    ResponseAffinity(), time.time, instance="B")
    await b.start()
    try:
        assert b.caught_up
        now = time.time()
        if replay_s > 3600:
            assert b.applied == 400
            assert b_router.session_replica("old-0") == "r1"
        else:
            assert b.applied == 0
        assert b_router.session_load("r1", now) < 1e-6
        placed = Counter(b_router.decide(body(i, "new"), "chat", "m", f"new-{i}", IDLE,
                                         now + i * 0.01).decision.replica for i in range(40))
    finally:
        await b.aclose()
    assert abs(placed["r1"] - placed["r2"]) <= 2, placed


@needs_redis
async def test_a_replica_restart_voids_earlier_facts_on_every_instance(redis_url: str) -> None:
    """A restart seen by A reaches B as a fact: the blocks B was told about before are
    gone, and a fact from before the restart that arrives after it is not put back."""
    a = SharedState(RedisSettings(url=redis_url), lambda f, t: None, ResponseAffinity(),
                    time.time, instance="A")
    b_router = router()
    b = SharedState(RedisSettings(url=redis_url), b_router.apply, ResponseAffinity(),
                    time.time, instance="B")
    a_router = router(publish=a.publish)
    await a.start()
    await b.start()
    try:
        t = time.time()
        a_router.decide(body(1, "x"), "chat", "m", "s1", [ReplicaState("r1", 0)], t)
        await until(lambda: b.applied >= 1)
        assert b_router.indexed_blocks("r1") > 0
        a_router.replica_restarted("r1", time.time())
        await until(lambda: b.applied >= 2)
        assert b_router.indexed_blocks("r1") == 0
        # Published late (queued before the restart, written after it).
        a.publish(Sent("r1", [11, 12, 13], "s2"))
        a._queue[-1] = (a._queue[-1][0], t - 0.5)
        a.publish(Sent("r1", [21, 22], "s3"))
        await until(lambda: b.applied >= 4)
        assert b_router.indexed_blocks("r1") == 2
        assert b_router.session_replica("s2") == "r1"  # bindings hold across a restart
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize(("facts", "blocks"), [
    ([(Sent("r1", [1, 2, 3]), 10.0), (Restarted("r1"), 20.0)], 0),
    ([(Restarted("r1"), 20.0), (Sent("r1", [1, 2, 3]), 19.0)], 0),
    ([(Restarted("r1"), 20.0), (Sent("r1", [1, 2, 3]), 21.0)], 3),
    ([(Restarted("r2"), 20.0), (Sent("r1", [1, 2, 3]), 19.0)], 3),
    # One restart seen by two instances, 5 s apart: what came in between is kept.
    ([(Restarted("r1"), 20.0), (Sent("r1", [1, 2, 3]), 22.0), (Restarted("r1"), 25.0)], 3),
    # Another restart, later: cleared again.
    ([(Restarted("r1"), 20.0), (Sent("r1", [1, 2, 3]), 22.0), (Restarted("r1"), 200.0)], 0),
])
def test_restart_voids_older_block_facts(facts: list[tuple[Sent | Restarted, float]],
                                         blocks: int) -> None:
    r = router()
    for fact, at in facts:
        r.apply(fact, at)
    assert r.indexed_blocks("r1") == blocks


@pytest.mark.parametrize(("at", "load"), [(0.0, 1.0), (-60.0, 0.3679), (-3600.0, 0.0)])
def test_a_fact_weighs_what_its_age_says(at: float, load: float) -> None:
    r = router()
    r.apply(Sent("r1", [1], "s"), 1000.0 + at)
    assert r.session_load("r1", 1000.0) == pytest.approx(load, abs=1e-4)


def test_an_older_fact_does_not_move_a_newer_binding() -> None:
    r = router()
    r.apply(Sent("r1", [1], "s"), 100.0)
    r.apply(Sent("r2", [2], "s"), 90.0)  # published earlier, arrived later
    assert r.session_replica("s") == "r1"
    assert r.session_load("r2", 100.0) == 0.0


@needs_redis
async def test_two_instances_clear_once_per_restart_and_again_at_the_next(
        redis_url: str) -> None:
    """Two instances, each publishing and applying, see one crash-looping replica: the
    restart both see (A first, B at its own next scrape, the same start time) clears each
    index once, so what both routed in between is kept; the next one, 10 s later, seen by
    B first, clears both again."""
    routers: dict[str, Router] = {}
    states = {n: SharedState(RedisSettings(url=redis_url),
                             lambda f, at, n=n: routers[n].apply(f, at),  # type: ignore[misc]
                             ResponseAffinity(), time.time, instance=n) for n in "AB"}
    for n, state in states.items():
        routers[n] = router(publish=state.publish)
        await state.start()
    a, b = routers["A"], routers["B"]
    try:
        def routed(tag: str) -> None:
            for i, r in enumerate((a, b)):
                r.decide(body(i, tag), "chat", "m", f"{tag}{i}", [ReplicaState("r1", 0)],
                         time.time())

        def told(to_a: int, to_b: int) -> Callable[[], bool]:  # facts each has applied
            return lambda: states["A"].applied >= to_a and states["B"].applied >= to_b

        routed("before")
        await until(told(1, 1))
        start = time.time() - 5
        a.replica_restarted("r1", time.time(), started=start)
        await until(lambda: b.indexed_blocks("r1") == 0)
        assert a.indexed_blocks("r1") == 0
        routed("between")
        await until(told(2, 3))
        held = a.indexed_blocks("r1"), b.indexed_blocks("r1")
        assert min(held) > 0
        b.replica_restarted("r1", time.time(), started=start)  # the same, seen by B
        routed("after")  # a marker: once A has this, it would have had any fact before
        await until(told(3, 4))
        assert a.indexed_blocks("r1") >= held[0] and b.indexed_blocks("r1") >= held[1]
        b.replica_restarted("r1", time.time() + 10, started=start + 10)  # the next crash
        await until(lambda: a.indexed_blocks("r1") == 0)
        assert b.indexed_blocks("r1") == 0
    finally:
        for state in states.values():
            await state.aclose()
