"""What an instance applies from the shared stream and what it writes there, on a real
redis-server: never its own facts back, never a delta whose chain it does not know (as if
the tail were a whole chain), and no delta built on a chain whose write failed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import CollectorRegistry

from gateway.routing.affinity import ResponseAffinity
from gateway.routing.facts import Fact, Sent, decode, encode
from gateway.shared.config import RedisSettings
from gateway.shared.redis_state import SharedState
from tests.redis_server import needs_redis, redis_server
from tests.servers import free_port

pytest.importorskip("redis")
pytestmark = needs_redis

CHAIN = list(range(1000, 1010))


async def until(cond: Callable[[], bool], what: str, deadline_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not cond():
        assert loop.time() < end, f"not within {deadline_s} s: {what}"
        await asyncio.sleep(0.005)


class Instance:
    """A SharedState with what it applied and its own metrics registry."""

    def __init__(self, url: str, name: str) -> None:
        self.applied: list[Fact] = []
        self.registry = CollectorRegistry()
        self.state = SharedState(RedisSettings(url=url, retry_s=0.05),
                                 lambda f, _t: self.applied.append(f), ResponseAffinity(),
                                 time.time, registry=self.registry, instance=name)

    def facts(self, direction: str, result: str) -> float:
        got = self.registry.get_sample_value(
            "gateway_shared_facts_total", {"direction": direction, "result": result})
        return got or 0.0


@pytest.fixture
async def redis_url() -> AsyncIterator[str]:
    port = free_port()
    with redis_server(port):
        yield f"redis://127.0.0.1:{port}/0"


def replicas(facts: list[Fact]) -> list[str]:
    return [f.replica for f in facts if isinstance(f, Sent)]


async def test_an_instance_never_applies_its_own_facts_back(redis_url: str) -> None:
    a, b = Instance(redis_url, "A"), Instance(redis_url, "B")
    await a.state.start()
    await b.state.start()
    try:
        a.state.publish(Sent("from-a", CHAIN, "s-a"))
        await until(lambda: a.state.written == 1, "A's fact is written")
        b.state.publish(Sent("from-b", [7, 8, 9], "s-b"))
        # A reads the stream in order: once it applied B's fact it has read its own
        await until(lambda: "from-b" in replicas(a.applied), "A applies B's fact")
        await until(lambda: "from-a" in replicas(b.applied), "B applies A's fact")
    finally:
        await a.state.aclose()
        await b.state.aclose()
    assert replicas(a.applied) == ["from-b"]
    assert replicas(b.applied) == ["from-a"]


async def test_a_delta_on_an_unknown_chain_is_skipped_not_applied_as_a_chain(
        redis_url: str) -> None:
    """Another instance's delta extends a chain this one never saw (it was written before
    it started, or evicted here): skipped and counted; the next fact is applied."""
    from redis.asyncio import Redis

    b = Instance(redis_url, "B")
    await b.state.start()
    client = Redis.from_url(redis_url)
    try:
        longer = [*CHAIN, 2000, 2001, 2002]
        now = time.time()
        await client.xadd(b.state.stream, encode(  # type: ignore[arg-type]
            Sent("delta", longer, "s"), "C", now, (CHAIN[-1], len(CHAIN))))
        await client.xadd(b.state.stream, encode(  # type: ignore[arg-type]
            Sent("whole", [5, 6], "t"), "C", now))
        await until(lambda: "whole" in replicas(b.applied), "the next fact is applied")
    finally:
        await client.aclose()
        await b.state.aclose()
    assert replicas(b.applied) == ["whole"]
    assert b.facts("in", "unresolved") == 1.0


async def test_a_failed_write_leaves_no_base_for_deltas(redis_url: str) -> None:
    """A conversation's fact is lost with its batch (Redis refused the write): the next
    fact about it goes whole, since no receiver saw the chain a delta would name."""
    from redis.asyncio import Redis

    a = Instance(redis_url, "A")
    client = Redis.from_url(redis_url)
    # the stream's key holds a string: every XADD fails (WRONGTYPE) until it is deleted
    await client.set(a.state.stream, b"not a stream")
    await a.state.start()
    try:
        a.state.publish(Sent("r1", CHAIN, "s"))
        await until(lambda: a.facts("out", "dropped") == 1.0, "the write fails")
        await client.delete(a.state.stream)
        a.state.publish(Sent("r1", [*CHAIN, 2000, 2001], "s"))  # the conversation's next turn
        await until(lambda: a.state.written == 1, "the next fact is written")
        entries: list[tuple[bytes, dict[bytes, bytes]]] = list(
            await client.xrange(a.state.stream))  # type: ignore[arg-type]
    finally:
        await client.aclose()
        await a.state.aclose()
    ((_id, fields),) = entries
    env = decode(fields)
    assert env.base is None
    assert isinstance(env.fact, Sent) and list(env.fact.hashes) == [*CHAIN, 2000, 2001]
