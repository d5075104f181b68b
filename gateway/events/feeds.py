"""The gateway's KV-event feeds: per replica, find where it publishes, subscribe, stay
subscribed, and check parity once. I/O; the decisions live in source.py, kvindex.py and
events/parity.py.

Per replica, one task: wait until the replica's models are known and one has a renderer;
take its event sources from `[[replicas]] kv_events_endpoint` or `GET /kv_event_sources`
(retried every `discover_interval_s` while it has none, so a replica that starts later, or
restarts with events on, is picked up); run the parity probe against its `/tokenize` (a
definite mismatch keeps the replica in text mode unless `parity_required` is off); then run
a subscriber per data-parallel rank until cancelled, restarting it with backoff when it
fails. The index learns the replica's block size from its first event, so a replica is
routed in text mode until events flow, and for good when its block size is not the one the
renderer hashes at (said in `status`).

The replicas are the configured ones at start-up, then follow the fleet: a replica that
joins at run time (a DNS name, a Kubernetes selector, a reloaded settings file, `gateway
epp`'s InferencePool) gets its feed (`add_replica`, from `Services.joined`, which
gateway.replicas.membership and gateway.epp.pool call), and one that departs has its feed
cancelled, its sockets closed and its state forgotten (`remove_replica`, from
`Services.remove_replica`), so the feeds are bounded by the fleet whatever the churn.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.backoff import Backoff, Retrier
from gateway.events.config import TokenSettings
from gateway.events.discovery import discover
from gateway.events.kvindex import KVIndex
from gateway.events.parity import Parity
from gateway.events.probe import probe
from gateway.events.source import EventSource, SourceError
from gateway.events.subscriber import KVSubscriber
from gateway.tasks import FailureLog, cancel_all, supervised
from gateway.tokens.render import TokenRenderer

log = logging.getLogger("gateway.events")

# A failed subscriber is restarted after 1, 2, 4, ... up to 30 s, less up to a fifth.
_RESUBSCRIBE = Backoff(base_s=1.0, cap_s=30.0, jitter=0.2)


@dataclass(frozen=True, slots=True)
class FeedTarget:
    """A replica as the feeds see it."""

    name: str
    url: str
    api_key: str | None = field(default=None, repr=False)
    endpoint: str | None = None  # configured PUB endpoint (skips discovery)
    replay_endpoint: str | None = None


@dataclass(slots=True)
class FeedState:
    model: str | None = None
    sources: tuple[EventSource, ...] = ()
    subscribers: list[KVSubscriber] = field(default_factory=list)
    parity: Parity | None = None
    problem: str | None = None  # why no events flow, when none do


class EventFeeds:
    def __init__(self, settings: TokenSettings, renderers: Mapping[str, TokenRenderer],
                 index: KVIndex, targets: Sequence[FeedTarget],
                 models_of: Callable[[str], frozenset[str] | None],
                 clock: Callable[[], float]) -> None:
        self._settings = settings
        self._renderers = dict(renderers)
        self._index = index
        self._targets = {t.name: t for t in targets}  # one per replica in the fleet
        self._models_of = models_of
        self._clock = clock
        self._state = {t.name: FeedState() for t in targets}
        self._tasks: dict[str, asyncio.Task[None]] = {}  # a running feed per target
        self._closing: set[asyncio.Task[None]] = set()  # departed feeds still unwinding
        self._failures = FailureLog(log)
        self._started = False
        self._ctx: Any = None
        self._http: aiohttp.ClientSession | None = None
        self._on_restart: Callable[[str, float], None] | None = None

    async def start(self, on_restart: Callable[[str, float], None] | None = None) -> None:
        """`on_restart(replica, now)`: a replica's event sequence restarted (a new engine
        process with an empty cache; the router's `replica_restarted`)."""
        import zmq.asyncio

        self._on_restart = on_restart

        self._ctx = zmq.asyncio.Context()
        self._http = aiohttp.ClientSession()
        self._started = True
        for target in self._targets.values():
            self._run(target)

    def _run(self, target: FeedTarget) -> None:
        # Each replica's feed under the error boundary (gateway/tasks.py): an error
        # nothing below expected is logged and that feed starts over, the others go on.
        self._tasks[target.name] = asyncio.get_running_loop().create_task(
            supervised(f"KV event feed {target.name}", functools.partial(self._feed, target),
                       self._failures), name=f"kv-feed {target.name}")

    def add_replica(self, target: FeedTarget) -> None:
        """A replica that joined (or whose settings changed): its feed, started now when
        the feeds run; the same target again changes nothing."""
        if self._targets.get(target.name) == target:
            return
        self.remove_replica(target.name)
        self._targets[target.name] = target
        self._state[target.name] = FeedState()
        if self._started:
            self._run(target)

    def remove_replica(self, name: str) -> None:
        """A replica that departed: its feed cancelled (its subscribers close their
        sockets as they unwind) and forgotten; waited for at `aclose`."""
        self._targets.pop(name, None)
        self._state.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        tasks = [*self._tasks.values(), *self._closing]
        self._tasks, self._started = {}, False
        await cancel_all(tasks)
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # one replica ------------------------------------------------------------------------

    def _model(self, name: str) -> str | None:
        models = self._models_of(name)
        if models is None:
            return None
        return next((m for m in sorted(models) if m in self._renderers), None)

    async def _feed(self, target: FeedTarget) -> None:
        state = self._state[target.name]
        settings = self._settings
        while state.model is None:
            state.model = self._model(target.name)
            if state.model is None:
                state.problem = "serves no token-mode model (or its models are not known yet)"
                await asyncio.sleep(1.0)
        self._index.add_replica(target.name, state.model)
        while not state.sources:
            state.sources = tuple(await self._sources(target, state))
            if not state.sources:
                await asyncio.sleep(settings.discover_interval_s)
        state.problem = None
        if settings.parity_check:
            await self._check_parity(target, state)
            parity = state.parity
            if parity is not None and parity.cause is not None and settings.parity_required:
                # Tokens that differ from the replica's zero every overlap: text mode is the
                # better guess. The feed stays off until the gateway restarts.
                self._index.remove_replica(target.name)
                state.problem = (f"token parity failed ({parity.cause}): {parity.message}; "
                                 "routed in text mode")
                return
        ranks = [self._subscribe(target, state, s) for s in state.sources]
        await asyncio.gather(*ranks)

    async def _sources(self, target: FeedTarget, state: FeedState) -> list[EventSource]:
        if target.endpoint is not None:
            return [EventSource(target.endpoint, target.replay_endpoint)]
        if not self._settings.discover:
            state.problem = "no kv_events_endpoint configured and discovery is off"
            return []
        assert self._http is not None
        try:
            found = await discover(self._http, target.url, headers=_auth(target))
        except (aiohttp.ClientError, TimeoutError, SourceError) as exc:
            problem = f"GET /kv_event_sources failed: {exc or type(exc).__name__}"
        else:
            if found:
                log.info("replica %s publishes KV events at %s", target.name,
                         ", ".join(s.endpoint for s in found))
                return found
            problem = "publishes no KV events (GET /kv_event_sources: none enabled)"
        if state.problem != problem:
            log.warning("replica %s: %s; routed in text mode, retrying every %g s",
                        target.name, problem, self._settings.discover_interval_s)
        state.problem = problem
        return []

    async def _check_parity(self, target: FeedTarget, state: FeedState) -> None:
        assert self._http is not None and state.model is not None
        renderer = self._renderers[state.model]
        try:
            state.parity = await probe(self._http, target.url, renderer, headers=_auth(target))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            state.parity = Parity(False, None, f"probe failed: {exc or type(exc).__name__}")
        if state.parity.ok:
            log.info("replica %s: token parity ok (%s)", target.name, state.parity.message)
        else:
            log.warning("replica %s: token parity check failed (%s): %s%s", target.name,
                        state.parity.cause or "unknown", state.parity.message,
                        "; routed in text mode" if state.parity.cause is not None
                        and self._settings.parity_required else "")

    async def _subscribe(self, target: FeedTarget, state: FeedState,
                         source: EventSource) -> None:
        retrier = Retrier(_RESUBSCRIBE)
        while True:
            sub = KVSubscriber(target.name, source, self._index, self._ctx, self._clock,
                               self._settings.replay_timeout_s, on_restart=self._on_restart)
            state.subscribers.append(sub)
            try:
                await sub.run()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broken socket: resubscribe, never crash the gateway
                delay = retrier.failed()
                log.warning("replica %s: KV event feed %s failed (%s); resubscribing in %.2g s",
                            target.name, source.endpoint, exc, delay)
                await retrier.sleep(delay)
            finally:
                state.subscribers.remove(sub)

    # reporting --------------------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        """The `token_mode` section of /stats."""
        replicas: dict[str, Any] = {}
        for target in self._targets.values():
            st = self._state[target.name]
            blocks = self._index.state(target.name)
            renderer = self._renderers.get(st.model or "")
            entry: dict[str, Any] = {"model": st.model,
                                     "sources": [s.endpoint for s in st.sources]}
            if blocks is not None and st.sources:
                live = self._index.live(target.name, now)
                mismatch = (renderer is not None and blocks.block_size is not None
                            and blocks.block_size != renderer.block_size)
                entry.update(
                    state="block size mismatch" if mismatch else "live" if live else
                    "disconnected" if not blocks.connected else
                    "waiting for events" if blocks.block_size is None else "stale",
                    block_size=blocks.block_size, held_blocks=self._index.held_blocks(
                        target.name),
                    stored=blocks.stored, removed=blocks.removed, cleared=blocks.cleared,
                    unresolved=blocks.unresolved)
                if mismatch and renderer is not None:
                    entry["problem"] = (f"the replica's blocks hold {blocks.block_size} "
                                        f"tokens, [tokens] block_size is {renderer.block_size}")
            else:
                entry["state"] = "text mode"
            if st.problem is not None:
                entry["problem"] = st.problem
            feeds = [sub.stats for sub in st.subscribers]
            if feeds:
                entry["events"] = {k: sum(getattr(f, k) for f in feeds)
                                   for k in ("batches", "gaps", "replayed", "lost", "restarts",
                                             "decode_errors")}
            if st.parity is not None:
                entry["parity"] = {"ok": st.parity.ok, "cause": st.parity.cause,
                                   "message": st.parity.message}
            replicas[target.name] = entry
        return {"models": sorted(self._renderers), "block_size": self._settings.block_size,
                "replicas": replicas}


def _auth(target: FeedTarget) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else None
