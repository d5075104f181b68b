"""The Responses API store of this instance, told to the other instances through the shared
state as it learns (gateway/shared/redis_state.py); lookups stay local."""

from __future__ import annotations

from gateway.routing.affinity import AffinityStore
from gateway.shared.redis_state import SharedState


class SharedAffinity:
    """The Responses API store of this instance, told to the others as it learns."""

    def __init__(self, local: AffinityStore, shared: SharedState) -> None:
        self._local = local
        self._shared = shared

    def remember(self, response_id: str, replica: str) -> None:
        self._local.remember(response_id, replica)
        self._shared.remember_response(response_id, replica)

    def lookup(self, response_id: str) -> str | None:
        return self._local.lookup(response_id)

    def forget_replica(self, replica: str) -> None:
        self._local.forget_replica(replica)
