"""What the admission room tests build: the room `normal` sees, a replica's load as a
table row (`load`), a follow-up's own replica full by this gateway's queued prefill
(`full_own`), a chat request for the gate (`ask`), and a two-replica fleet with its gate
(`two_replicas`) on a clock that stands still."""

from __future__ import annotations

import asyncio
import itertools
import math

from gateway.admission.config import AdmissionConfig
from gateway.admission.gate import Ask, Gate
from gateway.admission.room import ReplicaLoad, RoomLimits, reserved
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics
from tests.test_admission_engine import Clock

# `normal`'s room: half of 32,768 queued prefill tokens (16,384)
LIMITS = reserved(RoomLimits(math.inf, 32_768, 0.97), 0.75, 0.5)
PER_TOKEN = 0.001  # 1 ms per prefill token: easy arithmetic
IN_FLIGHT_S = 0.01


def load(name: str, **kw: float) -> ReplicaLoad:
    """A replica's load by short names (queued, predicted, largest, rate, free, reserved,
    waiting, kv, occupancy, seq_limit, healthy); what is not named is ReplicaLoad's
    default, and one request of this gateway is in flight there."""
    return ReplicaLoad(name=name, in_flight=int(kw.pop("in_flight", 1)),
                       queued_prefill_tokens=kw.pop("queued", 0.0),
                       predicted_tokens=int(kw.pop("predicted", 0)),
                       largest_prompt_tokens=kw.pop("largest", 0.0),
                       prefill_s_per_token=kw.pop("rate", None),
                       cache_free_tokens=kw.pop("free", None),
                       reserved_tokens=kw.pop("reserved", 0.0),
                       engine_waiting=kw.pop("waiting", None),
                       kv_usage=kw.pop("kv", None),
                       occupancy=kw.pop("occupancy", None),
                       seq_limit=(None if (lim := kw.pop("seq_limit", None)) is None
                                  else int(lim)),
                       healthy=bool(kw.pop("healthy", True)))


def full_own(**kw: float) -> ReplicaLoad:
    """A follow-up's own replica `a`: it holds 12k of the 14k-token prompt and is full by
    this gateway's queued prefill alone (20k queued of a 16,384-token room; 32,768 past
    it)."""
    return load("a", **{"queued": 20_000.0, "predicted": 12_000.0, "in_flight": 2,
                        "largest": 14_000.0, **kw})


def ask(priority: bytes, tenant: str, *turns: str, at: float = 0.0) -> Ask:
    """A chat request of `tenant` in class `priority`, its turns alternating user and
    assistant, sent at `at`."""
    roles = itertools.cycle(("user", "assistant"))
    body = {"model": "m", "messages": [{"role": r, "content": t}
                                       for r, t in zip(roles, turns, strict=False)]}
    return Ask(body, "chat", "m", None, None, tenant, priority, at)


def two_replicas(clock: Clock, **cfg: object) -> tuple[Fleet, Gate]:
    """Replicas `a` and `b`, healthy, serving "m", and an enabled gate in front of them
    (every class up to `high` allowed unless `cfg` says otherwise, rechecks every
    millisecond, scrapes fresh for a second) on `clock`."""
    routing = RoutingConfig()
    fleet = Fleet([ReplicaSettings(name=n, url=f"http://{n}:8000", models=("m",))
                   for n in ("a", "b")])
    for r in fleet.replicas.values():
        r.healthy = True
    settings: dict[str, object] = {"default_priority_cap": "high", **cfg}
    g = Gate(AdmissionConfig(enabled=True, recheck_s=0.001, **settings),  # type: ignore[arg-type]
             routing, Router(routing), GatewayMetrics(), clock, clock, fleet=fleet,
             scrape_interval_s=1.0)
    return fleet, g


async def wait_queued(g: Gate, cls: str, n: int, tries: int = 200) -> None:
    """Until `n` requests of `cls` wait in the gate (bounded: `tries` millisecond naps)."""
    for _ in range(tries):
        if g.stats()["queued"][cls] >= n:
            return
        await asyncio.sleep(0.001)
