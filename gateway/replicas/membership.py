"""Who is in the fleet, from every source at once (the static [[replicas]] list, each DNS
name of `[discovery] dns`), and how a replica joins and leaves.

Each source hands its whole current set (`set_source`); the fleet follows the union (the
first source to name a replica wins, the static list first). `plan` (pure) says what
changes:
- join: a name not in the fleet. Added down and `joining` (`Fleet.add`: no probe marks it
  up yet); its `/metrics` (KV capacity, restart identity) and models are read first, then
  it is probed: the first good probe marks it up and adds it to the router with the
  capacity just learned (gateway.replicas.monitor `on_transition`), so it is routed only
  once healthy and never on the router's default capacity when the engine reports one.
- leave: a name in the fleet no source lists. `Fleet.leave` marks it down at once (no new
  request goes there, whatever path picks) and its requests in flight run on.
- rejoin: a leaving name listed again at the same URL (a flap): `Fleet.rejoin`, so its next
  good probe marks it up with its index, sessions, capacity and metric series kept.
- replace: a name listed at another URL (another server): departs at once, then joins.
- update: the same name and URL with other settings (a reloaded key or capacity).

Departure (`departure_due`, pure): a leaving replica departs (`Services.remove_replica`:
index, sessions, metric series, semaphores, connections; gateway.replicas.departure) once
`grace_s` has passed since it left and its requests in flight finished, or once
`drain_timeout_s` has passed whatever is in flight. The grace period is what keeps a
flapping replica's learned state: listed again within it, nothing of it was dropped. The
leaving replicas are bounded (`MAX_LEAVING`, the oldest departs first past it) as well as
in time, so churn cannot grow the fleet.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from gateway.replicas.fleet import Fleet, Replica
from gateway.replicas.monitor import FleetMonitor
from gateway.settings import DiscoverySettings, ReplicaSettings
from gateway.tasks import every, guarded

log = logging.getLogger("gateway.replicas.membership")

STATIC = "static"  # the source name of [[replicas]]
MAX_LEAVING = 256  # leaving replicas held at once; past it the oldest departs at once
REAP_S = 0.25  # how often leaving replicas are checked for their departure


@dataclass(frozen=True, slots=True)
class Plan:
    join: tuple[ReplicaSettings, ...] = ()
    leave: tuple[str, ...] = ()
    rejoin: tuple[str, ...] = ()
    replace: tuple[ReplicaSettings, ...] = ()
    update: tuple[ReplicaSettings, ...] = ()


@dataclass(frozen=True, slots=True)
class Member:
    """What `plan` needs of a replica in the fleet."""
    settings: ReplicaSettings
    leaving: bool = False


def union(sources: Mapping[str, Mapping[str, ReplicaSettings]]) -> dict[str, ReplicaSettings]:
    """Every source's replicas; a name two sources list is the first source's."""
    out: dict[str, ReplicaSettings] = {}
    for replicas in sources.values():
        for name, replica in replicas.items():
            out.setdefault(name, replica)
    return out


def plan(current: Mapping[str, Member], wanted: Mapping[str, ReplicaSettings]) -> Plan:
    """What to do to make the fleet `current` follow `wanted` (module docstring)."""
    join: list[ReplicaSettings] = []
    rejoin: list[str] = []
    replace: list[ReplicaSettings] = []
    update: list[ReplicaSettings] = []
    for name, replica in wanted.items():
        member = current.get(name)
        if member is None:
            join.append(replica)
        elif member.settings.url != replica.url:
            replace.append(replica)
        else:
            if member.leaving:
                rejoin.append(name)
            if member.settings != replica:
                update.append(replica)
    leave = [n for n, m in current.items() if n not in wanted and not m.leaving]
    return Plan(tuple(join), tuple(leave), tuple(rejoin), tuple(replace), tuple(update))


def departure_due(left_at: float, now: float, in_flight: int, grace_s: float,
                  drain_timeout_s: float) -> bool:
    """A leaving replica departs now (module docstring)."""
    waited = now - left_at
    return waited >= drain_timeout_s or (waited >= grace_s and in_flight <= 0)


def overflow(leaving: Mapping[str, float], bound: int) -> list[str]:
    """The oldest leaving replicas past `bound` (they depart at once)."""
    extra = len(leaving) - bound
    return sorted(leaving, key=lambda n: (leaving[n], n))[:extra] if extra > 0 else []


@dataclass(eq=False)
class Membership:
    fleet: Fleet
    monitor: FleetMonitor
    remove: Callable[[str], object]  # Services.remove_replica: the whole departure
    discovery: DiscoverySettings
    clock: Callable[[], float]
    sources: dict[str, dict[str, ReplicaSettings]] = field(default_factory=dict)
    # told of each replica that joins or whose settings changed (token mode's KV-event
    # feeds: EventFeeds.add_replica); a departure goes through `remove`
    on_member: Callable[[ReplicaSettings], object] = lambda replica: None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _reaper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reaper = asyncio.create_task(
            every(REAP_S, self._reap, "departures", self.monitor.failures))

    async def aclose(self) -> None:
        tasks = [*self._tasks, *([self._reaper] if self._reaper is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._reaper = None

    async def joined(self, timeout_s: float) -> None:
        """The joins and probes started so far have ended, or `timeout_s` passed (they
        go on; a replica that takes longer is routed when its probe ends)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)

    def set_source(self, source: str, replicas: Mapping[str, ReplicaSettings]) -> None:
        """`source`'s whole current set (empty: it lists none); the fleet follows."""
        if replicas:
            self.sources[source] = dict(replicas)
        else:
            self.sources.pop(source, None)
        self.reconcile()

    def reconcile(self) -> None:
        current = {n: Member(r.settings, r.leaving_since is not None)
                   for n, r in self.fleet.replicas.items()}
        todo = plan(current, union(self.sources))
        now = self.clock()
        for name in todo.leave:
            if self.fleet.leave(name, now):
                self.monitor.publish(self.fleet.replicas[name])
                log.info("replica leaving", extra={"replica": name})
        for replica in todo.replace:
            self.remove(replica.name)
            log.info("replica departed", extra={"replica": replica.name,
                                                "reason": "address changed"})
        for replica in todo.update:
            self.fleet.update(replica)
            self.on_member(replica)
        for name in todo.rejoin:
            self.fleet.rejoin(name)
            log.info("replica rejoined", extra={"replica": name})
            self._start(functools.partial(self.monitor.probe, self.fleet.replicas[name]),
                        f"health probe {name}")
        for replica in (*todo.join, *todo.replace):
            joiner = self.fleet.add(replica, joining=True)
            self.on_member(replica)
            log.info("replica joined", extra={"replica": replica.name, "url": replica.url})
            self._start(functools.partial(self._join, joiner), f"join {replica.name}")
        self._reap_now(now)

    async def _join(self, replica: Replica) -> None:
        """Learn a joiner's capacity and models, then probe it now rather than at the next
        round (module docstring)."""
        try:
            await asyncio.gather(self.monitor.scrape(replica),
                                 self.monitor.refresh_model(replica))
        finally:
            self.fleet.joined(replica)  # an unreachable one is probed like any other
        await self.monitor.probe(replica)

    def _start(self, step: Callable[[], Awaitable[object]], what: str) -> None:
        task = asyncio.get_running_loop().create_task(guarded(step, what,
                                                              self.monitor.failures))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reap(self) -> None:
        self._reap_now(self.clock())

    def _reap_now(self, now: float) -> None:
        leaving = {n: r.leaving_since for n, r in self.fleet.replicas.items()
                   if r.leaving_since is not None}
        if not leaving:
            return
        due = set(overflow(leaving, MAX_LEAVING))
        d = self.discovery
        due.update(n for n, left_at in leaving.items() if departure_due(
            left_at, now, self.fleet.replicas[n].in_flight, d.grace_s, d.drain_timeout_s))
        for name in sorted(due):
            in_flight = self.fleet.replicas[name].in_flight
            self.remove(name)
            log.info("replica departed", extra={"replica": name, "in_flight": in_flight})
