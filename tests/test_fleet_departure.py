"""A replica leaving the fleet, the pure parts by tables: the fleet's setters for a name that
left, `depart` reaching every part, the metrics of a departed replica, /stats rows, the
token mode's view, and the walk (`names_held`) that the app-level tests
(test_fleet_departure_in_flight.py) rely on to find a name left in any map."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from gateway.events.kvindex import KVIndex
from gateway.events.tokenmode import TokenMode
from gateway.proxy.closing import ClosingPeers
from gateway.replicas.departure import depart, origin
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.upstream.counters import UpstreamCounters
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.record import UsageRecord
from gateway.usage.snapshot import EngineSnapshot
from gateway.usage.stats import UsageWindows
from tests.held_names import names_held
from tests.proxy_fakes import MODEL

# -- the fleet's setters for a name that left ----------------------------------------------

def _snapshot() -> EngineSnapshot:
    return EngineSnapshot(ts=1.0, kv_cache_usage=0.5, num_requests_running=1.0,
                          num_requests_waiting=1.0, prefix_cache_queries_total=2.0,
                          prefix_cache_hits_total=1.0, prompt_tokens_total=3.0,
                          generation_tokens_total=4.0, num_gpu_blocks=10, block_size=16)


SNAP = _snapshot()

SETTERS: list[tuple[str, Callable[[Fleet], object], object]] = [
    ("probe ok", lambda f: f.probe_result("a", True, 1.0), None),
    ("probe failed", lambda f: f.probe_result("a", False, 1.0), None),
    ("start time", lambda f: f.set_start_time("a", 5.0), False),
    ("models", lambda f: f.set_models("a", [{"id": MODEL}]), None),
    ("snapshot", lambda f: f.set_snapshot("a", SNAP, 1.0, 2), False),
]


@pytest.mark.parametrize(("what", "call", "returns"), SETTERS, ids=[s[0] for s in SETTERS])
def test_a_setter_for_a_name_that_left_changes_nothing(
        what: str, call: Callable[[Fleet], object], returns: object) -> None:
    fleet = Fleet([ReplicaSettings(name="a", url="http://a:1"),
                   ReplicaSettings(name="b", url="http://b:1")])
    left = fleet.remove("a")
    assert left is not None
    assert call(fleet) == returns
    assert list(fleet.replicas) == ["b"]
    assert (left.healthy, left.failures, left.models, left.snapshot) == (False, 0, None, None)


@pytest.mark.parametrize(("change", "holds"), [
    ("none", True),
    ("removed", False),
    ("replaced by a replica of the same name", False),
])
def test_holds(change: str, holds: bool) -> None:
    fleet = Fleet([ReplicaSettings(name="a", url="http://a:1")])
    replica = fleet.replicas["a"]
    if change != "none":
        fleet.remove("a")
    if change.startswith("replaced"):
        fleet.add(ReplicaSettings(name="a", url="http://a:2"))
    assert fleet.holds(replica) is holds


# -- depart: one call, every part ----------------------------------------------------------

class Retains:
    def __init__(self) -> None:
        self.told: list[frozenset[str]] = []

    def retain_origins(self, live: Iterable[str]) -> None:
        self.told.append(frozenset(live))


FLEET = {"a": "http://10.0.0.1:8000", "b": "http://10.0.0.2:8000",
         "c": "http://10.0.0.1:8000/v1", "d": "http://[fd00::4]:8000"}


@pytest.mark.parametrize(("name", "left", "live_origins"), [
    ("b", True, {"http://10.0.0.1:8000", "http://[fd00::4]:8000"}),
    # a shares its origin with c: the origin stays live
    ("a", True, {"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://[fd00::4]:8000"}),
    ("d", True, {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}),
    ("zz", False, None),  # no such replica: nothing is told
])
def test_depart(name: str, left: bool, live_origins: set[str] | None) -> None:
    fleet = Fleet([ReplicaSettings(name=n, url=u) for n, u in FLEET.items()])
    calls: list[tuple[str, str]] = []
    parts = [lambda n, i=i: calls.append((str(i), n)) for i in range(3)]
    pools = [Retains(), Retains()]
    gone = depart(fleet, name, parts, pools)  # type: ignore[arg-type]
    assert (gone is not None) is left
    assert name not in fleet.replicas
    if left:
        assert calls == [("0", name), ("1", name), ("2", name)]
        assert [p.told for p in pools] == [[frozenset(live_origins or ())]] * 2
    else:
        assert calls == [] and [p.told for p in pools] == [[], []]


@pytest.mark.parametrize(("url", "want"), [
    ("http://10.0.0.1:8000", "http://10.0.0.1:8000"),
    ("http://10.0.0.1:8000/v1/", "http://10.0.0.1:8000"),
    ("HTTP://Host.Example:8000", "http://host.example:8000"),
    ("http://[fd00::4]:8000", "http://[fd00::4]:8000"),
    ("https://h", "https://h"),
])
def test_origin_is_the_client_pools_key(url: str, want: str) -> None:
    assert origin(url) == want


def test_a_departed_peers_closing_record_goes() -> None:
    closing = ClosingPeers(after=2)
    for peer in (("10.0.0.1", 8000), ("10.0.0.2", 8000)):
        closing.checked(peer, False)
        closing.checked(peer, False)
        assert closing.keep(peer) is False  # learnt: closes after every answer
    closing.forget(("10.0.0.1", 8000))
    assert names_held(closing, ["10.0.0.1"]) == []
    assert closing.keep(("10.0.0.1", 8000)) is True  # a new replica there starts afresh
    assert closing.keep(("10.0.0.2", 8000)) is False


# -- metrics and /stats rows of a departed replica -----------------------------------------

def _record(replica: str | None, **kw: Any) -> UsageRecord:
    base: dict[str, Any] = dict(
        ts=100.0, request_id="r", model=MODEL, replica=replica, tenant=None, route="cold",
        status=200, stream=True, prompt_tokens=40, cached_tokens=None,
        predicted_cached_tokens=8, best_available_tokens=8, completion_tokens=2,
        latency_ms=5.0, ttft_ms=1.0, session=None)
    base.update(kw)
    return UsageRecord(**base)


def _series(metrics: GatewayMetrics, label: str = "replica") -> dict[str, set[str]]:
    """Replica label value -> the families with a series of it."""
    out: dict[str, set[str]] = {}
    for line in metrics.render().decode().splitlines():
        if line.startswith("#") or f'{label}="' not in line:
            continue
        value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
        out.setdefault(value, set()).add(line.split("{", 1)[0])
    return out


def test_remove_replica_drops_every_series_labelled_by_it() -> None:
    live = {"a", "b"}
    metrics = GatewayMetrics(live=live.__contains__)
    counters = UpstreamCounters(metrics.registry)  # another module's families, same registry
    for name in ("a", "b"):
        metrics.observe(_record(name))  # cached_tokens None: the "without" counter too
        metrics.observe(_record(name, stream=False, cached_tokens=20))
        metrics.replica_state(name, True, 1, _snapshot())
        counters.failure(name, "pool_busy")
        counters.retried(name)
    before = _series(metrics)
    assert before["a"] == before["b"] and len(before["a"]) >= 20, before
    live.discard("a")
    metrics.remove_replica("a")
    after = _series(metrics)
    assert "a" not in after and after["b"] == before["b"]
    # a request that ends after its replica left: counted, never as a series of it again
    metrics.observe(_record("a"))
    after = _series(metrics)
    assert "a" not in after and "departed" in after
    # a new replica of the same name starts from new series (no stale cached child)
    live.add("a")
    metrics.observe(_record("a"))
    text = metrics.render().decode()
    assert 'gateway_requests_total{model="m1",replica="a",route="cold",status="200",' \
           'tenant="none"} 1.0' in text


def test_a_departed_replicas_stats_rows_count_as_departed() -> None:
    windows = UsageWindows(bucket_s=10.0, horizon_s=20.0)
    windows.add(_record("a", ts=5.0))  # will be archived (since start)
    windows.add(_record("b", ts=5.0))
    windows.add(_record("a", ts=100.0))
    windows.add(_record("departed", ts=100.0))
    windows.forget_replica("a")
    whole = windows.summary(100.0, None)["by_replica"]
    assert "a" not in whole
    assert whole["departed"]["requests"] == 3 and whole["b"]["requests"] == 1
    assert all("a" not in s["by_replica"] for s in windows.series())


def test_the_token_modes_view_goes_with_the_replica() -> None:
    index = KVIndex()
    tokens = TokenMode({}, index)
    router = Router(RoutingConfig(), tokens)
    for name in ("a", "b"):
        router.add_replica(name)
        index.add_replica(name, MODEL, 16)
        index.set_connected(name, True, 1.0)
        tokens._live[name] = True  # what a lookup with a renderer learns
    router.remove_replica("a")
    assert index.state("a") is None and index.state("b") is not None
    assert names_held(router, ["a"]) == [] and names_held(router, ["b"]) != []


def test_the_walk_finds_a_name_in_each_kind_of_place() -> None:
    class Slotted:
        __slots__ = ("x",)

        def __init__(self, x: object) -> None:
            self.x = x

    class Plain:
        def __init__(self) -> None:
            self.keys = {"a": 1}
            self.values = {1: "a"}
            self.members = {"a"}
            self.items = deque([("x", "a")])
            self.inner = Slotted(["a"])
            self.clean = {"b": "c"}

    assert sorted(names_held(Plain(), ["a"])) == sorted([
        "services.keys[key]", "services.values[1]", "services.members[0]",
        "services.items[0][1]", "services.inner.x[0]"])
