"""The bars a `gateway-bench compare` run is held to (the routing issues' targets, on the
`prefix` columns), and how they print. Pure: functions of the columns' summaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.bench import explain
from gateway.bench.presets import Preset


def tiny_note(summaries: Mapping[str, Mapping[str, Any]], preset: Preset) -> str:
    """Why the smoke preset's columns are not a comparison of the policies."""
    requests = max((s.get("requests") or 0 for s in summaries.values()), default=0)
    working = max(((s.get("bound") or {}).get("working_set_blocks") or 0
                   for s in summaries.values()), default=0)
    cache = preset.replicas * preset.kv_blocks
    held = f"{cache / working:.0%} of" if working else "most of"
    return (f"(tiny checks that every column runs: {requests} requests on {preset.replicas} "
            f"replicas whose caches hold {held} the working set, so a few requests placed "
            "otherwise move a column by several points: its columns are no comparison of the "
            "policies; --preset default is one, about 20 s a column)")


def quality_checks(summaries: dict[str, dict[str, Any]], judged: bool = True
                   ) -> list[dict[str, Any]]:
    """The routing issue's bars, checked on the `prefix` column when present (reported
    without a verdict when `judged` is false)."""
    prefix = summaries.get("prefix")
    if prefix is None:
        return []
    checks: list[dict[str, Any]] = []

    def check(name: str, value: Any, target: str, ok: bool | None) -> None:
        checks.append({"check": name, "value": value, "target": target,
                       "met": ok if judged else None, "judged": judged})

    share = prefix.get("bound_share")
    check("cached ratio vs bound", share, ">= 95%", None if share is None else share >= 0.95)
    imb = (prefix.get("replica_requests") or {}).get("max_over_mean")
    check("request imbalance max/mean", imb, "<= 1.3", None if imb is None else imb <= 1.3)
    p99 = (prefix.get("ttft_ms") or {}).get("p99")
    ll = (summaries.get("least_loaded") or {}).get("ttft_ms", {}).get("p99")
    check(
        "TTFT p99 vs least_loaded", [p99, ll], "prefix <= least_loaded",
        None if p99 is None or ll is None else p99 <= ll,
    )
    mae = (prefix.get("predicted") or {}).get("median_abs_error")
    check(
        "predicted vs delivered median abs error", mae, "<= 16 tokens",
        None if mae is None else mae <= 16,
    )
    # Issue 11's bars, for every prefix column (with and without session ids).
    for name, col in summaries.items():
        if col.get("policy") != "prefix":
            continue
        moved = col.get("follow_ups_moved")
        check(f"{name}: follow-up turns moved", moved, "<= 3%",
              None if moved is None else moved <= 0.03)
        session = next((c for c in summaries.values() if c.get("policy") == "session"
                        and c.get("session_ids") != "none"), None)
        if session is not None:
            mine = (col.get("ttft_ms") or {}).get("p99")
            theirs = (session.get("ttft_ms") or {}).get("p99")
            check(f"{name}: TTFT p99 vs session (named sessions)", [mine, theirs],
                  "prefix <= session",
                  None if mine is None or theirs is None else mine <= theirs)
    return checks


def _number(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def format_checks(checks: list[dict[str, Any]]) -> list[str]:
    """One line per check; a pair of values (this column vs another) as "a vs b"."""
    lines = []
    for c in checks:
        value = c["value"]
        shown = (" vs ".join(_number(v) for v in value) if isinstance(value, list)
                 else _number(value))
        if not c.get("judged", True):
            lines.append(f"[   info] {c['check']}: {shown} (target {c['target']}, not judged)")
            continue
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[c["met"]]
        means = explain.meaning(c["check"])
        lines.append(f"[{verdict:>7}] {c['check']}: {shown} (target {c['target']})"
                     + (f": {means}" if means else ""))
    if explain.needs_not_met_note(checks):
        lines.append(explain.NOT_MET)
    if checks and not checks[0].get("judged", True):
        lines.append("(targets are judged on the simulated default, large and xl presets "
                     "only: tiny is a smoke run, and given replicas bring their own cache)")
    return lines
