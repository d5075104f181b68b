"""Windowed usage statistics from `UsageRecord`s (pure: time comes from the records and
from the `now` a caller passes in).

Storage (bounded memory): records are folded into time buckets of `bucket_s` seconds
(default 10) keyed by `floor(ts / bucket_s)` of the record's arrival `ts`. A bucket holds
one `Totals` per (model, replica, tenant), one per endpoint kind (`by_endpoint`:
chat, completions, responses, messages, other) and four quantile sketches (prompt length,
prompt + completion length, TTFT, TPOT). Only the buckets of the last `horizon_s`
(default 1 h) before the newest record are kept; older buckets are merged into one
`archive` bucket, so "since start" = archive + live buckets and nothing grows with the
number of requests (only with label cardinality and the sketches' bounded bucket count).

Window `W` at `now` covers every bucket that starts at or after `now - W`: more than
`W - bucket_s` seconds, never more than `W` (a "1m" window never reaches back further
than a minute); each summary says which span it really covers (`covered_s`, `from_ts`,
`to_ts`). Records stamped after `now` are included.

Requests the gateway answered itself, before any replica was chosen (no healthy replica,
unknown model, a malformed body: `replica` None), are counted in `gateway_rejected` by
status, never as a replica of their own.

Figures (all token-weighted sums over the window, never averages of per-request ratios):
- cached_ratio = sum(cached) / sum(prompt), over records whose engine reported both.
- Decomposition of reuse, each over the records where both of its inputs are known:
  available = sum(best_available) / sum(prompt): reuse any replica could have offered;
  captured  = sum(predicted) / sum(best_available): how much of it routing captured;
  delivered = sum(min(cached, predicted)) / sum(predicted): how much of the prediction
  the engine delivered.
  Every ratio lies in [0, 1]: best and predicted are capped at the prompt (estimates
  made before tokenization can overshoot it) and predicted at best.
  Records with `cached_tokens` None are excluded from cached_ratio and delivered, and
  counted in `records_without_cached_tokens`.
- P/D (two legs, `UsageRecord.cache_split`): "cached" is the prefill replica's own report
  (what it did not compute), the prediction P's; tokens it pulled back from a decoder
  (`pulled_tokens`, decoder_kv turns) are neither hits nor misses: they leave the prompt
  and the cached counts of cached_ratio, available and delivered, and are summed apart.
- Percentiles: prompt tokens P50/P95/P99; latency P50/P99 (every record with status <
  400); TTFT P99 over streamed records only (status < 400): a non-streamed answer arrives
  in one piece, its first byte is its last, so its "TTFT" would be its latency; TPOT P99,
  TPOT = (latency - ttft) / (completion_tokens - 1) for streamed requests with
  completion_tokens > 1. Sketch accuracy is 1% relative.
- Hygiene (gateway.usage.findings): findings by kind and severity with the prompt tokens
  they put at risk and their share of the window's prompt tokens, by model and by tenant.
- max_model_len_suggestion = ceil(P99(prompt + completion) * 1.2 / 1024) * 1024: room for
  99% of the observed requests plus 20% headroom, in the 1024-token steps operators use.
"""

from __future__ import annotations

import math
from typing import Any, Final

from gateway.usage.findings import FindingTally
from gateway.usage.record import DEPARTED, UsageRecord
from gateway.usage.sketch import QuantileSketch

NONE_KEY: Final = "none"
WINDOWS: Final[tuple[tuple[str, float | None], ...]] = (
    ("1m", 60.0),
    ("5m", 300.0),
    ("1h", 3600.0),
    ("all", None),
)
MAX_MODEL_LEN_HEADROOM: Final = 1.2
MAX_MODEL_LEN_STEP: Final = 1024


class Totals:
    """Token-weighted sums for one (model, replica, tenant) in one bucket."""

    __slots__ = (
        "avail_den", "avail_num", "capt_den", "capt_num", "completion", "deliv_den",
        "deliv_num", "prompt", "pulled", "ratio_den", "ratio_num", "requests", "status", "without",
    )  # fmt: skip

    def __init__(self) -> None:
        self.requests = 0
        self.status: dict[int, int] = {}
        self.prompt = 0  # every reported prompt token
        self.completion = 0
        self.ratio_num = 0  # cached, where prompt and cached are known
        self.ratio_den = 0  # prompt, same records
        self.without = 0  # records with prompt known and cached None
        self.pulled = 0  # P/D: prompt tokens a prefill replica pulled back from a decoder
        self.avail_num = 0
        self.avail_den = 0
        self.capt_num = 0
        self.capt_den = 0
        self.deliv_num = 0
        self.deliv_den = 0

    def add(self, rec: UsageRecord) -> None:
        self.requests += 1
        self.status[rec.status] = self.status.get(rec.status, 0) + 1
        # P/D: P's own hits; tokens pulled back from a decoder leave the cache figures
        prompt, cached, pulled = rec.cache_split()
        predicted, best = rec.predicted_cached_tokens, rec.best_available_tokens
        self.pulled += pulled
        if rec.completion_tokens is not None:
            self.completion += rec.completion_tokens
        if rec.prompt_tokens is not None:
            self.prompt += rec.prompt_tokens  # volume: every prompt token, pulled or not
        if prompt is not None:
            # Estimates made before the prompt was tokenized may overshoot it; no replica
            # can offer, nor routing predict, more than the whole prompt.
            best = None if best is None else min(best, prompt)
            predicted = None if predicted is None else min(predicted, prompt)
            if cached is None:
                self.without += 1
            else:
                self.ratio_num += min(cached, prompt)
                self.ratio_den += prompt
            if best is not None:
                self.avail_num += best
                self.avail_den += prompt
        if predicted is not None:
            if best is not None:
                self.capt_num += min(predicted, best)
                self.capt_den += best
            if cached is not None:
                # What of the prediction arrived (an engine holding more than predicted is
                # a surprise, not more than all of it).
                self.deliv_num += min(cached, predicted)
                self.deliv_den += predicted

    def merge(self, o: Totals) -> None:
        self.requests += o.requests
        for k, n in o.status.items():
            self.status[k] = self.status.get(k, 0) + n
        self.prompt += o.prompt
        self.completion += o.completion
        self.ratio_num += o.ratio_num
        self.ratio_den += o.ratio_den
        self.without += o.without
        self.pulled += o.pulled
        self.avail_num += o.avail_num
        self.avail_den += o.avail_den
        self.capt_num += o.capt_num
        self.capt_den += o.capt_den
        self.deliv_num += o.deliv_num
        self.deliv_den += o.deliv_den

    def figures(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt,
            "cached_tokens": self.ratio_num,
            "completion_tokens": self.completion,
            "cached_ratio": _ratio(self.ratio_num, self.ratio_den),
            "pulled_tokens": self.pulled,
            "records_without_cached_tokens": self.without,
            "available": _ratio(self.avail_num, self.avail_den),
            "captured": _ratio(self.capt_num, self.capt_den),
            "delivered": _ratio(self.deliv_num, self.deliv_den),
        }


def _ratio(num: int, den: int) -> float | None:
    return None if den <= 0 else num / den


Key = tuple[str, str | None, str]  # model, replica (None: the gateway answered), tenant


class Bucket:
    __slots__ = ("endpoints", "findings", "latency", "prompt", "total_len", "totals", "tpot",
                 "ttft")

    def __init__(self) -> None:
        self.totals: dict[Key, Totals] = {}
        self.endpoints: dict[str, Totals] = {}
        self.prompt = QuantileSketch()
        self.total_len = QuantileSketch()
        self.ttft = QuantileSketch()
        self.tpot = QuantileSketch()
        self.latency = QuantileSketch()
        self.findings = FindingTally()

    def add(self, rec: UsageRecord) -> None:
        key = (rec.model or NONE_KEY, rec.replica or None, rec.tenant or NONE_KEY)
        totals = self.totals.get(key)
        if totals is None:
            totals = self.totals[key] = Totals()
        totals.add(rec)
        kind = rec.endpoint_kind
        by_endpoint = self.endpoints.get(kind)
        if by_endpoint is None:
            by_endpoint = self.endpoints[kind] = Totals()
        by_endpoint.add(rec)
        if rec.prompt_tokens is not None:
            self.prompt.add(rec.prompt_tokens)
            self.total_len.add(rec.prompt_tokens + (rec.completion_tokens or 0))
        ttft = rec.ttft_ms
        if rec.status < 400:
            self.latency.add(rec.latency_ms)
            if ttft is not None and rec.stream:
                self.ttft.add(ttft)
        self.findings.add(rec)
        completion = rec.completion_tokens
        if rec.stream and ttft is not None and completion is not None and completion > 1:
            self.tpot.add((rec.latency_ms - ttft) / (completion - 1))

    def rename_replica(self, old: str, new: str) -> None:
        """Count `old`'s rows as `new`'s (merged where `new` has the same model and
        tenant)."""
        for key in [k for k in self.totals if k[1] == old]:
            t = self.totals.pop(key)
            to = (key[0], new, key[2])
            mine = self.totals.get(to)
            if mine is None:
                self.totals[to] = t
            else:
                mine.merge(t)

    def merge(self, o: Bucket) -> None:
        for key, t in o.totals.items():
            mine = self.totals.get(key)
            if mine is None:
                mine = self.totals[key] = Totals()
            mine.merge(t)
        for kind, t in o.endpoints.items():
            mine = self.endpoints.get(kind)
            if mine is None:
                mine = self.endpoints[kind] = Totals()
            mine.merge(t)
        self.prompt.merge(o.prompt)
        self.total_len.merge(o.total_len)
        self.ttft.merge(o.ttft)
        self.tpot.merge(o.tpot)
        self.latency.merge(o.latency)
        self.findings.merge(o.findings)


def max_model_len_suggestion(p99_total_tokens: float | None) -> int | None:
    if p99_total_tokens is None or p99_total_tokens <= 0:
        return None
    steps = math.ceil(p99_total_tokens * MAX_MODEL_LEN_HEADROOM / MAX_MODEL_LEN_STEP)
    return steps * MAX_MODEL_LEN_STEP


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


class UsageWindows:
    """Time-bucketed aggregates of usage records; see the module docstring."""

    def __init__(
        self,
        *,
        bucket_s: float = 10.0,
        horizon_s: float = 3600.0,
        ttft_target_ms: float = 1000.0,
        tpot_target_ms: float = 100.0,
    ) -> None:
        if bucket_s <= 0 or horizon_s < bucket_s:
            raise ValueError("need 0 < bucket_s <= horizon_s")
        self._bucket_s = bucket_s
        self._keep = math.ceil(horizon_s / bucket_s) + 1
        self._buckets: dict[int, Bucket] = {}
        self._archive = Bucket()
        self._newest = -(2**62)
        self._ttft_target = ttft_target_ms
        self._tpot_target = tpot_target_ms
        self.first_ts: float | None = None
        self.last_ts: float | None = None

    def add(self, rec: UsageRecord) -> None:
        ts = rec.ts
        idx = math.floor(ts / self._bucket_s)
        bucket = self._buckets.get(idx)
        if bucket is None:
            if idx <= self._newest - self._keep:
                bucket = self._archive  # too old for any window: only "since start"
            else:
                bucket = self._buckets[idx] = Bucket()
                if idx > self._newest:
                    self._newest = idx
                    self._evict()
        bucket.add(rec)
        if self.first_ts is None or ts < self.first_ts:
            self.first_ts = ts
        if self.last_ts is None or ts > self.last_ts:
            self.last_ts = ts

    def _evict(self) -> None:
        limit = self._newest - self._keep
        for idx in [i for i in self._buckets if i <= limit]:
            self._archive.merge(self._buckets.pop(idx))

    def forget_replica(self, replica: str) -> None:
        """The replica left the fleet: its rows, in every window and since start, are
        counted as `DEPARTED`'s from now on (totals kept; the rows bounded by the live
        fleet + "departed" + the gateway's own answers)."""
        for bucket in (*self._buckets.values(), self._archive):
            bucket.rename_replica(replica, DEPARTED)

    def bucket_count(self) -> int:
        return len(self._buckets)

    def merged(self, now: float, window_s: float | None) -> Bucket:
        """One bucket holding everything window `window_s` covers (None = since start)."""
        out = Bucket()
        if window_s is None:
            out.merge(self._archive)
        start = None if window_s is None else self.covered_from(now, window_s)
        for idx, bucket in self._buckets.items():
            if start is None or idx * self._bucket_s >= start:
                out.merge(bucket)
        return out

    def covered_from(self, now: float, window_s: float) -> float:
        """Start of the span window `window_s` really covers: the first bucket boundary at
        or after `now - window_s`."""
        return math.ceil((now - window_s) / self._bucket_s) * self._bucket_s

    @property
    def bucket_s(self) -> float:
        return self._bucket_s

    def summary(self, now: float, window_s: float | None, since: float | None = None
                ) -> dict[str, Any]:
        """`since`: when the gateway started; no window covers more than that."""
        b = self.merged(now, window_s)
        overall = Totals()
        dims: dict[str, dict[str, Totals]] = {"model": {}, "replica": {}, "tenant": {}}
        rejected = Totals()
        for (model, replica, tenant), t in b.totals.items():
            overall.merge(t)
            if replica is None:
                rejected.merge(t)
            for dim, name in (("model", model), ("replica", replica), ("tenant", tenant)):
                if name is None:
                    continue
                agg = dims[dim].get(name)
                if agg is None:
                    agg = dims[dim][name] = Totals()
                agg.merge(t)
        out = overall.figures()
        out["window_s"] = window_s
        start = None if window_s is None else self.covered_from(now, window_s)
        if since is not None:
            start = since if start is None else max(start, since)
        out["covered_s"] = None if start is None else round(max(0.0, now - start), 3)
        out["from_ts"] = start
        out["to_ts"] = now
        out["by_status"] = {str(k): n for k, n in sorted(overall.status.items())}
        out["gateway_rejected"] = {
            "requests": rejected.requests,
            "by_status": {str(k): n for k, n in sorted(rejected.status.items())}}
        for dim, groups in dims.items():
            out[f"by_{dim}"] = {name: groups[name].figures() for name in sorted(groups)}
        out["by_endpoint"] = {k: b.endpoints[k].figures() for k in sorted(b.endpoints)}
        p99_total = b.total_len.quantile(0.99)
        out["prompt_tokens_percentiles"] = {
            "p50": _round(b.prompt.quantile(0.50), 1),
            "p95": _round(b.prompt.quantile(0.95), 1),
            "p99": _round(b.prompt.quantile(0.99), 1),
        }
        out["total_tokens_p99"] = _round(p99_total, 1)
        out["max_model_len_suggestion"] = max_model_len_suggestion(p99_total)
        out["latency"] = {
            "p50_ms": _round(b.latency.quantile(0.50)),
            "p99_ms": _round(b.latency.quantile(0.99)),
            "samples": b.latency.count,
        }
        ttft99, tpot99 = b.ttft.quantile(0.99), b.tpot.quantile(0.99)
        out["ttft"] = {
            "p99_ms": _round(ttft99),
            "target_ms": self._ttft_target,
            "ok": None if ttft99 is None else ttft99 <= self._ttft_target,
            "samples": b.ttft.count,
        }
        out["tpot"] = {
            "p99_ms": _round(tpot99),
            "target_ms": self._tpot_target,
            "ok": None if tpot99 is None else tpot99 <= self._tpot_target,
            "samples": b.tpot.count,
        }
        out["hygiene"] = b.findings.figures(overall.prompt, out["covered_s"])
        return out

    def windows(self, now: float, since: float | None = None) -> dict[str, dict[str, Any]]:
        return {name: self.summary(now, w, since) for name, w in WINDOWS}

    def series(self) -> list[dict[str, Any]]:
        """Per live bucket, oldest first: its start, requests, and the cached-token ratio
        overall and per replica (what the /stats page charts)."""
        out: list[dict[str, Any]] = []
        for idx in sorted(self._buckets):
            bucket = self._buckets[idx]
            overall = Totals()
            replicas: dict[str, Totals] = {}
            for (_, replica, _), t in bucket.totals.items():
                overall.merge(t)
                if replica is None:
                    continue
                agg = replicas.get(replica)
                if agg is None:
                    agg = replicas[replica] = Totals()
                agg.merge(t)
            out.append({
                "ts": idx * self._bucket_s, "requests": overall.requests,
                "cached_ratio": _ratio(overall.ratio_num, overall.ratio_den),
                "by_replica": {r: _ratio(t.ratio_num, t.ratio_den)
                               for r, t in sorted(replicas.items())},
            })
        return out
