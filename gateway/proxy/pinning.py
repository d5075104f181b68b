"""Responses API continuations (pure apart from the affinity store it reads): which replica
a `previous_response_id` (or a call on one stored response) must go to.

A Responses request naming a `previous_response_id` whose creator the gateway knows is
pinned to that replica: no other replica holds the stored response. If that replica left
the fleet or is unhealthy, the answer is a 404/503 saying so instead of sending it where
it can only fail. Another tenant's id is answered as the engine answers an unknown one.
A call on one stored response (`GET`/`DELETE /v1/responses/{id}`,
`POST /v1/responses/{id}/cancel`: `stored_holder`) goes to its creator the same way, in
`gateway serve` and in the endpoint picker alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.proxy.errors import GatewayError
from gateway.replicas.fleet import Replica
from gateway.routing.affinity import AffinityStore, Lost, Pinned, owned, place


def pinned(body: Mapping[str, Any], tenant: str | None, affinity: AffinityStore,
           fleet: Mapping[str, Replica]) -> str | None:
    """The replica a continuation must go to, None when routing may choose."""
    previous = body.get("previous_response_id")
    if not isinstance(previous, str):
        return None
    return holder(previous, "previous_response_id", tenant, affinity, fleet)


def holder(previous: str, param: str, tenant: str | None, affinity: AffinityStore,
           fleet: Mapping[str, Replica]) -> str | None:
    """The replica that stored response `previous` for `tenant`, None when the gateway
    does not know it (or it is another tenant's); raises when that replica left or is
    down (no other holds it)."""
    mine = affinity.lookup(owned(previous, tenant))
    if mine is None and tenant is not None and affinity.lookup(previous) is not None:
        # another tenant's response: answered as the engine answers an unknown id,
        # never sent where it lives
        raise GatewayError(404, f"Response with id '{previous[:64]}' not found.",
                           code="response_not_found", param=param)
    where = place(mine, {name: r.healthy for name, r in fleet.items()})
    if isinstance(where, Pinned):
        return where.replica
    if isinstance(where, Lost):
        shown = previous[:64]
        if where.why == "removed":
            raise GatewayError(
                404, f"Response '{shown}' was created on replica {where.replica}, which has "
                "left the fleet; its stored state was lost with it. Start a new chain "
                "without previous_response_id.", code="previous_response_lost",
                param=param)
        raise GatewayError(
            503, f"Response '{shown}' is stored on replica {where.replica}, which is "
            "unhealthy; no other replica holds it. Retry later.",
            code="previous_response_unavailable", param=param)
    return None


def remember(affinity: AffinityStore, response_id: str, tenant: str | None,
             replica: str) -> None:
    """A Responses answer's id, made on `replica` for `tenant`."""
    if tenant is not None:  # that some tenant holds it (see `holder`); first, so the
        affinity.remember(response_id, replica)  # LRU forgets it first
    affinity.remember(owned(response_id, tenant), replica)


def stored_holder(path: str, method: str, tenant: str | None, affinity: AffinityStore,
                  fleet: Mapping[str, Replica]) -> str | None:
    """The replica a call on one stored response must go to (None: not such a call, or
    an id the gateway does not know); raises as `holder` (404, 503)."""
    stored = stored_response(path, method)
    if stored is None:
        return None
    return holder(stored, "response_id", tenant, affinity, fleet)


def stored_response(path: str, method: str) -> str | None:
    """The response id a call on one stored response names (GET/DELETE
    /v1/responses/{id}, POST /v1/responses/{id}/cancel), else None (pure)."""
    parts = path.split("/")
    if len(parts) < 4 or parts[1:3] != ["v1", "responses"] or not parts[3]:
        return None
    if len(parts) == 4 and method in ("GET", "DELETE"):
        return parts[3]
    if len(parts) == 5 and parts[4] == "cancel" and method == "POST":
        return parts[3]
    return None
