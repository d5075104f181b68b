"""The fleet as the admission queue reads it at each look: where a waiter may go now, and
each replica's load with its engine's own signals (no I/O; the clock is given).

- **Where** (`pool`): the fleet's healthy candidates for the model at this moment
  (`Fleet.candidates`, as the request path asks on arrival; a pinned request its replica
  alone; one a data plane restricted with a subset hint those of its `allowed` replicas),
  so a replica that went down while requests waited gets none of them and one that came
  up serves them. When none is left, the fleet's 503 (or 404) is raised (restricted: the
  picker's 503 for an empty subset): the gate answers the waiters with it, as a request
  arriving then is answered. Without a fleet (the queue's own tests): the arrival's
  candidates still healthy.
- **Trusted** (`doubt`, `trusted`): a replica a request left with no whole answer (no
  usage: refused, cut mid-stream, an error answer, or its client left first) is doubted,
  and a probe is asked for at once (`suspect`: `FleetMonitor.suspect`); it takes nothing
  from the queue until a probe succeeds after that. A replica that dies shows there
  seconds before the probes mark it down.
- **Load** (`load`): engine.py's reading of the last scrape (fresh or stale, what was sent
  since, what the engine has begun since at its prefill rate: `drain_s`, one of the
  largest prompts in flight there at the rate below, what the engine runs at once) with
  room.py's inputs; a streamed request's queued prefill ends at its first token, a
  non-streamed one's once a new fresh scrape shows it out of the engine's waiting queue
  and its prefill has had time at the rate below since (`Router.engine_began`); without
  engine figures (none exported, or the scrape stale) by the routing cost model
  (`Router.estimate_began`), not at a non-streamed answer's last byte. Begun is not
  prefilled: ended when a scrape showed it begun, a 114k-token prompt's prefill left
  its replica looking free for the 10 s it took, and requests sent there waited behind
  it (the Mooncake trace at 2x, issue 36). Beside it: the largest prompt in flight there
  (`Router.largest_by_replica`: what a waiting request's drain and a stall's window
  are priced with, engine.py `drain_s`, prefillrate.py `stalled`), the room left in its prefix
  cache by the router's index (`Router.cache_free_tokens`), and its engine's prefill
  rate as its scrapes show it (prefillrate.py), for room.py's cost model. While an
  engine's room is a guess this gateway's requests there outgrow (engine.py
  `scrape_teaches`), its next scrape is asked for at once (`scrape_soon`:
  `FleetMonitor.scrape_soon`), once per scrape folded, so the guess doubles at each
  scrape without waiting the interval, and a /metrics that fails is not asked again at
  every look.
- **Held for agent programs** (`reserved`: gateway.agents.reserve), fed once: the context
  of the programs in a tool call there is added to its KV usage now (the scraped one
  moved by what this gateway sent or finished since, engine.py) as a share of its
  KV capacity (`kv_with_reserved`: the engine's block count times block size), so a
  replica whose running requests would evict that context reads as full (room.py
  `has_room`) until the reservation ends, and one with room beyond it still takes other
  requests; `ReplicaLoad.kv_held` is that added share, so a replica full only by it
  stays closed where a full cache would only steer (room.py `room_but_cache`).
  `ReplicaLoad.reserved_tokens` stays 0 here, on purpose: room.py prices it
  only in a waiter's hold-or-move cost, which a new conversation (no cached prefix
  anywhere: bound by room alone, `Binding.why == "room"`) never reaches, so fed there the
  reservation would keep no newcomer off the program's replica; fed in both, a replica
  would read full for it and price its eviction again (counted twice). A program's own
  next request is never charged for its own context: the gate ends its reservation
  (`Reservations.began_on`) before it reads any load. Nor is a program returning from a
  tool call charged for the others' on the replica its context was held on
  (`without_held`, gate.py `_seen_by`): the reservation keeps new work off a replica
  for the programs coming back to it, and a returning program is one of them, its
  history there; charged, it waited or moved off its own history (measured:
  bench/results/admission.md, agent programs). On any other replica it is charged as a
  newcomer is (it would evict another program's held context there). The reservations
  price a miss at this view's measured prefill rate (`s_per_token`) and are bounded by
  its replica's KV capacity (`capacity_tokens`; reserve.py's module docstring).

What an engine showed it runs is learnt afresh after each restart the router takes as new
(`Router.restarts`) and when its replica leaves and comes back (another `Replica`); a
restarted engine that showed running counts before is held to the guess (engine.py
`PROBE_SEQS`) from the restart until its next scrape, not left without a limit.

Bounds: one learned `Capacity`, one `PrefillRate`, one last `EngineView`, one doubt and
one scrape asked soon after per replica of the fleet; those of replicas that left are
dropped (`forget_left`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gateway.admission.engine import (
    Capacity,
    EngineView,
    Scrape,
    drain_s,
    learn,
    scrape_teaches,
    view,
)
from gateway.admission.prefillrate import PrefillRate, learn_rate
from gateway.admission.room import ReplicaLoad
from gateway.agents.reserve import kv_with_reserved
from gateway.routing.router import Router
from gateway.upstream.errors import GatewayError

if TYPE_CHECKING:  # annotations only: replicas reach usage, whose metrics name admission's labels
    from gateway.replicas.fleet import Fleet, Replica
    from gateway.routing.decision import Outcome


class FleetView:
    def __init__(self, fleet: Fleet | None, router: Router, clock: Callable[[], float],
                 max_age_s: float, suspect: Callable[[Replica], None] | None,
                 reserved: Callable[[str, float], int] | None = None,
                 scrape_soon: Callable[[Replica], bool] | None = None) -> None:
        self.fleet = fleet
        self.router = router
        self.clock = clock  # wall clock, as the scrapes' and probes' times
        self.max_age_s = max_age_s
        self._suspect = suspect
        self._reserved = reserved  # (replica, wall clock) -> tokens held for agent programs
        self._scrape_soon = scrape_soon  # ask for a replica's next scrape now (monitor.py)
        # the scrape (its time; None: none yet) after which a scrape was last asked soon
        self._asked_after: dict[str, float | None] = {}
        self._capacity: dict[str, Capacity] = {}  # what each engine showed it runs
        self._rates: dict[str, PrefillRate] = {}  # how fast each engine was seen to prefill
        # whose engine that was: the replica object and its restart count when learnt
        self._learnt_of: dict[str, tuple[Replica, int]] = {}
        self._views: dict[str, EngineView] = {}  # the last read, for /stats
        self._doubted: dict[str, float] = {}  # replica -> when a request left it unanswered

    def pool(self, model: str, pin: str | None, arrival: Sequence[Replica],
             allowed: frozenset[str] | None = None) -> list[Replica]:
        """Where a waiter for `model` (pinned to `pin`, restricted to the replicas named
        in `allowed`) may go now (module docstring)."""
        if self.fleet is None:
            return [r for r in arrival if r.healthy]
        if pin is not None:
            if allowed is not None and pin not in allowed:
                raise _outside()
            r = self.fleet.replicas.get(pin)
            return [r] if r is not None and r.healthy else []
        # none healthy (503) or none serving it (404): raised, as a request arriving now
        # is told; waiting would only end in a 429 that blames load
        found = self.fleet.candidates(model)
        if allowed is None:
            return list(found)
        kept = [r for r in found if r.name in allowed]
        if not kept:  # none left of those it may go to: what an arrival is told now
            raise _outside()
        return kept

    def doubt(self, outcome: Outcome) -> None:
        """A request is over: no usage means no whole answer from its replica."""
        fleet, suspect = self.fleet, self._suspect
        if outcome.prompt_tokens is not None or fleet is None or suspect is None:
            return
        replica = fleet.replicas.get(outcome.replica)
        if replica is not None and replica.healthy:
            self._doubted[replica.name] = self.clock()
            suspect(replica)

    def trusted(self, replica: Replica) -> bool:
        """Healthy and not doubted (or probed fine since)."""
        if not replica.healthy:
            return False
        since = self._doubted.get(replica.name)
        if since is None:
            return True
        if replica.probed_ok_at is not None and replica.probed_ok_at >= since:
            del self._doubted[replica.name]
            return True
        return False

    def load(self, replica: Replica, own: int, queued: float | None = None,
             largest: float | None = None) -> ReplicaLoad:
        """`replica`'s load as room.py weighs it, `own` of this gateway's requests there:
        its engine's signals when its last scrape is fresh, this gateway's counts always;
        `queued` / `largest`: its queued prefill tokens / largest prompt in flight if
        already read (None: read here)."""
        name = replica.name
        snap = replica.snapshot
        scrape = None
        if snap is not None and replica.scraped_at is not None:
            scrape = Scrape(replica.scraped_at, snap.num_requests_running,
                            snap.num_requests_waiting, snap.kv_cache_usage,
                            replica.in_flight_at_scrape, replica.pinned_at_scrape)
        old = self._capacity.get(name, Capacity())
        epoch = (replica, self.router.restarts(name))
        seen = self._learnt_of.get(name)
        if seen is None or seen[0] is not replica or seen[1] != epoch[1]:
            if seen is not None:
                # another engine: it restarted (maybe with another --max-num-seqs) or its
                # replica left and came back; the scrape at hand may predate that, so it
                # is skipped, and until the next one a restarted engine that showed
                # running counts is held to the guess (PROBE_SEQS: most_running 0), never
                # to no limit: a queue held for it would otherwise go to the fresh engine
                # whole, into its first-come queue ahead of the classes above (a replica
                # that came back is another `Replica`, never scraped: a newcomer's start)
                shown = seen[0] is replica and old.most_running is not None
                old = Capacity(last_ts=None if scrape is None else scrape.ts,
                               most_running=0 if shown else None)
                self._rates.pop(name, None)  # its counters and speed start afresh
            self._learnt_of[name] = epoch
        # folds further apart than a scrape stays fresh pair no scrapes (engine.py)
        cap = self._capacity[name] = learn(old, scrape, self.max_age_s)
        if self._scrape_soon is not None and scrape_teaches(cap, scrape, own):
            self._ask_soon(replica, None if scrape is None else scrape.ts)
        rate = self._rates.get(name, PrefillRate())
        if snap is not None and scrape is not None:
            rate = self._rates[name] = learn_rate(
                rate, scrape.ts, snap.prompt_tokens_total, snap.prefix_cache_hits_total,
                snap.num_requests_waiting, self.router.config.prefill_s_per_token,
                self.max_age_s)
        if largest is None:
            largest = self.router.largest_by_replica().get(name, 0.0)
        per_token = rate.s_per_token() or self.router.config.prefill_s_per_token
        # a flat prompt counter beside a queue is no stall while the largest prompt there
        # may still be in its prefill (prefillrate.py, "Stalled")
        stuck = rate.stalled(per_token * largest)
        capacity = replica.capacity_tokens()
        v = self._views[name] = view(scrape, cap, own, self.clock(), self.max_age_s,
                                     drain_s(per_token, largest, stuck),
                                     pinned_now=self.router.pinned_tokens(name),
                                     capacity_tokens=float(capacity) if capacity else None)
        if scrape is not None and cap.last_ts != old.last_ts and v.source == "engine":
            # a new scrape: what it shows past the engine's queue has begun its prefill
            # (a non-streamed request's ends at its rate from then; a stream's at its
            # first token: Router.engine_began)
            self.router.engine_began(name, scrape.ts, scrape.waiting, per_token)
            queued = None
        elif v.source == "gateway":  # no figure from the engine: the cost model's estimate
            self.router.estimate_began(name, self.clock())
            queued = None
        kv_now = self._kv_usage(replica, v.kv_usage)
        return ReplicaLoad(
            name=name, in_flight=own,
            queued_prefill_tokens=(self.router.queued_tokens(name, self.clock()) if queued is None
                                   else queued),
            kv_usage=kv_now, kv_held=(0.0 if kv_now is None or v.kv_usage is None
                                      else max(0.0, kv_now - v.kv_usage)),
            healthy=self.trusted(replica),
            occupancy=v.occupancy, engine_waiting=v.waiting, seq_limit=v.seq_limit,
            largest_prompt_tokens=largest,
            prefill_s_per_token=rate.s_per_token(),
            cache_free_tokens=self.router.cache_free_tokens(name),
            engine_stuck=stuck)

    def _ask_soon(self, replica: Replica, after: float | None) -> None:
        """The guess may be low: ask for `replica`'s next scrape now, once per scrape
        folded (`after`: its time): one that failed or taught nothing is not asked again
        at every look, only after the next scrape lands (engine.py `scrape_teaches`)."""
        name = replica.name
        if name in self._asked_after and self._asked_after[name] == after:
            return
        if self._scrape_soon is not None and self._scrape_soon(replica):
            self._asked_after[name] = after

    def s_per_token(self, name: str) -> float:
        """`name`'s prefill rate as its scrapes showed it, else the cost model's."""
        rate = self._rates.get(name)
        measured = None if rate is None else rate.s_per_token()
        return self.router.config.prefill_s_per_token if measured is None else measured

    def capacity_tokens(self, name: str) -> int | None:
        """`name`'s KV capacity in tokens (None: unknown, or not in the fleet)."""
        replica = None if self.fleet is None else self.fleet.replicas.get(name)
        return None if replica is None else replica.capacity_tokens()

    def without_held(self, load: ReplicaLoad) -> ReplicaLoad:
        """`load` (read by `load` at this look) with its KV usage now (engine.py), nothing
        held for agent programs: as a program returning from its tool call reads it."""
        v = self._views.get(load.name)
        return load if v is None else replace(load, kv_usage=v.kv_usage, kv_held=0.0)

    def _kv_usage(self, replica: Replica, kv_usage: float | None) -> float | None:
        """The KV usage now (engine.py) with the context held for agent programs added."""
        if self._reserved is None or kv_usage is None:
            return kv_usage
        return kv_with_reserved(kv_usage, self._reserved(replica.name, self.clock()),
                                replica.capacity_tokens())

    def forget_left(self) -> None:
        """Drop what was learned of replicas that left the fleet (the bound on the maps)."""
        fleet = self.fleet
        if fleet is None or len(self._capacity) <= len(fleet.replicas):
            return
        for name in [n for n in self._capacity if n not in fleet.replicas]:
            self.forget(name)

    def forget(self, name: str) -> None:
        """`name` left the fleet: nothing learned of its engine stays (at the departure,
        not at the next release pass, which comes only while requests wait)."""
        self._capacity.pop(name, None)
        self._rates.pop(name, None)
        self._learnt_of.pop(name, None)
        self._views.pop(name, None)
        self._doubted.pop(name, None)
        self._asked_after.pop(name, None)

    def stats(self) -> dict[str, Any]:
        """Per replica, where its room came from at the last look (`/stats`), and the
        prefill this gateway sent there that the engine has not done (now)."""
        return {name: {
            "source": v.source,
            "snapshot_age_s": None if v.age_s is None else round(v.age_s, 3),
            "seq_limit": v.seq_limit,
            "occupancy": v.occupancy,
            "engine_waiting": v.waiting,
            # the KV usage the queue reads now: scraped, moved by what was sent since
            "kv_usage": None if v.kv_usage is None else round(v.kv_usage, 4),
            "prefill_tokens_per_s": (None if (r := self._rates.get(name)) is None
                                     or r.tokens_per_s is None else round(r.tokens_per_s)),
            "queued_prefill_tokens": round(self.router.queued_tokens(name)),
        } for name, v in sorted(self._views.items())}


def _outside() -> GatewayError:
    """None of the replicas a waiter may go to is there (the picker's own 503 for a subset
    hint that allows no ready endpoint, gateway.epp.decision)."""
    return GatewayError(503, "No ready endpoint in the subset the gateway allowed is "
                        "available.", code="no_healthy_replica")
