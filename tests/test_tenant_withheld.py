"""Where the routing index is shared by every tenant (token mode without
`tenant_cache_salt`), what a non-admin key reads is withheld (pure tables; the loopback
side is tests/test_tenant_token_mode.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence

import pytest

from gateway.proxy.app import create_app
from gateway.proxy.auth import Authenticator
from gateway.proxy.tenancy import TenantSalts, routing_salt
from gateway.proxy.upstream import Timeouts
from gateway.settings import AuthSettings
from gateway.upstream.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamPoolBusy,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from gateway.upstream.failure import client_error
from gateway.usage.exposure import stats_view
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import EVENTS, SSE_H, Fake, chat, ok_stream, settings, started
from tests.upstream_double import MockReply, MockRequest, MockResponse, MockUpstream

VIEW = {"model": "m", "prompt": "p", "cache_salt": "own"}


@pytest.mark.parametrize(("secret", "token_mode", "salt", "shared"), [
    # text mode: the index is the gateway's, keyed by tenant (and the client's salt)
    ("", False, routing_salt("alice", "own"), False),
    # token mode, no secret: the engines' shared blocks, seen as the engine sees them
    ("", True, "own", True),
    # the secret keys both, in either mode
    ("s3cret", False, "engine", False),
    ("s3cret", True, "engine", False),
])
def test_the_routing_view_of_a_tenants_request(secret: str, token_mode: bool, salt: str,
                                               shared: bool) -> None:
    salts = TenantSalts({"alice", "bob"}, secret, token_mode=token_mode)
    if salt == "engine":
        salt = salts.engine("alice") or ""
        assert salt and salt != salts.engine("bob")
    assert salts.route_view(VIEW, "alice")["cache_salt"] == salt
    assert VIEW["cache_salt"] == "own"  # the forwarded body's view is never changed
    assert salts.shared_index is shared
    # only a non-admin key of a shared index is told nothing of the decision
    assert salts.withheld("alice", admin=False) is shared
    assert salts.withheld("alice", admin=True) is False
    assert salts.withheld(None, admin=False) is False  # no keys: the operator's gateway


def test_admin_tenant_follows_the_key_table() -> None:
    auth = Authenticator({"ka": "alice", "kops": "ops"}, admin_tenants=("ops",))
    assert [auth.admin_tenant(t) for t in ("alice", "ops", None)] == [False, True, False]
    assert Authenticator({}).admin_tenant(None)  # no keys: every caller is the operator


@pytest.mark.parametrize("exc", [
    UpstreamConnectError("Cannot connect to host 10.0.0.7:8000"),
    UpstreamPoolBusy("no free connection to 10.0.0.7:8000"),
    UpstreamTimeout("no head from 10.0.0.7:8000"),
    UpstreamProtocolError("Server disconnected 10.0.0.7:8000"),
])
def test_an_error_names_the_replica_only_where_the_choice_may_be_shown(
        exc: UpstreamError) -> None:
    named = client_error(exc, "gpu-A")
    hidden = client_error(exc, None)
    assert (named.status, named.code) == (hidden.status, hidden.code)
    assert "gpu-A" in named.message
    assert "gpu-A" not in hidden.message and "10.0.0.7" not in hidden.message
    assert "the replica" in hidden.message.lower()


def refused(replica: str, req: MockRequest) -> MockReply:
    raise UpstreamConnectError(f"Cannot connect to host {replica}.test:80")


async def test_a_non_admin_keys_failed_request_is_told_nothing_of_the_shared_choice() -> None:
    """The handler's side: a shared index (as token mode without the salt sets it) keeps
    the replica out of a non-admin key's headers and errors; the admin reads them."""
    cfg = dataclasses.replace(settings(), auth=AuthSettings(
        keys={"ka": "alice", "kops": "ops"}, admin_tenants=("ops",)))
    app = create_app(cfg, upstream=Fake(refused).upstream)
    records: list[UsageRecord] = []
    async for client in started(app, records):
        assert app._proxy is not None
        app._proxy.salts = TenantSalts({"alice", "ops"}, "", token_mode=True)
        alice = await client.post("/v1/chat/completions", json=chat(),
                                  headers={"authorization": "Bearer ka"})
        admin = await client.post("/v1/chat/completions", json=chat(),
                                  headers={"authorization": "Bearer kops"})
    assert alice.status_code == admin.status_code == 502
    assert alice.headers["x-gateway-route"] == "withheld"
    assert alice.headers["x-gateway-cache"] == "route=withheld"
    assert "x-gateway-replica" not in alice.headers
    told = alice.json()["error"]["message"]
    assert "replica a" not in told and "replica b" not in told and ".test" not in told, told
    assert ".test" in admin.json()["error"]["message"]
    assert admin.headers["x-gateway-route"] != "withheld"


FIGURES = {"requests": 2, "prompt_tokens": 900, "completion_tokens": 8, "cached_tokens": 800,
           "cached_ratio": 0.89, "records_without_cached_tokens": 0, "available": 0.9,
           "captured": 1.0, "delivered": 0.98}
STATS = {
    "windows": {"5m": {"requests": 3, "by_tenant": {"bob": FIGURES, "alice": FIGURES}}},
    "hygiene": {"latest": [{"tenant": "bob", "replica": "r1", "kind": "timestamp"},
                           {"tenant": "alice", "replica": "r0", "kind": "uuid"}]},
}


@pytest.mark.parametrize("shared", [False, True])
def test_a_keys_own_stats_leave_out_what_a_shared_index_decided(shared: bool) -> None:
    got = stats_view(STATS, "tenant", "bob", shared_index=shared)
    row = got["windows"]["5m"]["by_tenant"]
    assert list(row) == ["bob"]  # never alice's, either way
    routed = {"available", "captured", "delivered"}
    assert set(row["bob"]) == (set(FIGURES) - routed if shared else set(FIGURES))
    latest = got["hygiene"]["latest"]
    assert latest == [{"tenant": "bob", "kind": "timestamp"} if shared else
                      {"tenant": "bob", "replica": "r1", "kind": "timestamp"}]
    # the admin reads everything, shared or not
    assert stats_view(STATS, "operator", None, shared_index=shared) == STATS


class _Cut(MockResponse):
    """A stream the replica breaks after its first event."""

    async def chunks(self) -> AsyncIterator[bytes]:
        yield EVENTS[0]
        raise UpstreamProtocolError("Server disconnected from 10.0.0.7:8000")


class _CutUpstream(MockUpstream):
    async def send(self, method: str, url: str, headers: Sequence[tuple[str, str]],
                   body: bytes | None, timeouts: Timeouts) -> MockResponse:
        got = await super().send(method, url, headers, body, timeouts)
        if method == "POST":
            got = _Cut(MockReply(200, SSE_H, []))
        return got


@pytest.mark.parametrize(("key", "named"), [("ka", False), ("kops", True)])
async def test_a_stream_cut_by_the_replica_names_it_only_to_whom_it_may(
        key: str, named: bool) -> None:
    cfg = dataclasses.replace(settings(), auth=AuthSettings(
        keys={"ka": "alice", "kops": "ops"}, admin_tenants=("ops",)))
    app = create_app(cfg, upstream=_CutUpstream(Fake(ok_stream).handle))
    async for client in started(app, []):
        assert app._proxy is not None
        app._proxy.salts = TenantSalts({"alice", "ops"}, "", token_mode=True)
        r = await client.post("/v1/chat/completions", json=chat(stream=True),
                              headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200 and "error" in r.text, r.text
    assert ("10.0.0.7" in r.text) is named
    assert any(f"replica {n} " in r.text.lower() for n in ("a", "b")) is named
