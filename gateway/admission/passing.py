"""Who may pass whom past the room (room.py, "past"): a follow-up sent to its own replica
past the gateway's queued-prefill room reaches that engine at once, ahead of whoever
waits in the gateway for the replica, so the queue sends none there while a waiter of a
higher class may go to it (`wanted_above`), and only a follow-up whose history is there
(`holds_history`). Pure: functions of the waiting flows and the candidates of each pass."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from gateway.admission import priority
from gateway.admission.asks import PoolKey, Pools, Waiter
from gateway.admission.config import CLASSES, Priority
from gateway.admission.shares import Flow

if TYPE_CHECKING:  # annotations only: replicas reach usage, whose metrics name admission's labels
    from gateway.replicas.fleet import Replica
    from gateway.routing.plan import RoutePlan


def wanted_above(flows: Mapping[Flow, Iterable[Waiter]], pools: Pools) -> dict[Priority, set[str]]:
    """Per class, the replicas some waiter of a higher class may go to: a request of
    the class goes to none of them past the room (room.py, "past")."""
    wanted: dict[Priority, set[str]] = {c: set() for c in CLASSES}
    keys: dict[Priority, set[PoolKey]] = {c: set() for c in CLASSES}
    for (c, _), q in flows.items():
        keys[c].update(w.ask.key() for w in q if not w.future.done())
    for c, ks in keys.items():
        for k in ks:
            wanted[c].update(r.name for r in pools.get(k, ()))
    above: dict[Priority, set[str]] = {}
    higher: set[str] = set()
    for c in sorted(CLASSES, key=priority.rank):
        above[c] = set(higher)
        higher |= wanted[c]
    return above


def holds_history(preview: RoutePlan, pool: Sequence[Replica], names: set[str]) -> bool:
    """One of `names` holds the longest cached prefix of `preview`'s prompt among `pool`
    (a follow-up that may go there past the room: room.py, "past")."""
    if not names:
        return False
    best = max((preview.predicted.get(r.name, 0) for r in pool), default=0)
    return best > 0 and any(preview.predicted.get(n, 0) == best for n in names
                            if any(r.name == n for r in pool))
