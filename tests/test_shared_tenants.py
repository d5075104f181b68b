"""Tenants: one tenant's session id or identical prompt cannot bind, join or move another
tenant's conversation, in one instance and across instances (facts); /stats' per-tenant
breakdowns of other tenants are for admin keys only."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from gateway.proxy.app import create_app
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.facts import Fact, decode, encode
from gateway.routing.router import Router
from gateway.routing.sessions import scoped
from gateway.settings import AuthSettings
from gateway.usage.record import UsageRecord
from tests.proxy_fakes import Fake, chat, settings, started

NAMES = ["r1", "r2", "r3"]
ALL = [ReplicaState(n, 0) for n in NAMES]


def router(published: list[Fact] | None = None) -> Router:
    r = Router(RoutingConfig(seed=4), publish=published.append if published is not None
               else None)
    for n in NAMES:
        r.add_replica(n)
    return r


def body(system: str, *turns: str) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"model": "m", "messages": msgs}


SYSTEM = "You are the support agent of a large shop. " * 40


@pytest.mark.parametrize("named", [True, False], ids=["session id", "implicit"])
@pytest.mark.parametrize("across", [False, True], ids=["one instance", "two instances"])
def test_one_tenants_session_cannot_move_anothers(named: bool, across: bool) -> None:
    """Tenant A's conversation lives on its replica. Tenant B sends the same session id
    (or, without ids, a prompt that extends A's) and lands on another replica: A's
    conversation stays bound where it was, on this instance and on one that learns all
    of it from facts."""
    published: list[Fact] = []
    a = router(published)
    session = "s1" if named else None
    first = a.decide(body(SYSTEM, "where is my order?"), "chat", "m", session, ALL, 1.0,
                     tenant="A")
    home = first.decision.replica
    elsewhere = [ReplicaState(n, 0) for n in NAMES if n != home][:1]
    follow = body(SYSTEM, "where is my order?", "It ships today.", "thanks, and the bill?")
    b_plan = a.decide(follow, "chat", "m", session, elsewhere, 2.0, tenant="B")
    assert b_plan.decision.replica != home
    seen = a
    if across:
        seen = router()
        for i, fact in enumerate(published):  # through the wire form, as Redis carries it
            seen.apply(decode(encode(fact, "a", 1.0 + i)).fact, 1.0 + i)
    if named:
        assert seen.session_replica(scoped("s1", "A")) == home
        assert seen.session_replica(scoped("s1", "B")) == elsewhere[0].name
    # A's next turn still belongs to A's conversation, on A's replica.
    again = seen.decide(follow, "chat", "m", session, ALL, 3.0, tenant="A")
    assert again.decision.replica == home
    if not named:
        assert again.conversation == first.conversation or across
        assert seen.conversations() == 2  # A's and B's, not one


def test_without_tenants_the_same_session_id_is_one_session() -> None:
    """The control: keys without tenants share ids, so the second sender moves it."""
    a = router()
    first = a.decide(body(SYSTEM, "hello"), "chat", "m", "s1", ALL, 1.0)
    other = [ReplicaState(n, 0) for n in NAMES if n != first.decision.replica][:1]
    a.decide(body(SYSTEM, "hello", "hi", "more"), "chat", "m", "s1", other, 2.0)
    assert a.session_replica("s1") == other[0].name


@pytest.mark.parametrize(("key", "sees_tenants"), [
    ("k-admin", True), ("k-user", False), (None, False)])
async def test_only_admin_keys_read_stats_by_tenant(key: str | None,
                                                   sees_tenants: bool) -> None:
    auth = AuthSettings(keys={"k-admin": "ops", "k-user": "team-a", "k-other": "team-b"},
                        admin_tenants=("ops",), public_metrics=True)
    app = create_app(dataclasses.replace(settings(), auth=auth), upstream=Fake().upstream)
    records: list[UsageRecord] = []
    async for client in started(app, records):
        r = await client.post("/v1/chat/completions", json=chat(),
                              headers={"authorization": "Bearer k-other"})
        assert r.status_code == 200
        headers = {"authorization": f"Bearer {key}"} if key else {}
        stats = await client.get("/stats", headers=headers)
        page = await client.get("/stats?format=html", headers=headers)
    assert stats.status_code == 200
    assert ("team-b" in stats.text) is sees_tenants
    assert sees_tenants or "team-b" not in page.text
    assert ('"by_tenant":{"team-b"' in stats.text) is sees_tenants
    assert '"by_model"' in stats.text


@pytest.mark.parametrize(("auth", "error"), [
    ({"keys": {"k": "a"}, "admin_tenants": ("b",)}, "no key names"),
    ({"keys": {"k": "a\x1fb"}}, "printable"),
    ({"tenant_cache_salt": "secret"}, "needs auth.keys"),
])
def test_auth_settings_refuse(auth: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        AuthSettings(**auth)


@pytest.mark.parametrize("header", ["x-session-id", "x-claude-code-session-id",
                                    "x-session-affinity", "session-id"])
async def test_a_harness_session_header_is_scoped_by_tenant(header: str) -> None:
    """Through the request path: two keys of two tenants send the same agent-harness session
    header. Each tenant's session is its own binding; the second never rebinds the first."""
    auth = AuthSettings(keys={"ka": "alice", "kb": "bob"})
    app = create_app(dataclasses.replace(settings(), auth=auth), upstream=Fake().upstream)
    records: list[UsageRecord] = []
    async for client in started(app, records):
        assert app.services is not None
        router = app.services.router
        homes = {}
        for key, tenant in (("ka", "alice"), ("kb", "bob"), ("ka", "alice")):
            r = await client.post("/v1/chat/completions", json=chat(),
                                  headers={"authorization": f"Bearer {key}", header: "s1"})
            assert r.status_code == 200
            homes.setdefault(tenant, r.headers["x-gateway-replica"])
            # alice's binding is where alice's turns went, whatever bob sent since
            assert router.session_replica(scoped("s1", "alice")) == homes["alice"]
        assert router.session_replica(scoped("s1", "bob")) == homes["bob"]
        assert router.session_replica("s1") is None  # no unscoped binding at all
    assert [rec.session for rec in records] == ["s1", "s1", "s1"]
