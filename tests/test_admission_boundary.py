"""The admission queue's error boundary and what it forgets (in process: a Gate with a
Fleet and a real Router, no network).

- An error in a dispatch pass (the router, the drain rate, metrics) never stops the
  ticker, never escapes into another request's `done`, never strands a waiter: the waiter
  whose own decision failed is answered at once with an OpenAI-shaped 500, the others go on.
- What an engine was seen to run at once is forgotten when it restarts (it may come back
  with another --max-num-seqs) and when its replica leaves the fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from gateway.admission.engine import Capacity, Scrape, learn, view
from gateway.admission.gate import Ask, Gate
from gateway.replicas.fleet import Fleet
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.upstream.errors import GatewayError
from tests.test_admission_engine import Clock, ask, busy, snap, world


class Flaky:
    """Wraps one of the router's methods: raises RuntimeError while `on` (or for the asks
    whose text is in `texts`), else calls through."""

    def __init__(self, router: Router, method: str, texts: tuple[str, ...] = ()) -> None:
        self.real = getattr(router, method)
        self.on = False
        self.raised = 0
        self.texts = texts
        setattr(router, method, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        text = ""
        if args and isinstance(args[0], dict):
            text = args[0]["messages"][0]["content"]
        if self.on or text in self.texts:
            self.raised += 1
            raise RuntimeError("a bug in one pass")
        return self.real(*args, **kwargs)


async def until(check: Any) -> None:
    """Wait (bounded: 5 s, in steps of 1 ms) until `check()`."""
    for _ in range(5000):
        if check():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not met in time")


def test_the_ticker_goes_on_after_an_error_in_a_pass() -> None:
    async def run() -> str:
        g, router, fleet, _, _ = world(replica_max_in_flight=1, own_replica_max_wait_s=0.0)
        a, b = fleet.replicas["a"], fleet.replicas["b"]
        b.healthy = False
        held = await busy(g, fleet, "a", 1)
        waiter = asyncio.create_task(g.admit(ask("w"), [a]))
        await until(lambda: g.stats()["queued"]["normal"] == 1)
        flaky = Flaky(router, "queued_by_replica")
        flaky.on = True
        await until(lambda: flaky.raised >= 2)  # ticks met the error and went on
        flaky.on = False
        b.healthy = True  # only the ticker can see this: nothing finishes meanwhile
        ticket = await asyncio.wait_for(waiter, 5)
        g.done(held[0])
        g.done(ticket)
        await g.aclose()
        return ticket.plan.decision.replica
    assert asyncio.run(run()) == "b"


def test_an_error_in_a_pass_does_not_escape_into_another_requests_done() -> None:
    async def run() -> tuple[str, int]:
        g, router, fleet, _, _ = world(replica_max_in_flight=1, own_replica_max_wait_s=0.0)
        a = fleet.replicas["a"]
        fleet.replicas["b"].healthy = False
        (held,) = await busy(g, fleet, "a", 1)
        waiter = asyncio.create_task(g.admit(ask("w"), [a]))
        await until(lambda: g.stats()["queued"]["normal"] == 1)
        flaky = Flaky(router, "queued_by_replica")
        flaky.on = True
        a.in_flight -= 1
        held.plan.outcome.prompt_tokens = 8
        g.done(held)  # its own cleanup: the pass it runs fails, but not this call
        flaky.on = False
        ticket = await asyncio.wait_for(waiter, 5)  # the ticker releases it
        g.done(ticket)
        await g.aclose()
        return ticket.plan.decision.replica, g._count
    assert asyncio.run(run()) == ("a", 0)


def test_an_error_in_the_pass_on_arrival_leaves_the_waiter_waiting() -> None:
    async def run() -> tuple[str, int]:
        g, router, fleet, _, _ = world(replica_max_in_flight=1, own_replica_max_wait_s=0.0)
        a, b = fleet.replicas["a"], fleet.replicas["b"]
        b.healthy = False
        held = await busy(g, fleet, "a", 1)
        flaky = Flaky(router, "queued_by_replica")
        flaky.on = True
        waiter = asyncio.create_task(g.admit(ask("w"), [a]))
        await until(lambda: flaky.raised >= 1)
        await asyncio.sleep(0.01)
        assert not waiter.done() and g.stats()["queued"]["normal"] == 1
        flaky.on = False
        b.healthy = True
        ticket = await asyncio.wait_for(waiter, 5)
        g.done(held[0])
        g.done(ticket)
        await g.aclose()
        return ticket.plan.decision.replica, g._count
    assert asyncio.run(run()) == ("b", 0)


def test_a_waiter_whose_decision_fails_is_answered_at_once_and_the_others_go() -> None:
    async def run() -> tuple[BaseException | None, str, int]:
        g, router, fleet, _, _ = world(replica_max_in_flight=1, own_replica_max_wait_s=0.0)
        a, b = fleet.replicas["a"], fleet.replicas["b"]
        b.healthy = False
        held = await busy(g, fleet, "a", 1)
        Flaky(router, "decide", texts=("w0",))
        w0 = asyncio.create_task(g.admit(ask("w0"), [a]))
        await until(lambda: g.stats()["queued"]["normal"] == 1)
        w1 = asyncio.create_task(g.admit(ask("w1"), [a]))
        await until(lambda: g.stats()["queued"]["normal"] == 2)
        b.healthy = True  # room for one: w0 first, whose decision fails
        err = None
        try:
            await asyncio.wait_for(w0, 5)  # at once, not at its 30 s max wait
        except GatewayError as exc:
            err = exc
        ticket = await asyncio.wait_for(w1, 5)
        g.done(held[0])
        g.done(ticket)
        await g.aclose()
        return err, ticket.plan.decision.replica, g._count
    err, went, count = asyncio.run(run())
    assert isinstance(err, GatewayError) and err.status == 500
    assert err.code == "internal_error" and went == "b" and count == 0


# what an engine showed it runs: forgotten with the engine --------------------------------

def saturate(g: Gate, fleet: Fleet, clock: Clock, running: int) -> Any:
    """Scrapes of replica a showing `running` requests running and 2 waiting, 3 s long."""
    a = fleet.replicas["a"]
    for _ in range(4):
        clock.t += 1.0
        fleet.set_snapshot("a", snap(clock, running=running, waiting=2), clock.t, 0)
        g._load(a)
    return g.stats()["replicas"]["a"]["seq_limit"]


def test_a_restarted_engine_is_learned_again() -> None:
    """Seen running 8 at most while requests waited; restarted with --max-num-seqs 2: it
    runs 2 with requests waiting, and 2 is what it runs (not the old 8 for ever)."""
    async def run() -> tuple[int, int]:
        g, router, fleet, clock, _ = world()
        router.add_replica("a")
        before = saturate(g, fleet, clock, 8)
        clock.t += 1.0
        router.replica_restarted("a", clock.t, clock.t - 0.5, sign="counters")
        after = saturate(g, fleet, clock, 2)
        await g.aclose()
        return before, after
    assert asyncio.run(run()) == (8, 2)


def test_a_replica_that_left_and_came_back_is_learned_again() -> None:
    async def run() -> tuple[int, int | None]:
        g, _, fleet, clock, _ = world()
        before = saturate(g, fleet, clock, 8)
        fleet.remove("a")
        back = fleet.add(ReplicaSettings(name="a", url="http://a:8000", models=("m",)))
        back.healthy = True
        g._load(back)  # not scraped yet: nothing known of what it runs
        await g.aclose()
        return before, g.stats()["replicas"]["a"]["seq_limit"]
    assert asyncio.run(run()) == (8, None)


@pytest.mark.parametrize("started", [None, 5.0])
def test_restarts_are_counted_per_replica(started: float | None) -> None:
    router = world()[1]
    router.add_replica("a")
    assert router.restarts("a") == 0
    router.replica_restarted("a", 100.0, started, sign="counters")
    router.replica_restarted("a", 100.0, started, sign="counters")  # the same one again
    assert router.restarts("a") == 1 and router.restarts("b") == 0


# odd engine figures ----------------------------------------------------------------------

@pytest.mark.parametrize("odd", [1e308, 2.0**40, 1e9])
def test_an_impossible_running_count_teaches_nothing(odd: float) -> None:
    """One scrape with a running count no engine runs (1e308, a counter read as a gauge)
    is no figure: afterwards the engine's queue beside 4 running still shows its limit
    (were 1e308 taken as the most it ran, 4 could never be the limit again)."""
    cap = learn(Capacity(), Scrape(0.0, odd, 0.0, None, 0))
    assert cap.most_running is None and cap.seq_limit is None
    assert view(Scrape(0.0, odd, 0.0, None, 0), cap, 1, 0.5, 10.0).source == "gateway"
    for ts in (1.0, 2.0, 3.0, 4.0):
        cap = learn(cap, Scrape(ts, 4.0, 2.0, None, 0))
    assert cap.seq_limit == 4


def test_without_engine_figures_a_non_streamed_prefill_ends_by_the_cost_model() -> None:
    """An engine that exports no running/waiting counts (llama.cpp) or whose scrapes fail:
    a non-streamed request's first byte is its last, and nothing else says its prefill
    began. It counts as queued prefill for the time the routing cost model gives its
    prompt (and those sent before it), not until its answer ends: otherwise 4 prompts of
    ~5k tokens hold `normal`'s prefill room for their whole generation."""
    async def run() -> tuple[int, str, float]:
        g, router, fleet, clock, _ = world()
        fleet.replicas["b"].healthy = False
        a = fleet.replicas["a"]
        def doc(i: int) -> Ask:  # ~6.9k tokens, sent now (the router's clock)
            return dataclasses.replace(ask(f"document {i}: " + "alpha beta " * 2500),
                                       ts=clock.t)
        big = [await g.admit(doc(i), [a]) for i in range(3)]
        a.in_flight = 3
        waiter = asyncio.create_task(g.admit(doc(9), [a]))
        await until(lambda: g.stats()["queued"]["normal"] == 1)
        queued = int(router.queued_tokens("a"))
        # the three prompts' prefill at 33 us a token is well under a second
        clock.t += 1.0
        ticket = await asyncio.wait_for(waiter, 5)
        for t in [*big, ticket]:
            g.done(t)
        await g.aclose()
        return queued, g.stats()["replicas"]["a"]["source"], ticket.plan.decision.replica
    queued, source, went = asyncio.run(run())
    assert queued > 16384 and source == "gateway" and went == "a"


# the fleet view's own decisions ----------------------------------------------------------

def test_a_probe_from_before_the_doubt_does_not_clear_it() -> None:
    """A good probe at 1000.5, then a request left the replica unanswered at 1001: only a
    probe after 1001 makes it trusted again."""
    async def run() -> tuple[bool, bool]:
        g, _, fleet, clock, _ = world(replica_max_in_flight=1)
        a = fleet.replicas["a"]
        fleet.probe_result("a", True, clock.t + 0.5)
        clock.t += 1.0
        (held,) = await busy(g, fleet, "a", 1)
        a.in_flight -= 1
        g.done(held)  # no usage: doubted
        view = g._fleet_view
        before = view.trusted(a)
        fleet.probe_result("a", True, clock.t + 0.1)
        await g.aclose()
        return before, view.trusted(a)
    assert asyncio.run(run()) == (False, True)


def test_a_waiter_pinned_to_a_replica_that_went_down_is_not_sent_there() -> None:
    async def run() -> tuple[bool, str]:
        g, _, fleet, _, _ = world(replica_max_in_flight=1)
        a = fleet.replicas["a"]
        fleet.replicas["b"].healthy = False
        (held,) = await busy(g, fleet, "a", 1)
        pinned = dataclasses.replace(ask("continue"), pin="a")
        waiter = asyncio.create_task(g.admit(pinned, [a]))
        await until(lambda: g.stats()["queued"]["normal"] == 1)
        a.healthy = False  # its request ends: nothing of the gateway's left there
        a.in_flight -= 1
        held.plan.outcome.prompt_tokens = 8
        g.done(held)
        await asyncio.sleep(0.02)
        went_down = waiter.done()
        a.healthy = True  # back: the continuation goes
        fleet.probe_result("a", True, 2000.0)
        ticket = await asyncio.wait_for(waiter, 5)
        g.done(ticket)
        await g.aclose()
        return went_down, ticket.plan.decision.replica
    assert asyncio.run(run()) == (False, "a")


def test_what_was_learnt_of_a_replica_that_left_is_dropped() -> None:
    async def run() -> list[str]:
        g, _, fleet, clock, _ = world()
        saturate(g, fleet, clock, 4)
        g._load(fleet.replicas["b"])
        fleet.remove("a")
        g._fleet_view.forget_left()
        await g.aclose()
        return sorted(g.stats()["replicas"])
    assert asyncio.run(run()) == ["b"]


def test_a_request_of_a_departed_replica_gives_back_nothing_under_its_name() -> None:
    """`a` departs with a request in flight and comes back as another server (a new
    address): the old request's end (`done(counted=False)`, gateway/proxy/flow.py) leaves
    the new a's admitted count as it is; counted, it would free the new one's room."""
    async def run() -> tuple[int, int]:
        g, _, fleet, _, _ = world(replica_max_in_flight=1)
        (old,) = await busy(g, fleet, "a", 1)
        g.forget_replica("a")  # departed (Services.remove_replica), back at a new address
        fleet.replicas["a"] = dataclasses.replace(fleet.replicas["a"], in_flight=0)
        (new,) = await busy(g, fleet, "a", 1)
        g.done(old, counted=False)
        kept = g._admitted.get("a", 0)
        g.done(new)
        await g.aclose()
        return kept, g._admitted.get("a", 0)
    assert asyncio.run(run()) == (1, 0)
