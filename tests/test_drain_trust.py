"""The measured drain (shedding.py `DrainRate`): below the floors only when measured over
`trusted_span_s`, and forgotten when the queue empties (gate.py `_leave`)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.shedding import DrainRate
from tests.test_admission_engine import ask, busy, world


@pytest.mark.parametrize(("span_s", "rate"), [
    (7.0, 30_000.0),  # 8 samples over 7 s, 1,000 tokens/s: too short, the floor stands
    (9.0, 30_000.0),
    (10.0, 1_000.0),  # over the trusted span: the slow drain is believed
    (19.0, 1_000.0),
])
def test_a_slow_drain_is_believed_once_measured_long_enough(span_s: float,
                                                             rate: float) -> None:
    drain = DrainRate(floor=100.0)
    n = 8
    for i in range(n):
        drain.add(100.0 + i * span_s / (n - 1), 1_000.0 * span_s / (n - 1))
    assert drain.rate(100.0 + span_s, floor=30_000.0) == pytest.approx(rate)


def test_cleared_it_measures_afresh() -> None:
    drain = DrainRate(floor=100.0)
    for i in range(20):
        drain.add(100.0 + i, 10.0)
    assert drain.rate(119.0) == pytest.approx(10.0)
    drain.clear()
    assert drain.rate(119.0) == 100.0


def test_the_gate_forgets_its_drain_when_its_queue_empties() -> None:
    """Samples from an earlier overload, then a quiet spell: once the last waiter left,
    the gate's drain holds only what was measured since, not the spell between."""
    async def run() -> tuple[int, int]:
        g, _, fleet, _, _ = world(replica_max_in_flight=1)
        a = fleet.replicas["a"]
        fleet.replicas["b"].healthy = False
        for i in range(20):
            g._drain.add(1.0 + i, 1000.0)  # an old overload's drain
        (held,) = await busy(g, fleet, "a", 1)
        waiter = asyncio.create_task(g.admit(ask("w"), [a]))
        for _ in range(200):  # bounded: until it is queued
            if g.stats()["queued"]["normal"] == 1:
                break
            await asyncio.sleep(0.001)
        queued = len(g._drain._samples or [])
        a.in_flight -= 1
        held.plan.outcome.prompt_tokens = 8
        g.done(held)
        ticket = await asyncio.wait_for(waiter, 5)
        left = len(g._drain._samples or [])
        g.done(ticket)
        await g.aclose()
        return queued, left
    queued, left = asyncio.run(run())
    assert queued == 20  # kept while a request waits
    assert left == 1  # the release that emptied the queue, nothing older
