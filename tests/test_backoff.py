"""The retry schedule (pure, by table) and the retrier's sleeps (a recording sleep)."""

from __future__ import annotations

import pytest

from gateway.backoff import Backoff, Retrier

EXP = Backoff(base_s=1.0, cap_s=30.0)
JITTERED = Backoff(base_s=1.0, cap_s=30.0, jitter=0.2)


@pytest.mark.parametrize(
    ("backoff", "attempt", "draw", "delay"),
    [
        (EXP, 0, 0.7, 1.0),
        (EXP, 1, 0.7, 2.0),
        (EXP, 4, 0.0, 16.0),
        (EXP, 5, 0.0, 30.0),  # 32 capped
        (EXP, 10_000, 0.0, 30.0),  # no overflow far past the cap
        (JITTERED, 0, 0.0, 1.0),
        (JITTERED, 0, 0.5, 0.9),
        (JITTERED, 3, 0.999, 8.0 * (1 - 0.2 * 0.999)),
        (JITTERED, 9, 0.5, 27.0),
        (Backoff(base_s=0.5, cap_s=10.0, factor=3.0), 2, 0.0, 4.5),
        (Backoff(base_s=2.0, cap_s=2.0), 7, 0.3, 2.0),  # constant
        (Backoff(base_s=0.0, cap_s=0.0, jitter=1.0), 3, 0.9, 0.0),  # never waits
    ],
)
def test_delay(backoff: Backoff, attempt: int, draw: float, delay: float) -> None:
    assert backoff.delay(attempt, draw) == pytest.approx(delay)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_s": -1.0, "cap_s": 1.0},
        {"base_s": 2.0, "cap_s": 1.0},
        {"base_s": 1.0, "cap_s": 2.0, "factor": 0.5},
        {"base_s": 1.0, "cap_s": 2.0, "jitter": 1.5},
    ],
)
def test_invalid_schedules(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="backoff needs"):
        Backoff(**kwargs)


async def test_retrier_sleeps_the_schedule_and_resets() -> None:
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    draws = iter([0.0, 0.5, 0.0, 0.0, 0.25])
    retrier = Retrier(JITTERED, rand=lambda: next(draws), sleep=sleep)
    assert [await retrier.wait() for _ in range(3)] == pytest.approx([1.0, 1.8, 4.0])
    retrier.reset()
    assert retrier.failures == 0
    delay = retrier.failed()
    await retrier.sleep(delay)
    assert await retrier.wait() == pytest.approx(2.0 * 0.95)
    assert slept == pytest.approx([1.0, 1.8, 4.0, 1.0, 1.9])
