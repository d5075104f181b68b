"""Which replica created each Responses API response (pure, bounded).

vLLM keeps stored responses (`VLLM_ENABLE_RESPONSES_API_STORE=1`) in the memory of the
replica that created them: a request that continues one by `previous_response_id` works
only there, any other replica answers 404. The gateway therefore remembers
`response id -> replica` from every answer it relays (the `id` of a JSON body, the
`response.id` of the stream's events) and pins each continuation to that replica.

`ResponseAffinity` is an LRU map of at most `capacity` ids (oldest forgotten first). The
`AffinityStore` protocol is the seam for sharing the map between gateway instances
(Redis, where shared state is on); `ResponseAffinity` is the local store.

`place` is the decision: `Pinned(replica)` when the creator is known and usable,
`Lost(replica, why)` when it is known but gone from the fleet or unhealthy (the gateway
answers with an error saying so: any other replica would only answer 404), and None when
the id is unknown (created before this gateway started, or by another instance): the
request is routed as usual and the replica answers for itself.

Tenants: every id is remembered and looked up as its tenant's (`owned`), and, with keys,
also bare, meaning "some tenant holds it": a key that names another tenant's id is
answered 404 as for an unknown id (proxy/handler.py), never pinned to, nor told where,
another tenant's response lives (so with keys, `capacity` holds half as many ids).
Shared through Redis as the same composite: tenant names are printable, so the `\x1f`
separator is unambiguous.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

MAX_ID_LENGTH = 256  # vLLM's ids are `resp_` + 32 hex; longer values are not remembered


def owned(response_id: str, tenant: str | None) -> str:
    """The key of `response_id` created (or asked for) by `tenant`'s key."""
    return response_id if tenant is None else f"{tenant}\x1f{response_id}"


class AffinityStore(Protocol):
    def remember(self, response_id: str, replica: str) -> None: ...
    def lookup(self, response_id: str) -> str | None: ...
    def forget_replica(self, replica: str) -> None: ...


class ResponseAffinity:
    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def remember(self, response_id: str, replica: str) -> None:
        if not response_id or len(response_id) > MAX_ID_LENGTH:
            return
        owner = self._owner
        owner[response_id] = replica
        owner.move_to_end(response_id)
        while len(owner) > self.capacity:
            owner.popitem(last=False)

    def lookup(self, response_id: str) -> str | None:
        replica = self._owner.get(response_id)
        if replica is not None:
            self._owner.move_to_end(response_id)  # a live chain stays remembered
        return replica

    def forget_replica(self, replica: str) -> None:
        """The replica restarted or left: its stored responses are gone."""
        for rid in [r for r, name in self._owner.items() if name == replica]:
            del self._owner[rid]


@dataclass(frozen=True, slots=True)
class Pinned:
    replica: str


@dataclass(frozen=True, slots=True)
class Lost:
    replica: str
    why: Literal["removed", "unhealthy"]


def place(owner: str | None, healthy: Mapping[str, bool]) -> Pinned | Lost | None:
    """Where a continuation of a response created on `owner` can go. `healthy` maps each
    replica of the fleet to its health."""
    if owner is None:
        return None
    state = healthy.get(owner)
    if state is None:
        return Lost(owner, "removed")
    if not state:
        return Lost(owner, "unhealthy")
    return Pinned(owner)
