"""Review 47 of issue 36's throttle (engine.py, fleetview.py, room.py): faults while
requests wait, odd engine output, and time. Each test here is a break the review found,
first left as `xfail(strict=True)` with a reason saying what a fix must do; all eight are
fixed (branch fix47) and the markers gone, so each now guards its fix.

Pure where the decision is (engine.py `learn`, `view`; prefillrate.py `learn_rate`);
through `FleetView` (no sockets, the clock given) where the break is in how the scrapes
are read together (a restart, two scrapes showing an engine that begins nothing)."""

from __future__ import annotations

import asyncio
import math

import pytest

from gateway.admission.config import AdmissionConfig
from gateway.admission.engine import PROBE_SEQS, Capacity, Scrape, learn, view
from gateway.admission.fleetview import FleetView
from gateway.admission.gate import Ask, Gate
from gateway.admission.prefillrate import PrefillRate, learn_rate
from gateway.admission.room import ReplicaLoad, RoomLimits, has_room, prefill_room
from gateway.replicas.fleet import Fleet
from gateway.routing.config import RoutingConfig
from gateway.routing.router import Router
from gateway.settings import ReplicaSettings
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.snapshot import EngineSnapshot

COST_MODEL = RoutingConfig().prefill_s_per_token  # 33 us/token: 30k tokens/s
# the gate's limits for `high` and for `normal` (gate.py), at the default settings
FULL = RoomLimits(math.inf, 32_768, 0.97, sized_s_per_token=COST_MODEL)


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def one_replica() -> tuple[FleetView, Router, Fleet, Clock]:
    router = Router(RoutingConfig())
    fleet = Fleet([ReplicaSettings(name="a", url="http://a:8000", models=("m",))])
    fleet.replicas["a"].healthy = True
    clock = Clock()
    return FleetView(fleet, router, clock, 15.0, None), router, fleet, clock


def snap(ts: float, running: float, waiting: float, prompt_total: float | None = None,
         kv: float | None = None, started: float | None = 1.0) -> EngineSnapshot:
    return EngineSnapshot(ts, kv, running, waiting, None, None, prompt_total, None, None,
                          None, process_start_time_seconds=started)


def scraped(fleet: Fleet, clock: Clock, s: EngineSnapshot, own: int) -> None:
    fleet.set_snapshot("a", s, clock.t, own)


# -- a replica restarted while requests wait for it -----------------------------------------

def test_a_restarted_engine_is_held_to_the_guess_until_its_next_scrape() -> None:
    fv, router, fleet, clock = one_replica()
    a = fleet.replicas["a"]
    fleet.set_start_time("a", 1.0)
    scraped(fleet, clock, snap(clock.t, 6, 0), own=6)
    before = fv.load(a, 6, 0.0, 0.0)
    assert before.seq_limit == 12  # 2 x the 6 it took in
    # the engine restarts (a new process start time): the gateway's requests there died
    clock.t += 5.0
    restarted = fleet.set_start_time("a", 2.0)
    assert restarted
    router.replica_restarted("a", clock.t, 2.0, sign="counters")
    scraped(fleet, clock, snap(clock.t, 0, 0, started=2.0), own=0)
    clock.t += 0.1
    after = fv.load(a, 20, 0.0, 0.0)  # 20 of the queue's waiters sent to it since
    assert after.seq_limit is not None and after.seq_limit <= PROBE_SEQS
    assert not has_room(after, FULL)


# -- an engine that begins nothing: its waiting count must not drain ------------------------

@pytest.mark.parametrize(("running", "waiting", "kv"), [
    (0, 5, 0.1),  # nothing runs, five wait, for 5 s: a stalled engine
    (3, 2, 0.95),  # three decode, two wait for KV blocks (usage below the 0.97 limit)
])
def test_a_waiting_count_the_engine_does_not_move_keeps_holding(
        running: int, waiting: int, kv: float) -> None:
    fv, _, fleet, clock = one_replica()
    a = fleet.replicas["a"]
    own = running + waiting
    scraped(fleet, clock, snap(clock.t, 10, 0, 50_000.0), own=10)  # it ran 10 before
    fv.load(a, 10, 0.0, 0.0)
    for _ in range(2):  # two scrapes, 5 s apart: the same queue, not a token prefilled
        clock.t += 5.0
        scraped(fleet, clock, snap(clock.t, running, waiting, 60_000.0, kv), own=own)
        fv.load(a, own, 0.0, 0.0)
    clock.t += 3.0
    load = fv.load(a, own, 0.0, 0.0)
    assert load.engine_waiting == waiting
    assert not has_room(load, FULL)


# -- a learnt limit that is not the engine's --------------------------------------------------

def learnt(scrapes: list[Scrape]) -> Capacity:
    cap = Capacity()
    for s in scrapes:
        cap = learn(cap, s)
    return cap


def test_a_queue_held_by_the_kv_cache_is_not_a_sequence_limit() -> None:
    kv_bound = [Scrape(0.0, 3, 2, 0.96, 5), Scrape(5.0, 3, 2, 0.96, 5)]
    quiet = [Scrape(10.0 + 5 * k, 3, 0, 0.2, 3) for k in range(60)]  # 5 minutes
    cap = learnt(kv_bound + quiet)
    assert cap.seq_limit is not None and cap.seq_limit > 3


def test_a_learnt_limit_the_engine_never_confirms_again_is_probed() -> None:
    coincidence = [Scrape(0.0, 7, 0, 0.3, 7), Scrape(5.0, 7, 2, 0.3, 9),
                   Scrape(10.0, 7, 1, 0.3, 8)]
    assert learnt(coincidence).seq_limit == 7
    quiet = [Scrape(15.0 + 5 * k, 7, 0, 0.3, 7) for k in range(60)]
    limit = learnt(coincidence + quiet).seq_limit
    assert limit is not None and limit > 7


# -- the prefill rate: an over-estimate is kept for the engine's life ------------------------

def rate_after(samples: list[tuple[float, float, float]]) -> PrefillRate:
    rate = PrefillRate()
    for ts, computed, waiting in samples:
        rate = learn_rate(rate, ts, computed, 0.0, waiting, COST_MODEL)
    return rate


def test_one_high_sample_does_not_set_the_rate_for_the_engines_life() -> None:
    samples = [(0.0, 0.0, 0.0), (5.0, 1_500_000.0, 0.0)]  # 300k tokens/s, once
    samples += [(5.0 + 5 * k, 1_500_000.0 + 150_000.0 * k, 0.0) for k in range(1, 721)]
    rate = rate_after(samples)
    assert rate.tokens_per_s is not None and rate.tokens_per_s < 60_000.0
    load = ReplicaLoad("a", 1, 0.0, prefill_s_per_token=rate.s_per_token())
    assert prefill_room(load, FULL) < 2 * 32_768


def test_a_scrape_missing_its_cache_hit_counter_is_no_sample() -> None:
    rate, prompt, hits = PrefillRate(), 0.0, 0.0
    for k in range(61):  # 5 minutes: 40k computed + 10k hit tokens/s, nothing waiting
        rate = learn_rate(rate, 5.0 * k, prompt, hits, 0.0, COST_MODEL)
        prompt, hits = prompt + 250_000.0, hits + 50_000.0
    assert rate.tokens_per_s == pytest.approx(40_000.0)
    rate = learn_rate(rate, 305.0, prompt, None, 0.0, COST_MODEL)  # the hits line absent
    assert rate.tokens_per_s is not None and rate.tokens_per_s < 60_000.0


# -- clocks: a scrape's time is the wall clock ------------------------------------------------

def test_a_scrape_dated_after_now_is_not_fresh_for_ever() -> None:
    seen = Scrape(ts=4600.0, running=4, waiting=9, kv_usage=0.98, own_at_scrape=0)
    got = view(seen, learn(Capacity(), seen), 1, now=1000.0, max_age_s=15.0)
    assert got.source == "gateway"


# -- scrapes are folded only when the gate reads a load --------------------------------------

def test_two_bursts_minutes_apart_do_not_make_a_sequence_limit() -> None:
    fv, _, fleet, clock = one_replica()
    a = fleet.replicas["a"]
    scraped(fleet, clock, snap(clock.t, 7, 0), own=7)  # it took 7 in: the guess, 14
    fv.load(a, 7, 0.0, 0.0)
    clock.t += 5.0
    scraped(fleet, clock, snap(clock.t, 7, 2), own=9)  # long prompts wait for the budget
    fv.load(a, 9, 0.0, 0.0)
    for _ in range(120):  # ten idle minutes, scraped every 5 s, no request: no look
        clock.t += 5.0
        scraped(fleet, clock, snap(clock.t, 0, 0), own=0)
    clock.t += 5.0
    scraped(fleet, clock, snap(clock.t, 7, 1), own=8)  # the next burst's first scrape
    load = fv.load(a, 8, 0.0, 0.0)
    assert load.seq_limit is not None and load.seq_limit > 7


def test_an_idle_gap_between_two_folds_is_not_a_slow_engine() -> None:
    fv, _, fleet, clock = one_replica()
    a = fleet.replicas["a"]
    total = 0.0
    for _ in range(4):  # busy: a queue at each scrape, 500k tokens in 5 s
        scraped(fleet, clock, snap(clock.t, 6, 2, total), own=8)
        fv.load(a, 8, 0.0, 0.0)
        clock.t += 5.0
        total += 500_000.0
    before = fv.s_per_token("a")
    assert before == pytest.approx(1 / 100_000)
    for _ in range(120):  # ten idle minutes, scraped, no look
        scraped(fleet, clock, snap(clock.t, 0, 0, total), own=0)
        clock.t += 5.0
    scraped(fleet, clock, snap(clock.t, 6, 2, total + 20_000.0), own=8)  # the next burst
    fv.load(a, 8, 0.0, 0.0)
    assert fv.s_per_token("a") == pytest.approx(before)


def test_waiters_held_for_a_restarting_replica_do_not_all_go_at_its_restart() -> None:
    async def run() -> int:
        router = Router(RoutingConfig())
        fleet = Fleet([ReplicaSettings(name="a", url="http://a:8000", models=("m",))])
        a = fleet.replicas["a"]
        a.healthy = True
        clock = Clock()
        g = Gate(AdmissionConfig(enabled=True), RoutingConfig(), router, GatewayMetrics(),
                 clock, clock, fleet=fleet, scrape_interval_s=5.0)
        fleet.set_start_time("a", 1.0)
        scraped(fleet, clock, snap(clock.t, 8, 0), own=8)  # it took 8 in: the guess, 16

        def low(text: str) -> Ask:
            return Ask({"model": "m", "messages": [{"role": "user", "content": text}]},
                       "chat", "m", None, None, "t", b"low", clock.t)
        held = []
        for i in range(12):  # `low`'s 0.75 of 16, sent at once
            held.append(await g.admit(low(f"running {i}"), [a]))
            a.in_flight += 1
        waiters = [asyncio.create_task(g.admit(low(f"waiting {i}"), [a])) for i in range(40)]
        try:
            await asyncio.sleep(0)  # each task to its place in the queue
            assert g.stats()["queued"]["low"] == 40
            # the engine restarts: a new process, nothing running; its requests end
            clock.t += 5.0
            assert fleet.set_start_time("a", 2.0)
            router.replica_restarted("a", clock.t, 2.0, sign="counters")
            # its first scrape (a restart loads the model for a while: the requests it
            # dropped ended before it answers)
            scraped(fleet, clock, snap(clock.t, 0, 0, started=2.0), own=0)
            for t in held:
                a.in_flight -= 1
                t.plan.outcome.prompt_tokens = 8  # not doubted: the probes say it is up
                g.done(t)
            left: int = g.stats()["queued"]["low"]
            return 40 - left  # sent to the fresh engine at once
        finally:
            for w in waiters:
                w.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
            await g.aclose()
    assert asyncio.run(run()) <= PROBE_SEQS
