"""The one place a finished request's `UsageRecord` goes: metrics, stats windows, sinks.

`record(rec)` runs on the request path once per request (streamed, non-streamed, failed,
cancelled). It updates the Prometheus metrics and the stats windows, encodes the record
once (orjson, fields in schema order, `None` as `null`) and offers the line to each sink's
bounded buffer. It never awaits and never raises to the caller (see `record`).

Missing cached_tokens: a replica whose records carry `prompt_tokens` but no
`cached_tokens` runs without `--enable-prompt-tokens-details`. `record` logs that once per
replica at first detection; `missing_cached_tokens_replicas()` lists such replicas (rule
in `gateway.usage.details`), and `/stats` turns them into warnings. The replica monitor's
start-up probe reports through `probe_cached_tokens` (no usage record: probe traffic is
not a client request).

`stats(now, replicas, configured_capacity=..., default_capacity_tokens=...)` builds the
`/stats` JSON: the windows of `gateway.usage.stats`, each replica's last scrape with
KV-usage levels (`kv_warn`/`kv_critical` of the config) and the capacity the router uses
with its source (`effective_capacity`: the engine's `cache_config_info`, else the replica's
configured `capacity_tokens`, else the routing default), sink counters and a `warnings`
list of plain sentences.

Hygiene: each record's findings feed the windows (by kind, model, tenant; see
gateway.usage.findings) and the ring of the latest few; `/stats` shows them in its
`hygiene` section (over the last hour) and warns about every kind whose warnings put at
least `hygiene_warn_share` of the hour's prompt tokens at risk. Findings are logged here,
one line each as `LogLimiter` admits them, and what it held back as one summary line per
`log_interval_s` (on the next record after it is due, and from a timer while the recorder
runs, so a burst that stops is still summed up).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from gateway.extras import require
from gateway.hygiene.lograte import LogLimiter
from gateway.tasks import FailureLog, every
from gateway.usage.access import log_access
from gateway.usage.config import UsageConfig
from gateway.usage.details import CachedTokensReporting, missing_cached_tokens_warning
from gateway.usage.findings import LatestFindings, costly_kinds
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.panels import duration
from gateway.usage.record import DEPARTED, UsageRecord
from gateway.usage.sinks import FileSink, Sink, SinkPump, StdoutSink
from gateway.usage.snapshot import EngineSnapshot
from gateway.usage.stats import UsageWindows

log = logging.getLogger("gateway.usage")
hygiene_log = logging.getLogger("gateway.hygiene")

_ERROR_LOG_EVERY_S = 60.0


def require_redis() -> None:
    """Raise `MissingExtra` (with the install command) when the Redis sink cannot load."""
    require("redis", extra="redis", feature="the Redis usage sink ([usage] redis_url)")


def sinks_from_config(config: UsageConfig) -> list[Sink]:
    sinks: list[Sink] = []
    if config.log_path:
        sinks.append(FileSink(config.log_path))
    if config.log_stdout:
        sinks.append(StdoutSink())
    if config.redis_url:
        require_redis()
        from gateway.usage.redis_sink import RedisStreamSink  # the `redis` extra

        sinks.append(RedisStreamSink(config.redis_url, config.redis_stream, config.redis_maxlen))
    return sinks


def effective_capacity(
    snap: EngineSnapshot | None, configured: int | None, default: int | None,
) -> tuple[int | None, str]:
    """(capacity in tokens, source) as the router sizes its index for the replica."""
    reported = None if snap is None else snap.capacity_tokens
    if reported is not None:
        return reported, "engine"
    if configured is not None:
        return configured, "config"
    return default, "default"


def kv_level(usage: float | None, warn: float, critical: float) -> str:
    if usage is None:
        return "unknown"
    if usage >= critical:
        return "critical"
    if usage >= warn:
        return "warn"
    return "ok"


class UsageRecorder:
    def __init__(
        self,
        config: UsageConfig,
        metrics: GatewayMetrics,
        *,
        sinks: list[Sink] | None = None,
        access_log: bool = False,
        started_at: float | None = None,
        finding_log: LogLimiter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`finding_log`: the limiter hygiene log lines pass (None: findings are not
        logged); `clock`: wall time for the summary timer (records carry their own)."""
        self._access_log = access_log
        self._started_at = started_at  # no stats window reaches back before this
        self._config = config
        self._metrics = metrics
        self._pumps = [
            SinkPump(
                s,
                metrics,
                capacity=config.queue_size,
                batch_size=config.batch_size,
                retry_s=config.sink_retry_s,
            )
            for s in (sinks_from_config(config) if sinks is None else sinks)
        ]
        self._windows = UsageWindows(
            bucket_s=config.bucket_s,
            ttft_target_ms=config.ttft_target_ms,
            tpot_target_ms=config.tpot_target_ms,
        )
        self._details = CachedTokensReporting()
        self._latest = LatestFindings(config.hygiene_latest)
        self._finding_log = finding_log
        self._clock = clock
        self._summary_task: asyncio.Task[None] | None = None
        self._record_errors = 0
        self._last_error_log = -_ERROR_LOG_EVERY_S

    @property
    def windows(self) -> UsageWindows:
        return self._windows

    @property
    def pumps(self) -> list[SinkPump]:
        return self._pumps

    async def start(self) -> None:
        for pump in self._pumps:
            pump.start()
        if self._finding_log is not None and self._finding_log.interval_s > 0:
            self._summary_task = asyncio.create_task(self._summaries(
                self._finding_log.interval_s))

    async def aclose(self) -> None:
        if self._summary_task is not None:
            self._summary_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._summary_task
            self._summary_task = None
        self._log_summary(self._clock(), due=True)  # nothing held back is lost at shutdown
        for pump in self._pumps:
            await pump.aclose()

    async def _summaries(self, every_s: float) -> None:
        async def once() -> None:
            self._log_summary(self._clock())

        await every(every_s, once, "hygiene summary", FailureLog(log))

    def _log_summary(self, now: float, *, due: bool = False) -> None:
        if self._finding_log is None:
            return
        summary = self._finding_log.summary(now, due=due)
        if summary is not None:
            warn = any(h.severity == "warning" for h in summary.held)
            hygiene_log.log(logging.WARNING if warn else logging.INFO, "%s", summary.text(),
                            extra={"suppressed": summary.findings})

    def _log_findings(self, rec: UsageRecord) -> None:
        assert self._finding_log is not None
        for f in self._finding_log.admit(rec.findings, rec.ts):
            # `info` findings (a break in front of a short tail) cost almost nothing:
            # debug level, so they do not drown the warnings.
            level = logging.WARNING if f.severity == "warning" else logging.DEBUG
            hygiene_log.log(level, "hygiene finding", extra={
                "request_id": rec.request_id, "model": rec.model, **f.to_dict()})

    def record(self, rec: UsageRecord, departed: bool = False) -> None:
        """Account one finished request. Never blocks, never raises to the caller.
        `departed`: the replica it went to left, though its name may be in the fleet again
        (another server's): counted as DEPARTED, as when the name is gone; the access log
        and the usage stream still name it."""
        try:
            if self._access_log:
                log_access(rec)
            self._metrics.observe(rec, departed)
            live = not departed and self._metrics.live_or_none(rec.replica)
            # a request that ended after its replica left: no row of that name again
            self._windows.add(rec if live else dataclasses.replace(rec, replica=DEPARTED))
            if rec.findings:
                self._latest.add(rec)
                if self._finding_log is not None:
                    self._log_findings(rec)
            self._log_summary(rec.ts)
            if live and self._details.add(rec):
                log.warning("%s", missing_cached_tokens_warning(rec.replica or ""))
            if self._pumps:
                line = orjson.dumps(rec) + b"\n"
                for pump in self._pumps:
                    pump.offer(line)
        except Exception:
            # The request already finished for the client; a bug in accounting must not
            # turn it into a failure. It is logged (rate-limited) with its traceback.
            self._record_errors += 1
            now = time.monotonic()
            if now - self._last_error_log >= _ERROR_LOG_EVERY_S:
                self._last_error_log = now
                log.exception("usage record failed (%d so far)", self._record_errors)

    def probe_cached_tokens(self, replica: str, reports: bool) -> None:
        """The start-up probe's verdict on replica (see gateway.usage.details)."""
        if self._details.probe(replica, reports):
            log.warning("%s", missing_cached_tokens_warning(replica),
                        extra={"replica": replica, "source": "startup probe"})

    def forget_replica(self, replica: str) -> None:
        """The replica left the fleet: its cached_tokens verdict goes and its /stats rows
        count as "departed" (a record that ends after is not tracked under its name:
        `GatewayMetrics.live`)."""
        self._details.forget(replica)
        self._windows.forget_replica(replica)

    def missing_cached_tokens_replicas(self) -> list[str]:
        """Replicas that send usage without cached_tokens (see gateway.usage.details)."""
        return self._details.missing()

    def stats(
        self, now: float, replicas: Mapping[str, EngineSnapshot | None], *,
        configured_capacity: Mapping[str, int | None] | None = None,
        default_capacity_tokens: int | None = None,
        fleet_warnings: Sequence[str] = (),
    ) -> dict[str, Any]:
        """`configured_capacity`: replica -> its `[[replicas]] capacity_tokens`;
        `default_capacity_tokens`: the routing default used when neither is known."""
        cfg = self._config
        configured = configured_capacity or {}
        warnings = [*fleet_warnings,
                    *(missing_cached_tokens_warning(r)
                      for r in self.missing_cached_tokens_replicas())]
        reps: dict[str, Any] = {}
        for name in sorted(replicas):
            snap = replicas[name]
            usage = None if snap is None else snap.kv_cache_usage
            level = kv_level(usage, cfg.kv_warn, cfg.kv_critical)
            if level in ("warn", "critical"):
                assert usage is not None
                warnings.append(
                    f"replica {name} KV cache usage {usage:.0%} is {level} "
                    f"(warn {cfg.kv_warn:.0%}, critical {cfg.kv_critical:.0%})"
                )
            capacity = effective_capacity(snap, configured.get(name), default_capacity_tokens)
            reps[name] = _replica_json(snap, level, self._details.reports(name), capacity)
        windows = self._windows.windows(now, self._started_at)
        recent = windows["5m"]
        hour = windows["1h"]
        hygiene = {"window": "1h", "covered_s": hour["covered_s"],
                   "prompt_tokens": hour["prompt_tokens"], **hour["hygiene"],
                   "warn_share": cfg.hygiene_warn_share, "latest": self._latest.rows()}
        for row in costly_kinds(hour["hygiene"], cfg.hygiene_warn_share):
            warnings.append(
                f"hygiene: {row['kind']} findings put {row['share_of_prompt_tokens']:.0%} of "
                f"the last hour's prompt tokens at risk ({row['tokens_at_risk']} of "
                f"{hour['prompt_tokens']} tokens, {row['requests']} request(s)); the latest "
                "are under hygiene.latest in /stats")
        for key, label in (("ttft", "TTFT"), ("tpot", "TPOT")):
            fig = recent[key]
            if fig["ok"] is False:
                warnings.append(
                    f"{label} p99 over the last 5 min is {fig['p99_ms']:.0f} ms "
                    f"(target {fig['target_ms']:.0f} ms)"
                )
        sinks: dict[str, Any] = {}
        for pump in self._pumps:
            sinks[pump.sink.name] = {
                "written": pump.written,
                "queued": pump.queued,
                "dropped": pump.dropped,
                "errors": pump.errors,
            }
            if pump.dropped:
                warnings.append(f"usage sink {pump.sink.name} dropped {pump.dropped} records")
        return {
            "summary": headline(now, self._started_at, windows, reps, warnings),
            "now": now,
            "uptime_s": None if self._started_at is None else round(now - self._started_at, 3),
            "first_record_ts": self._windows.first_ts,
            "last_record_ts": self._windows.last_ts,
            "windows": windows,
            "replicas": reps,
            "sinks": sinks,
            "warnings": warnings,
            "hygiene": hygiene,
            "bucket_s": self._windows.bucket_s,
            "series": self._windows.series(),
        }


def headline(now: float, started_at: float | None, windows: Mapping[str, Any],
             replicas: Mapping[str, Any], warnings: list[str]) -> dict[str, Any]:
    """What a person wants first: is it working, is the cache working, is it fast."""
    recent, total = windows["5m"], windows["all"]

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1%}"

    # TTFT is measured on streamed answers only; without any, latency is what there is.
    ttft = recent["ttft"]["p99_ms"]
    latency = recent["latency"]["p99_ms"]
    # (seconds from 10 s on, as the page's table: a long answer's 226468 ms is 226.5 s)
    if ttft is not None:
        speed = f"TTFT p99 {duration(ttft, 0)} (streamed, 5 min)"
    elif latency is not None:
        speed = f"latency p99 {duration(latency, 0)} (5 min)"
    else:
        speed = "no answers in the last 5 min"
    return {
        "uptime_s": None if started_at is None else round(now - started_at, 1),
        "requests": total["requests"],
        "requests_last_5m": recent["requests"],
        "cached_ratio": total["cached_ratio"],
        "cached_ratio_last_5m": recent["cached_ratio"],
        "ttft_p99_ms_last_5m": ttft,
        "latency_p99_ms_last_5m": latency,
        "replicas": len(replicas),
        "warnings": len(warnings),
        "text": (f"{total['requests']} requests, {pct(total['cached_ratio'])} of prompt "
                 f"tokens served from cache ({pct(recent['cached_ratio'])} in the last 5 min), "
                 f"{speed}, "
                 f"{len(warnings)} warning(s)"),
    }


def _replica_json(
    snap: EngineSnapshot | None,
    level: str,
    reports: bool | None,
    capacity: tuple[int | None, str],
) -> dict[str, Any]:
    if snap is None:
        return {"scraped": False, "kv_level": level, "capacity_tokens": capacity[0],
                "capacity_source": capacity[1], "reports_cached_tokens": reports}
    hit_rate = None
    if snap.prefix_cache_queries_total and snap.prefix_cache_hits_total is not None:
        hit_rate = snap.prefix_cache_hits_total / snap.prefix_cache_queries_total
    return {
        "scraped": True,
        "scraped_at": snap.ts,
        "kv_cache_usage": snap.kv_cache_usage,
        "kv_level": level,
        "requests_running": snap.num_requests_running,
        "requests_waiting": snap.num_requests_waiting,
        "capacity_tokens": capacity[0],
        "capacity_source": capacity[1],
        "engine_prefix_cache_hit_rate_since_start": hit_rate,
        "reports_cached_tokens": reports,
    }
