"""Figures per tenant and per priority class (pure): what `compare` shows for the
overload presets, where one column's totals hide who paid for the overload.

Per group: requests, answered (2xx), shed (429, the gateway's queue refusing with
Retry-After), timed out (the client gave up or the gateway answered 504/408), other
failures; TTFT p50/p99 of the answered ones (simulated ms, the gateway's queue wait
included: `runner.record_of`); the cached ratio (cached / prompt tokens, answered ones);
the follow-ups that left their conversation's replica.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gateway.bench.report import follow_ups_moved, percentile
from gateway.bench.runner import RequestRecord
from gateway.bench.table import fmt, render

_TIMEOUT_STATUSES = (408, 504)


def _timed_out(r: RequestRecord) -> bool:
    return r.status in _TIMEOUT_STATUSES or (
        r.status == 0 and r.error is not None and "timeout" in r.error.lower())


def group_figures(records: Sequence[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and 200 <= r.status < 300]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    shed = sum(1 for r in records if r.status == 429)
    timeouts = sum(1 for r in records if _timed_out(r))
    return {
        "requests": len(records),
        "ok": len(ok),
        "shed_429": shed,
        "timeouts": timeouts,
        "other_errors": len(records) - len(ok) - shed - timeouts,
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "cached_ratio": cached / prompt if prompt else None,
        "follow_ups_moved": follow_ups_moved(ok),
        # p99 of each part of TTFT: where an answered request's first token waited
        "wait_p99_ms": {
            "gateway": percentile([r.gateway_wait_ms for r in ok
                                   if r.gateway_wait_ms is not None], 99),
            "engine": percentile([r.engine_wait_ms for r in ok
                                  if r.engine_wait_ms is not None], 99)},
    }


def by(records: Sequence[RequestRecord],
       key: Callable[[RequestRecord], str | None]) -> dict[str, dict[str, Any]]:
    """Figures per value of `key`; empty when no record has one."""
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        k = key(r)
        if k is not None:
            groups[k].append(r)
    return {k: group_figures(v) for k, v in sorted(groups.items())}


def groups_table(columns: Mapping[str, Mapping[str, Any]], markdown: bool = False) -> str:
    """One row per (column, tenant or class); empty when no column has groups."""
    header = ["column", "group", "requests", "ok", "429", "timeouts", "other",
              "TTFT p50", "TTFT p99", "gw wait p99", "engine wait p99", "cached", "moved"]
    rows = []
    for name, summary in columns.items():
        for kind in ("by_class", "by_tenant"):
            for group, g in (summary.get(kind) or {}).items():
                label = ("class " if kind == "by_class" else "tenant ") + group
                waits = g.get("wait_p99_ms") or {}
                rows.append([name, label, str(g["requests"]), str(g["ok"]),
                             str(g["shed_429"]), str(g["timeouts"]), str(g["other_errors"]),
                             fmt(g["ttft_ms"]["p50"], "ms"), fmt(g["ttft_ms"]["p99"], "ms"),
                             fmt(waits.get("gateway"), "ms"), fmt(waits.get("engine"), "ms"),
                             fmt(g["cached_ratio"], "pct"), fmt(g["follow_ups_moved"], "pct")])
    return render(header, rows, markdown) if rows else ""
