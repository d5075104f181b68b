"""Replica sources and membership, their pure decisions (gateway.replicas.membership,
gateway.replicas.sources): what joins, leaves, rejoins; when a leaving replica departs;
DNS answers as replicas; and the real `getaddrinfo` path on localhost."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.replicas.fleet import Fleet
from gateway.replicas.membership import Member, departure_due, overflow, plan, union
from gateway.replicas.sources import DnsWatch, dns_members, getaddrinfo
from gateway.settings import DiscoverySettings, ReplicaSettings, host_port, parse_settings
from gateway.tasks import FailureLog


def rs(name: str, url: str | None = None, **kw: object) -> ReplicaSettings:
    return ReplicaSettings(name=name, url=url or f"http://{name}.test:8000", **kw)  # type: ignore[arg-type]


A, B, C = rs("a"), rs("b"), rs("c")


@pytest.mark.parametrize(("current", "wanted", "expected"), [
    ({}, {"a": A}, {"join": ("a",)}),
    ({"a": Member(A)}, {"a": A}, {}),
    ({"a": Member(A), "b": Member(B)}, {"a": A}, {"leave": ("b",)}),
    # leaving already: not left again
    ({"a": Member(A), "b": Member(B, leaving=True)}, {"a": A}, {}),
    # a flap: listed again at the same URL
    ({"b": Member(B, leaving=True)}, {"b": B}, {"rejoin": ("b",)}),
    # another server under the name
    ({"a": Member(A)}, {"a": rs("a", "http://other:1")}, {"replace": ("a",)}),
    ({"a": Member(A, leaving=True)}, {"a": rs("a", "http://other:1")}, {"replace": ("a",)}),
    # the same server, another key
    ({"a": Member(A)}, {"a": rs("a", api_key="k")}, {"update": ("a",)}),
    ({"a": Member(A, leaving=True)}, {"a": rs("a", capacity_tokens=9)},
     {"rejoin": ("a",), "update": ("a",)}),
    ({"a": Member(A), "b": Member(B)}, {"b": B, "c": C}, {"join": ("c",), "leave": ("a",)}),
])
def test_plan(current: dict[str, Member], wanted: dict[str, ReplicaSettings],
              expected: dict[str, tuple[str, ...]]) -> None:
    got = plan(current, wanted)
    names = {k: tuple(x if isinstance(x, str) else x.name for x in getattr(got, k))
             for k in ("join", "leave", "rejoin", "replace", "update")}
    assert {k: v for k, v in names.items() if v} == expected


def test_union_first_source_wins() -> None:
    static = rs("x", "http://static:1")
    assert union({"static": {"x": static}, "dns:n:1": {"x": rs("x"), "c": C}}) == {
        "x": static, "c": C}


@pytest.mark.parametrize(("waited", "in_flight", "grace", "drain", "due"), [
    (0.0, 0, 0.0, 10.0, True),  # no grace, nothing in flight: at once
    (0.0, 1, 0.0, 10.0, False),  # draining
    (9.9, 1, 0.0, 10.0, False),
    (10.0, 1, 0.0, 10.0, True),  # the drain timeout bounds it
    (4.9, 0, 5.0, 10.0, False),  # the grace period keeps it (a flap keeps its state)
    (5.0, 0, 5.0, 10.0, True),
    (5.0, 2, 5.0, 10.0, False),
    (10.0, 2, 30.0, 10.0, True),  # the drain timeout bounds the grace period too
])
def test_departure_due(waited: float, in_flight: int, grace: float, drain: float,
                       due: bool) -> None:
    assert departure_due(100.0, 100.0 + waited, in_flight, grace, drain) is due


def test_overflow_takes_the_oldest() -> None:
    assert overflow({"a": 3.0, "b": 1.0, "c": 2.0}, 1) == ["b", "c"]
    assert overflow({"a": 3.0}, 1) == []


@pytest.mark.parametrize(("answers", "port", "bound", "names"), [
    (["10.0.0.2", "10.0.0.1", "10.0.0.2"], 8000, 8, ["10.0.0.1:8000", "10.0.0.2:8000"]),
    (["fd00::1", "10.0.0.9"], 80, 8, ["10.0.0.9:80", "[fd00::1]:80"]),
    # bounded: the lowest addresses, whatever order DNS answers in
    (["10.0.0.3", "10.0.0.1", "10.0.0.2"], 1, 2, ["10.0.0.1:1", "10.0.0.2:1"]),
    (["not-an-ip", "fe80::1%eth0", "10.0.0.10", "10.0.0.9"], 1, 8,
     ["10.0.0.9:1", "10.0.0.10:1"]),
    ([], 1, 8, []),
])
def test_dns_members(answers: list[str], port: int, bound: int, names: list[str]) -> None:
    got = dns_members(answers, port, bound, api_key="k")
    assert list(got) == names
    for name, replica in got.items():
        assert replica.name == name and replica.url == f"http://{name}"
        assert replica.api_key == "k"


@pytest.mark.parametrize(("text", "ok"), [
    ("vllm:8000", ("vllm", 8000)), ("[::1]:9", ("::1", 9)), ("a.b.svc:1", ("a.b.svc", 1)),
    ("vllm", None), ("vllm:0", None), ("vllm:65536", None), (":80", None), ("v:x", None),
    # RFC 1123 lengths: a label of 63 octets, a name of 253, a final dot; an IDNA name
    ("a" * 63 + ".svc:1", ("a" * 63 + ".svc", 1)), ("a" * 64 + ".svc:1", None),
    (".".join(["a" * 63] * 3 + ["b" * 61]) + ":1", (".".join(["a" * 63] * 3 + ["b" * 61]), 1)),
    (".".join(["a" * 63] * 3 + ["b" * 62]) + ":1", None),
    ("vllm.svc.:1", ("vllm.svc.", 1)), ("a..b:1", None),
    ("bücher.example:1", ("bücher.example", 1)),
    ("[2001:db8::1]:80", ("2001:db8::1", 80)), ("10.0.0.1:80", ("10.0.0.1", 80)),
])
def test_host_port(text: str, ok: tuple[str, int] | None) -> None:
    if ok is None:
        with pytest.raises(ValueError):
            host_port(text)
    else:
        assert host_port(text) == ok


def test_discovery_settings_from_file_and_env() -> None:
    s = parse_settings('[discovery]\ndns = ["vllm:8000"]\ngrace_s = 2\n',
                       {"GATEWAY_DISCOVERY__DRAIN_TIMEOUT_S": "7"})
    assert s.discovery.dns == ("vllm:8000",)
    assert (s.discovery.grace_s, s.discovery.drain_timeout_s) == (2.0, 7.0)
    with pytest.raises(ValueError):
        DiscoverySettings(dns=("vllm",))
    with pytest.raises(ValueError):
        DiscoverySettings(grace_s=-1)


def test_a_leaving_replica_stays_down_until_it_rejoins() -> None:
    fleet = Fleet([A])
    assert fleet.probe_result("a", True, 1.0) == "up"
    assert fleet.leave("a", 2.0) and not fleet.replicas["a"].healthy
    assert not fleet.leave("a", 3.0)  # once
    assert fleet.probe_result("a", True, 3.0) is None  # no probe brings it back
    assert fleet.healthy() == []
    assert fleet.rejoin("a")
    assert fleet.probe_result("a", True, 4.0) == "up"
    assert fleet.replicas["a"].down_since is None  # nothing to forget: memory kept


async def test_real_getaddrinfo_on_localhost() -> None:
    """The production resolver (the seam's other side): localhost's loopback address."""
    found = dns_members(await getaddrinfo("localhost", 8000), 8000, 8)
    assert set(found) & {"127.0.0.1:8000", "[::1]:8000"}, found
    with pytest.raises(OSError):
        await getaddrinfo("no-such-name.invalid", 8000)


async def test_a_failed_resolution_keeps_the_last_set(caplog: pytest.LogCaptureFixture) -> None:
    answers: list[str] | None = ["10.0.0.1"]
    published: list[dict[str, ReplicaSettings]] = []

    async def resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("vllm", 8000)
        if answers is None:
            raise OSError("temporary failure in name resolution")
        return answers

    watch = DnsWatch("vllm:8000", DiscoverySettings(dns=("vllm:8000",)), resolve,
                     lambda source, found: published.append(found),
                     FailureLog(logging.getLogger("test")))
    await watch.refresh()
    answers = None
    caplog.set_level(logging.WARNING)
    await watch.refresh()
    await watch.refresh()
    assert [list(p) for p in published] == [["10.0.0.1:8000"]]  # nothing published: kept
    assert sum("not resolved" in r.getMessage() for r in caplog.records) == 1  # said once
    answers = []
    await watch.refresh()
    assert published[-1] == {}  # an answer with no address empties it
    await asyncio.sleep(0)


def test_a_joining_replica_goes_up_only_once_joined() -> None:
    fleet = Fleet([])
    joiner = fleet.add(A, joining=True)
    assert fleet.probe_result("a", True, 1.0) is None and not joiner.healthy
    fleet.joined(joiner)
    assert fleet.probe_result("a", True, 2.0) == "up"
