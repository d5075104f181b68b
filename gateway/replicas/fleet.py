"""The replica fleet as the request path sees it: health, models, in-flight counts and the
last engine snapshot per replica, plus the pure decisions made from them.

No I/O here: `gateway.replicas.monitor` probes and scrapes, then reports through
`probe_result`, `set_models` and `set_snapshot`; the request path asks `candidates(model)`
and moves in-flight counts with `acquire`/`release`.

Health rule: from probes alone. A replica starts down, goes up on its first successful
probe, and goes down after `unhealthy_after` consecutive failed probes. What a client request
meets never marks a replica down by itself: a request that could not be delivered only asks
for a probe now (gateway.replicas.monitor), and a busy replica, whose pool of client
connections is full, is not probed through that pool.

Memory rule (`memory_verdict`, pure): a replica that went down keeps its routing memory
(index, session bindings) while it is down; it is cleared once, when the replica is seen
restarted (its `/metrics` process start time changed, or a cumulative engine counter went
backwards: `counters_reset`) or when it comes back after more than `forget_after_s` down.

Departure rule: a replica may leave at any moment (an InferencePool pod deleted while its
probe, scrape or requests are in flight). Every setter takes a name that left as a result
nobody waits for: it changes nothing and raises nothing (`holds` tells the monitor whether
the `Replica` it probed is still the one of that name, so a late answer never reaches a
new replica that took the name).

Leaving rule (`leave`, `rejoin`; gateway.replicas.membership decides when): a replica that a
source no longer lists is leaving: it is marked down at once (so no new request, pinned
waiter or retry goes to it: every path asks `healthy`), no probe marks it up again, and
its requests in flight finish. It keeps everything learned until its departure; if a
source lists it again first (a flap), `rejoin` lets its next good probe mark it up with its
memory kept (`down_since` is never set by leaving, so `memory_verdict` does not clear it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.routing.decision import ReplicaState
from gateway.settings import ReplicaSettings
from gateway.upstream.errors import GatewayError
from gateway.usage.snapshot import EngineSnapshot

Transition = Literal["up", "down"] | None


@dataclass(slots=True, eq=False)
class Replica:
    settings: ReplicaSettings
    healthy: bool = False
    failures: int = 0
    in_flight: int = 0
    models: frozenset[str] | None = None  # None until discovered (or configured)
    model_cards: tuple[dict[str, object], ...] = ()  # /v1/models entries, as served
    snapshot: EngineSnapshot | None = None
    upstream_headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    down_since: float | None = None  # when probes last marked it down (None: up or never up)
    start_time: float | None = None  # the engine process's start time (/metrics), if shown
    # when the last stored scrape was asked for, and this gateway's requests in flight there
    # at that moment (what the admission queue needs to age the snapshot and to add what it
    # sent since: gateway/admission/engine.py)
    scraped_at: float | None = None
    in_flight_at_scrape: int = 0
    pinned_at_scrape: float = 0.0  # their prompt tokens holding KV blocks (engine.py)
    probed_ok_at: float | None = None  # when a health probe last succeeded
    leaving_since: float | None = None  # when its source stopped listing it (None: listed)
    # joined at run time and not yet scraped: no probe marks it up before its KV capacity
    # and models are read (gateway.replicas.membership)
    joining: bool = False

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def url(self) -> str:
        return self.settings.url

    @property
    def prefill_only(self) -> bool:
        """A `prefill` replica (gateway.pd): it gets prefill legs, never a whole request."""
        return self.settings.role == "prefill"

    def state(self) -> ReplicaState:
        snap = self.snapshot
        return ReplicaState(
            name=self.settings.name,
            in_flight=self.in_flight,
            engine_waiting=(snap.num_requests_waiting or 0.0) if snap else 0.0,
            engine_running=(snap.num_requests_running or 0.0) if snap else 0.0,
        )

    def capacity_tokens(self) -> int | None:
        """The engine's own figure when it reports one, else the configured one."""
        reported = self.snapshot.capacity_tokens if self.snapshot else None
        return reported if reported is not None else self.settings.capacity_tokens


def counters_reset(prev: EngineSnapshot | None, cur: EngineSnapshot) -> bool:
    """True when a cumulative counter went backwards: the engine restarted (cache empty)."""
    if prev is None:
        return False
    pairs = (
        (prev.prefix_cache_queries_total, cur.prefix_cache_queries_total),
        (prev.prompt_tokens_total, cur.prompt_tokens_total),
        (prev.generation_tokens_total, cur.generation_tokens_total),
    )
    return any(a is not None and b is not None and b < a for a, b in pairs)


def restarted(known: float | None, seen: float | None) -> bool:
    """True when the engine's process start time changed: a new process, an empty cache."""
    return known is not None and seen is not None and seen != known


def memory_verdict(down_since: float | None, now: float, forget_after_s: float) -> bool:
    """True when a replica coming back up must lose its routing memory: it was down longer
    than `forget_after_s` (whatever it holds now cannot be told from what it held)."""
    return down_since is not None and now - down_since > forget_after_s


def not_found(model: str) -> GatewayError:
    return GatewayError(404, f"The model `{model}` does not exist.", code="model_not_found",
                        param="model")


def no_healthy(model: str | None) -> GatewayError:
    what = f" serving `{model}`" if model else ""
    return GatewayError(503, f"No healthy replica{what} is available.",
                        code="no_healthy_replica")


class Fleet:
    def __init__(self, replicas: Sequence[ReplicaSettings], *, unhealthy_after: int = 1) -> None:
        self.unhealthy_after = unhealthy_after
        self.replicas: dict[str, Replica] = {}
        for r in replicas:
            headers = (("Authorization", f"Bearer {r.api_key}"),) if r.api_key else ()
            self.replicas[r.name] = Replica(
                settings=r,
                models=frozenset(r.models) if r.models is not None else None,
                upstream_headers=headers,
            )

    def add(self, replica: ReplicaSettings, *, joining: bool = False) -> Replica:
        """A replica that joined (an InferencePool pod): down until its first probe (and,
        `joining`, until `joined`)."""
        headers = (("Authorization", f"Bearer {replica.api_key}"),) if replica.api_key else ()
        r = self.replicas[replica.name] = Replica(
            settings=replica,
            models=frozenset(replica.models) if replica.models is not None else None,
            upstream_headers=headers, joining=joining)
        return r

    def joined(self, replica: Replica) -> None:
        """Its first scrape is done: the next good probe may mark it up."""
        replica.joining = False

    def leave(self, name: str, now: float) -> bool:
        """`name` is no longer listed: down at once, kept until its departure (module
        docstring); False when no replica has that name or it is leaving already."""
        r = self.replicas.get(name)
        if r is None or r.leaving_since is not None:
            return False
        r.leaving_since = now
        r.healthy = False
        return True

    def rejoin(self, name: str) -> bool:
        """A leaving replica listed again: up at its next good probe, memory kept."""
        r = self.replicas.get(name)
        if r is None or r.leaving_since is None:
            return False
        r.leaving_since = None
        return True

    def update(self, replica: ReplicaSettings) -> None:
        """New settings for a replica at the same URL (a reloaded [[replicas]] entry):
        its key, configured models and capacity; what it learned stays."""
        r = self.replicas.get(replica.name)
        if r is None:
            return
        r.settings = replica
        r.upstream_headers = ((("Authorization", f"Bearer {replica.api_key}"),)
                              if replica.api_key else ())
        if replica.models is not None:
            r.models = frozenset(replica.models)

    def current(self, replica: Replica) -> bool:
        """Whether `replica` is the server the fleet routes to under its name now. The
        Replica object is the incarnation: `update` and `rejoin` change it in place (the
        same server), a new address under the same name is a new object (`remove`, then
        `add`), so a request sent to the old one ends with this False."""
        return self.replicas.get(replica.name) is replica

    def remove(self, name: str) -> Replica | None:
        """A replica that left; requests in flight to it finish on their own. Only the
        whole departure (`gateway.replicas.departure`) calls this: every other map keyed
        by the name goes at the same time."""
        return self.replicas.pop(name, None)

    def holds(self, replica: Replica) -> bool:
        """`replica` is still in the fleet (not gone, nor replaced by one of its name)."""
        return self.replicas.get(replica.name) is replica

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def known_model(self, model: str) -> bool:
        """A replica lists model (from [[replicas]] models or its /v1/models): the test for
        whether a client's model name may become a metric label."""
        return any(r.models is not None and model in r.models for r in self.replicas.values())

    def candidates(self, model: str) -> list[Replica]:
        """Healthy replicas serving model; 404 when no replica knows it, 503 when the ones
        that do are down. Replicas whose models are not known yet count as serving it.
        `prefill` replicas are never candidates (they get prefill legs only:
        `prefill_candidates`)."""
        up: list[Replica] = []
        unknown: list[Replica] = []
        known_anywhere = False
        for r in self.replicas.values():
            if r.prefill_only:
                continue
            if r.models is None:
                if r.healthy:
                    unknown.append(r)
                continue
            if model in r.models:
                known_anywhere = True
                if r.healthy:
                    up.append(r)
        if up:
            return up
        if unknown:
            return unknown
        if known_anywhere or not any(r.healthy for r in self.replicas.values()):
            raise no_healthy(model)
        raise not_found(model)

    def prefill_candidates(self, model: str) -> list[Replica]:
        """Healthy `prefill` replicas serving model (those whose models are not known yet
        count as serving it); none is no error: the decode replica then computes alone."""
        return [r for r in self.replicas.values()
                if r.prefill_only and r.healthy and (r.models is None or model in r.models)]

    def has_prefill(self) -> bool:
        """The fleet has a `prefill` replica: without one, nothing of P/D runs."""
        return any(r.prefill_only for r in self.replicas.values())

    def serving(self) -> list[Replica]:
        """Healthy replicas that take whole requests (not `prefill`): where a call no
        model names is forwarded."""
        return [r for r in self.replicas.values() if r.healthy and not r.prefill_only]

    def probe_result(self, name: str, ok: bool, now: float) -> Transition:
        r = self.replicas.get(name)
        if r is None:
            return None  # left while probed (module docstring)
        if ok:
            r.failures = 0
            r.probed_ok_at = now
            if not r.healthy and r.leaving_since is None and not r.joining:
                r.healthy = True
                return "up"
            return None
        r.failures += 1
        if r.healthy and r.failures >= self.unhealthy_after:
            r.healthy = False
            r.down_since = now
            return "down"
        return None

    def set_start_time(self, name: str, start_time: float | None) -> bool:
        """Store the engine's process start time; True when it shows a restart."""
        r = self.replicas.get(name)
        if r is None:
            return False
        fresh = restarted(r.start_time, start_time)
        if start_time is not None:
            r.start_time = start_time
        return fresh

    def set_models(self, name: str, cards: Sequence[dict[str, object]]) -> None:
        r = self.replicas.get(name)
        if r is None:
            return
        r.model_cards = tuple(cards)
        if r.settings.models is None:
            r.models = frozenset(str(c["id"]) for c in cards if isinstance(c.get("id"), str))

    def set_snapshot(self, name: str, snapshot: EngineSnapshot, asked_at: float | None = None,
                     in_flight: int = 0, pinned: float = 0.0) -> bool:
        """Store a scrape (asked for at `asked_at`, default its own time, with `in_flight`
        requests of this gateway there then, of `pinned` prompt tokens); True when it
        shows the engine restarted since the last one."""
        r = self.replicas.get(name)
        if r is None:
            return False
        restarted = counters_reset(r.snapshot, snapshot)
        r.snapshot = snapshot
        r.scraped_at = snapshot.ts if asked_at is None else asked_at
        r.in_flight_at_scrape = in_flight
        r.pinned_at_scrape = pinned
        return restarted

    def model_list(self) -> list[dict[str, object]]:
        """Union of the healthy replicas' model cards, first card per id wins."""
        seen: dict[str, dict[str, object]] = {}
        for r in self.healthy():
            cards = r.model_cards or tuple(
                {"id": m, "object": "model", "owned_by": "gateway"} for m in sorted(r.models or ())
            )
            for card in cards:
                key = str(card.get("id"))
                seen.setdefault(key, card)
        return list(seen.values())
