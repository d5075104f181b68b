"""Shared routing state through Redis: publish this instance's routing facts, apply the
other instances'. I/O only; the facts and their wire form are gateway/routing/facts.py,
their effect is `Router.apply`.

Why these Redis mechanisms:
- One capped stream, `<prefix>:routing` (`XADD MAXLEN ~ stream_maxlen`): every instance
  appends and every instance reads everything in order, so all routers replay the same
  history; the cap bounds Redis's memory, and it is exactly the catch-up a (re)starting
  instance needs: it reads the stream from the start, i.e. the latest `stream_maxlen`
  facts, which cover what the replicas can still hold. Bindings (sessions, implicit
  conversations, Responses API ids) travel as facts in the same stream rather than as
  expiring keys: a key would have to be read on the request path, and reads must stay
  local; the stream's cap plays the role of the expiry.
- Consumer groups are not used: each instance must see every fact, not a share of them.
- Writes are fire-and-forget: `publish` appends to a bounded local queue (O(1), on the
  request path) and a background task pipelines batches with `XADD`. Reads are one
  background `XREAD BLOCK` loop from the last id seen. Redis is therefore never on a
  request's path; a slow or dead Redis costs nothing but staleness.

Failure: a command that fails or takes longer than `timeout_s` marks Redis down (one
warning, `gateway_shared_state_up` 0); the failed batch is dropped and counted, new facts
queue (the oldest dropped once `queue_size` is reached), and both loops retry with
backoff. Back up: one info line, the queue is flushed, and the reader resumes from the
last id it applied, catching up on whatever the stream still holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.routing.affinity import AffinityStore
from gateway.routing.facts import Fact, FactError, Response, decode, encode
from gateway.shared.config import RedisSettings
from gateway.tasks import cancel_all

log = logging.getLogger("gateway.shared")

_MAX_RETRY_S = 10.0


class SharedState:
    def __init__(self, settings: RedisSettings, apply: Callable[[Fact, float], None],
                 affinity: AffinityStore, clock: Callable[[], float],
                 registry: CollectorRegistry | None = None,
                 instance: str | None = None) -> None:
        if settings.url is None:
            raise ValueError("SharedState needs redis.url")
        self.settings = settings
        self.instance = instance or os.urandom(6).hex()
        self.stream = f"{settings.prefix}:routing"
        self._apply = apply
        self._affinity = affinity
        self._clock = clock
        self._queue: deque[tuple[Fact, float]] = deque(maxlen=settings.queue_size)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._last_id = b"0"  # from the start of the stream: catch up first
        self._up: bool | None = None
        self._writer: Any = None
        self._reader: Any = None
        r = registry
        self._m_up = Gauge("gateway_shared_state_up",
                           "1 while Redis answers (shared routing state), else 0.", registry=r)
        self._m_facts = Counter(
            "gateway_shared_facts", "Routing facts by direction and result.",
            ("direction", "result"), registry=r)
        self._m_delay = Histogram(
            "gateway_shared_fact_delay_seconds",
            "From another instance's publish to this instance applying the fact.",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0), registry=r)
        self.applied = 0  # facts from other instances applied (tests, bench)

    # the request path's side ------------------------------------------------------------

    def publish(self, fact: Fact) -> None:
        """Queue a fact (O(1), never blocks, never fails)."""
        if len(self._queue) == self._queue.maxlen:
            self._m_facts.labels("out", "dropped").inc()
        self._queue.append((fact, self._clock()))
        self._wake.set()

    def remember_response(self, response_id: str, replica: str) -> None:
        self.publish(Response(response_id, replica))

    # lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        from redis.asyncio import Redis

        s = self.settings
        assert s.url is not None
        self._writer = Redis.from_url(s.url, socket_connect_timeout=s.timeout_s,
                                      socket_timeout=s.timeout_s)
        # A blocked XREAD waits up to block_ms for news; its socket timeout covers that
        # with a second to spare (a loaded host delays the answer, and a false "down"
        # would pause the reader for retry_s).
        self._reader = Redis.from_url(s.url, socket_connect_timeout=s.timeout_s,
                                      socket_timeout=s.timeout_s + s.block_ms / 1000.0 + 1.0)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write_loop(), name="shared-state writer"),
                       loop.create_task(self._read_loop(), name="shared-state reader")]

    async def aclose(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_all(tasks)
        from redis.exceptions import RedisError

        for client in (self._writer, self._reader):
            if client is not None:
                with contextlib.suppress(RedisError, OSError):
                    await client.aclose()

    @property
    def up(self) -> bool:
        return bool(self._up)

    # loops ------------------------------------------------------------------------------

    def _state(self, up: bool, error: BaseException | None = None) -> None:
        if self._up == up:
            return
        first = self._up is None
        self._up = up
        self._m_up.set(1 if up else 0)
        if not up:
            log.warning("shared state: Redis unreachable, routing on local state",
                        extra={"redis": _safe(self.settings.url), "error": str(error)[:200]})
        elif not first:
            log.info("shared state: Redis back, catching up",
                     extra={"redis": _safe(self.settings.url)})

    async def _write_loop(self) -> None:
        from redis.exceptions import RedisError

        s = self.settings
        pause = s.retry_s
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            batch = [self._queue.popleft() for _ in range(min(s.batch_size, len(self._queue)))]
            try:
                async with self._writer.pipeline(transaction=False) as pipe:
                    for fact, at in batch:
                        pipe.xadd(self.stream, encode(fact, self.instance, at),
                                  maxlen=s.stream_maxlen, approximate=True)
                    await asyncio.wait_for(pipe.execute(), s.timeout_s * 2)
            except (TimeoutError, RedisError, OSError) as exc:
                self._m_facts.labels("out", "dropped").inc(len(batch))
                self._state(False, exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, _MAX_RETRY_S)
                continue
            pause = s.retry_s
            self._m_facts.labels("out", "ok").inc(len(batch))
            self._state(True)

    async def _read_loop(self) -> None:
        from redis.exceptions import RedisError

        s = self.settings
        pause = s.retry_s
        while True:
            try:
                got = await self._reader.xread({self.stream: self._last_id}, count=1000,
                                               block=s.block_ms)
            except (TimeoutError, RedisError, OSError) as exc:
                self._state(False, exc)
                await asyncio.sleep(pause)
                pause = min(pause * 2, _MAX_RETRY_S)
                continue
            pause = s.retry_s
            self._state(True)
            for _stream, entries in got or ():
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    self._receive(fields)

    def _receive(self, fields: dict[bytes, bytes]) -> None:
        try:
            env = decode(fields)
        except FactError as exc:
            self._m_facts.labels("in", "invalid").inc()
            log.debug("shared state: invalid fact skipped", extra={"error": str(exc)})
            return
        if env.origin == self.instance:
            return
        now = self._clock()
        if isinstance(env.fact, Response):
            self._affinity.remember(env.fact.response_id, env.fact.replica)
        else:
            self._apply(env.fact, now)
        self.applied += 1
        self._m_facts.labels("in", "ok").inc()
        self._m_delay.observe(max(0.0, now - env.at))


def _safe(url: str | None) -> str:
    """The URL without its password, for logs."""
    if url is None or "@" not in url:
        return url or ""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


class SharedAffinity:
    """The Responses API store of this instance, told to the others as it learns."""

    def __init__(self, local: AffinityStore, shared: SharedState) -> None:
        self._local = local
        self._shared = shared

    def remember(self, response_id: str, replica: str) -> None:
        self._local.remember(response_id, replica)
        self._shared.remember_response(response_id, replica)

    def lookup(self, response_id: str) -> str | None:
        return self._local.lookup(response_id)

    def forget_replica(self, replica: str) -> None:
        self._local.forget_replica(replica)
