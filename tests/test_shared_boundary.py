"""The shared state's loops under their error boundary, through a real redis-server: an
error nothing expected (here: encoding a fact raises once) ends one run of the writer,
logged; the writer starts again and later facts still reach the other instance, whole (the
chains of the lost batch are forgotten, so no delta is built on a chain no receiver saw).
And the reader goes on past an entry whose application raises."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gateway.routing.affinity import ResponseAffinity
from gateway.routing.facts import Fact, Sent
from gateway.shared import redis_state
from gateway.shared.config import RedisSettings
from gateway.shared.redis_state import SharedState
from tests.redis_server import needs_redis
from tests.test_shared_time import redis_url, until

pytest.importorskip("redis")
__all__ = ["redis_url"]  # the fixture, used by name


@needs_redis
async def test_the_writer_goes_on_after_an_error_and_builds_no_delta_on_lost_chains(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[Fact] = []
    a = SharedState(RedisSettings(url=redis_url), lambda f, t: None, ResponseAffinity(),
                    time.time, instance="A")
    b = SharedState(RedisSettings(url=redis_url), lambda f, t: got.append(f),
                    ResponseAffinity(), time.time, instance="B")
    await a.start()
    await b.start()
    try:
        a.publish(Sent("r1", [1, 2, 3], "s"))
        await until(lambda: len(got) == 1)
        real = redis_state.encode
        calls = 0

        def fails_once(*args: Any, **kwargs: Any) -> dict[bytes, bytes]:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise RuntimeError("a bug in encoding")
            return real(*args, **kwargs)

        monkeypatch.setattr(redis_state, "encode", fails_once)
        a.publish(Sent("r1", [1, 2, 3, 4], "s"))  # lost with the run that failed
        await until(lambda: calls >= 1)
        a.publish(Sent("r1", [1, 2, 3, 4, 5], "s"))
        await until(lambda: len(got) == 2)
        last = got[-1]
        assert isinstance(last, Sent) and list(last.hashes) == [1, 2, 3, 4, 5]
    finally:
        await a.aclose()
        await b.aclose()


@needs_redis
async def test_the_reader_goes_on_past_an_entry_it_cannot_apply(redis_url: str) -> None:
    got: list[Fact] = []

    def apply(fact: Fact, at: float) -> None:
        if isinstance(fact, Sent) and fact.session == "poison":
            raise KeyError("a fact this router cannot apply")
        got.append(fact)

    a = SharedState(RedisSettings(url=redis_url), lambda f, t: None, ResponseAffinity(),
                    time.time, instance="A")
    b = SharedState(RedisSettings(url=redis_url), apply, ResponseAffinity(), time.time,
                    instance="B")
    await a.start()
    await b.start()
    try:
        a.publish(Sent("r1", [7], "poison"))
        a.publish(Sent("r1", [8], "fine"))
        await until(lambda: len(got) == 1)
        assert isinstance(got[0], Sent) and got[0].session == "fine"
    finally:
        await a.aclose()
        await b.aclose()
