"""Review of the KV usage the admission queue reads between scrapes (engine.py `view`'s
`pinned_now` / `Scrape.pinned_at_scrape`, fleetview.py, the monitor, Router.pinned_tokens):
cases the change's own tests left out. Three were breaks, fixed since (each test says what
broke); each test names the mutation it catches."""

from __future__ import annotations

import asyncio
import os

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.engine import pinned_at_scrape
from gateway.admission.gate import Gate, Ticket
from gateway.bench.compare import gateway_env
from gateway.bench.presets import PRESETS
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics
from tests.test_admission_kv_between_scrapes import LONG, Clock, asked, snap


class Bench:
    """Replicas (`a`, or `names`) behind a Gate, queue on, the clock in the test's hands;
    scrapes are stored as the monitor stores them (`scrape`)."""

    def __init__(self, names: tuple[str, ...] = ("a",)) -> None:
        self.routing = RoutingConfig()
        self.router = Router(self.routing)
        self.fleet = Fleet([ReplicaSettings(name=n, url=f"http://{n}:8000", models=("m",))
                            for n in names])
        for r in self.fleet.replicas.values():
            r.healthy = True
        self.clock = Clock()
        self.gate = Gate(AdmissionConfig(enabled=True), self.routing, self.router,
                         GatewayMetrics(), self.clock, self.clock, fleet=self.fleet,
                         scrape_interval_s=5.0)

    def scrape(self, name: str, kv: float, running: float, waiting: float = 0) -> None:
        """A scrape of `name` asked for now, with what is in flight there now (the
        monitor's `asked_at`, `in_flight`, `pinned`)."""
        r = self.fleet.replicas[name]
        self.fleet.set_snapshot(name, snap(self.clock.t, kv, running, waiting), self.clock.t,
                                r.in_flight, pinned_at_scrape(self.router.live_prompts(name),
                                                              waiting,
                                                              self.router.swept_tokens(name),
                                                              kv))

    async def send(self, text: str, name: str = "a") -> Ticket:
        r = self.fleet.replicas[name]
        t = await self.gate.admit(asked(text, self.clock.t), [r])
        r.in_flight += 1
        return t

    def finish(self, t: Ticket) -> None:
        """As flow.finish orders it: in-flight count, the router's report, the gate."""
        assert t.replica is not None
        self.fleet.replicas[t.replica].in_flight -= 1
        self.router.report(t.plan, self.clock.t)
        self.gate.done(t)

    async def goes(self, text: str, name: str = "a") -> bool:
        """Whether a request is admitted to `name` at once (taken back either way)."""
        r = self.fleet.replicas[name]
        task = asyncio.create_task(self.gate.admit(asked(text, self.clock.t), [r]))
        await asyncio.sleep(0)
        went = task.done() and task.exception() is None
        if went:
            assert task.result().replica == name
            self.router.report(task.result().plan, self.clock.t)
            self.gate.done(task.result())
        else:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return went

    def kv(self, name: str = "a") -> float | None:
        got = self.gate.stats()["replicas"][name]["kv_usage"]
        return None if got is None else float(got)


async def a_finish_beside(running: float, waiting: float) -> tuple[bool, float | None]:
    """A and B (~14k tokens each) sent to `a`; a scrape at 0.99 showing `running` and
    `waiting` with both in flight; A ends: does a third go at once, and what KV usage is
    read?"""
    b = Bench()
    try:
        b.scrape("a", 0.0, 0)
        first = await b.send(f"A {LONG}")
        await b.send(f"B {LONG}")
        b.clock.t += 1.0
        b.scrape("a", 0.99, running=running, waiting=waiting)
        b.router.engine_began("a", b.clock.t, waiting, 1e-9)  # what waits: its prefill queued
        b.clock.t += 0.1
        b.finish(first)
        went = await b.goes(f"third {LONG}")
        return went, b.kv()
    finally:
        await b.gate.aclose()


def test_a_finish_that_lets_a_waiting_request_in_frees_no_kv() -> None:
    """The engine at its KV limit with a queue: other clients fill ~0.77 of a 64k-token
    cache, this gateway's A (~14k tokens) runs, its B (~14k) waits in the engine for
    blocks; the scrape reads 0.99, running 3, waiting 1, both A and B in flight. A ends:
    vLLM gives its blocks to B at the next step (the queue's own waiting-count rule says
    the same: `waiting_since`, "a finish lets one in"), so the cache is as full as it
    was. The queue reads ~0.99 (past `kv_usage_limit`, 0.97) and holds a third prompt.
    It broke: the baseline counted B, so the queue read 0.99 - 14k/64k and let the third go
    into an engine that made it wait for blocks. Mutation caught: `pinned_at_scrape`
    keeping the `waiting` youngest."""
    went, kv = asyncio.run(a_finish_beside(running=3, waiting=1))
    assert kv is not None and kv >= 0.97, kv  # admission.kv_usage_limit
    assert not went


def test_control_a_finish_with_nothing_waiting_frees_its_prompt() -> None:
    """The control of the test above: the same cache, nothing waiting at the scrape
    (both running): A's end frees its blocks, and the third goes."""
    went, kv = asyncio.run(a_finish_beside(running=4, waiting=0))
    assert kv is not None and 0.7 < kv < 0.85, kv
    assert went


def test_a_request_in_flight_past_the_sweep_still_pins_its_prompt() -> None:
    """A long generation (a reasoning model's, an agent's) in flight 301 s: a scrape at
    299 s counted it in `pinned_at_scrape`; the next decision's sweep (at 301 s) drops it
    from `live`; it stays counted on both sides (`Router.pinned_tokens`, the ledger's
    `swept`), so the queue reads 0.5. It broke: the queue read the scraped 0.5 less its
    ~14k tokens (~0.28) while it still ran. Mutation caught: the sweep not adding to
    `swept`."""
    async def go() -> tuple[float, float | None, float | None]:
        b = Bench()
        try:
            b.scrape("a", 0.0, 0)
            await b.send(f"long {LONG}")
            pinned = b.router.pinned_tokens("a")
            b.clock.t += 299.0
            b.scrape("a", 0.5, running=1)
            await b.goes("a short one")  # a look (the long one is 299 s old: kept)
            before = b.kv()
            b.clock.t += 2.0
            await b.goes("a short one")  # a decision: the ledger sweeps
            await b.goes("another")  # the next look reads the ledger after the sweep
            return pinned, before, b.kv()
        finally:
            await b.gate.aclose()

    pinned, before, after = asyncio.run(go())
    assert pinned > 10_000
    assert before == pytest.approx(0.5, abs=0.01)
    assert after is not None and after >= 0.49, after


def test_a_retried_request_moves_its_prompt_to_the_replica_serving_it() -> None:
    """A retry (flow.moved: Router.retried, then Gate.moved) takes the request's prompt
    out of the replica that never received it and into the one serving it: `a` scraped
    with it in flight reads its prompt gone, `b` scraped before it reads it added.
    Mutation caught: Ledger.moved leaving the plan in the old replica's `live`
    (`a` keeps reading 0.9: full, for a request it never received)."""
    async def go() -> tuple[float | None, float | None]:
        b = Bench(("a", "b"))
        try:
            b.scrape("a", 0.0, 0)
            b.scrape("b", 0.3, 0)
            t = await b.send(f"retried {LONG}")
            b.clock.t += 1.0
            b.scrape("a", 0.9, running=1)
            b.scrape("b", 0.3, running=0)  # before the retry reached it
            b.router.retried(t.plan, "b", b.clock.t)
            b.fleet.replicas["a"].in_flight -= 1
            b.fleet.replicas["b"].in_flight += 1
            b.gate.moved(t, "b")
            # a look at each (either has room): the stats show what the queue read
            assert await b.goes("x", "a")
            assert await b.goes("x", "b")
            return b.kv("a"), b.kv("b")
        finally:
            await b.gate.aclose()

    a, bb = asyncio.run(go())
    assert a is not None and a < 0.75, a
    assert bb is not None and bb > 0.45, bb


def test_an_exported_scrape_interval_still_reaches_compare_gateways(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An interval the caller exported reaches compare's gateways (it broke: the scaled
    one replaced it, and bench/results/admission.md's run with one exported could no longer
    be made that way)."""
    monkeypatch.setenv("GATEWAY_USAGE__SCRAPE_INTERVAL_S", "1")
    env = gateway_env("prefix", PRESETS["overload"], 0.5)
    merged = {**os.environ, **env}  # as gateway.bench.procs.Managed starts the gateway
    assert merged["GATEWAY_USAGE__SCRAPE_INTERVAL_S"] == "1"
