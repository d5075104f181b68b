"""Facts sized by what is new (gateway/shared/chains.py): a receiver applying delta facts
ends with the router state of one applying whole facts (hypothesis); a follow-up's fact
is small and does not grow with the conversation; the stream stays within its byte bound
on a real redis-server."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.affinity import ResponseAffinity
from gateway.routing.config import RoutingConfig
from gateway.routing.facts import Fact, Reply, Sent, decode, encode
from gateway.routing.router import Router
from gateway.shared.chains import Chains, Published
from gateway.shared.config import RedisSettings
from gateway.shared.redis_state import SharedState
from gateway.shared.stream import entry_bytes, stream_maxlen
from tests.redis_server import needs_redis, redis_server
from tests.servers import free_port

NAMES = ["r1", "r2", "r3"]


def router() -> Router:
    r = Router(RoutingConfig(seed=1, default_capacity_tokens=4096))
    for n in NAMES:
        r.add_replica(n)
    return r


def held(r: Router, name: str) -> tuple[object, ...]:
    """A replica's index: its blocks with their parents, and its leaves in eviction order
    (oldest stamp first; the stamps' values depend on the clock, their order does not)."""
    h = r._ledger.index._held[name]
    leaves = sorted((b for b in h.parent if b not in h.kids), key=lambda b: h.stamp.get(b, 0))
    return tuple(sorted(h.parent.items(), key=str)), tuple(leaves)


def state(r: Router) -> tuple[object, ...]:
    """What a router remembers: each replica's index, the bindings and loads of sessions,
    the conversations."""
    return (tuple(held(r, n) for n in NAMES),
            tuple(r._sessions._bound.items()),
            tuple(round(r.session_load(n, 1e4), 9) for n in NAMES),
            r.conversations())


# One step of a conversation: (conversation, blocks added, replica, session id or
# implicit, whether the reply is indexed too, fork: turns back to an earlier length).
STEP = st.tuples(st.integers(0, 3), st.integers(0, 12), st.sampled_from(NAMES),
                 st.booleans(), st.booleans(), st.integers(0, 6))


def facts_of(steps: Sequence[tuple[int, int, str, bool, bool, int]]) -> list[Fact]:
    chains: dict[int, list[int]] = {}
    out: list[Fact] = []
    rng = random.Random(len(steps))
    for conv, added, replica, named, reply, back in steps:
        chain = chains.setdefault(conv, [])
        if back and back < len(chain):
            del chain[len(chain) - back:]  # a retry or fork from an earlier turn
        chain += [rng.getrandbits(64) for _ in range(added + 1)]
        out.append(Sent(replica, list(chain), f"s{conv}" if named else None, not named))
        if reply:
            held = len(chain)
            chain += [rng.getrandbits(64) for _ in range(rng.randint(1, 4))]
            out.append(Reply(replica, list(chain), held))
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(STEP, max_size=40), st.integers(1, 64), st.sampled_from([1e9, 3.0]))
def test_delta_facts_leave_the_router_as_whole_facts_do(
        steps: list[tuple[int, int, str, bool, bool, int]], capacity: int,
        rebase_s: float) -> None:
    facts = facts_of(steps)
    published, chains = Published(capacity, rebase_s), Chains(1 << 20)
    whole, delta = router(), router()
    deltas = 0
    for i, fact in enumerate(facts):
        at = 100.0 + i
        whole.apply(fact, at)
        assert isinstance(fact, (Sent, Reply))
        base = published.base(fact.hashes, at)
        published.sent(fact.hashes, base, at)
        env = decode(encode(fact, "a", at, base))
        got = env.fact
        assert isinstance(got, (Sent, Reply))
        if env.base is None:
            chains.learn(got.hashes)
            resolved = list(got.hashes)
        else:
            deltas += 1
            resolved_or_none = chains.resolve(env.base, got.hashes)
            assert resolved_or_none is not None  # the receiver saw every earlier fact
            resolved = resolved_or_none
        assert resolved == list(fact.hashes)
        delta.apply(Sent(got.replica, resolved, got.session, got.implicit)
                    if isinstance(got, Sent) else Reply(got.replica, resolved, got.held), at)
    assert state(delta) == state(whole)
    if any(isinstance(f, Reply) for f in facts):
        assert deltas > 0  # a reply always extends the prompt just sent


@settings(max_examples=100, deadline=None)
@given(st.lists(STEP, max_size=40), st.integers(1, 200))
def test_a_receiver_short_of_memory_resolves_right_or_not_at_all(
        steps: list[tuple[int, int, str, bool, bool, int]], budget: int) -> None:
    published, chains = Published(64, 1e9), Chains(budget)
    for i, fact in enumerate(facts_of(steps)):
        assert isinstance(fact, (Sent, Reply))
        base = published.base(fact.hashes, float(i))
        published.sent(fact.hashes, base, float(i))
        env = decode(encode(fact, "a", float(i), base))
        assert isinstance(env.fact, (Sent, Reply))
        if env.base is None:
            chains.learn(env.fact.hashes)
        else:
            got = chains.resolve(env.base, env.fact.hashes)
            assert got is None or got == list(fact.hashes)
        assert chains.held <= budget or len(chains) == 1  # one chain is kept whatever its size


def test_the_publisher_rebases_after_rebase_s() -> None:
    p = Published(16, rebase_s=60.0)
    p.sent([1, 2, 3], None, 0.0)
    assert p.base([1, 2, 3, 4], 30.0) == (3, 3)
    p.sent([1, 2, 3, 4], (3, 3), 30.0)
    assert p.base([1, 2, 3, 4, 5], 59.0) == (4, 4)  # its chain went whole at 0 s
    assert p.base([1, 2, 3, 4, 5], 61.0) is None  # whole again
    p.sent([1, 2, 3, 4, 5], None, 61.0)
    assert p.base([1, 2, 3, 4, 5, 6], 100.0) == (5, 5)


# A 32k-token agent conversation: ~4 canonical bytes a token, 64-byte blocks.
BLOCKS_PER_KTOKEN = 4096 // 64
TURN_BLOCKS = 1024 * 4 // 64  # a follow-up adds ~1k tokens (a tool result and a reply)


@pytest.mark.parametrize("ktokens", [8, 32, 100])
def test_a_follow_up_fact_is_small_whatever_the_conversations_length(ktokens: int) -> None:
    rng = random.Random(ktokens)
    chain = [rng.getrandbits(64) for _ in range(ktokens * BLOCKS_PER_KTOKEN)]
    p = Published(16, 120.0)
    first = encode(Sent("replica-1", chain, "session-0123456789"), "0123456789ab", 1.0)
    p.sent(chain, None, 1.0)
    follow = chain + [rng.getrandbits(64) for _ in range(TURN_BLOCKS)]
    base = p.base(follow, 2.0)
    fields = encode(Sent("replica-1", follow, "session-0123456789"), "0123456789ab", 2.0, base)
    assert base == (chain[-1], len(chain))
    assert entry_bytes(fields) <= 1.5 * 1024 < entry_bytes(first)


@needs_redis
async def test_the_stream_stays_within_its_byte_bound() -> None:
    pytest.importorskip("redis")
    from redis.asyncio import Redis

    port = free_port()
    bound = 256 << 10
    with redis_server(port):
        url = f"redis://127.0.0.1:{port}/0"
        # a generous command timeout: this is about the bound, and a batch that took over
        # the default 0.5 s on a loaded machine (a CI rehearsal) marked Redis down and
        # left its facts unwritten
        a = SharedState(RedisSettings(url=url, stream_max_bytes=bound, timeout_s=10.0),
                        lambda f, t: None, ResponseAffinity(), time.time, instance="A")
        await a.start()
        rng = random.Random(5)
        try:
            for i in range(3000):  # ~2.4 MB of facts, 10x the bound
                a.publish(Sent(NAMES[i % 3], [rng.getrandbits(64) for _ in range(60)],
                               f"s{i}"))
                if i % 200 == 0:
                    await asyncio.sleep(0)
            deadline = time.monotonic() + 20
            while a.written < 3000:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        finally:
            await a.aclose()
        client = Redis.from_url(url)
        used = await client.memory_usage(a.stream, samples=0)
        length = await client.xlen(a.stream)
        await client.aclose()
    assert a.written_bytes > 7 * bound
    assert used is not None
    # MAXLEN ~ trims whole stream nodes only: one node's worth over, at most.
    assert used <= bound * 1.1, (used, length)
    assert used >= bound * 0.7, (used, length)  # and keeps what the bound allows


@needs_redis
@pytest.mark.parametrize("catch_up_facts", [8, 1000])
async def test_start_up_applies_the_newest_facts_and_resolves_their_deltas(
        catch_up_facts: int) -> None:
    """One conversation of 30 turns (a whole chain, then deltas): an instance that starts
    afterwards applies only the newest catch_up_facts facts, yet resolves every one of
    them (it learned the chains the earlier facts built) and indexes the conversation."""
    port = free_port()
    with redis_server(port):
        url = f"redis://127.0.0.1:{port}/0"
        a = SharedState(RedisSettings(url=url), lambda f, t: None, ResponseAffinity(),
                        time.time, instance="A")
        await a.start()
        rng = random.Random(2)
        chain = [rng.getrandbits(64) for _ in range(100)]
        for _ in range(30):
            chain += [rng.getrandbits(64) for _ in range(5)]
            a.publish(Sent("r1", list(chain), "s"))
        deadline = time.monotonic() + 20
        while a.written < 30:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await a.aclose()
        b_router = router()
        b = SharedState(RedisSettings(url=url, catch_up_facts=catch_up_facts),
                        b_router.apply, ResponseAffinity(), time.time, instance="B")
        await b.start()
        await b.aclose()
    assert b.caught_up
    assert b.applied == min(30, catch_up_facts)
    assert b._m_facts.labels("in", "unresolved")._value.get() == 0
    assert b_router.indexed_blocks("r1") == len(chain)


@pytest.mark.parametrize(("max_bytes", "cap", "written_bytes", "written", "maxlen"), [
    (1000, 50, 0, 0, 50),  # nothing measured yet: the count cap
    (1000, 50, 500, 10, 20),  # 50 B a fact: 20 fit
    (1000, 10, 500, 10, 10),  # the count cap still holds
    (10, 50, 5000, 10, 1),  # facts larger than the bound: keep the last one
])
def test_the_stream_keeps_what_its_byte_bound_allows(max_bytes: int, cap: int,
                                                     written_bytes: int, written: int,
                                                     maxlen: int) -> None:
    assert stream_maxlen(max_bytes, cap, written_bytes, written) == maxlen
