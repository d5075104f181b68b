"""The admission queue's pure decisions, by tables: classes and caps, room, late binding,
fair shares in prompt tokens, shedding verdicts and Retry-After."""

from __future__ import annotations

import math

import pytest

from gateway.admission.config import AdmissionConfig, Priority
from gateway.admission.priority import ENGINE_PRIORITY, capped, requested, resolve
from gateway.admission.room import (
    ReplicaLoad,
    RoomLimits,
    bind,
    has_room,
    reserved,
    wait_estimate,
)
from gateway.admission.shares import FairShare, Flow, RecentTokens
from gateway.admission.shedding import Arrival, DrainRate, Shed, retry_after, verdict
from gateway.proxy.errors import GatewayError

LIMITS = RoomLimits(max_in_flight=4, max_queued_prefill_tokens=1000, kv_usage_limit=0.9)
PER_TOKEN = 0.001  # 1 ms per prefill token: easy arithmetic
IN_FLIGHT_S = 0.01


@pytest.mark.parametrize(("raw", "cls"), [
    (None, "normal"), (b"high", "high"), (b"normal", "normal"), (b"low", "low"),
    (b" HIGH ", "high"), (b"Low", "low"),
])
def test_requested_class(raw: bytes | None, cls: Priority) -> None:
    assert requested(raw) == cls


@pytest.mark.parametrize("raw", [b"", b"urgent", b"1", b"high,low", b"h" * 17,
                                 b"high" + b" " * 20, b"\xff"])
def test_bad_priority_header_is_a_400(raw: bytes) -> None:
    with pytest.raises(GatewayError) as err:
        requested(raw)
    assert err.value.status == 400
    assert err.value.payload()["error"]["param"] == "x-gateway-priority"


@pytest.mark.parametrize(("cls", "cap", "out"), [
    ("high", "high", "high"), ("high", "normal", "normal"), ("high", "low", "low"),
    ("normal", "low", "low"), ("low", "high", "low"), ("normal", "high", "normal"),
])
def test_a_key_cannot_raise_itself_above_its_cap(cls: Priority, cap: Priority,
                                                 out: Priority) -> None:
    assert capped(cls, cap) == out


@pytest.mark.parametrize(("raw", "tenant", "out"), [
    (b"high", "gold", "high"),  # its cap allows it
    (b"high", "free", "low"),  # capped
    (b"high", "other", "normal"),  # the default cap
    (b"high", None, "normal"),  # no tenant: the default cap
    (b"low", "gold", "low"),  # asking less is always allowed
])
def test_resolve_applies_the_tenant_cap(raw: bytes, tenant: str | None, out: Priority) -> None:
    caps: dict[str, Priority] = {"gold": "high", "free": "low"}
    assert resolve(raw, tenant, caps, "normal") == out


def test_engine_priority_leaves_normal_at_vllms_default() -> None:
    assert ENGINE_PRIORITY == {"high": -1, "normal": 0, "low": 1}


def load(name: str, in_flight: int = 1, queued: float = 0.0, kv: float | None = None,
         predicted: int = 0) -> ReplicaLoad:
    return ReplicaLoad(name, in_flight, queued, kv, predicted)


@pytest.mark.parametrize(("ld", "room"), [
    (load("a", in_flight=0, queued=5000, kv=1.0), True),  # idle always has room
    (load("a", in_flight=3), True),
    (load("a", in_flight=4), False),  # in-flight limit
    (load("a", queued=999), True),
    (load("a", queued=1000), False),  # queued prefill limit
    (load("a", kv=0.89), True),
    (load("a", kv=0.9), False),  # KV nearly full: preemption ahead
    (load("a", kv=None), True),  # unknown KV usage does not block
])
def test_room(ld: ReplicaLoad, room: bool) -> None:
    assert has_room(ld, LIMITS) is room


@pytest.mark.parametrize(("share", "in_flight", "queued"), [
    (0.75, 3, 750.0), (0.5, 2, 500.0), (1.0, 4, 1000.0), (0.01, 1, 10.0),
])
def test_lower_classes_leave_room_for_high(share: float, in_flight: int,
                                           queued: float) -> None:
    lower = reserved(LIMITS, share)
    assert (lower.max_in_flight, lower.max_queued_prefill_tokens) == (in_flight, queued)
    assert lower.kv_usage_limit == LIMITS.kv_usage_limit
    busy = load("a", in_flight=in_flight, queued=0)
    assert not has_room(busy, lower) and has_room(busy, LIMITS) is (in_flight < 4)


@pytest.mark.parametrize(("share", "prefill_share", "in_flight", "queued"), [
    (0.75, 0.5, 3, 500.0), (0.75, 0.25, 3, 250.0), (0.5, 1.0, 2, 1000.0),
])
def test_lower_classes_meet_a_shorter_prefill_queue(share: float, prefill_share: float,
                                                    in_flight: int, queued: float) -> None:
    lower = reserved(LIMITS, share, prefill_share)
    assert (lower.max_in_flight, lower.max_queued_prefill_tokens) == (in_flight, queued)
    # a replica with that much prefill queued is full for them, not for high
    busy = load("a", in_flight=1, queued=queued)
    assert not has_room(busy, lower) and has_room(busy, LIMITS) is (queued < 1000)


@pytest.mark.parametrize(("events", "at", "flow", "part"), [
    ([], 0.0, ("normal", "x"), 0.0),
    ([(("normal", "x"), 900.0, 0.0), (("normal", "y"), 100.0, 0.0)], 0.0, ("normal", "x"), 0.9),
    # other classes do not count
    ([(("normal", "x"), 100.0, 0.0), (("high", "y"), 900.0, 0.0)], 0.0, ("normal", "x"), 1.0),
    # x's burst was two half-lives ago: 800 -> 200 against y's fresh 200
    ([(("normal", "x"), 800.0, 0.0), (("normal", "y"), 200.0, 10.0)], 10.0,
     ("normal", "x"), 0.5),
    # long idle: decayed below a token, dropped
    ([(("normal", "x"), 800.0, 0.0), (("normal", "y"), 200.0, 100.0)], 100.0,
     ("normal", "x"), 0.0),
])
def test_recent_tokens(events: list[tuple[Flow, float, float]], at: float, flow: Flow,
                       part: float) -> None:
    recent = RecentTokens(half_life_s=5.0)
    for f, tokens, now in events:
        recent.add(f, tokens, now)
    assert recent.part(flow, at) == pytest.approx(part, abs=1e-6)


@pytest.mark.parametrize(("ld", "seconds"), [
    (load("a"), 0.0),
    (load("a", queued=2000), 2.0),
    (load("a", in_flight=4, queued=100), 0.1 + 0.01),
    (load("a", in_flight=6, queued=0), 0.03),
])
def test_wait_estimate(ld: ReplicaLoad, seconds: float) -> None:
    assert wait_estimate(ld, LIMITS, PER_TOKEN, IN_FLIGHT_S) == pytest.approx(seconds)


@pytest.mark.parametrize(("loads", "waited", "go", "replicas", "why"), [
    # nobody has room: wait
    ([load("a", in_flight=4), load("b", queued=1000)], 0.0, False, (), "full"),
    # the holder of its prefix has room: go, to the replicas with room
    ([load("a", predicted=800), load("b", in_flight=4)], 0.0, True, ("a",), "room"),
    # cold request (nothing cached anywhere): any replica with room
    ([load("a", in_flight=4), load("b")], 0.0, True, ("b",), "room"),
    # own replica full, ~1.2 s of prefill queued there; re-prefilling its 1500 cached
    # tokens elsewhere costs 1.5 s: wait for its own
    ([load("a", queued=1200, predicted=1500), load("b")], 0.0, False, (), "own"),
    # ... while what it waited plus the wait stays below the recompute (0.2 + 1.2 < 1.5)
    ([load("a", queued=1200, predicted=1500), load("b")], 0.2, False, (), "own"),
    # ... then it moves (0.4 + 1.2 > 1.5), though the cap (2 s) is not reached
    ([load("a", queued=1200, predicted=1500), load("b")], 0.4, True, ("b",), "elsewhere"),
    # ... and never past own_replica_max_wait_s (2 s here)
    ([load("a", queued=1200, predicted=1500), load("b")], 0.9, True, ("b",), "elsewhere"),
    # own replica's wait (2 s) is longer than the recompute (1.5 s): go elsewhere now
    ([load("a", queued=2000, predicted=1500), load("b")], 0.0, True, ("b",), "elsewhere"),
    # the other replica holds most of it: only the difference is recomputed (0.8 s)
    ([load("a", queued=1200, predicted=1500), load("b", predicted=700)], 0.0, True, ("b",),
     "elsewhere"),
    # elsewhere has room but its own queue adds 0.5 s: 2.0 s there, wait for its own
    ([load("a", queued=1200, predicted=1500), load("b", queued=500)], 0.0, False, (), "own"),
])
def test_late_binding(loads: list[ReplicaLoad], waited: float, go: bool,
                      replicas: tuple[str, ...], why: str) -> None:
    b = bind(loads, LIMITS, PER_TOKEN, IN_FLIGHT_S, waited, own_max_wait_s=2.0)
    assert (b.go, b.replicas, b.why) == (go, replicas, why)


CFG = AdmissionConfig(high_weight=4, normal_weight=2, low_weight=1,
                      tenant_weights={"big": 3.0})


def fair() -> FairShare:
    return FairShare(CFG.class_weight, CFG.tenant_weight)


def serve(share: FairShare, waiting: dict[Flow, float], n: int, size: float) -> dict[Flow, int]:
    """Admit n requests of `size` tokens from always-backlogged flows; count per flow."""
    for f in waiting:
        share.activate(f, {g: q for g, q in waiting.items() if g != f})
    got = dict.fromkeys(waiting, 0)
    for _ in range(n):
        head = share.order(waiting)[0]
        share.charge(head, size)
        got[head] += 1
    return got


@pytest.mark.parametrize(("flows", "shares"), [
    # tenants within a class share by weight (big weighs 3)
    ({("normal", "big"): 1e9, ("normal", "small"): 1e9},
     {("normal", "big"): 0.75, ("normal", "small"): 0.25}),
    # classes by weight, not strictly: low still progresses
    ({("high", "a"): 1e9, ("low", "a"): 1e9}, {("high", "a"): 0.8, ("low", "a"): 0.2}),
    ({("high", "a"): 1e9, ("normal", "a"): 1e9, ("low", "a"): 1e9},
     {("high", "a"): 4 / 7, ("normal", "a"): 2 / 7, ("low", "a"): 1 / 7}),
    # equal tenants equal shares
    ({("low", "x"): 1e9, ("low", "y"): 1e9}, {("low", "x"): 0.5, ("low", "y"): 0.5}),
])
def test_fair_shares_by_weight(flows: dict[Flow, float], shares: dict[Flow, float]) -> None:
    got = serve(fair(), flows, 700, 100.0)
    for f, share in shares.items():
        assert got[f] / 700 == pytest.approx(share, abs=0.01)


def test_shares_count_prompt_tokens_not_requests() -> None:
    share = fair()
    waiting: dict[Flow, float] = {("normal", "x"): 1e9, ("normal", "y"): 1e9}
    tokens = dict.fromkeys(waiting, 0.0)
    for _ in range(400):
        head = share.order(waiting)[0]
        size = 1000.0 if head[1] == "x" else 100.0  # x sends prompts 10x longer
        share.charge(head, size)
        tokens[head] += size
    x, y = tokens[("normal", "x")], tokens[("normal", "y")]
    assert x / (x + y) == pytest.approx(0.5, abs=0.02)


def test_an_idle_flow_banks_no_credit() -> None:
    share = fair()
    busy: Flow = ("normal", "x")
    share.activate(busy, {})
    for _ in range(50):
        share.charge(busy, 100.0)
    # y arrives after x was served 5000 tokens: lifted to x's time, not served 50 in a row
    late: Flow = ("normal", "y")
    share.activate(late, {busy: 1e9})
    got = serve(share, {busy: 1e9, late: 1e9}, 20, 100.0)
    assert got[late] <= 11


def test_forget_idle_keeps_state_bounded() -> None:
    share = fair()
    for t in range(100):
        share.activate(("normal", f"t{t}"), {})
        share.charge(("normal", f"t{t}"), 10.0)
    share.forget_idle({})
    assert share.order({}) == []
    assert not share._flow_vt and not share._class_vt


@pytest.mark.parametrize(("flow", "tokens", "waiting", "ahead"), [
    # alone: just itself
    (("normal", "x"), 100.0, {}, 100.0),
    # a flooder's backlog counts only up to its share of the newcomer's time
    (("normal", "x"), 100.0, {("normal", "flood"): 1e6}, 200.0),
    # the flooder itself waits behind its whole backlog
    (("normal", "flood"), 100.0, {("normal", "flood"): 1e6, ("normal", "x"): 100.0},
     1e6 + 100.0 + 100.0),
    # a weight-3 tenant next to it: 3x its own time
    (("normal", "x"), 100.0, {("normal", "big"): 1e6}, 400.0),
    # a higher class counts up to its class weight's share (high 4 vs normal 2)
    (("normal", "x"), 100.0, {("high", "a"): 1e6}, 300.0),
    # a lower class's short backlog counts in full, a long one up to its share
    (("normal", "x"), 100.0, {("low", "a"): 10.0}, 110.0),
    (("normal", "x"), 100.0, {("low", "a"): 1e6}, 150.0),
])
def test_projected_tokens(flow: Flow, tokens: float, waiting: dict[Flow, float],
                          ahead: float) -> None:
    assert fair().projected_tokens(flow, tokens, waiting) == pytest.approx(ahead)


def arrival(**kw: object) -> Arrival:
    base: dict[str, object] = dict(
        queue_len=0, max_queue=10, lower_waiting=False, projected_s=1.0, max_wait_s=10.0,
        tenant_waiting=0, tenant_slots=5.0, others_waiting=False)
    base.update(kw)
    return Arrival(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("a", "out"), [
    (arrival(), "enqueue"),
    (arrival(projected_s=11.0), "wait_limit"),
    (arrival(queue_len=10), "queue_full"),
    (arrival(queue_len=10, lower_waiting=True), "displace"),
    # over its share while others wait
    (arrival(tenant_waiting=5, others_waiting=True), "tenant_share"),
    # over its share but alone: it may use the whole queue
    (arrival(tenant_waiting=5), "enqueue"),
    (arrival(tenant_waiting=4, others_waiting=True), "enqueue"),
    # share is checked before the wait projection (the flooder's own reason)
    (arrival(tenant_waiting=9, others_waiting=True, projected_s=99.0), "tenant_share"),
    # took more than over_share x its fair part of the class's recent tokens: shed at once
    (arrival(others_waiting=True, recent_part=0.9, fair_part=0.5), "tenant_share"),
    (arrival(others_waiting=True, recent_part=0.62, fair_part=0.5), "enqueue"),
    (arrival(others_waiting=True, recent_part=0.63, fair_part=0.5), "tenant_share"),
    (arrival(others_waiting=True, recent_part=0.9, fair_part=0.5, over_share=2.0), "enqueue"),
    # ... but only while another tenant waits
    (arrival(recent_part=1.0, fair_part=0.5), "enqueue"),
])
def test_verdict(a: Arrival, out: str) -> None:
    assert verdict(a) == out


@pytest.mark.parametrize(("projected", "limit", "seconds"), [
    (0.0, 10.0, 1), (0.2, 10.0, 1), (2.1, 10.0, 3), (50.0, 10.0, 10), (math.inf, 30.0, 30),
    (5.0, 0.5, 1),
])
def test_retry_after(projected: float, limit: float, seconds: int) -> None:
    assert retry_after(projected, limit) == seconds


def test_shed_is_a_429_in_openais_shape_with_retry_after() -> None:
    err = Shed("queue_full", 7)
    assert err.status == 429
    assert err.payload()["error"]["type"] == "rate_limit_exceeded"
    assert err.payload()["error"]["code"] == "overloaded_queue_full"
    assert set(err.payload()["error"]) == {"message", "type", "param", "code"}
    assert err.headers() == [(b"retry-after", b"7")]


def test_drain_rate_is_measured_but_never_below_the_floor() -> None:
    rate = DrainRate(floor=100.0, capacity=16)
    assert rate.rate(0.0) == 100.0
    for i in range(16):
        rate.add(i * 0.1, 1000.0)
    assert rate.rate(1.5) == pytest.approx(15 * 1000.0 / 1.5)
    assert rate.rate(100.0) == 100.0  # old samples leave the window
    assert len(rate._samples or []) == 16


@pytest.mark.parametrize(("samples", "rate"), [
    # a burst of releases a millisecond apart is no throughput: below 8 samples in the
    # window the floor stands, however fast the few there were
    (1, 100.0), (2, 100.0), (7, 100.0),
    (8, 7 * 1000.0 / 0.007),  # enough to measure: tokens after the first over the span
])
def test_drain_rate_is_not_trusted_from_a_few_samples(samples: int, rate: float) -> None:
    drain = DrainRate(floor=100.0)
    for i in range(samples):
        drain.add(10.0 + i * 0.001, 1000.0)
    assert drain.rate(10.0 + samples * 0.001) == pytest.approx(rate)


@pytest.mark.parametrize("bad", [
    {"max_queue": 0}, {"high_max_wait_s": 0}, {"low_weight": -1}, {"kv_usage_limit": 1.5},
    {"tenant_weights": {"a": 0.0}}, {"own_replica_max_wait_s": -1}, {"recheck_s": 0},
    {"lower_class_room": 0}, {"lower_class_room": 1.5},
    {"lower_class_prefill_room": 0}, {"lower_class_prefill_room": 1.01},
    {"over_share": 0.99}, {"share_half_life_s": 0}, {"own_replica_past_room": 0.5},
])
def test_config_rejects_bad_values(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="admission"):
        AdmissionConfig(**bad)  # type: ignore[arg-type]


def test_the_session_prior_keeps_a_follow_up_waiting_for_its_own() -> None:
    loads = [load("a", queued=1200, predicted=1500), load("b", predicted=700)]
    assert bind(loads, LIMITS, PER_TOKEN, IN_FLIGHT_S, 0.0, 2.0).why == "elsewhere"
    assert bind(loads, LIMITS, PER_TOKEN, IN_FLIGHT_S, 0.0, 2.0, prior_s=0.5).why == "own"


@pytest.mark.parametrize(("recent", "head"), [
    ({}, ("normal", "flood")),  # no history: the first name
    ({("normal", "flood"): 0.9, ("normal", "quiet"): 0.1}, ("normal", "quiet")),
    ({("normal", "flood"): 0.1, ("normal", "quiet"): 0.9}, ("normal", "flood")),
])
def test_a_flow_just_started_wins_the_tie_when_it_had_less(recent: dict[Flow, float],
                                                           head: Flow) -> None:
    shares = fair()
    shares.charge(("normal", "flood"), 500.0)
    waiting: dict[Flow, float] = {("normal", "flood"): 100.0}
    shares.activate(("normal", "quiet"), waiting)  # lifted to the flooder's virtual time
    waiting[("normal", "quiet")] = 100.0
    assert shares.order(waiting, lambda f: recent.get(f, 0.0))[0] == head
