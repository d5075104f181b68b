"""Shared routing state through Redis: publish this instance's routing facts, apply the
other instances'. I/O only; the facts and their wire form are gateway/routing/facts.py,
their effect is `Router.apply`.

Why these Redis mechanisms:
- One stream, `<prefix>:routing`: every instance appends and every instance reads
  everything in order, so all routers replay the same history. Bindings (sessions,
  implicit conversations, Responses API ids) travel as facts in the same stream rather
  than as expiring keys: a key would have to be read on the request path, and reads must
  stay local.
- Bounded in bytes (`stream_max_bytes`): Redis trims a stream by count (MAXLEN) or by id
  (MINID), not by size, so each batch's XADDs carry `MAXLEN ~ n` with n = the bound over
  the bytes per fact this instance has measured on what it wrote (a fact's fields plus
  Redis's per-entry overhead, gateway/shared/stream.py, measured with MEMORY USAGE), and one
  `XTRIM MINID ~` drops what is older than `replay_s`, which nobody applies any more.
- Facts are sized by what is new (gateway/shared/chains.py): a follow-up carries only the
  blocks its conversation added since this instance's last fact about it.
- Catch-up: a (re)starting instance applies, before it serves, the newest
  `catch_up_facts` facts of the last `replay_s` (XREVRANGE pages from the end, applied
  oldest first), not the whole stream, after learning (not applying) the chains the
  facts before them built, for at most `catch_up_s`: start-up takes a bounded time
  however full the stream is (bench/RESULTS.md). Facts older than `replay_s` are skipped at any time
  (applied at their own time they would weigh nothing anyway). A delta whose chain came
  before what was read is counted `unresolved` and skipped; its conversation's next
  whole chain (within `rebase_s`) brings it back.
- Consumer groups are not used: each instance must see every fact, not a share of them.
- Writes are fire-and-forget: `publish` appends to a bounded local queue (O(1), on the
  request path) and a background task encodes and pipelines batches with `XADD`. Reads
  are one background `XREAD BLOCK` loop from the last id seen. Redis is therefore never
  on a request's path; a slow or dead Redis costs nothing but staleness.

Departures (gateway/shared/departures.py): a replica that left is recorded in
`<prefix>:departed` (read before the catch-up) and as a `Departed` fact; facts about it
from before its departure are skipped, so that one back under its name is not taken for
warm.

Failure: a command that fails or takes longer than `timeout_s` marks Redis down (one
warning, `gateway_shared_state_up` 0); the failed batch is dropped and counted, new facts
queue (the oldest dropped once `queue_size` is reached), and both loops retry with
backoff; the next facts go whole (receivers never saw the chains a delta would name).
Back up: one info line, the queue is flushed, and the reader resumes from the last id it
applied, catching up on whatever the stream still holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.backoff import Backoff, Retrier
from gateway.routing import facts
from gateway.routing.affinity import AffinityStore
from gateway.routing.facts import Base, Fact, FactError, Reply, Response, Sent, decode, encode
from gateway.shared import departures as gone
from gateway.shared.chains import Chains, Published
from gateway.shared.config import RedisSettings
from gateway.shared.stream import entry_bytes, entry_time, stream_id, stream_maxlen
from gateway.tasks import FailureLog, cancel_all, supervised

log = logging.getLogger("gateway.shared")

_MAX_RETRY_S = 10.0  # the longest pause between reconnection attempts
_PAGE = 200  # stream entries per read at start-up


class SharedState:
    def __init__(self, settings: RedisSettings, apply: Callable[[Fact, float], None],
                 affinity: AffinityStore, clock: Callable[[], float],
                 registry: CollectorRegistry | None = None,
                 instance: str | None = None,
                 known: Callable[[str], bool] = lambda replica: True) -> None:
        if settings.url is None:
            raise ValueError("SharedState needs redis.url")
        self.settings = settings
        self.instance = instance or os.urandom(6).hex()
        self.stream = f"{settings.prefix}:routing"
        self._apply = apply
        self._affinity = affinity
        # Whether a replica is in this instance's fleet: a response stored on one it has
        # seen depart (another instance, resolving later, still routed there) is not
        # remembered, as `Router.apply` ignores the other facts about it.
        self._known = known
        self._clock = clock
        self._departed_key = gone.departed_key(settings.prefix)
        self.departures = gone.Departures(gone.MAX_DEPARTED, settings.replay_s)
        self._queue: deque[tuple[Fact, float]] = deque(maxlen=settings.queue_size)
        self._wake = asyncio.Event()
        # both loops pause retry_s, doubling up to 10 s, less up to a fifth at random, so
        # instances that lost Redis together do not reconnect in step
        self._backoff = Backoff(base_s=settings.retry_s, cap_s=max(_MAX_RETRY_S, settings.retry_s),
                                jitter=0.2)
        self._tasks: list[asyncio.Task[None]] = []
        self._last_id = b"0"  # set at start: replay_s ago
        self._caught_up = asyncio.Event()
        self._published = Published(settings.published_capacity, settings.rebase_s)
        self._chains = Chains(settings.chains_budget)
        self.written_bytes = 0  # bytes (as counted against the bound) of facts written
        self.written = 0
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
        self._m_bytes = Counter("gateway_shared_fact_bytes",
                                "Bytes of routing facts written to Redis.", registry=r)
        self.applied = 0  # facts from other instances applied (tests, bench)
        self.caught_up_s: float | None = None  # start-up: seconds until caught up

    # the request path's side ------------------------------------------------------------

    def publish(self, fact: Fact) -> None:
        """Queue a fact (O(1), never blocks, never fails)."""
        if len(self._queue) == self._queue.maxlen:
            self._m_facts.labels("out", "dropped").inc()
        self._queue.append((fact, self._clock()))
        self._wake.set()

    def remember_response(self, response_id: str, replica: str) -> None:
        self.publish(Response(response_id, replica))

    def depart(self, replica: str) -> None:
        """`replica` left this instance's fleet: facts about it from before now are void
        here and, once written, everywhere (gateway/shared/departures.py)."""
        now = self._clock()
        self.departures.record(replica, now, now)
        self.publish(facts.Departed(replica))

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
        t0 = loop.time()
        await self._catch_up()
        self.caught_up_s = loop.time() - t0
        # Redis errors are each loop's own business (retried with backoff); anything
        # else ends one run of the loop, logged, and it starts again (gateway/tasks.py):
        # the reader past the entry it was on, the writer with the next batch.
        failures = FailureLog(log)
        self._tasks = [
            loop.create_task(supervised("shared-state writer", self._write_run, failures),
                             name="shared-state writer"),
            loop.create_task(supervised("shared-state reader", self._read_loop, failures),
                             name="shared-state reader")]

    async def _catch_up(self) -> None:
        """Before serving: apply the newest facts of the last replay_s, at most
        catch_up_facts of them (read newest first in pages, applied oldest first), after
        learning, within catch_up_s, the chains the rebase_s of facts before them built
        (so that the deltas among the newest resolve), so that start-up takes a bounded
        time however full the stream is; the reader goes on from the newest. Redis down: the reader
        starts from replay_s ago once it is back."""
        from redis.exceptions import RedisError

        s = self.settings
        since = stream_id(self._clock() - s.replay_s)
        self._last_id = since
        newest: list[tuple[bytes, dict[bytes, bytes]]] = []
        cursor = b"+"
        try:
            # the departures first: every fact replayed below is checked against them
            await self.departures.load(self._reader, self._departed_key, self._clock,
                                       s.timeout_s * 4)
            while len(newest) < s.catch_up_facts:
                page = await self._page(cursor, since, s.catch_up_facts - len(newest), True)
                newest += page
                if len(page) < _PAGE:
                    break
                cursor = b"(" + page[-1][0]
            if len(newest) == s.catch_up_facts:
                await self._learn_chains(since, b"(" + newest[-1][0],
                                         entry_time(newest[-1][1]) - s.rebase_s)
        except (TimeoutError, RedisError, OSError) as exc:
            self._state(False, exc)
            return
        for _id, fields in reversed(newest):
            self._receive(fields)
        if newest:
            self._last_id = newest[0][0]
        self._state(True)
        self._caught_up.set()

    async def _page(self, start: bytes, end: bytes, count: int, backwards: bool
                    ) -> list[tuple[bytes, dict[bytes, bytes]]]:
        # Pages of _PAGE: a page of whole 100k-token chains is 10 MB.
        count = min(_PAGE, count)
        reader, wait = self._reader, self.settings.timeout_s * 4
        if backwards:
            got = await asyncio.wait_for(
                reader.xrevrange(self.stream, max=start, min=end, count=count), wait)
        else:
            got = await asyncio.wait_for(
                reader.xrange(self.stream, min=start, max=end, count=count), wait)
        return list(got)

    async def _learn_chains(self, since: bytes, before: bytes, after: float) -> None:
        """Learn the chains of the facts before `before` (and from `since`) without
        applying them: those back to `after` (a delta's chain went whole within
        rebase_s), read newest first for at most catch_up_s, learnt oldest first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.catch_up_s
        older: list[tuple[bytes, dict[bytes, bytes]]] = []
        cursor = before
        while True:
            if loop.time() > deadline:
                log.warning("shared state: start-up catch-up cut short",
                            extra={"catch_up_s": self.settings.catch_up_s})
                break
            page = await self._page(cursor, since, _PAGE, True)
            older += page
            if len(page) < _PAGE or entry_time(page[-1][1]) < after:
                break
            cursor = b"(" + page[-1][0]
        for _id, fields in reversed(older):
            self._learn(fields)

    def _learn(self, fields: dict[bytes, bytes]) -> None:
        try:
            env = decode(fields)
        except FactError:
            return
        fact = env.fact
        if not isinstance(fact, (Sent, Reply)) or env.at < self._clock() - self.settings.replay_s:
            return
        if env.base is None:
            self._chains.learn(fact.hashes)
        else:
            self._chains.extend(env.base, fact.hashes)

    @property
    def caught_up(self) -> bool:
        return self._caught_up.is_set()

    async def aclose(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            # redis-py reads under a timeout context; a cancel that lands as that timeout
            # fires comes back as a TimeoutError (Python 3.11), which the loop takes for
            # a Redis outage and goes on: cancel again until the task ends (bounded).
            for _ in range(50):
                if task.done():
                    break
                task.cancel()
                await asyncio.wait({task}, timeout=0.2)
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

    async def _write_run(self) -> None:
        try:
            await self._write_loop()
        except Exception:
            # The batch in hand is lost: receivers never saw its chains, so no delta may
            # be built on them (as after a failed write).
            s = self.settings
            self._published = Published(s.published_capacity, s.rebase_s)
            raise

    async def _write_loop(self) -> None:
        from redis.exceptions import RedisError

        s = self.settings
        retrier = Retrier(self._backoff)
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            batch = [self._queue.popleft() for _ in range(min(s.batch_size, len(self._queue)))]
            entries = [self._entry(fact, at) for fact, at in batch]
            size = sum(map(entry_bytes, entries))
            maxlen = stream_maxlen(s.stream_max_bytes, s.stream_maxlen,
                                   self.written_bytes + size, self.written + len(entries))
            try:
                async with self._writer.pipeline(transaction=False) as pipe:
                    for fields in entries:
                        pipe.xadd(self.stream, fields, maxlen=maxlen, approximate=True)
                    pipe.xtrim(self.stream, minid=stream_id(self._clock() - s.replay_s),
                               approximate=True)
                    gone.write_departures(pipe, self._departed_key, batch, self._clock(),
                                          s.replay_s)
                    await asyncio.wait_for(pipe.execute(), s.timeout_s * 2)
            except (TimeoutError, RedisError, OSError) as exc:
                self._m_facts.labels("out", "dropped").inc(len(batch))
                # Receivers never saw these chains: build no delta on them.
                self._published = Published(s.published_capacity, s.rebase_s)
                self._state(False, exc)
                await retrier.wait()
                continue
            retrier.reset()
            self.written_bytes += size
            self.written += len(entries)
            self._m_bytes.inc(size)
            self._m_facts.labels("out", "ok").inc(len(batch))
            self._state(True)

    def _entry(self, fact: Fact, at: float) -> dict[bytes, bytes]:
        """The stream entry for a fact: a Sent or Reply as a delta on a chain this
        instance published before, when there is one."""
        base: Base | None = None
        if isinstance(fact, (Sent, Reply)):
            base = self._published.base(fact.hashes, at)
            self._published.sent(fact.hashes, base, at)
        return encode(fact, self.instance, at, base)

    async def _read_loop(self) -> None:
        from redis.exceptions import RedisError

        s = self.settings
        retrier = Retrier(self._backoff)
        while True:
            try:
                got = await self._reader.xread({self.stream: self._last_id}, count=1000,
                                               block=s.block_ms)
            except (TimeoutError, RedisError, OSError) as exc:
                self._state(False, exc)
                await retrier.wait()
                continue
            retrier.reset()
            self._state(True)
            for _stream, entries in got or ():
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    self._receive(fields)
            if not got:
                self._caught_up.set()

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
        if env.at < now - self.settings.replay_s:
            self._m_facts.labels("in", "old").inc()
            return
        fact = env.fact
        if isinstance(fact, (Sent, Reply)):
            if env.base is not None:
                whole = self._chains.resolve(env.base, fact.hashes)
                if whole is None:
                    # The chain it extends is unknown here (it came before this instance
                    # started, or was evicted): the next whole chain repairs it.
                    self._m_facts.labels("in", "unresolved").inc()
                    return
                fact = dataclasses.replace(fact, hashes=whole)
            else:
                self._chains.learn(fact.hashes)
        if not self.departures.screen(fact, env.at, now):
            # about the server that left, not the one now under its name
            self._m_facts.labels("in", "departed").inc()
            return
        if isinstance(fact, Response):
            if not self._known(fact.replica):
                self._m_facts.labels("in", "unknown_replica").inc()
                return
            self._affinity.remember(fact.response_id, fact.replica)
        elif not isinstance(fact, facts.Departed):  # (that one is ours, above)
            # Applied when it happened (a clock ahead of this one: now).
            self._apply(fact, min(env.at, now))
        self.applied += 1
        self._m_facts.labels("in", "ok").inc()
        self._m_delay.observe(max(0.0, now - env.at))


def _safe(url: str | None) -> str:
    """The URL without its password, for logs."""
    if url is None or "@" not in url:
        return url or ""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"

