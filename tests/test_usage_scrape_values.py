"""Every parser of what a replica sends takes any value without raising, with a defined
meaning (by table): `/metrics` samples and `cache_config_info` labels (vLLM and llama.cpp
names), KV event batches, `/kv_event_sources`, `/tokenize` for the parity probe. And the
error boundary of background loops (gateway/tasks.py): an error is logged, rate-limited,
and the loop goes on."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import pytest

from gateway.backoff import Backoff
from gateway.events.decode import EventDecodeError, decode_payload
from gateway.events.source import SourceError, parse_sources
from gateway.replicas.scrape import MAX_SAMPLE_LINES, parse_engine_metrics
from gateway.tasks import FailureLog, every, supervised
from gateway.usage.snapshot import EngineSnapshot

ODD = ["inf", "+Inf", "-Inf", "NaN", "nan", "1e308", "-1e308", "1e999", "-5", "-0.5", "2.5e15",
       "abc", "", "0x10", "1" * 400, "-" + "1" * 400]


def info(block_size: str, blocks: str) -> str:
    return f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{blocks}"}} 1\n'


@pytest.mark.parametrize("value", ODD)
@pytest.mark.parametrize("name", [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "process_start_time_seconds",
    "llamacpp:requests_processing", "llamacpp:prompt_tokens_total",
    "llamacpp:kv_cache_usage_ratio", "llamacpp:tokens_predicted_total",
])
def test_an_odd_sample_value_is_no_reading(name: str, value: str) -> None:
    """NaN, infinities, negatives, values above 1e15 and words: as if the line were absent
    (and the lines around it still read)."""
    text = f"vllm:num_requests_running 3\n{name} {value}\nvllm:num_requests_waiting 2\n"
    snap = parse_engine_metrics(text, 1.0)
    clean = parse_engine_metrics("vllm:num_requests_running 3\nvllm:num_requests_waiting 2\n",
                                 1.0)
    if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        clean = parse_engine_metrics(text.replace(f"{name} {value}\n", ""), 1.0)
    assert snap == clean, value
    for field in EngineSnapshot.__slots__:  # type: ignore[attr-defined]
        got = getattr(snap, field)
        assert got is None or 0 <= got <= 1e15


@pytest.mark.parametrize(("text", "field", "value"), [
    ("vllm:num_requests_running 1e308\nvllm:num_requests_running 2\n",
     "num_requests_running", 2.0),  # one engine's odd figure skipped, the other's summed
    ("vllm:kv_cache_usage_perc 1.5\n", "kv_cache_usage", 1.0),  # a fraction: clamped
    ("vllm:kv_cache_usage_perc 0.25\n", "kv_cache_usage", 0.25),
    ('vllm:kv_cache_usage_perc{engine="0"} 0.9\nvllm:kv_cache_usage_perc{engine="1"} 0.2\n',
     "kv_cache_usage", 0.9),  # the fullest engine, in whatever order
    ('process_start_time_seconds{a="0"} 1.7e9\nprocess_start_time_seconds{a="1"} 1.6e9\n',
     "process_start_time_seconds", 1.7e9),
    ("llamacpp:kv_cache_usage_ratio 7\n", "kv_cache_usage", 1.0),
    ("vllm:kv_cache_usage_perc 1e16\n", "kv_cache_usage", None),
    ("process_start_time_seconds 0\n", "process_start_time_seconds", None),  # unknown
    ("process_start_time_seconds 1.7e9\n", "process_start_time_seconds", 1.7e9),
    ("vllm:prompt_tokens_total 1e15\n", "prompt_tokens_total", 1e15),  # the bound itself
    ("llamacpp:prompt_tokens_total 10\nllamacpp:prompt_tokens_cached_total inf\n",
     "prefix_cache_queries_total", None),  # no cached counter read: no queries either
    ("llamacpp:prompt_tokens_total 10\nllamacpp:prompt_tokens_cached_total 4\n",
     "prefix_cache_queries_total", 14.0),
])
def test_values_read_as_defined(text: str, field: str, value: float | None) -> None:
    assert getattr(parse_engine_metrics(text, 0.0), field) == value


@pytest.mark.parametrize(("block_size", "blocks", "capacity"), [
    ("16", "1000", 16_000),
    ("16.0", "1e3", 16_000),  # whole numbers written as floats
    *[(odd, "1000", None) for odd in ODD],
    *[("16", odd, None) for odd in ODD],
    ("16.5", "1000", None),  # not whole
    ("0" * 40 + "16", "1000", None),  # over 32 characters: not read at all
    ("0", "1000", None),  # no block of 0 tokens
    ("16", "0", None),
    ("16", str(2**32), 16 * 2**32),  # the bound itself
    ("16", str(2**32 + 1), None),
])
def test_cache_config_labels(block_size: str, blocks: str, capacity: int | None) -> None:
    snap = parse_engine_metrics(info(block_size, blocks), 0.0)
    assert snap.capacity_tokens == capacity


def test_a_whole_scrape_of_odd_values_parses() -> None:
    text = "".join(f"{name} {v}\n" for v in ODD for name in (
        "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
        "process_start_time_seconds", "vllm:prompt_tokens_total")) + \
        "".join(info(v, v) for v in ODD) + 'vllm:cache_config_info{block_size="16"} 1\n'
    snap = parse_engine_metrics(text, 0.0)
    assert snap.block_size == 16 and snap.num_gpu_blocks is None


@pytest.mark.parametrize("odd", [False, True])
def test_a_page_is_read_up_to_a_bounded_number_of_wanted_lines(odd: bool) -> None:
    """The parse runs on the event loop: a page of a million wanted lines (or of odd ones,
    parsed again line by line) costs what MAX_SAMPLE_LINES of them cost, the first ones."""
    junk = "vllm:num_requests_running{engine=\"x\" junk\n" if odd else ""
    page = (junk + 'vllm:num_requests_running{engine="0"} 1\n') * (MAX_SAMPLE_LINES + 50)
    page += "vllm:num_requests_waiting 7\n"  # after the bound: never read
    snap = parse_engine_metrics(page, 0.0)
    read = MAX_SAMPLE_LINES // 2 if odd else MAX_SAMPLE_LINES
    assert (snap.num_requests_running, snap.num_requests_waiting) == (read, None)


def batch(*events: object, ts: object = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, list(events), None])


@pytest.mark.parametrize(("payload", "ok"), [
    (batch({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1, 2], "block_size": 2}), True),
    (batch({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [-1, 2], "block_size": 2}), False),  # no negative token id
    (batch({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [2**64 - 1, 2], "block_size": 2}), True),  # the largest
    (batch({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [1.5, 2], "block_size": 2}), False),
    (batch({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
            "token_ids": [], "block_size": 0}), False),
    (batch(ts=float("nan")), True),  # the batch time is not read
    (batch(ts=float("inf")), True),
    (batch(ts="soon"), False),
    (batch(["BlockRemoved", [2**63]]), True),
])
def test_kv_event_batches(payload: bytes, ok: bool) -> None:
    try:
        decode_payload(1, payload)
    except EventDecodeError:
        assert not ok
    else:
        assert ok


def test_decoded_token_ids_hash_without_raising() -> None:
    from gateway.tokens.chain import chain_token_hashes

    got = decode_payload(1, batch({"type": "BlockStored", "block_hashes": [1],
                                   "parent_block_hash": None, "token_ids": [2**64 - 1, 0],
                                   "block_size": 2}))
    stored = got.events[0]
    assert len(chain_token_hashes(stored.token_ids, 0, 2)) == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("port", ["²", "٣", "99999", "0", "-1", "1" * 5000, "", "1e3", "inf"])
def test_an_event_source_port_that_is_no_port_is_refused(port: str) -> None:
    doc = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    with pytest.raises(SourceError):
        parse_sources(doc, "http://r.test:8000")


def test_an_event_source_port_is_read() -> None:
    doc = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"}
    assert parse_sources(doc, "http://r.test:8000")[0].endpoint == "tcp://r.test:5557"


# the error boundary ----------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("failures", "logged"), [
    ([("scrape a", 0.0)], [True]),
    ([("scrape a", 0.0), ("scrape a", 30.0), ("scrape a", 59.0)], [True, False, False]),
    ([("scrape a", 0.0), ("scrape a", 60.0)], [True, True]),
    ([("scrape a", 0.0), ("scrape b", 1.0)], [True, True]),  # per kind
])
def test_failures_are_logged_rate_limited(failures: list[tuple[str, float]],
                                          logged: list[bool]) -> None:
    clock = Clock()
    log = FailureLog(logging.getLogger("test"), 60.0, clock=clock)
    got = []
    for what, at in failures:
        clock.now = at
        got.append(log.failed(what, RuntimeError("x")))
    assert got == logged and log.failures == len(failures)


def test_the_failure_log_remembers_a_bounded_number_of_kinds() -> None:
    clock = Clock()
    log = FailureLog(logging.getLogger("test"), 60.0, clock=clock, capacity=2)
    assert [log.failed(w, RuntimeError()) for w in "abc"] == [True] * 3
    assert log.failed("c", RuntimeError()) is False
    assert log.failed("a", RuntimeError()) is True  # forgotten first: logged again


def test_a_logged_line_counts_the_failures_not_logged_since(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    log = FailureLog(logging.getLogger("test.count"), 60.0, clock=clock)
    with caplog.at_level(logging.ERROR, logger="test.count"):
        for at in (0.0, 10.0, 20.0, 60.0, 70.0, 120.0):
            clock.now = at
            log.failed("scrape a", RuntimeError())
    assert [r.not_logged for r in caplog.records] == [0, 2, 1]  # type: ignore[attr-defined]


def test_the_kind_logged_longest_ago_is_forgotten_first() -> None:
    clock = Clock()
    log = FailureLog(logging.getLogger("test"), 60.0, clock=clock, capacity=2)
    for what, at in (("a", 0.0), ("b", 1.0), ("a", 100.0), ("c", 101.0)):  # b goes
        clock.now = at
        assert log.failed(what, RuntimeError()) is True
    clock.now = 102.0
    assert log.failed("a", RuntimeError()) is False  # logged at 100, still remembered
    assert log.failed("b", RuntimeError()) is True


async def test_a_supervised_loop_that_ran_long_starts_its_backoff_over() -> None:
    clock = Clock()
    slept: list[float] = []
    runs = [1.0, 1.0, 100.0, 1.0, None]  # how long each run lasts before failing; None: ends

    async def loop() -> None:
        length = runs.pop(0)
        if length is None:
            return
        clock.now += length
        raise RuntimeError("the Redis reader broke")

    async def sleep(delay: float) -> None:
        slept.append(delay)

    await asyncio.wait_for(supervised("reader", loop, FailureLog(logging.getLogger("t")),
                                      sleep=sleep, clock=clock,
                                      retry=Backoff(base_s=0.5, cap_s=30.0)), 10)
    assert slept == [0.5, 1.0, 0.5, 1.0]  # the run of 100 s > the cap: from the base again


async def test_a_periodic_action_goes_on_after_errors() -> None:
    runs = 0
    done = asyncio.Event()

    async def action() -> None:
        nonlocal runs
        runs += 1
        if runs == 5:
            done.set()
        raise OverflowError("cannot convert float infinity to integer")

    log = FailureLog(logging.getLogger("test"))
    task = asyncio.create_task(every(0.0, action, "scrapes", log))
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        task.cancel()
    assert log.failures >= 4


async def test_a_supervised_loop_starts_again_after_an_error_and_ends_when_it_returns(
) -> None:
    runs = 0
    slept: list[float] = []

    async def loop() -> None:
        nonlocal runs
        runs += 1
        if runs < 4:
            raise KeyError("a fact this router cannot apply")

    async def sleep(delay: float) -> None:
        slept.append(delay)

    log = FailureLog(logging.getLogger("test"))
    await asyncio.wait_for(supervised("reader", loop, log, sleep=sleep,
                                      retry=Backoff(base_s=0.5, cap_s=30.0)), 10)
    assert runs == 4 and slept == [0.5, 1.0, 2.0] and log.failures == 3


async def test_cancellation_still_ends_a_supervised_loop() -> None:
    started = asyncio.Event()

    async def loop() -> None:
        started.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(supervised("reader", loop, FailureLog(logging.getLogger("t"))))
    await asyncio.wait_for(started.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)


def test_an_empty_stored_event_teaches_no_block_size() -> None:
    from gateway.events.decode import BlockStored
    from gateway.events.kvindex import KVIndex

    index = KVIndex()
    index.add_replica("r", "m")
    index.apply("r", [BlockStored((), None, (), 2**62)], 0.0)  # no blocks, an odd size
    index.apply("r", [BlockStored((7,), None, (1, 2), 2)], 0.0)
    state = index.state("r")
    assert state is not None and state.block_size == 2
