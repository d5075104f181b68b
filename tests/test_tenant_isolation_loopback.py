"""Two tenants on a real `gateway serve` in front of `gateway sim` replicas, over loopback.

The table: alice (key `ka`) sends every endpoint a prompt whose system part she alone
knows, naming her session, user and request ids; bob (key `kb`) then sends every endpoint
a prompt that shares it. Nothing bob reads (his answers' headers, his errors, `/stats` as
JSON and HTML, `/metrics`), nor anything a caller without a key reads with
`public_metrics = true`, names alice's tenant, sessions, users or request ids, or tells bob
that a prefix of his prompt was sent before: his predictions count only what his own
tenant put in the cache. The admin key (`kops`) reads alice's rows: the control.

The differential: bob's headers are the same whether alice sent his prefix before or
another one of the same length, with `[auth] keys` set; with `tenant_cache_salt` the
engine-derived ones are the same too. The headers that differ per request whatever the
tenants do are named in `PER_REQUEST`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.servers import gateway, sim

KEYS = "ka=alice,kb=bob,kops=ops"
BASE_ENV = {"GATEWAY_AUTH__KEYS": KEYS, "GATEWAY_AUTH__ADMIN_TENANTS": "ops",
            "GATEWAY_AUTH__PUBLIC_METRICS": "true", "GATEWAY_ADMISSION__ENABLED": "true",
            "GATEWAY_HEALTH_INTERVAL_S": "0.5", "GATEWAY_USAGE__SCRAPE_INTERVAL_S": "0.5"}
# What alice's traffic names: every such value contains "alice".
ALICE = re.compile(r"alice", re.IGNORECASE)
# The prefix alice sends: long enough for whole blocks, with a timestamp (a hygiene
# finding naming her session in /stats' latest findings).
SECRET = ("Updated 2026-01-05T10:00:00Z. You are the payroll agent of a shop; the vault "
          "code is 4471. " + "Follow the payroll rules exactly. " * 60)
OTHER = ("Updated 2026-01-05T10:00:00Z. You are the garden agent of a shop; the shed "
         "code is 9902. " + "Follow the gardening rules closely. " * 60)[:len(SECRET)]
# Headers that differ from one request to the next whatever anyone sent before.
PER_REQUEST = frozenset({"x-request-id", "x-gateway-request-id", "date",
                         "x-gateway-queue-ms"})
# Headers the engine's own cache decides (its timing, the length of a body carrying its
# cached token count): the same across tenants only where the engines' caches are
# isolated (`tenant_cache_salt`), as the gateway cannot make them so otherwise.
ENGINE = frozenset({"content-length", "x-sim-timing"})


def body(endpoint: str, system: str, model: str, user: str) -> dict[str, Any]:
    question = "What is due this week?"
    if endpoint == "chat":
        return {"model": model, "user": user, "max_tokens": 4, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question}]}
    if endpoint == "completions":
        return {"model": model, "user": user, "max_tokens": 4,
                "prompt": system + "\n" + question}
    if endpoint == "responses":
        return {"model": model, "user": user, "max_output_tokens": 4, "instructions": system,
                "input": question}
    return {"model": model, "max_tokens": 4, "system": system, "metadata": {"user_id": user},
            "messages": [{"role": "user", "content": question}]}


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses", "messages": "/v1/messages"}


def send(c: httpx.Client, url: str, key: str, who: str, endpoint: str, system: str,
         model: str, n: int) -> httpx.Response:
    return c.post(url + PATHS[endpoint], json=body(endpoint, system, model, f"{who}-user-{n}"),
                  headers={"authorization": f"Bearer {key}", "x-request-id": f"{who}-rid-{n}",
                           "x-session-id": f"{who}-session-{n}"})


def model_of(c: httpx.Client, url: str) -> str:
    r = c.get(url + "/v1/models", headers={"authorization": "Bearer kb"})
    return str(r.json()["data"][0]["id"])


@contextlib.contextmanager
def stack(env: dict[str, str], names: list[str] | None = None
          ) -> Iterator[tuple[str, httpx.Client]]:
    """`names` receives the replicas' names (host:port, as x-gateway-replica says)."""
    with sim(2) as urls, gateway(urls, env={**BASE_ENV, **env}) as url, \
            httpx.Client(timeout=30) as c:
        if names is not None:
            names.extend(u.removeprefix("http://") for u in urls)
        yield url, c


def readable(c: httpx.Client, url: str, key: str | None) -> str:
    """Everything `key` (None: no key) reads of the gateway's own state."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    parts = []
    for path in ("/stats", "/stats?format=html", "/metrics"):
        r = c.get(url + path, headers=headers)
        assert r.status_code == 200, (path, r.text)
        parts.append(r.text)
    return "\n".join(parts)


def shown(r: httpx.Response) -> str:
    return "\n".join(f"{k}: {v}" for k, v in r.headers.items()) + "\n" + (
        r.text if r.status_code >= 400 else "")


@pytest.mark.parametrize("salt", [False, True], ids=["keys", "keys + tenant_cache_salt"])
def test_what_a_second_tenant_reads_names_nothing_of_the_first(salt: bool) -> None:
    env = {"GATEWAY_AUTH__TENANT_CACHE_SALT": "s3cret"} if salt else {}
    with stack(env) as (url, c):
        model = model_of(c, url)
        stored = ""
        for n, endpoint in enumerate(PATHS):
            for turn in range(2):  # a second turn: alice's prefix is in the index
                r = send(c, url, "ka", "alice", endpoint, SECRET, model, 10 * n + turn)
                assert r.status_code == 200, (endpoint, r.text)
                stored = r.json()["id"] if endpoint == "responses" else stored
        # alice's errors too: an unknown model, a bad body
        send(c, url, "ka", "alice", "chat", SECRET, "no-such-model", 90)
        c.post(url + "/v1/chat/completions", content=b"{", headers={
            "authorization": "Bearer ka", "x-request-id": "alice-rid-91"})
        seen = []
        for n, endpoint in enumerate(PATHS):
            r = send(c, url, "kb", "bob", endpoint, SECRET, model, n)
            assert r.status_code == 200, (endpoint, r.text)
            seen.append(shown(r))
            if n == 0:  # bob's first request: nothing of alice's prefix is predicted
                assert "predicted=0" in r.headers["x-gateway-cache"], r.headers
        for bad in (send(c, url, "kb", "bob", "chat", SECRET, "no-such-model", 7),
                    c.post(url + "/v1/chat/completions", content=b"{",
                           headers={"authorization": "Bearer kb"}),
                    c.get(url + f"/v1/responses/{stored}", headers={
                        "authorization": "Bearer kb"}),
                    c.post(url + "/v1/responses", headers={"authorization": "Bearer kb"},
                           json={"model": model, "input": "go on",
                                 "previous_response_id": stored})):
            assert bad.status_code in (400, 404), bad.text
            # answered by the gateway: alice's stored response is never fetched for bob
            assert "x-gateway-replica" not in bad.headers
            seen.append(shown(bad))
        seen.append(readable(c, url, "kb"))
        seen.append(readable(c, url, None))
        for text in seen:
            assert not ALICE.search(text), ALICE.findall(text)[:3]
        assert "bob" in readable(c, url, "kb")  # bob reads his own rows
        assert ALICE.search(readable(c, url, "kops"))  # the control: the admin reads hers


def bob_after(alice_sent: str, env: dict[str, str]) -> list[dict[str, str]]:
    """Bob's answers' headers on a fresh stack after alice sent `alice_sent` on every
    endpoint (twice: her prefix is in the index and the engine's cache)."""
    out = []
    names: list[str] = []
    with stack(env, names) as (url, c):
        model = model_of(c, url)
        for n, endpoint in enumerate(PATHS):
            for turn in range(2):
                r = send(c, url, "ka", "alice", endpoint, alice_sent, model, 10 * n + turn)
                assert r.status_code == 200
        for n, endpoint in enumerate(PATHS):
            r = send(c, url, "kb", "bob", endpoint, SECRET, model, n)
            assert r.status_code == 200
            h = dict(r.headers.items())
            # the replica by its place in the fleet (each stack has its own ports)
            h["x-gateway-replica"] = f"replica {names.index(h['x-gateway-replica'])}"
            out.append(h)
    return out


@pytest.mark.parametrize("salt", [False, True], ids=["keys", "keys + tenant_cache_salt"])
def test_a_second_tenants_headers_do_not_depend_on_the_first_tenants_prefix(
        salt: bool) -> None:
    env = {"GATEWAY_AUTH__TENANT_CACHE_SALT": "s3cret"} if salt else {}
    same = bob_after(SECRET, env)
    other = bob_after(OTHER, env)

    def kept(endpoint: str, h: dict[str, str]) -> dict[str, str]:
        # vLLM's Messages endpoint takes no cache_salt (nor does the simulator's): its
        # engine cache stays shared, so its engine-derived headers are left out there too
        engine = not salt or endpoint == "messages"
        ignored = PER_REQUEST | ENGINE if engine else PER_REQUEST
        return {k: v for k, v in h.items() if k not in ignored}

    assert ([kept(e, h) for e, h in zip(PATHS, same, strict=True)]
            == [kept(e, h) for e, h in zip(PATHS, other, strict=True)])
    assert all("x-gateway-cache" in h and "x-gateway-replica" in h for h in same)
