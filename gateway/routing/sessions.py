"""Session bindings and the future load they put on each replica (pure: time is a parameter).

A session's later turns follow it to the replica it is bound to, so how many sessions a
replica carries is load it has not received yet. Each binding remembers its replica and
when the session last sent a request; a replica's *session load* is the decayed count

    load(r, t) = sum over sessions bound to r of exp(-(t - last request) / active_s)

so a session counts 1 while it is busy and fades out over `active_s` seconds once it goes
quiet (finished, or an agent thinking for minutes). Each replica keeps the sum and the time
it was last brought up to date, so `touch` and `load` are O(1): the whole sum decays by one
factor, and a session's old contribution (known from its own last time) is taken out of
its replica's sum when it sends again there.

A session that *moves* (its history was evicted and it is placed again) leaves its old
share on the old replica to fade there: that replica served its requests so far, and
taking the share out at once made it look light and drew new sessions onto it, so moves
piled requests onto the replicas sessions left (requests max/mean 1.31 in one run of
gateway-bench's default preset, where about one request in ten moves).

Sessions are explicit (a client's id, a str) or implicit (a conversation recognised by
its content, an int from conversations.py): both are placed and counted alike.

Times may come out of order: another gateway instance's fact (gateway/shared/) is applied
at the time it happened, which can be before the latest local request. A request older
than the session's binding changes nothing (the binding is newer news); an older
contribution is added to a replica's sum decayed to the sum's own time.

Bindings are an LRU of at most `capacity` sessions; the oldest is forgotten first.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import xxhash

# An explicit session id (str) or an implicit conversation (int, conversations.py).
SessionKey = str | int


class SessionLoad:
    def __init__(self, active_s: float, capacity: int) -> None:
        if active_s <= 0:
            raise ValueError("active_s must be positive")
        self._tau = active_s
        self._capacity = max(1, capacity)
        # session -> (replica, time of its last request), least recently active first
        self._bound: OrderedDict[SessionKey, tuple[str, float]] = OrderedDict()
        self._sum: dict[str, tuple[float, float]] = {}  # replica -> (decayed sum, as of)
        self._count: dict[str, int] = {}  # replica -> sessions bound (exact)

    def replica(self, session: SessionKey) -> str | None:
        item = self._bound.get(session)
        return item[0] if item is not None else None

    def weight(self, session: SessionKey, now: float) -> float:
        """This session's own share of its replica's load now (0 when unbound)."""
        item = self._bound.get(session)
        return self._decay(now - item[1]) if item is not None else 0.0

    def load(self, replica: str, now: float) -> float:
        """Decayed count of the sessions bound to `replica`."""
        item = self._sum.get(replica)
        if item is None:
            return 0.0
        value, at = item
        return value * self._decay(now - at)

    def sessions(self, replica: str) -> int:
        return self._count.get(replica, 0)

    def touch(self, session: SessionKey, replica: str, now: float) -> None:
        """`session` sent a request to `replica` at `now` (binds or moves it there)."""
        old = self._bound.get(session)
        if old is not None and old[1] > now:
            return  # older than what the binding already knows
        old = self._bound.pop(session, None)
        if old is not None:
            # Same replica: its share is renewed; moved: its old share stays there to fade.
            self._take(old[0], self._decay(now - old[1]) if old[0] == replica else 0.0, now)
        self._bound[session] = (replica, now)
        self._add(replica, 1.0, now)
        if len(self._bound) > self._capacity:
            _, (where, last) = self._bound.popitem(last=False)
            self._take(where, self._decay(now - last), now)

    def forget_replica(self, replica: str) -> None:
        """The replica left: its sessions are unbound (they will be placed again)."""
        for session in [s for s, (r, _) in self._bound.items() if r == replica]:
            del self._bound[session]
        self._sum.pop(replica, None)
        self._count.pop(replica, None)

    # internals ----------------------------------------------------------------------------
    def _decay(self, elapsed: float) -> float:
        return math.exp(-max(0.0, elapsed) / self._tau)

    def _add(self, replica: str, amount: float, now: float) -> None:
        self._shift(replica, amount, now)
        self._count[replica] = self._count.get(replica, 0) + 1

    def _shift(self, replica: str, amount: float, now: float) -> float:
        """Add `amount` (as of `now`) to the replica's sum, kept as of the later time."""
        value, at = self._sum.get(replica, (0.0, now))
        if now >= at:
            value, at = value * self._decay(now - at) + amount, now
        else:
            value += amount * self._decay(at - now)
        value = max(0.0, value)
        self._sum[replica] = (value, at)
        return value

    def _take(self, replica: str, amount: float, now: float) -> None:
        count = self._count.get(replica, 0) - 1
        if count > 0:
            self._count[replica] = count
        else:
            self._count.pop(replica, None)
        value = self._shift(replica, -amount, now)
        if count <= 0 and value < 1e-9:
            # No float residue once a replica has no session left (shares of sessions that
            # moved away keep fading until then).
            self._sum.pop(replica, None)


def scoped(session: str, tenant: str | None) -> str:
    """The binding key of a client's session id: its tenant's own (two tenants may pick
    the same id; neither may move the other's session). \\x1f cannot be in a tenant name
    from config's table, so keys of different tenants never collide."""
    return session if tenant is None else f"{tenant}\x1f{session}"


def ratio_key(model: str, tenant: str | None) -> str:
    """The key of a bytes-per-token estimate (estimate.TokenEstimator): the model's, and
    with keys its tenant's own, so what another tenant's prompts tokenize to never moves
    the tokens predicted or estimated for a key. At most models x (tenants + 1) entries."""
    return model if tenant is None else f"{model}\x1f{tenant}"


def tenant_scope(tenant: str | None) -> int:
    """The tenant's scope for implicit conversations (conversations.py); 0 without one."""
    return 0 if tenant is None else xxhash.xxh3_64_intdigest(tenant.encode()) or 1
