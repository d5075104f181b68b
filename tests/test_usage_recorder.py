"""UsageRecorder: records reach the file/stdout sinks unchanged (0 stays 0, null stays
null), failures are counted and never raised, /stats JSON carries flags and warnings."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.backoff import Backoff, Retrier
from gateway.usage.config import UsageConfig
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.recorder import UsageRecorder
from gateway.usage.sinks import FileSink, SinkError, SinkPump, StdoutSink
from gateway.usage.snapshot import EngineSnapshot
from tests.records import usage_record as rec


def metric(m: GatewayMetrics, name: str, **labels: str) -> float | None:
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def snap(kv: float | None) -> EngineSnapshot:
    return EngineSnapshot(
        ts=1.0, kv_cache_usage=kv, num_requests_running=1.0, num_requests_waiting=0.0,
        prefix_cache_queries_total=200.0, prefix_cache_hits_total=50.0, prompt_tokens_total=200.0,
        generation_tokens_total=5.0, num_gpu_blocks=100, block_size=16,
    )  # fmt: skip


async def test_file_sink_keeps_zero_and_null(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    m = GatewayMetrics()
    r = UsageRecorder(UsageConfig(log_path=str(path)), m)
    await r.start()
    r.record(rec(request_id="zero", cached_tokens=0))
    r.record(rec(request_id="null", cached_tokens=None, ttft_ms=None, tenant=None))
    r.record(rec(request_id="hit", cached_tokens=992, tenant="acme"))
    await r.aclose()
    lines = path.read_bytes().splitlines()
    assert len(lines) == 3
    objs = [orjson.loads(line) for line in lines]
    assert [o["request_id"] for o in objs] == ["zero", "null", "hit"]
    assert objs[0]["cached_tokens"] == 0
    assert "cached_tokens" in objs[1] and objs[1]["cached_tokens"] is None
    assert objs[1]["ttft_ms"] is None and objs[1]["tenant"] is None
    assert objs[2]["cached_tokens"] == 992
    assert list(objs[0]) == list(rec().to_dict())  # schema order, every field
    # and the same truth in the stats
    s = r.stats(1000.0, {})["windows"]["1m"]
    assert s["cached_tokens"] == 992
    assert s["records_without_cached_tokens"] == 1
    assert s["cached_ratio"] == pytest.approx(992 / 2000)
    assert r.pumps[0].written == 3


async def test_stdout_sink() -> None:
    out = io.StringIO()
    m = GatewayMetrics()
    r = UsageRecorder(UsageConfig(), m, sinks=[StdoutSink(out)])
    await r.start()
    r.record(rec(cached_tokens=None))
    await r.aclose()
    assert orjson.loads(out.getvalue())["cached_tokens"] is None


async def test_unwritable_file_is_counted_not_raised(tmp_path: Path, caplog: Any) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    m = GatewayMetrics()
    # a path under a regular file cannot be opened, even as root
    r = UsageRecorder(UsageConfig(log_path=str(blocker / "usage.jsonl"), sink_retry_s=0.0), m)
    await r.start()
    with caplog.at_level(logging.WARNING, logger="gateway.usage"):
        for i in range(5):
            r.record(rec(request_id=str(i)))  # must not raise
            await asyncio.sleep(0.01)
        await r.aclose()
    errors = metric(m, "gateway_usage_sink_errors_total", sink="file")
    assert errors is not None and errors >= 1
    assert metric(m, "gateway_usage_records_dropped_total", sink="file") == 5.0
    assert r.pumps[0].dropped == 5
    # the failure is logged, rate-limited: one line for several failures
    assert sum("usage sink file failed" in m_.message for m_ in caplog.records) == 1
    stats = r.stats(1000.0, {})
    assert stats["sinks"]["file"]["errors"] == errors
    assert any("dropped 5 records" in w for w in stats["warnings"])
    # metrics and stats still saw every record
    assert metric(m, "gateway_requests_total", replica="a") == 5.0


async def test_bounded_queue_drops_and_counts() -> None:
    m = GatewayMetrics()
    out = io.StringIO()
    pump = SinkPump(StdoutSink(out), m, capacity=3, batch_size=2)
    for i in range(10):
        pump.offer(b'{"i":%d}\n' % i)  # not started: nothing drains yet
    assert pump.queued == 3 and pump.dropped == 7
    assert metric(m, "gateway_usage_records_dropped_total", sink="stdout") == 7.0
    pump.start()
    await pump.aclose()
    assert [orjson.loads(x)["i"] for x in out.getvalue().splitlines()] == [0, 1, 2]


async def test_aclose_flushes_without_start(tmp_path: Path) -> None:
    path = tmp_path / "u.jsonl"
    r = UsageRecorder(UsageConfig(log_path=str(path)), GatewayMetrics())
    r.record(rec())
    await r.aclose()
    assert len(path.read_bytes().splitlines()) == 1


async def test_file_sink_reopens_after_failure(tmp_path: Path) -> None:
    sub = tmp_path / "later"
    sink = FileSink(str(sub / "u.jsonl"))
    with pytest.raises(OSError):
        await sink.write([b"{}\n"])
    sub.mkdir()
    await sink.write([b'{"a":1}\n'])
    await sink.aclose()
    assert (sub / "u.jsonl").read_bytes() == b'{"a":1}\n'


def test_record_never_raises_on_a_broken_record() -> None:
    m = GatewayMetrics()
    r = UsageRecorder(UsageConfig(), m)
    bad = rec()
    bad.latency_ms = "not a number"  # type: ignore[assignment]
    r.record(bad)  # logged, not raised
    r.record(rec())
    assert metric(m, "gateway_requests_total", replica="a") is not None


def test_missing_cached_tokens_detection(caplog: Any) -> None:
    r = UsageRecorder(UsageConfig(), GatewayMetrics())
    with caplog.at_level(logging.WARNING, logger="gateway.usage"):
        r.record(rec(replica="old", cached_tokens=None))
        r.record(rec(replica="old", cached_tokens=None))
        r.record(rec(replica="new", cached_tokens=0))
        r.record(rec(replica="failed", cached_tokens=None, prompt_tokens=None, status=502))
        r.record(rec(replica="cold023", cached_tokens=None))
    assert r.missing_cached_tokens_replicas() == ["cold023", "old"]
    logged = [x.message for x in caplog.records if "does not report cached_tokens" in x.message]
    assert len(logged) == 2  # once per replica
    r.record(rec(replica="cold023", cached_tokens=512))  # <=0.23 with the flag: first hit
    assert r.missing_cached_tokens_replicas() == ["old"]
    r.record(rec(replica="cold023", cached_tokens=None))  # its later cold requests
    assert r.missing_cached_tokens_replicas() == ["old"]
    stats = r.stats(1000.0, {"old": None, "new": snap(0.2)})
    assert (
        "replica old does not report cached_tokens: start vLLM with "
        "--enable-prompt-tokens-details"
    ) in stats["warnings"]
    assert stats["replicas"]["old"]["reports_cached_tokens"] is False
    assert stats["replicas"]["new"]["reports_cached_tokens"] is True


@pytest.mark.parametrize(
    ("kv", "level", "warns"),
    [(None, "unknown", False), (0.5, "ok", False), (0.85, "warn", True), (0.94, "warn", True),
     (0.95, "critical", True), (1.0, "critical", True)],
)  # fmt: skip
def test_kv_levels(kv: float | None, level: str, warns: bool) -> None:
    r = UsageRecorder(UsageConfig(), GatewayMetrics())
    stats = r.stats(5.0, {"a": snap(kv)})
    rep = stats["replicas"]["a"]
    assert rep["kv_level"] == level
    assert rep["capacity_tokens"] == 1600
    assert rep["engine_prefix_cache_hit_rate_since_start"] == 0.25
    assert any("replica a KV cache usage" in w for w in stats["warnings"]) is warns
    assert orjson.loads(orjson.dumps(stats)) == stats  # JSON-serialisable as is


def test_stats_windows_and_latency_warnings() -> None:
    r = UsageRecorder(UsageConfig(bucket_s=1.0), GatewayMetrics())
    for i in range(10):
        r.record(rec(ts=1000.0 - i * 31, ttft_ms=2500.0, latency_ms=2590.0, completion_tokens=2))
    stats = r.stats(1000.0, {})
    w = stats["windows"]
    assert (w["1m"]["requests"], w["5m"]["requests"], w["1h"]["requests"]) == (2, 10, 10)
    assert w["all"]["requests"] == 10
    assert any(x.startswith("TTFT p99 over the last 5 min") for x in stats["warnings"])
    assert any(x.startswith("TPOT p99") for x in stats["warnings"]) is False  # 90 ms
    assert stats["first_record_ts"] == 721.0 and stats["last_record_ts"] == 1000.0


@pytest.mark.parametrize(
    ("scraped", "configured", "expected"),
    [(True, 300, (1600, "engine")), (True, None, (1600, "engine")),
     (False, 300, (300, "config")), (False, None, (5000, "default"))],
)  # fmt: skip
def test_stats_capacity_and_its_source(
    scraped: bool, configured: int | None, expected: tuple[int, str]
) -> None:
    r = UsageRecorder(UsageConfig(), GatewayMetrics())
    stats = r.stats(5.0, {"a": snap(0.1) if scraped else None},
                    configured_capacity={"a": configured}, default_capacity_tokens=5000)
    rep = stats["replicas"]["a"]
    assert (rep["capacity_tokens"], rep["capacity_source"]) == expected


def test_startup_probe_verdict_overrides_both_ways(caplog: pytest.LogCaptureFixture) -> None:
    r = UsageRecorder(UsageConfig(), GatewayMetrics())
    with caplog.at_level(logging.WARNING, logger="gateway.usage"):
        r.probe_cached_tokens("a", False)  # before any request
        r.record(rec(replica="a", cached_tokens=None))  # already known: not logged again
        assert r.missing_cached_tokens_replicas() == ["a"]
        r.probe_cached_tokens("a", True)  # restarted with the flag
        assert r.missing_cached_tokens_replicas() == []
        assert r.stats(5.0, {"a": None})["replicas"]["a"]["reports_cached_tokens"] is True
        r.probe_cached_tokens("a", False)  # restarted without it again
        assert r.missing_cached_tokens_replicas() == ["a"]
    logged = [x for x in caplog.records if "does not report cached_tokens" in x.getMessage()]
    assert len(logged) == 2 and all("--enable-prompt-tokens-details" in x.getMessage()
                                    for x in logged)
    assert r.stats(5.0, {})["windows"]["all"]["requests"] == 1  # only the real record


def _ts_finding(tokens: int = 800) -> Any:
    from gateway.hygiene.finding import Finding

    return Finding("timestamp", "warning", "pattern", 0, "system", 23, "<timestamp:19 chars>",
                   tokens, None)


async def test_findings_held_back_are_summed_up_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An agent sending the same timestamped prompt every 5 s: one line for the first, then
    one summary a minute (on the next record once due, and from the timer while the
    recorder runs), never silence."""
    from gateway.hygiene.lograte import LogLimiter

    wall = [1000.0]
    r = UsageRecorder(UsageConfig(), GatewayMetrics(), finding_log=LogLimiter(60.0, 20, 100),
                      clock=lambda: wall[0])
    with caplog.at_level(logging.DEBUG, logger="gateway.hygiene"):
        for i in range(13):  # 1000 .. 1060
            r.record(rec(ts=1000.0 + 5 * i, findings=(_ts_finding(),)))
        lines = [x.getMessage() for x in caplog.records]
        # the first at 1000 and, its minute over, the same at 1060; the 11 between summed up
        # with the saving per hour of all 13 (10400 tokens in 60 s)
        assert lines == ["hygiene finding", "hygiene finding",
                         "11 more hygiene finding(s) in the last 60 s, not logged one by "
                         "one: timestamp (warning) x11, 8800 tokens at risk, fixing it saves "
                         "about 624000 tokens an hour: keep the prompt prefix stable"]
        caplog.clear()
        # three more, then the traffic stops: the timer sums them up
        for i in range(3):
            r.record(rec(ts=1061.0 + i, findings=(_ts_finding(),)))
        await r.start()
        wall[0] = 1200.0
        r._log_summary(wall[0])  # what the timer calls; its period is log_interval_s
        await r.aclose()
    assert [x.getMessage() for x in caplog.records] == [
        "3 more hygiene finding(s) in the last 140 s, not logged one by one: timestamp "
        "(warning) x3, 2400 tokens at risk, fixing it saves about 61714 tokens an hour: "
        "keep the prompt prefix stable"]


def test_stats_hygiene_section_and_warning() -> None:
    r = UsageRecorder(UsageConfig(hygiene_warn_share=0.5, hygiene_latest=2), GatewayMetrics())
    for i in range(3):
        r.record(rec(ts=1000.0 + i, request_id=f"r{i}", prompt_tokens=1000,
                     findings=(_ts_finding(800 - i),)))
    s = r.stats(1010.0, {})
    h = s["hygiene"]
    assert [f["request_id"] for f in h["latest"]] == ["r2", "r1"]
    assert h["latest"][0]["char_offset"] == 23 and h["latest"][0]["tokens_at_risk"] == 798
    assert h["by_kind"][0]["share_of_prompt_tokens"] == pytest.approx(2397 / 3000, abs=1e-4)
    assert [w for w in s["warnings"] if w.startswith("hygiene:")] == [
        "hygiene: timestamp findings put 80% of the last hour's prompt tokens at risk (2397 of "
        "3000 tokens, 3 request(s)); the latest are under hygiene.latest in /stats"]
    quiet = UsageRecorder(UsageConfig(hygiene_warn_share=0.9), GatewayMetrics())
    quiet.record(rec(ts=1000.0, prompt_tokens=1000, findings=(_ts_finding(800),)))
    assert not any(w.startswith("hygiene:") for w in quiet.stats(1010.0, {})["warnings"])


class FlakySink:
    """Fails the writes whose number (from 0) is in `failing`; records the rest."""

    name = "flaky"

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing
        self.calls = 0
        self.lines: list[bytes] = []

    async def write(self, lines: Sequence[bytes]) -> None:
        n, self.calls = self.calls, self.calls + 1
        if n in self.failing:
            raise SinkError(f"write {n} refused")
        self.lines.extend(lines)

    async def aclose(self) -> None:
        return None


async def test_pump_backs_off_while_failing_and_resets_after_a_write() -> None:
    slept: list[float] = []

    async def sleep(delay: float) -> None:
        slept.append(delay)

    sink = FlakySink({0, 1, 2, 4})
    retrier = Retrier(Backoff(base_s=1.0, cap_s=3.0), rand=lambda: 0.0, sleep=sleep)
    pump = SinkPump(sink, GatewayMetrics(), batch_size=1, retrier=retrier)
    for i in range(6):
        pump.offer(b"%d\n" % i)
    pump.start()
    for _ in range(1000):  # the sleeps return at once: the pump drains in a few turns
        if sink.calls == 6:
            break
        await asyncio.sleep(0)
    await pump.aclose()
    assert sink.calls == 6 and sink.lines == [b"3\n", b"5\n"]
    assert slept == [1.0, 2.0, 3.0, 1.0]  # doubling, capped; back to the base after write 3
    assert pump.dropped == 4 and pump.errors == 4
