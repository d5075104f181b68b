"""Client authentication: an optional table of API keys, each naming a tenant (pure).

With no keys configured every request is accepted with tenant `None`. Otherwise the
`Authorization: Bearer <key>` header must match one key. Keys are compared as SHA-256
digests with `hmac.compare_digest`, against every configured key whatever matched: the time
taken reveals neither which key matched nor how much of one, nor a key's length
(`compare_digest` returns at once on inputs of different lengths; digests all have one).
Only the digests are kept.

Roles: a key's tenant may be an admin (`[auth] admin_tenants`); only admins read what
is tenant-scoped in `/stats` and `/metrics` (gateway.usage.exposure classifies every
field). Without keys there are no tenants and every caller is the operator.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection, Mapping

from gateway.proxy.errors import GatewayError


class Authenticator:
    def __init__(self, keys: Mapping[str, str], admin_tenants: Collection[str] = ()) -> None:
        self._keys = [(_digest(k.encode()), tenant) for k, tenant in keys.items()]
        self._admins = frozenset(admin_tenants)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def tenant(self, authorization: bytes | None) -> str | None:
        """The tenant of the request's Authorization header value; 401 if it is not valid."""
        if not self._keys:
            return None
        presented = b""
        if authorization is not None:
            scheme, _, value = authorization.partition(b" ")
            if scheme.lower() == b"bearer":
                presented = value.strip()
        digest = _digest(presented)
        found: str | None = None
        for key, tenant in self._keys:
            if hmac.compare_digest(key, digest) and found is None:
                found = tenant
        if found is None:
            raise GatewayError(
                401,
                "Incorrect API key provided." if presented else "Missing API key.",
                code="invalid_api_key",
            )
        return found

    def admin_tenant(self, tenant: str | None) -> bool:
        """Whether `tenant` (a valid key's; None without keys) has the admin role."""
        return not self._keys or tenant in self._admins

    def admin(self, authorization: bytes | None) -> bool:
        """Whether the request's key has the admin role (never raises: False)."""
        if not self._keys:
            return True
        try:
            return self.tenant(authorization) in self._admins
        except GatewayError:
            return False


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()
