"""What the request path and the admission queue exchange (gate.py): a request's `Ask`,
the `Waiter` it becomes while it waits in its flow, and the `Ticket` it is given when it
goes. Records only; the queue's decisions are in gate.py, room.py, shares.py."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gateway.admission.config import Priority
from gateway.admission.shares import Flow
from gateway.agents.programs import ProgramId

if TYPE_CHECKING:  # annotations only: replicas reach usage, whose metrics name admission's labels
    from gateway.replicas.fleet import Replica
    from gateway.routing.plan import RoutePlan

# (model, pin, allowed) -> candidates
PoolKey = tuple[str, str | None, frozenset[str] | None]
Pools = Mapping[PoolKey, Sequence["Replica"]]


@dataclass(frozen=True, slots=True)
class Ask:
    """What the request path knows when it asks to route a request."""

    body: Mapping[str, Any]
    kind: Literal["chat", "completions"]
    model: str
    session: str | None
    pin: str | None  # the one replica it may go to (Responses continuation)
    tenant: str | None
    priority: bytes | None  # the raw x-gateway-priority header
    ts: float  # arrival, wall clock (what the router is given when it goes at once)
    # the replicas it may go to at all (a data plane's subset hint, by name), None: any
    # candidate; each pass reads the fleet again within these only
    allowed: frozenset[str] | None = None
    # the agent program it is a turn of (gateway.agents.programs), None: none named
    program: ProgramId | None = None

    def key(self) -> PoolKey:
        """Waiters with the same key may go to the same replicas."""
        return (self.model, self.pin, self.allowed)


@dataclass(slots=True, eq=False)
class Ticket:
    plan: RoutePlan
    cls: Priority
    replica: str | None  # where the gate counts it (None: admission off)
    # vLLM `priority` to put in the body, None to leave the body alone
    engine_priority: int | None = None
    queued_ms: float | None = None  # how long it waited in the queue (None: never queued)
    program: ProgramId | None = None  # its agent program, whose tool call begins at `done`


@dataclass(slots=True, eq=False)
class Waiter:
    ask: Ask
    cls: Priority
    flow: Flow
    tokens: float
    preview: RoutePlan
    pool: Sequence[Replica]  # at arrival: read again each pass only without a fleet
    arrived: float  # timer
    # when it first chose to wait for its own replica while another had room (late
    # binding's clock: the time it waited with no room anywhere is not a choice to stay)
    own_since: float | None = None
    # a program's turn back from a tool call: the replica its history is on, where it is
    # charged for no program's reservation (fleetview.py `without_held`); None: not one
    returning: str | None = None
    future: asyncio.Future[Ticket] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
