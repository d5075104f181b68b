"""A tenant's cache namespace (pure): what keeps one tenant's prompts out of what another
tenant's key can learn.

With `[auth] keys` set, the prefix index the router consults is keyed by tenant: the
request's routing view carries a `cache_salt` derived from its tenant, which seeds the
block-hash chain (routing.normalize.chain_seed; token mode: tokens.chain.namespace), so
a prediction, a route reason and the replica chosen for a key depend only on what its own
tenant's traffic put in the index, never on whether another tenant sent the same prefix.
That costs one dict copy per request and no per-block work.

`[auth] tenant_cache_salt` (a secret; empty: off) isolates the engines' caches as well:
the gateway sets vLLM's `cache_salt` on each chat, completions, Responses and Messages
body to
`HMAC-SHA256(secret, tenant)` (hex, 32 characters; the engine never sees the tenant's
name), overriding whatever the client sent, and the routing view carries the same value,
so the index and the engines are partitioned alike (a vLLM whose Anthropic Messages
endpoint takes no `cache_salt` ignores it: those requests are not isolated by the
engine; the index still is). Without it, the salt stays in the
gateway (`routing_salt`: the tenant and the client's own `cache_salt`, which the engine
still sees), and the engines' caches, hence timing and the engine's own
`cached_tokens` in answers, are shared across tenants as before.

Token mode (`[tokens]`) without the secret is the exception (`shared_index`): the index
is then the engines' own blocks, which are shared, so a tenant-keyed index would match none
of them and route every request cold. The router sees the request as the engine does (the
client's own `cache_salt`), and what of an answer derives from that shared index (the
chosen replica, the predicted tokens, the route reason) is withheld from every key but an
admin's (`withheld`; proxy/handler.py), so no header tells a key what another tenant sent.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection, Mapping
from typing import Any

_ENGINE_SALT_HEX = 32
# The route reason a key reads where the shared index decided (`TenantSalts.withheld`).
WITHHELD = "withheld"


class TenantSalts:
    """The salts of the configured tenants, derived once (bounded by the key table)."""

    def __init__(self, tenants: Collection[str], secret: str, *,
                 token_mode: bool = False) -> None:
        self._engine: dict[str, str] = {}
        if secret:
            key = secret.encode("utf-8", "surrogatepass")
            for tenant in tenants:
                digest = hmac.new(key, tenant.encode("utf-8", "surrogatepass"),
                                  hashlib.sha256).hexdigest()
                self._engine[tenant] = digest[:_ENGINE_SALT_HEX]
        # token mode routes on the engines' blocks: keyed by tenant only where they are
        self.shared_index = token_mode and not secret

    @property
    def engine_salting(self) -> bool:
        return bool(self._engine)

    def engine(self, tenant: str) -> str | None:
        """vLLM's `cache_salt` for `tenant`'s requests, None when the option is off."""
        return self._engine.get(tenant)

    def route_view(self, view: Mapping[str, Any], tenant: str) -> dict[str, Any]:
        """The routing view of `tenant`'s request: keyed by the tenant (its engine salt,
        else the routing-only salt), or as it is where the index is shared."""
        salt = self.engine(tenant)
        if salt is not None:
            return salted(view, salt)
        if self.shared_index:
            return dict(view)  # as the engine sees it (a copy, like the others)
        return salted(view, routing_salt(tenant, view.get("cache_salt")))

    def withheld(self, tenant: str | None, admin: bool) -> bool:
        """Whether an answer to `tenant`'s key must not show what the shared index decided
        (replica, predicted tokens, route reason)."""
        return self.shared_index and tenant is not None and not admin


def routing_salt(tenant: str, client_salt: object) -> str:
    """The routing-only salt of a request: its tenant and the client's own `cache_salt`
    (the engine partitions by the latter; the index by both). Never forwarded."""
    own = client_salt if isinstance(client_salt, str) else ""
    return f"tenant\x00{tenant}\x00{own}"


def salted(view: Mapping[str, Any], salt: str) -> dict[str, Any]:
    """`view` with `cache_salt` = `salt` (a shallow copy: the forwarded body is untouched)."""
    return {**view, "cache_salt": salt}
