"""Tool gaps learnt (gateway.agents.gaps) and context reserved while a program is in a
tool call (gateway.agents.reserve), by table; time is a parameter."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.agents.gaps import GapLearner, remaining_wait
from gateway.agents.programs import ProgramId
from gateway.agents.reserve import Reservations, holds, kv_with_reserved

S = 1e-3  # seconds per prefilled token: 1000 tokens cost 1 s


@pytest.mark.parametrize(("gaps", "elapsed", "q", "want"), [
    ([1.0, 2.0, 3.0, 4.0], 0.0, 0.5, 2.0),
    ([1.0, 2.0, 3.0, 4.0], 1.5, 0.5, 1.5),  # of 2,3,4 what is left: .5, 1.5, 2.5
    ([1.0, 2.0, 3.0, 4.0], 4.0, 0.5, None),  # away longer than any gap: no estimate
    ([1.0, 2.0, 3.0, 100.0], 0.0, 0.5, 2.0),  # a long tail does not move the median
    ([1.0, 2.0, 3.0, 4.0], 0.0, 1.0, 4.0),
    ([], 0.0, 0.5, None),
])
def test_remaining_wait(gaps: list[float], elapsed: float, q: float,
                        want: float | None) -> None:
    assert remaining_wait(sorted(gaps), elapsed, q) == whole(gaps, elapsed, q) == want


@pytest.mark.parametrize(("elapsed", "tokens", "gaps", "max_s", "want"), [
    (0.0, 5000, [1.0, 2.0, 3.0], 10.0, True),   # 2 s wait < 5 s to recompute
    (0.0, 1000, [1.0, 2.0, 3.0], 10.0, False),  # 2 s wait > 1 s to recompute
    (0.0, 2000, [1.0, 2.0, 3.0], 10.0, False),  # equal: not below
    (2.5, 5000, [1.0, 2.0, 3.0], 10.0, True),   # .5 s left
    (3.0, 5000, [1.0, 2.0, 3.0], 10.0, False),  # past every gap
    (10.0, 10**6, [20.0, 30.0], 10.0, False),   # the cap
    (9.9, 10**6, [20.0, 30.0], 10.0, True),
    (0.0, 10**6, [1.0], 0.0, False),            # off
    (0.0, 5000, [], 10.0, False),               # nothing learnt, no prior
    (0.0, 0, [1.0], 10.0, False),
])
def test_holds(elapsed: float, tokens: int, gaps: list[float], max_s: float,
               want: bool) -> None:
    assert holds(elapsed, tokens, gaps, S, max_s) is want


def test_learner_own_gaps_after_min_samples_else_prior() -> None:
    g = GapLearner(min_samples=3, window=4, prior_window=8)
    a, b = ("t", "a"), ("t", "b")
    for i, gap in enumerate([5.0, 6.0]):
        g.observe(a, gap, float(i))
    g.observe(b, 0.5, 2.0)
    assert sorted(g.samples(a, 3.0)) == [0.5, 5.0, 6.0]  # too few: the fleet's prior
    g.observe(a, 7.0, 3.0)
    assert sorted(g.samples(a, 3.0)) == [5.0, 6.0, 7.0]  # its own
    for i in range(5):
        g.observe(a, 1.0, 4.0 + i)
    assert list(g.samples(a, 9.0)) == [1.0] * 4  # the window: older gaps fell out
    # a program never seen: the fleet's 8 most recent gaps
    assert sorted(g.samples(("t", "new"), 9.0)) == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 6.0, 7.0]


def test_learner_bounds_lru_and_ttl() -> None:
    g = GapLearner(max_programs=2, ttl_s=10.0, min_samples=1)
    g.observe(("t", "a"), 1.0, 0.0)
    g.observe(("t", "b"), 2.0, 1.0)
    g.observe(("t", "a"), 1.0, 2.0)  # a seen again: b is the least recent
    g.observe(("t", "c"), 3.0, 3.0)
    assert len(g) == 2
    assert list(g.samples(("t", "b"), 3.0)) != [2.0]  # dropped: the prior stands for it
    g.observe(("t", "d"), 4.0, 13.5)  # a (seen 2.0) and c (3.0) are past the TTL
    assert len(g) == 1
    with pytest.raises(ValueError):
        GapLearner(max_programs=0)


def prog(name: str, agent: str | None = None, tenant: str = "t") -> ProgramId:
    return ProgramId(tenant, name, "session", agent)


def learnt(r: Reservations, p: ProgramId, gaps: list[float], start: float = 0.0) -> float:
    """Teach `p` these gaps on replica r0 (1000-token turns); returns the clock after."""
    now = start
    for gap in gaps:
        r.ended(p, "r0", 1000, now)
        now += gap
        r.began(p, now)
        now += 1.0
    return now


def test_reservation_lifecycle_expiry_and_cap() -> None:
    r = Reservations(max_s=10.0, s_per_token=lambda _: S, learner=GapLearner(min_samples=2))
    p = prog("a")
    now = learnt(r, p, [2.0, 2.0, 2.0])
    r.ended(p, "r0", 8000, now)  # 8 s to recompute, 2 s expected away
    assert r.reserved_tokens("r0", now) == 8000
    assert r.reserved_tokens("r1", now) == 0
    assert r.reserved_tokens("r0", now + 1.9) == 8000
    assert r.reserved_tokens("r0", now + 2.0) == 0  # longer than it ever took: released
    r.began(p, now + 3.0)
    assert r.reserved_tokens("r0", now + 0.5) == 0  # it came back: nothing held
    # the cap: a program whose tool calls last 30 s, with a huge context
    q = prog("slow")
    now = learnt(r, q, [30.0, 30.0], start=now + 10.0)
    r.ended(q, "r0", 10**6, now)
    assert r.reserved_tokens("r0", now + 9.9) == 10**6
    assert r.reserved_tokens("r0", now + 10.0) == 0


def test_reservation_off_and_sub_agents_and_bounds() -> None:
    off = Reservations(max_s=0.0, s_per_token=lambda _: S, learner=GapLearner(min_samples=1))
    now = learnt(off, prog("a"), [1.0])
    off.ended(prog("a"), "r0", 10**6, now)
    assert off.reserved_tokens("r0", now) == 0
    r = Reservations(max_s=10.0, s_per_token=lambda _: S, learner=GapLearner(min_samples=1),
                     max_threads=2)
    now = learnt(r, prog("p", "x"), [1.0])
    r.ended(prog("p", "x"), "r0", 5000, now)
    r.ended(prog("p", "y"), "r0", 3000, now)  # a sub-agent: its own context, the same gaps
    assert r.reserved_tokens("r0", now) == 8000
    r.ended(prog("q"), "r0", 4000, now + 0.1)  # over the bound: the oldest goes
    assert len(r) == 2
    assert r.reserved_tokens("r0", now + 0.1) == 7000
    r.forget_replica("r0")
    assert r.reserved_tokens("r0", now + 0.1) == 0


def test_reservation_two_tenants_apart() -> None:
    r = Reservations(max_s=10.0, s_per_token=lambda _: S, learner=GapLearner(min_samples=1))
    now = learnt(r, prog("same", tenant="a"), [1.0])
    r.ended(prog("same", tenant="a"), "r0", 5000, now)
    r.ended(prog("same", tenant="b"), "r1", 5000, now)
    r.began(prog("same", tenant="b"), now + 0.1)  # b's return does not end a's
    assert r.reserved_tokens("r0", now + 0.2) == 5000
    assert r.reserved_tokens("r1", now + 0.2) == 0


@pytest.mark.parametrize(("usage", "reserved", "capacity", "want"), [
    (0.5, 25_000, 100_000, 0.75),
    (0.5, 0, 100_000, 0.5),
    (None, 25_000, 100_000, None),
    (0.5, 25_000, None, 0.5),
    (0.5, 25_000, 0, 0.5),
])
def test_kv_with_reserved(usage: float | None, reserved: int, capacity: int | None,
                          want: float | None) -> None:
    assert kv_with_reserved(usage, reserved, capacity) == want


def test_began_says_whether_the_program_returns_from_a_tool_call() -> None:
    from gateway.agents.programs import ProgramId
    r = Reservations(max_s=10.0, s_per_token=lambda _: 0.01)
    p = ProgramId("t", "run", "session")
    assert r.began(p, 0.0) is False  # a first turn: it was nowhere between turns
    r.ended(p, "a", 1000, 1.0)
    assert r.began(p, 3.0) is True  # back from its tool call
    assert r.began(p, 3.5) is False  # the same turn's retry: already back



def test_the_context_held_on_a_replica_is_at_most_half_its_capacity() -> None:
    # tenant A holds one context of 1,000 tokens, then B eight more, on a 10,000-token
    # cache: at most half of it (5,000) held in all
    learner = GapLearner()
    for tenant in ("A", "B"):
        for i in range(4):
            learner.observe((tenant, "teacher"), 2.0, 100.0 + i)
    res = Reservations(max_s=10.0, s_per_token=lambda _: 0.01, learner=learner,
                       capacity_tokens=lambda _: 10_000)
    res.ended(ProgramId("A", "a-run", "session"), "r", 1000, 110.0)
    assert res.reserved_tokens("r", 110.5) == 1000
    for i in range(8):
        res.ended(ProgramId("B", f"b-run-{i}", "session"), "r", 1000, 110.0)
    assert res.reserved_tokens("r", 110.5) == 5000
    assert res.reserved_tokens("other", 110.5) == 0


def test_each_tenant_has_its_own_bounded_prior() -> None:
    learner = GapLearner(max_tenants=2)
    learner.observe(("A", "a"), 1.0, 100.0)
    learner.observe(("B", "b"), 2.0, 100.0)
    assert (learner.samples(("A", "new"), 100.0), learner.samples(("C", "new"), 100.0)) \
        == ((1.0,), ())
    learner.observe(("C", "c"), 3.0, 100.0)  # a third tenant: the least recent (A) goes
    assert [tuple(learner.samples((t, "new"), 100.0)) for t in "ABC"] == [(), (2.0,), (3.0,)]


def test_a_hold_ends_when_its_replica_restarts() -> None:
    restarts = {"r": 0}
    learner = GapLearner()
    for i in range(4):
        learner.observe(("t", "teacher"), 2.0, 100.0 + i)
    res = Reservations(max_s=10.0, s_per_token=lambda _: 0.01, learner=learner,
                       epoch=lambda name: restarts.get(name, 0))
    res.ended(ProgramId("t", "run", "session"), "r", 1000, 110.0)
    assert res.reserved_tokens("r", 110.5) == 1000
    restarts["r"] = 1
    assert (res.reserved_tokens("r", 110.5), len(res)) == (0, 0)
    res.ended(ProgramId("t", "run", "session"), "r", 1000, 111.0)  # a turn since: held
    assert res.reserved_tokens("r", 111.5) == 1000


@given(st.lists(st.floats(0.0, 100.0), max_size=40), st.floats(0.0, 120.0),
       st.sampled_from([0.1, 0.5, 0.9, 1.0]))
def test_the_bisected_remaining_wait_equals_the_whole_one(
        gaps: list[float], elapsed: float, q: float) -> None:
    """What the reservation reads (bisection over the sorted gaps) is the whole one."""
    assert remaining_wait(sorted(gaps), elapsed, q) == whole(gaps, elapsed, q)


def whole(gaps: list[float], elapsed: float, q: float) -> float | None:
    """The nearest-rank `q`-quantile of `g - elapsed` over the gaps longer than `elapsed`,
    computed whole (the reference `remaining_wait` bisects to)."""
    left = sorted(g - elapsed for g in gaps if g > elapsed)
    if not left:
        return None
    return left[max(0, min(len(left) - 1, math.ceil(q * len(left)) - 1))]


def test_the_sorted_prior_follows_what_is_taught() -> None:
    g = GapLearner(min_samples=4)
    g.observe(("t", "a"), 3.0, 0.0)
    assert g.samples(("t", "x"), 0.0) == (3.0,)
    g.observe(("t", "b"), 1.0, 0.0)  # a change: the sorted prior is made again
    assert g.samples(("t", "x"), 0.0) == (1.0, 3.0)
