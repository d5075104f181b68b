"""Tenants in token mode (`[tokens]`: routing by the engines' own KV events), on loopback:
`gateway sim --kv-events` replicas, a real `gateway serve`, three keys (alice, bob, the
admin `ops`).

Without `[auth] tenant_cache_salt` the engines' caches are shared by every tenant, so the
gateway routes on the shared index (a prefix another tenant sent is found where the engine
holds it), and withholds from non-admin keys whatever of an answer derives from that
index: `x-gateway-replica`, `predicted=` and the route reason (`withheld`). With the salt,
the salt keys both the engines' blocks and the index: each tenant's own prefixes are
predicted and shown. Either way, what bob reads (his headers, `/stats`' `token_mode`) is
the same whether or not alice sent his prefix before: the differential.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.servers import free_ports, gateway, sim
from tests.test_tenant_isolation_loopback import ENGINE, OTHER, PER_REQUEST, SECRET

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

ENV = {"GATEWAY_TOKENS__MODELS": "sim=sim", "GATEWAY_AUTH__KEYS": "ka=alice,kb=bob,kops=ops",
       "GATEWAY_AUTH__ADMIN_TENANTS": "ops", "GATEWAY_AUTH__PUBLIC_METRICS": "true"}
SALT = {"GATEWAY_AUTH__TENANT_CACHE_SALT": "s3cret"}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# What alice sends instead of bob's prefix: of its length, sharing not one block with it
# (OTHER shares its first words, a whole block, with SECRET)
ELSE = "Revised" + OTHER[len("Updated"):]


def body(endpoint: str, system: str) -> dict[str, Any]:
    if endpoint == "chat":
        return {"model": "sim", "max_tokens": 4, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "Go on."}]}
    return {"model": "sim", "max_tokens": 4, "prompt": system + "\nGo on."}


def send(c: httpx.Client, url: str, key: str, endpoint: str, system: str) -> httpx.Response:
    r = c.post(url + PATHS[endpoint], json=body(endpoint, system),
               headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r


def token_mode(c: httpx.Client, url: str, key: str | None) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    got: dict[str, Any] = c.get(url + "/stats", headers=headers).json().get("token_mode", {})
    return got


@contextlib.contextmanager
def stack(env: dict[str, str]) -> Iterator[tuple[str, httpx.Client, list[str]]]:
    """The gateway's URL, a client, and the replicas' URLs."""
    kv = free_ports(4)
    with sim(2, ["--model", "sim", "--speed", "200", "--kv-events", "--kv-events-port",
                 str(kv), "--dev-mode"]) as urls, \
            gateway(urls, ["--policy", "prefix"], env={**ENV, **env}) as url, \
            httpx.Client(timeout=30) as c:
        deadline = time.monotonic() + 20
        while sum(r.get("state") == "live"
                  for r in token_mode(c, url, "kops").get("replicas", {}).values()) < 2:
            assert time.monotonic() < deadline, token_mode(c, url, "kops")
            time.sleep(0.1)
        yield url, c, urls


def held(c: httpx.Client, url: str, replica: str | None = None) -> int:
    """Blocks the index holds from the engines' events (on `replica`, or on all)."""
    return sum(int(r["held_blocks"]) for k, r in token_mode(c, url, "kops")["replicas"].items()
               if replica is None or "http://" + k == replica)


def flush(c: httpx.Client, url: str, urls: list[str]) -> None:
    """Every replica's events up to now are in the index: a marker prompt sent to each
    replica directly, until its blocks arrive (each replica's events come in order)."""
    for i, replica in enumerate(urls):
        before = held(c, url, replica)
        r = c.post(replica + "/v1/completions", json={
            "model": "sim", "max_tokens": 1, "prompt": f"Marker {i}. " + "Noted. " * 80})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 10
        while held(c, url, replica) <= before:
            assert time.monotonic() < deadline, "the marker's blocks never arrived"
            time.sleep(0.05)


def per_replica(c: httpx.Client, url: str) -> dict[str, int]:
    return {k: int(r["held_blocks"])
            for k, r in token_mode(c, url, "kops")["replicas"].items()}


def warm(c: httpx.Client, url: str, key: str, endpoint: str, system: str) -> str:
    """`key` sends `system` until the engines' events put its blocks in the index; the
    replica that stored them."""
    before = per_replica(c, url)
    send(c, url, key, endpoint, system)
    deadline = time.monotonic() + 10
    while True:
        grew = [k for k, n in per_replica(c, url).items() if n > before[k]]
        if grew:
            return grew[0]
        assert time.monotonic() < deadline, "no BlockStored event arrived"
        time.sleep(0.05)


def predicted(r: httpx.Response) -> int | None:
    for item in r.headers["x-gateway-cache"].split(","):
        k, _, v = item.strip().partition("=")
        if k == "predicted":
            return int(v)
    return None


@pytest.mark.parametrize("endpoint", list(PATHS))
def test_without_the_salt_routing_finds_another_tenants_blocks_and_shows_them_to_no_key(
        endpoint: str) -> None:
    long = SECRET * 4  # so much cached prefill that spreading conversations gives way
    with stack({}) as (url, c, _urls):
        where = warm(c, url, "ka", endpoint, long)
        # a conversation on each replica: spreading new ones decides nothing below
        assert warm(c, url, "ka", endpoint, ELSE * 4) != where
        # the admin reads what routing decided: the engine's blocks, whoever sent them
        admin = send(c, url, "kops", endpoint, long)
        assert admin.headers["x-gateway-replica"] == where, admin.headers
        assert (predicted(admin) or 0) > 200 and "route=prefix" in admin.headers[
            "x-gateway-cache"], admin.headers
        # bob is routed the same way, and told nothing of it
        bob = send(c, url, "kb", endpoint, long)
        assert "x-gateway-replica" not in bob.headers
        assert bob.headers["x-gateway-route"] == "withheld"
        assert bob.headers["x-gateway-cache"] == "route=withheld", bob.headers


def bob_after(alice_sent: str, env: dict[str, str]) -> tuple[list[dict[str, str]],
                                                              list[dict[str, Any]]]:
    """Bob's headers, his own /stats figures and the `token_mode` section bob and a caller
    without a key read, after alice sent `alice_sent` on every endpoint (her blocks in the
    engines' events)."""
    headers, sections = [], []
    with stack(env) as (url, c, urls):
        names = [u.removeprefix("http://") for u in urls]
        for endpoint in PATHS:
            warm(c, url, "ka", endpoint, alice_sent)
            send(c, url, "ka", endpoint, alice_sent)
        for endpoint in PATHS:
            h = dict(send(c, url, "kb", endpoint, SECRET).headers.items())
            if "x-gateway-replica" in h:
                h["x-gateway-replica"] = f"replica {names.index(h['x-gateway-replica'])}"
            headers.append(h)
        flush(c, url, urls)  # bob's blocks, if he added any, are in the index
        # bob's own figures: without the salt, those of the engines' shared caches (also in
        # his answers' usage) vary; what the shared index decided is left out
        deadline = time.monotonic() + 10  # his records are written as his answers end
        while True:
            mine = c.get(url + "/stats", headers={"authorization": "Bearer kb"}).json()
            if mine["windows"]["all"]["by_tenant"].get("bob", {}).get("requests") == 2:
                break
            assert time.monotonic() < deadline, mine["windows"]["all"]
            time.sleep(0.05)
        engine = set() if "GATEWAY_AUTH__TENANT_CACHE_SALT" in env else {
            "cached_tokens", "cached_ratio"}
        sections.append({w: {k: v for k, v in d["by_tenant"]["bob"].items() if k not in engine}
                         for w, d in mine["windows"].items()})
        for key in ("kb", None):  # what routing decided, counted in /metrics
            auth = {"authorization": f"Bearer {key}"} if key else {}
            sections.append([line for line in c.get(url + "/metrics", headers=auth).text
                             .splitlines() if line.startswith(("gateway_routing_decisions",
                                                               "gateway_route_moves"))
                             and "_created" not in line])  # a series' creation time
        for key in ("kb", None):
            tm = token_mode(c, url, key)
            # the replicas by their place in the fleet; their event ports differ per stack
            tm["replicas"] = {f"replica {names.index(k)}": {
                f: v for f, v in r.items() if f != "sources"}
                for k, r in tm.get("replicas", {}).items()}
            sections.append(tm)
    return headers, sections


@pytest.mark.parametrize("salt", [False, True], ids=["keys", "keys + tenant_cache_salt"])
def test_token_mode_a_second_tenant_reads_the_same_whatever_the_first_sent(
        salt: bool) -> None:
    env = SALT if salt else {}
    same_h, same_s = bob_after(SECRET, env)
    other_h, other_s = bob_after(ELSE, env)
    ignored = PER_REQUEST if salt else PER_REQUEST | ENGINE

    def kept(h: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in h.items() if k not in ignored}

    assert [kept(h) for h in same_h] == [kept(h) for h in other_h]
    assert same_s == other_s
    if salt:  # the salt keys the index: bob's own routing is shown to him
        assert all("x-gateway-replica" in h for h in same_h)
    else:
        assert all("x-gateway-replica" not in h for h in same_h)


def test_with_the_salt_a_tenants_own_prefix_is_predicted_from_the_engines_blocks() -> None:
    with stack(SALT) as (url, c, _names):
        warm(c, url, "ka", "chat", SECRET)
        again = send(c, url, "ka", "chat", SECRET)
        assert (predicted(again) or 0) > 200, again.headers
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 200
        bob = send(c, url, "kb", "chat", SECRET)  # another tenant: nothing of hers
        assert predicted(bob) == 0, bob.headers
        assert bob.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
