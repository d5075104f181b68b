"""What in the gateway's services still holds a replica's name: a walk over every object
they reach, so that a per-replica map added later that forgets a departed replica fails
the departure tests (tests/test_fleet_departure_in_flight.py, tests/test_fleet_churn.py) without a
list of maps to keep up to date."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from typing import Any

from gateway.settings import Settings

# Not walked: the registry (its series are counted from /metrics instead), the transports,
# loggers and tasks (they hold no per-replica map of the gateway's own).
_SKIP_MODULES = ("prometheus_client", "aiohttp", "asyncio", "logging", "httpx", "threading",
                 "concurrent", "uvloop", "redis", "multidict", "yarl", "starlette", "_asyncio")


# Paths the walk leaves out: none (the admission queue forgets at the departure too).
NOT_YET: tuple[str, ...] = ()
# Paths that hold a departed replica's name by design, bounded in count and time: the
# shared state's record of departures (gateway/shared/departures.py: facts about it from
# before it left are void, should a server come back under its name).
KEPT: tuple[str, ...] = ("services.shared.departures._at",)


def names_held(root: object, names: Iterable[str], limit: int = 500_000) -> list[str]:
    """Paths from `root` to every string equal to one of `names` (a dict key or value, a
    set member, an attribute, an item of a list, tuple or deque), through every object the
    gateway's services reach."""
    wanted = set(names)
    found: list[str] = []
    seen: set[int] = set()
    todo: deque[tuple[object, str]] = deque([(root, "services")])
    while todo and len(seen) < limit:
        obj, path = todo.popleft()
        if isinstance(obj, str):
            if obj in wanted and not path.startswith((*NOT_YET, *KEPT)):
                found.append(path)
            continue
        if id(obj) in seen or obj is None or isinstance(obj, (int, float, bytes, bool)):
            continue
        seen.add(id(obj))
        module = type(obj).__module__ or ""
        if module.startswith(_SKIP_MODULES) or (callable(obj) and not hasattr(obj, "__dict__")):
            continue
        if isinstance(obj, (type, Settings)) or asyncio.iscoroutine(obj):
            continue  # (the configuration is no map: a configured replica never leaves)
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                todo.append((k, f"{path}[key]"))
                todo.append((v, f"{path}[{k!r}]"))
        elif isinstance(obj, (list, tuple, set, frozenset, deque)):
            for i, v in enumerate(list(obj)):
                todo.append((v, f"{path}[{i}]"))
        else:
            attrs: dict[str, Any] = {}
            for cls in type(obj).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if isinstance(slot, str) and hasattr(obj, slot):
                        attrs[slot] = getattr(obj, slot)
            attrs.update(getattr(obj, "__dict__", {}))
            for k, v in attrs.items():
                todo.append((v, f"{path}.{k}"))
    return found
