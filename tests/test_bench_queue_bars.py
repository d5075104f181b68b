"""bench/bench_queue_bars.py's pooled figures (issue 36's bars), by table."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load

BARS = load("bench_queue_bars")


def run(off: float, on: float, off2: float = 0.0, on2: float = 0.0,
        cached: tuple[float, float] = (0.5, 0.5)) -> dict[str, dict[str, float]]:
    return {BARS.OFF: {"p99": off, "cached": cached[0]},
            BARS.ON: {"p99": on, "cached": cached[1]},
            BARS.OFF2: {"p99": off2, "cached": cached[0]},
            BARS.ON2: {"p99": on2, "cached": cached[1]}}


@pytest.mark.parametrize(("runs", "expected"), [
    # one round: the ratio is on / off, never off / on
    ([run(100, 110)], {"ratio": 1.1, "on_le_off": 0, "rounds": 1}),
    # the median of the rounds' ratios, not the ratio of medians
    ([run(100, 90), run(100, 120), run(200, 210)],
     {"ratio": 1.05, "ratio_min": 0.9, "ratio_max": 1.2, "on_le_off": 1}),
    # equal counts as at most
    ([run(100, 100), run(100, 101)], {"on_le_off": 1}),
    # cached: on - off, median over rounds
    ([run(1, 1, cached=(0.50, 0.53)), run(1, 1, cached=(0.50, 0.49)),
      run(1, 1, cached=(0.50, 0.52))], {"cached_diff": 0.02}),
])  # fmt: skip
def test_pooled(runs: list[dict[str, dict[str, float]]], expected: dict[str, float]) -> None:
    got = BARS.pooled(runs, noise=False)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
    assert "noise" not in got


def test_noise_pairs_each_configuration_with_its_twin() -> None:
    # off's twin runs 10% slower, on's twin 20% faster: the noise is both, pooled
    got = BARS.pooled([run(100, 200, off2=110, on2=160)], noise=True)
    assert got["noise_min"] == pytest.approx(0.8)
    assert got["noise_max"] == pytest.approx(1.1)
    assert got["ratio2"] == pytest.approx(160 / 110)
