"""Plain-text tables for the terminal and for bench.md (pure).

`render()` aligns columns (first column left, others right) and can emit a Markdown table;
the other functions pick the rows from the summaries built by `report`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    out = []
    for row in [header, ["-" * w for w in widths], *rows]:
        cells = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


def fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "ms":
        return f"{value:.0f}"
    if kind == "x":
        return f"{value:.2f}"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def _get(summary: Mapping[str, Any], path: str) -> Any:
    value: Any = summary
    for part in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


# (label, key path in a summary, format)
SUMMARY_ROWS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", ""),
    ("errors", "errors", ""),
    ("prompt tokens", "prompt_tokens", ""),
    ("cached tokens (engine)", "cached_tokens", ""),
    ("cached ratio (engine)", "cached_ratio", "pct"),
    ("bound ratio", "bound.ratio", "pct"),
    ("working set (blocks)", "bound.working_set_blocks", ""),
    ("share of bound", "bound_share", "pct"),
    ("TTFT p50 ms", "ttft_ms.p50", "ms"),
    ("TTFT p90 ms", "ttft_ms.p90", "ms"),
    ("TTFT p99 ms", "ttft_ms.p99", "ms"),
    ("e2e p50 ms", "e2e_ms.p50", "ms"),
    ("e2e p90 ms", "e2e_ms.p90", "ms"),
    ("e2e p99 ms", "e2e_ms.p99", "ms"),
    # the benchmark's own pacing, not capacity (gateway.bench.explain.PACING says so)
    ("req/s (paced)", "requests_per_s", "x"),
    ("prompt tokens/s (paced)", "prompt_tokens_per_s", "ms"),
    ("requests max/mean", "replica_requests.max_over_mean", "x"),
    ("prompt tokens max/mean", "replica_prompt_tokens.max_over_mean", "x"),
    ("routing precision", "routing_precision", "pct"),
    ("follow-ups moved", "follow_ups_moved", "pct"),
    ("follow-ups moved (prefill leg)", "follow_ups_moved_prefill", "pct"),
    ("follow-ups: history still cached", "history_cached.share", "pct"),
    ("follow-ups: cached / previous prompt", "history_cached.ratio", "pct"),
    ("conversations max/mean", "replica_conversations.max_over_mean", "x"),
    ("pred-vs-delivered median abs err", "predicted.median_abs_error", ""),
    ("pred-vs-delivered p90", "predicted.p90_abs_error", ""),
)


def summary_table(
    columns: Mapping[str, Mapping[str, Any]], markdown: bool = False
) -> str:
    """One row per metric, one column per run (policy)."""
    names = list(columns)
    rows = [
        [label, *(fmt(_get(columns[n], path), kind) for n in names)]
        for label, path, kind in SUMMARY_ROWS
        if any(_get(columns[n], path) is not None for n in names)
    ]
    return render(["metric", *names], rows, markdown)


def turn_table(rows: Sequence[Mapping[str, Any]], markdown: bool = False) -> str:
    header = ["turn", "requests", "prompt tokens", "TTFT ms", "e2e ms", "cache hit", "from cache"]
    body = [
        [
            str(r["turn"]),
            str(r["requests"]),
            f"{r['prompt_tokens']:.0f}",
            fmt(r["ttft_ms"], "ms"),
            fmt(r["e2e_ms"], "ms"),
            fmt(r["cached_ratio"], "pct"),
            f"{r['cached_tokens']:.0f}",
        ]
        for r in rows
    ]
    return render(header, body, markdown)


def replica_table(columns: Mapping[str, Mapping[str, Any]], markdown: bool = False) -> str:
    """Requests per replica for each run."""
    names = list(columns)
    replicas: set[str] = set()
    for s in columns.values():
        replicas.update((_get(s, "replica_requests.per_replica") or {}).keys())
    per = {n: _get(columns[n], "replica_requests.per_replica") or {} for n in names}
    rows = [[rep, *(fmt(per[n].get(rep)) for n in names)] for rep in sorted(replicas)]
    return render(["replica", *names], rows, markdown)
