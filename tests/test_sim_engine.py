"""Engine model of the simulator: prefix cache, pool, scheduler, timing (pure, simulated time)."""

from __future__ import annotations

import pytest

from gateway.sim.engine import Engine, EngineConfig
from gateway.sim.hitrate import HitRateWindow
from gateway.sim.pool import BlockPool
from gateway.sim.request import SimRequest
from gateway.sim.steptime import StepTimeModel
from gateway.sim.tokenizer import IM_END_ID, Tokenizer

NO_JITTER = StepTimeModel(jitter=0.0)


def make_engine(**kw: object) -> Engine:
    cfg = {"num_gpu_blocks": 4096, "step_time": NO_JITTER, **kw}
    return Engine(EngineConfig(**cfg), Tokenizer())  # type: ignore[arg-type]


def prompt(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


def drain(engine: Engine, now: float = 0.0) -> float:
    """Run steps back to back until idle; returns the simulated end time."""
    for _ in range(100_000):
        if not engine.has_work():
            return now
        plan, duration = engine.plan_step(0.5, now)
        now += duration
        engine.finish_step(plan, now)
    raise AssertionError("engine did not drain")


def submit(
    engine: Engine, ids: list[int], now: float, max_tokens: int | None = 4, salt: bytes = b""
) -> SimRequest:
    req = engine.new_request(f"r{now}", ids, max_tokens, now, IM_END_ID, salt)
    engine.add(req)
    return req


@pytest.mark.parametrize(
    ("n", "cached"),
    [(10, 0), (16, 0), (17, 16), (32, 16), (33, 32), (1000, 992), (4096, 4080)],
)
def test_repeated_prompt_table(n: int, cached: int) -> None:
    engine = make_engine()
    first = submit(engine, prompt(n), 0.0)
    t = drain(engine)
    second = submit(engine, prompt(n), t)
    drain(engine, t)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == cached


@pytest.mark.parametrize(
    ("n", "expected"),
    [(1000, [0.0, 49.6, 66.1, 74.4, 79.4]), (48, [0.0, 33.3, 44.4, 50.0, 53.3])],
)
def test_hit_rate_series_of_identical_requests(n: int, expected: list[float]) -> None:
    engine = make_engine()
    t = 0.0
    series = []
    for _ in expected:
        submit(engine, prompt(n), t)
        t = drain(engine, t)
        series.append(round(engine.hit_rate.rate() * 100, 1))
    assert series == expected


def test_hit_rate_series_approaches_k_minus_1_over_k() -> None:
    w = HitRateWindow()
    rates = []
    for k in range(5):
        w.observe(1, 1600, 0 if k == 0 else 1600)
        rates.append(round(w.rate() * 100, 1))
    assert rates == [0.0, 50.0, 66.7, 75.0, 80.0]


def test_hit_rate_window_drops_whole_oldest_records_and_keeps_newest() -> None:
    w = HitRateWindow(max_requests=1000)
    w.observe(600, 600, 0)
    w.observe(600, 600, 600)  # 1200 > 1000: the first record goes
    assert (w.requests, w.rate()) == (600, 1.0)
    w.observe(5000, 5000, 0)  # alone above the cap, but the newest is always kept
    assert (w.requests, w.queries, w.hits) == (5000, 5000, 0)
    w.observe(0, 0, 0)  # empty steps are ignored
    assert w.requests == 5000
    w.reset()
    assert (w.requests, w.rate()) == (0, 0.0)


def test_reset_prefix_cache_clears_hits_and_window() -> None:
    engine = make_engine()
    submit(engine, prompt(100), 0.0)
    t = drain(engine)
    assert engine.reset_prefix_cache()
    assert engine.hit_rate.requests == 0
    again = submit(engine, prompt(100), t)
    drain(engine, t)
    assert again.num_cached_tokens == 0


def test_reset_refused_while_blocks_in_use() -> None:
    engine = make_engine()
    submit(engine, prompt(100), 0.0)
    engine.plan_step(0.5, 0.0)
    assert not engine.reset_prefix_cache()


def test_cache_salt_isolates_and_same_salt_shares() -> None:
    engine = make_engine()
    t = 0.0
    got = []
    for salt in (b"", b"salt\x00a", b"salt\x00b", b"salt\x00a", b""):
        req = submit(engine, prompt(200), t, salt=salt)
        t = drain(engine, t)
        got.append(req.num_cached_tokens)
    assert got == [0, 0, 0, 192, 192]


@pytest.mark.parametrize(
    ("ops", "free_order", "cached_ids"),
    [
        # Freed blocks go to the tail in reverse (deepest first): 4,5 were never used.
        ([("cache", 3), ("free_rev", [1, 2, 3])], [4, 5, 3, 2, 1], [1, 2, 3]),
        # Allocating pops from the head: 4, 5, then block 3 (the chain tail) is evicted.
        ([("cache", 3), ("free_rev", [1, 2, 3]), ("alloc", 3)], [2, 1], [1, 2]),
        # A hit touches: block 2 leaves the free queue and survives a full allocation.
        ([("cache", 3), ("free_rev", [1, 2, 3]), ("touch", [2]), ("alloc", 4)], [], [2]),
        # LRU across requests: the one freed first loses its tail (2) first.
        (
            [("cache", 4), ("free_rev", [1, 2]), ("free_rev", [3, 4]), ("alloc", 2)],
            [1, 4, 3],
            [1, 3, 4],
        ),
        # Nothing is evicted before a cached block is popped.
        ([("cache", 2), ("free_rev", [1, 2]), ("alloc", 3)], [2, 1], [1, 2]),
    ],
)
def test_pool_eviction_order(
    ops: list[tuple[str, object]], free_order: list[int], cached_ids: list[int]
) -> None:
    pool = BlockPool(6)
    for op, arg in ops:
        if op == "cache":
            for b in pool.allocate(arg):  # type: ignore[arg-type]
                pool.cache(b, 1000 + b.block_id)
        elif op == "alloc":
            pool.allocate(arg)  # type: ignore[arg-type]
        elif op == "free_rev":
            pool.free(pool.blocks[i] for i in reversed(arg))  # type: ignore[call-overload]
        elif op == "touch":
            pool.touch(pool.blocks[i] for i in arg)  # type: ignore[attr-defined]
    assert pool.free_order() == free_order
    assert [i for i in range(1, 6) if pool.lookup(1000 + i) is not None] == cached_ids


def test_pool_usage_counts_cached_unreferenced_blocks_as_free() -> None:
    pool = BlockPool(11)
    blocks = pool.allocate(5)
    assert pool.usage() == pytest.approx(0.5)
    for b in blocks:
        pool.cache(b, b.block_id)
    pool.free(reversed(blocks))
    assert pool.usage() == 0.0
    assert pool.lookup(3) is blocks[2]


def test_eviction_under_tiny_pool_loses_the_oldest_prefix() -> None:
    # 8 usable blocks of 16 tokens: two 64-token prompts do not both stay cached.
    engine = make_engine(num_gpu_blocks=9)
    t = 0.0
    for base in (1000, 5000, 9000):
        submit(engine, prompt(64, base), t, max_tokens=1)
        t = drain(engine, t)
    newest = submit(engine, prompt(64, 9000), t, max_tokens=1)
    t = drain(engine, t)
    oldest = submit(engine, prompt(64, 1000), t, max_tokens=1)
    drain(engine, t)
    assert newest.num_cached_tokens == 48
    assert oldest.num_cached_tokens == 0
    assert engine.pool.evictions > 0


def test_blocks_are_registered_at_scheduling_time() -> None:
    # A 20k-token prompt takes 3 chunked steps; a twin admitted after the first step already
    # hits the blocks the first request is still prefilling.
    engine = make_engine(num_gpu_blocks=8192)
    first = submit(engine, prompt(20000), 0.0)
    plan, d = engine.plan_step(0.5, 0.0)
    engine.finish_step(plan, d)
    assert first.num_computed == 8192 and first.first_token is None
    twin = submit(engine, prompt(20000), d)
    drain(engine, d)
    assert twin.num_cached_tokens >= 8192


def test_finished_request_frees_its_blocks() -> None:
    engine = make_engine()
    submit(engine, prompt(500), 0.0, max_tokens=50)
    _, d = engine.plan_step(0.5, 0.0)
    assert engine.pool.usage() > 0
    drain(engine, d)
    assert engine.pool.usage() == 0.0
    assert engine.gauges().running == 0


def test_abort_frees_blocks_and_counts_abort() -> None:
    engine = make_engine()
    req = submit(engine, prompt(500), 0.0, max_tokens=50)
    plan, d = engine.plan_step(0.5, 0.0)
    assert engine.abort(req, d)
    engine.finish_step(plan, d)
    assert engine.pool.usage() == 0.0
    assert engine.metrics.counters.success["abort"] == 1
    assert not engine.has_work()


def test_preemption_of_newest_when_decode_cannot_allocate() -> None:
    # 6 usable blocks: two requests each holding 2 full blocks need a 3rd one to decode on.
    engine = make_engine(num_gpu_blocks=7, max_model_len=4096)
    a = submit(engine, prompt(32, 1000), 0.0, max_tokens=40)
    b = submit(engine, prompt(32, 5000), 0.0, max_tokens=40)
    drain(engine)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert engine.metrics.counters.preemptions >= 1
    assert a.finish_reason == b.finish_reason == "length"
    assert b.num_cached_tokens == 0  # set once, at first scheduling


def ttft(engine: Engine, ids: list[int], now: float) -> float:
    req = submit(engine, ids, now, max_tokens=1)
    end = drain(engine, now)
    assert req.first_token is not None
    return req.first_token - req.arrival if end else 0.0


def test_ttft_grows_with_uncached_tokens_and_cached_prompt_is_much_faster() -> None:
    engine = make_engine(num_gpu_blocks=8192)
    t1k = ttft(engine, prompt(1000, 10), 0.0)
    t8k = ttft(engine, prompt(8000, 20000), 10.0)
    t32k = ttft(engine, prompt(32000, 40000), 20.0)
    cached = ttft(engine, prompt(32000, 40000), 30.0)
    assert 0.030 < t1k < 0.070
    assert 0.25 < t8k < 0.40
    assert 1.0 < t32k < 2.0
    assert t1k < t8k < t32k
    assert cached < t32k / 20


def test_ttft_grows_with_queueing() -> None:
    engine = make_engine(num_gpu_blocks=8192)
    reqs = [submit(engine, prompt(4000, 100_000 * (i + 1)), 0.0, max_tokens=1) for i in range(8)]
    drain(engine)
    ttfts = [r.first_token - r.arrival for r in reqs]  # type: ignore[operator]
    assert ttfts == sorted(ttfts) and ttfts[-1] > 2.5 * ttfts[0]
    assert reqs[-1].first_scheduled is not None and reqs[-1].first_scheduled > 0


def test_decode_step_time_grows_with_batch_context() -> None:
    model = StepTimeModel(jitter=0.0)
    single = model.duration(1000, 0, 0, 0.5)
    batch = model.duration(64 * 2000, 0, 0, 0.5)
    assert single == pytest.approx(0.0015 + 0.0048 + 1000 * 0.039e-6)
    assert batch > 1.7 * single
    with_chunk = model.duration(1000, 8192, 8192**2, 0.5)
    assert with_chunk > 0.25  # the generation stall of a full prefill chunk


def test_jitter_is_bounded_and_seeded() -> None:
    model = StepTimeModel(jitter=0.1)
    assert model.duration(0, 0, 0, 0.0) == pytest.approx(0.0063 * 0.9)
    assert model.duration(0, 0, 0, 0.999999) == pytest.approx(0.0063 * 1.1, rel=1e-5)


def test_generation_is_deterministic_for_a_seed() -> None:
    outs = []
    for seed in (1, 1, 2):
        engine = make_engine(seed=seed)
        req = submit(engine, prompt(100), 0.0, max_tokens=30)
        drain(engine)
        outs.append(req.output_ids)
    assert outs[0] == outs[1] != outs[2]


def test_natural_stop_without_max_tokens() -> None:
    engine = make_engine(output_len=20)
    req = submit(engine, prompt(100), 0.0, max_tokens=None)
    drain(engine)
    assert req.finish_reason == "stop"
    assert req.output_ids[-1] == IM_END_ID
    assert 10 <= req.num_output_tokens <= 31


def test_metrics_counters_track_queries_hits_tokens() -> None:
    engine = make_engine()
    t = 0.0
    for _ in range(2):
        submit(engine, prompt(1000), t, max_tokens=5)
        t = drain(engine, t)
    c = engine.metrics.counters
    assert (c.prefix_queries, c.prefix_hits) == (2000, 992)
    assert (c.prompt_tokens, c.prompt_tokens_cached, c.generation_tokens) == (2000, 992, 10)
    assert c.success["length"] == 2
    text = engine.metrics.render("m", engine.gauges())
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 992.0' in text
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 2.0' in text


def test_virtual_clock_idle_wake_and_steps() -> None:
    from gateway.sim.clock import VirtualClock

    clock = VirtualClock(speed=100.0, wall=10.0)
    assert clock.now(10.5) == pytest.approx(50.0)  # idle: wall x speed
    assert clock.wake(10.5) == pytest.approx(50.0)
    assert clock.now(10.6) == pytest.approx(50.0)  # pinned until the step starts
    assert clock.begin_step(10.6, 0.2) == pytest.approx(50.0)
    assert clock.now(10.601) == pytest.approx(50.1)  # inside the step: wall x speed ...
    assert clock.now(11.0) == pytest.approx(50.2)  # ... capped at the step's end
    assert clock.end_step(11.5) == pytest.approx(50.2)  # CPU lag is not simulated time
    assert clock.begin_step(11.5, 0.1) == pytest.approx(50.2)  # back-to-back steps chain
    clock.end_step(11.6)
    clock.idle(12.0)
    assert clock.now(12.01) == pytest.approx(51.3)


def test_a_request_larger_than_the_pool_is_capped_not_stuck() -> None:
    engine = make_engine(num_gpu_blocks=5)  # 4 usable blocks = 64 tokens
    req = submit(engine, prompt(40), 0.0, max_tokens=1000)
    drain(engine)
    assert req.finish_reason == "length" and req.num_tokens <= 64
