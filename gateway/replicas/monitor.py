"""Background I/O that keeps the `Fleet` current: health probes, model discovery and engine
metrics scrapes, each on its own timer, all through the probes' own `Upstream` (a small pool
apart from client traffic, `server.probe_connections` per replica, so a replica whose client
pool is full is still probed at once).

- health, every `server.health_interval_s` (timeout `server.health_timeout_s`): `GET /health`
  on every replica; 200 is up, `server.unhealthy_after` failures in a row are down (the
  fleet's rule). A replica going up is added to the router with its configured
  `capacity_tokens` (if any) and has its models and metrics read at once. One going down
  keeps its routing memory (index, bindings): it is routed around, not forgotten.
- suspect: a request that could not be delivered to a replica (`suspect`) starts a quick
  probe run on it (up to `unhealthy_after` probes, `SUSPECT_SPACING_S` apart, stopping at
  the first success); at most one run per replica at a time.
- memory: cleared once (`Router.replica_restarted`) when the replica is seen restarted (a
  new `process_start_time_seconds` in `/metrics`, handed on as the restart's identity, or
  engine counters gone backwards), or when it comes back after more than
  `server.forget_after_s` down; every restart of a crash-looping replica clears it again
  (routing/restarts.py). After a failed probe
  the next good one reads `/metrics` at once, so a quick restart is seen at once too.
- models, every `server.models_refresh_s`: `GET /v1/models` on the healthy replicas.
- scrape, every `usage.scrape_interval_s`: `GET /metrics`, parsed by
  `parse_engine_metrics`; feeds `Router.set_capacity` (reported capacity, else the
  configured `capacity_tokens`, also when the scrape fails or `/metrics` is off),
  `Router.replica_restarted` when the engine restarted, and `GatewayMetrics.replica_state`.
  One scrape of a replica at a time, so two answers never land out of order (an older
  scrape stored after a newer one would read as counters gone backwards: a restart): one
  asked for while another of that `Replica` is in flight runs once more after it (the
  health probe's check after a hiccup is not lost behind a scrape that then fails); a
  replica replaced under its name is another `Replica`, scraped at once.
- scrape soon (`scrape_soon`): the admission queue asks for a replica's next scrape now
  when its engine's room is still a guess that a scrape could raise (this gateway has more
  in flight there than the engine was seen to take in, and the last scrape showed nothing
  waiting, or a running count still growing: gateway/admission/engine.py
  `scrape_teaches`; asked once per scrape folded, gateway/admission/fleetview.py); none
  while one of that replica is in flight, and at most one every `SOON_SPACING_S` a
  replica, counted from its last scrape asked for (a wall clock stepped back counts as
  past it). The guess doubles once a scrape, so a burst to a cold fleet reaches an
  engine's real room (vLLM runs 256 to 1024) in a few seconds instead of a few scrape
  intervals: held at the guess meanwhile, 90 of 600
  concurrent streams to two engines of 512 waited past `normal`'s 30 s and got 429 (see
  bench/results/admission.md, "a cold burst").

- details probe (`usage.startup_probe`, default on): once a replica is up and its models
  known, a background task sends it `POST /v1/completions` with a fixed ~40-token prompt
  and `max_tokens: 1`, twice (the second hits the prefix cache: vLLM <= 0.23 leaves
  `prompt_tokens_details` out when nothing was cached). If neither answer carries
  `cached_tokens` the replica runs without `--enable-prompt-tokens-details`:
  `UsageRecorder.probe_cached_tokens` logs it and `/stats` warns; if one does, that is
  cleared. The probe goes straight to the replica: no router, no usage record.

`start()` runs one probe round before returning, so `/ready` is right as soon as the app
serves (the details probe runs after, in the background). Failures of one replica never
stop the loops; each probe is bounded by its timeout. Every step runs inside an error
boundary (gateway/tasks.py), per replica: whatever a replica answers, or whatever goes
wrong with one, is logged (rate-limited) and the other replicas, and the next round, are
probed and scraped as usual; the gateway starts whatever its first round met. The parsers
of what replicas send take any value without raising (replicas/scrape.py).

A replica that leaves (`forget_replica`, from gateway.replicas.departure) while its probe,
scrape, model refresh or details probe is in flight: the answer that comes back after is
dropped quietly (`Fleet.holds`: the `Replica` probed is no longer the fleet's), never
stored, published as a metric or told to the router, nor logged as a failure; its suspect
run is cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Awaitable, Callable, Iterable

import orjson

from gateway.admission.engine import pinned_at_scrape
from gateway.replicas.details import probe_details
from gateway.replicas.fleet import Fleet, Replica, memory_verdict
from gateway.replicas.scrape import parse_engine_metrics
from gateway.routing.router import Router
from gateway.settings import Settings
from gateway.tasks import FailureLog, every, guarded
from gateway.upstream.errors import UpstreamConnectError, UpstreamError, UpstreamProtocolError
from gateway.upstream.seam import Timeouts, Upstream
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.recorder import UsageRecorder

log = logging.getLogger("gateway.replicas")

DETAILS_PROBE_TIMEOUT_S = 30.0
SUSPECT_SPACING_S = 0.5  # between the probes of a suspect run
# the least time between a replica's scrapes asked for soon (module docstring): each is
# parsed on the event loop (0.4 ms for a vLLM 0.32 page of 59 KB, measured), and they
# are asked only while a guess is growing
SOON_SPACING_S = 0.25
# A body of /health, /v1/models or /metrics larger than this is a failed probe or scrape,
# never read further nor parsed: real vLLM /metrics is ~100 KB an engine, and parsing costs
# ~10 us a line on the event loop (64 MiB of it stalled all routing for seconds).
MAX_PROBE_BYTES = 8 * 1024 * 1024


class ProbeBodyTooLarge(UpstreamProtocolError):
    """A replica's answer to a probe or scrape was over `MAX_PROBE_BYTES`."""


class ReplicaLeft(UpstreamConnectError):
    """The replica left the fleet before this GET was sent: nothing is sent (the client
    pool would keep its origin again), and the step ends like an unreachable replica's,
    then drops its result (`Fleet.holds`)."""


def warning_due(failures: int) -> bool:
    """Warn about a replica that stays unreachable at its 1st, 2nd, 4th, 8th ... failed
    probe: a backoff that keeps the log readable over hours of an outage."""
    return failures > 0 and failures & (failures - 1) == 0


class FleetMonitor:
    def __init__(
        self, fleet: Fleet, upstream: Upstream, router: Router, metrics: GatewayMetrics,
        settings: Settings, clock: Callable[[], float], recorder: UsageRecorder | None = None,
        probes: Upstream | None = None,
    ) -> None:
        self.fleet = fleet
        self.recorder = recorder if settings.usage.startup_probe else None
        self.upstream = upstream  # the client pool: the details probe is an inference
        self.probes = probes if probes is not None else upstream
        self.router = router
        self.metrics = metrics
        self.clock = clock
        server = settings.server
        self.health_interval = server.health_interval_s
        self.models_interval = server.models_refresh_s
        self.scrape_interval = settings.usage.scrape_interval_s
        self.forget_after_s = server.forget_after_s
        self.timeouts = Timeouts(
            connect_s=server.health_timeout_s, read_s=server.health_timeout_s,
            total_s=server.health_timeout_s,
        )
        # Every GET of the monitor ends by this deadline, whatever the transport does: the
        # client's own timeouts (total, and the wait for a pool slot) end it well before,
        # and a step that hung instead would hold up the whole round of every replica.
        self.get_deadline_s = 2 * server.health_timeout_s + 1.0
        self.probe_timeouts = Timeouts(
            connect_s=server.connect_timeout_s, read_s=server.read_timeout_s,
            total_s=DETAILS_PROBE_TIMEOUT_S,
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._details_probes: set[asyncio.Task[None]] = set()
        self._suspects: dict[str, asyncio.Task[None]] = {}  # at most one per replica
        self._soon: dict[str, asyncio.Task[None]] = {}  # scrapes asked soon: one per replica
        # the `Replica`s (by id) with a scrape in flight, and those asked again meanwhile
        self._scraping: set[int] = set()
        self._again: set[int] = set()
        self._asked: dict[str, float] = {}  # replica -> when its last scrape was asked for
        self.failures = FailureLog(log)  # the error boundary's log (gateway/tasks.py)

    async def start(self) -> None:
        await self.probe_all()
        self._tasks = [
            asyncio.create_task(every(self.health_interval, self.probe_all, "health probes",
                                      self.failures)),
            asyncio.create_task(every(self.models_interval, self.refresh_models,
                                      "model refresh", self.failures)),
            asyncio.create_task(every(self.scrape_interval, self.scrape_all, "scrapes",
                                      self.failures)),
        ]

    async def aclose(self) -> None:
        tasks = [*self._tasks, *self._details_probes, *self._suspects.values(),
                 *self._soon.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = []
        self._details_probes.clear()
        self._suspects.clear()
        self._soon.clear()

    async def _each(self, what: str, step: Callable[[Replica], Awaitable[object]],
                    replicas: Iterable[Replica]) -> None:
        """`step` on every replica at once, each inside the error boundary: one replica's
        failure is logged and never stops another's."""
        await asyncio.gather(*(guarded(functools.partial(step, r), f"{what} {r.name}",
                                       self.failures) for r in replicas))

    async def _get(self, replica: Replica, path: str) -> tuple[int, bytes]:
        """GET `path`: its status and body, bounded in time (`get_deadline_s`: TimeoutError)
        and in bytes (`ProbeBodyTooLarge`)."""
        if not self.fleet.holds(replica):
            raise ReplicaLeft(f"{replica.name} left the fleet")
        async with asyncio.timeout(self.get_deadline_s):
            resp = await self.probes.send(
                "GET", replica.url + path, replica.upstream_headers, None, self.timeouts
            )
            try:
                parts: list[bytes] = []
                size = 0
                async for chunk in resp.chunks():
                    size += len(chunk)
                    if size > MAX_PROBE_BYTES:
                        raise ProbeBodyTooLarge(
                            f"GET {path} answered over {MAX_PROBE_BYTES} bytes")
                    parts.append(chunk)
            except BaseException:
                resp.abort()
                raise
            resp.release()
        return resp.status, b"".join(parts)

    # health ------------------------------------------------------------------------------

    async def probe_all(self) -> None:
        await self._each("health probe", self.probe, list(self.fleet.replicas.values()))

    async def probe(self, replica: Replica) -> bool:
        """One health probe; True when it succeeded."""
        reason = ""
        try:
            status, _ = await self._get(replica, "/health")
            ok = status == 200
            reason = f"GET /health answered {status}"
        except UpstreamError as exc:
            ok = False
            reason = str(exc) or type(exc).__name__
        except Exception as exc:
            ok = False  # is no 200: a failed probe, not a stopped health loop
            reason = type(exc).__name__
            if self.fleet.holds(replica):
                self.failures.failed(f"health probe {replica.name}", exc)
        if not self.fleet.holds(replica):
            return ok  # it left while probed: nobody waits for this answer
        failed_before = replica.failures > 0
        transition = self.fleet.probe_result(replica.name, ok, self.clock())
        if transition is not None:
            await self.on_transition(replica, transition)
        elif not ok and warning_due(replica.failures):
            # Down from the start (or still down): said at once, then less and less often.
            log.warning("replica unreachable", extra={
                "replica": replica.name, "url": replica.url, "reason": reason,
                "failed_probes": replica.failures,
                "next_warning_in_s": replica.failures * self.health_interval})
        elif ok and failed_before:
            await self.scrape(replica)  # back after a hiccup: restarted meanwhile?
        self.publish(replica)
        return ok

    async def on_transition(self, replica: Replica, transition: str) -> None:
        level = logging.INFO if transition == "up" else logging.WARNING
        log.log(level, "replica %s", transition,
                extra={"replica": replica.name, "url": replica.url})
        if transition != "up":
            return  # routed around (fleet.candidates), its memory kept until it returns
        down_since, replica.down_since = replica.down_since, None
        if memory_verdict(down_since, self.clock(), self.forget_after_s):
            log.warning("replica memory cleared", extra={
                "replica": replica.name, "reason": "down too long"})
            self.router.replica_restarted(replica.name, self.clock(), sign="down")
        self.router.add_replica(replica.name)
        # The configured capacity holds from the start: a replica without /metrics
        # (llama.cpp's default) never gets a scrape that would set it.
        self.apply_capacity(replica)
        await asyncio.gather(
            guarded(functools.partial(self.refresh_model, replica),
                    f"model refresh {replica.name}", self.failures),
            guarded(functools.partial(self.scrape, replica), f"scrape {replica.name}",
                    self.failures))
        if self.recorder is not None:
            task = asyncio.create_task(guarded(
                functools.partial(self.probe_details, replica, self.recorder),
                f"details probe {replica.name}", self.failures))
            self._details_probes.add(task)
            task.add_done_callback(self._details_probes.discard)

    def suspect(self, replica: Replica) -> None:
        """A request could not be delivered to `replica`: probe it now (module docstring)."""
        if replica.name in self._suspects or not replica.healthy:
            return
        task = asyncio.create_task(guarded(functools.partial(self._probe_suspect, replica),
                                           f"suspect probe {replica.name}", self.failures))
        self._suspects[replica.name] = task
        task.add_done_callback(functools.partial(self._suspect_done, replica.name))

    def _suspect_done(self, name: str, task: asyncio.Task[None]) -> None:
        if self._suspects.get(name) is task:  # not a later run for a replica of that name
            del self._suspects[name]

    def forget_replica(self, name: str) -> None:
        """The replica left: its suspect run and its scrape asked soon end (what its other
        steps get back is dropped when it comes: module docstring)."""
        self._asked.pop(name, None)
        for tasks in (self._suspects, self._soon):
            task = tasks.pop(name, None)
            if task is not None:
                task.cancel()

    async def _probe_suspect(self, replica: Replica) -> None:
        for i in range(self.fleet.unhealthy_after):
            if i:
                await asyncio.sleep(SUSPECT_SPACING_S)
            if await self.probe(replica) or not replica.healthy:
                return

    def publish(self, replica: Replica) -> None:
        if not self.fleet.holds(replica):
            return  # a departed replica's series went with it; never made again
        self.metrics.replica_state(
            replica.name, replica.healthy, replica.in_flight, replica.snapshot
        )

    # models ------------------------------------------------------------------------------

    async def refresh_models(self) -> None:
        await self._each("model refresh", self.refresh_model, self.fleet.healthy())

    async def refresh_model(self, replica: Replica) -> None:
        try:
            status, body = await self._get(replica, "/v1/models")
            doc = orjson.loads(body) if status == 200 else None
        except (UpstreamError, orjson.JSONDecodeError):
            return
        if not self.fleet.holds(replica):
            return
        data = doc.get("data") if isinstance(doc, dict) else None
        if isinstance(data, list):
            self.fleet.set_models(replica.name, [c for c in data if isinstance(c, dict)])

    # engine metrics ----------------------------------------------------------------------

    async def scrape_all(self) -> None:
        await self._each("scrape", self.scrape, self.fleet.healthy())

    def scrape_soon(self, replica: Replica) -> bool:
        """Scrape `replica` now unless one is in flight or was asked for less than
        `SOON_SPACING_S` ago (module docstring); True when one was started."""
        name = replica.name
        since = self.clock() - self._asked.get(name, -math.inf)
        if (name in self._soon or id(replica) in self._scraping or not replica.healthy
                or 0.0 <= since < SOON_SPACING_S):
            return False
        task = asyncio.create_task(guarded(functools.partial(self.scrape, replica),
                                           f"scrape {name}", self.failures))
        self._soon[name] = task
        task.add_done_callback(functools.partial(self._soon_done, name))
        return True

    def _soon_done(self, name: str, task: asyncio.Task[None]) -> None:
        if self._soon.get(name) is task:
            del self._soon[name]

    async def scrape(self, replica: Replica) -> None:
        """One scrape of `replica`; asked while another of it is in flight, that one runs
        once more after (module docstring)."""
        key = id(replica)
        if key in self._scraping:
            self._again.add(key)
            return
        self._scraping.add(key)
        try:
            for _ in range(2):  # bounded: once more at most, however often asked meanwhile
                self._again.discard(key)
                await self._scrape(replica)
                if key not in self._again:
                    break
        finally:
            self._scraping.discard(key)
            self._again.discard(key)

    async def _scrape(self, replica: Replica) -> None:
        # what the engine's counts are compared with (the admission queue adds what this
        # gateway sent or finished there since: gateway/admission/engine.py)
        asked_at, in_flight = self.clock(), replica.in_flight
        if self.fleet.holds(replica):
            self._asked[replica.name] = asked_at
        prompts = self.router.live_prompts(replica.name)
        swept = self.router.swept_tokens(replica.name)
        try:
            status, body = await self._get(replica, "/metrics")
        except ProbeBodyTooLarge as exc:  # the replica's fault, not the network's: said
            if self.fleet.holds(replica):
                self.failures.failed(f"scrape {replica.name}", exc)
            status, body = 0, b""
        except UpstreamError:
            status, body = 0, b""
        if not self.fleet.holds(replica):
            return  # it left while scraped
        if status != 200:
            self.apply_capacity(replica)  # no engine figure this time: keep the last/configured
            return
        text = body.decode("utf-8", "replace")
        snapshot = parse_engine_metrics(text, self.clock())
        # what held KV blocks then: not what the scrape shows waiting (engine.py)
        pinned = pinned_at_scrape(prompts, snapshot.num_requests_waiting, swept,
                                  snapshot.kv_cache_usage)
        new_process = self.fleet.set_start_time(replica.name,
                                               snapshot.process_start_time_seconds)
        if self.fleet.set_snapshot(replica.name, snapshot, asked_at, in_flight,
                                  pinned) or new_process:
            # The start time names this restart (a crash loop's next one is new at once);
            # counters gone backwards under the same start time name none.
            started = snapshot.process_start_time_seconds if new_process else None
            log.warning("replica restarted", extra={"replica": replica.name,
                                                    "process_start_time": started})
            self.router.replica_restarted(replica.name, self.clock(), started,
                                          sign="counters")
        self.apply_capacity(replica, snapshot.block_size)
        self.publish(replica)

    def apply_capacity(self, replica: Replica, block_size: int | None = None) -> None:
        """Tell the router the replica's capacity: the engine's last reported figure, else
        the configured `capacity_tokens`, else (None) the router's default. Only for a
        healthy replica: `set_capacity` would add a replica that went down meanwhile."""
        if replica.healthy and self.fleet.holds(replica):
            self.router.set_capacity(replica.name, replica.capacity_tokens(), block_size)

    # cached_tokens reporting -------------------------------------------------------------

    async def probe_details(self, replica: Replica, recorder: UsageRecorder) -> None:
        """The details probe (module docstring; details.py)."""
        await probe_details(self.upstream, self.fleet, replica, recorder, self.probe_timeouts)
