"""Per-session and per-client state is the tenant's own.

Hygiene drift: a request is compared only with its own tenant's earlier requests, by
session id, by implicit conversation and by template; another tenant that sends the
victim's session id, earlier messages or template learns nothing of the victim's prompt
from its findings and plants no finding in the victim's next answer.
Responses affinity: a response id another tenant's request created is answered 404 to a
key of this one (never sent to, nor told about, the replica holding it).
(Sessions and implicit conversations of the router: tests/test_shared_tenants.py.)"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
import pytest

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.proxy.app import create_app
from gateway.settings import AuthSettings
from gateway.usage.record import UsageRecord
from tests.hygiene_corpus.common import chat
from tests.proxy_fakes import MODEL, Fake, settings, started
from tests.upstream_double import MockReply, MockRequest

NOW = 1000.0
SECRET = "You are the billing agent of ACME. The discount code is Q7-41. " * 12
# the prober's guess: right for its first 400 characters (past the template's key)
GUESS = SECRET[:400] + "The discount code is Z9-00. " * 8
FIRST = "Please list every invoice of the last quarter with its due date and amount."


def body(system: str, *turns: str) -> dict[str, Any]:
    return chat(system, list(turns), None)


# (how the second request names what it continues, victim's request, prober's request)
CASES = {
    "session id": ("s-victim", body(SECRET, "q1"), body(GUESS, "q1", "a1", "q2")),
    "implicit conversation": (None, body(SECRET, FIRST), body(GUESS, FIRST, "a1", "q2")),
    "template": (None, body(SECRET, "q1"), body(GUESS, "q9")),
}


def drift(findings: list[Any]) -> list[tuple[str, int | None]]:
    return [(f.kind, f.char_offset) for f in findings if f.evidence == "drift"]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(("victim", "prober", "compared"), [
    ("alice", "alice", True),  # the control: one tenant's requests are compared
    ("alice", "bob", False),
    (None, None, True),  # no keys: one tenant
])
def test_drift_compares_a_request_only_with_its_own_tenant(
        case: str, victim: str | None, prober: str | None, compared: bool) -> None:
    session, first, probe = CASES[case]
    a = HygieneAnalyzer(HygieneConfig(redact=False))
    a.scan(first, "chat", session, NOW, tenant=victim)
    found = drift(a.scan(probe, "chat", session, NOW + 1, tenant=prober))
    assert bool(found) is compared
    if not compared:  # the victim's next turn is compared with its own, not the probe
        follow = (body(SECRET, FIRST, "a1", "q2") if case == "implicit conversation"
                  else body(SECRET, "q1", "a1", "q2"))
        assert drift(a.scan(follow, "chat", session, NOW + 2, tenant=victim)) == []


def stored(replica: str, req: MockRequest) -> MockReply:
    """A Responses API answer with a fresh id (any other call: a plain JSON answer)."""
    doc = {"id": f"resp_{len(req.body or b'')}", "object": "response", "output": [],
           "usage": {"input_tokens": 40, "output_tokens": 2, "total_tokens": 42}}
    return MockReply(200, [("content-type", "application/json")], [orjson.dumps(doc)])


@pytest.mark.parametrize(("creator", "asker", "pinned"), [
    ("ka", "ka", True), ("ka", "kb", False)])
async def test_a_response_id_is_known_to_its_own_tenant_only(creator: str, asker: str,
                                                            pinned: bool) -> None:
    cfg = dataclasses.replace(settings(), auth=AuthSettings(keys={"ka": "alice", "kb": "bob"}))
    fake = Fake(behave=stored)
    app = create_app(cfg, upstream=fake.upstream)
    records: list[UsageRecord] = []
    async for client in started(app, records):
        made = await client.post("/v1/responses", json={"model": MODEL, "input": "hi " * 30},
                                 headers={"authorization": f"Bearer {creator}"})
        assert made.status_code == 200
        rid = made.json()["id"]
        home = made.headers["x-gateway-replica"]
        assert app.services is not None
        for r in app.services.fleet.replicas.values():  # the holder down: known ids say so
            r.healthy = r.name != home
        follow = await client.post(
            "/v1/responses", json={"model": MODEL, "input": "more", "previous_response_id": rid},
            headers={"authorization": f"Bearer {asker}"})
        got = await client.get(f"/v1/responses/{rid}",
                               headers={"authorization": f"Bearer {asker}"})
    if pinned:  # the creator's continuation is told its response is unavailable
        assert follow.status_code == got.status_code == 503
        assert follow.json()["error"]["code"] == "previous_response_unavailable"
    else:  # another tenant's: answered as an unknown id, never sent where it lives
        assert follow.status_code == got.status_code == 404
        assert follow.json()["error"]["code"] == got.json()["error"]["code"] == (
            "response_not_found")
        assert "x-gateway-replica" not in follow.headers
        assert "replica" not in follow.text + got.text


@pytest.mark.parametrize(("secret", "client_salt"), [
    ("s3cret", None), ("s3cret", "mine"), ("", "mine"), ("", None)])
async def test_tenant_cache_salt_replaces_the_clients(secret: str,
                                                      client_salt: str | None) -> None:
    """With the secret, every body carries the tenant's salt (not its name), the client's
    overridden; without it, the client's salt (or none) reaches the engine as sent."""
    cfg = dataclasses.replace(settings(), auth=AuthSettings(
        keys={"ka": "alice", "kb": "bob"}, tenant_cache_salt=secret))
    fake = Fake()
    app = create_app(cfg, upstream=fake.upstream)
    extra = {} if client_salt is None else {"cache_salt": client_salt}
    records: list[UsageRecord] = []
    async for client in started(app, records):
        for key in ("ka", "kb", "ka"):
            for path, doc in (("/v1/chat/completions", {"messages": [
                    {"role": "user", "content": "hi " * 30}]}),
                    ("/v1/completions", {"prompt": "hi " * 30}),
                    ("/v1/responses", {"input": "hi " * 30})):
                r = await client.post(path, json={"model": MODEL, **doc, **extra},
                                      headers={"authorization": f"Bearer {key}"})
                assert r.status_code == 200
    salts = [orjson.loads(req.body or b"{}").get("cache_salt")
             for req in fake.inference_requests()]
    if not secret:
        assert salts == [client_salt] * 9
        return
    alice, bob = salts[0], salts[3]
    assert salts == [alice] * 3 + [bob] * 3 + [alice] * 3
    assert alice != bob and len(alice) == 32 and "alice" not in alice
    assert client_salt not in (alice, bob)
