"""`gateway report USAGE_LOG [--json] [--top N]`: summarise a usage log.

Reads the JSON lines the file sink writes (`-` for stdin), builds the digest of
`gateway.usage.digest` (windows relative to the log's last timestamp, the whole log,
per model/replica/tenant, prompt-length percentiles, the `--max-model-len` suggestion,
top sessions and tenants by uncached tokens, warnings) and prints it as a terminal table,
or as JSON with `--json`. An unreadable line (a log cut mid-line, a foreign line) is
skipped with a message naming it, and counted (`skipped_lines`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import IO, Any

import orjson

from gateway.usage.digest import digest
from gateway.usage.logfile import LogError, read_records

MAX_SHOWN = 20  # skipped lines named one by one; the rest are counted


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("usage_log", metavar="USAGE_LOG", help="usage log (JSON lines), - = stdin")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--top", type=int, default=10, metavar="N", help="sessions/tenants to list (default 10)"
    )


def _lines(path: str) -> Iterator[bytes]:
    if path == "-":
        yield from sys.stdin.buffer
        return
    with open(path, "rb") as fh:
        yield from fh


def run(args: argparse.Namespace) -> int:
    if args.top < 0:
        print("gateway report: --top must be >= 0", file=sys.stderr)
        return 2
    skipped: list[LogError] = []
    try:
        report = digest(read_records(_lines(args.usage_log), skipped.append), top=args.top)
    except OSError as e:
        print(f"gateway report: cannot read {args.usage_log}: {e}", file=sys.stderr)
        return 2
    for err in skipped[:MAX_SHOWN]:
        print(f"gateway report: {args.usage_log}: skipped {err}", file=sys.stderr)
    if skipped:
        more = f" ({len(skipped) - MAX_SHOWN} not shown)" if len(skipped) > MAX_SHOWN else ""
        print(f"gateway report: skipped {len(skipped)} unreadable line(s){more}",
              file=sys.stderr)
    report["skipped_lines"] = len(skipped)
    try:
        if args.json:
            sys.stdout.buffer.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        else:
            write_table(report, args.usage_log, sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        # `gateway report log | head`: the reader left; that is not an error of ours.
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silences the exit flush
    return 0


# -- terminal rendering ----------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}{unit}"


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(out: IO[str], header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        pairs = zip(row, widths, strict=True)
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(pairs)]
        out.write("  ".join(cells).rstrip() + "\n")
    out.write("\n")


_FIG_HEADER = ["", "requests", "prompt", "cached", "ratio", "available", "captured",
               "delivered", "no cached"]  # fmt: skip


def _fig_row(name: str, f: dict[str, Any]) -> list[str]:
    return [
        name,
        _num(f["requests"]),
        _num(f["prompt_tokens"]),
        _num(f["cached_tokens"]),
        _pct(f["cached_ratio"]),
        _pct(f["available"]),
        _pct(f["captured"]),
        _pct(f["delivered"]),
        _num(f["records_without_cached_tokens"]),
    ]


def write_table(report: dict[str, Any], source: str, out: IO[str]) -> None:
    out.write(f"usage log {source}: {report['records']} records, "
              f"{_when(report['first_ts'])} .. {_when(report['last_ts'])}\n\n")  # fmt: skip
    windows: dict[str, dict[str, Any]] = report["windows"]
    if not windows:
        out.write("no records\n")
        return
    out.write("windows (relative to the last record)\n")
    rows = [_fig_row(name, w) for name, w in windows.items()]
    _table(out, ["window", *_FIG_HEADER[1:]], rows)
    whole = windows["all"]
    for dim in ("model", "replica", "tenant"):
        groups: dict[str, dict[str, Any]] = whole[f"by_{dim}"]
        out.write(f"by {dim} (whole log)\n")
        _table(out, [dim, *_FIG_HEADER[1:]], [_fig_row(n, g) for n, g in groups.items()])
    out.write("latency and status\n")
    lat_rows = []
    for name, w in windows.items():
        statuses = " ".join(f"{k}:{v}" for k, v in w["by_status"].items())
        lat_rows.append([
            name,
            _num(w["ttft"]["p99_ms"], " ms"),
            _num(w["tpot"]["p99_ms"], " ms"),
            statuses or "-",
        ])  # fmt: skip
    ttft_t, tpot_t = whole["ttft"]["target_ms"], whole["tpot"]["target_ms"]
    _table(out, ["window", f"TTFT p99 (<{ttft_t:.0f})", f"TPOT p99 (<{tpot_t:.0f})", "status"],
           lat_rows)  # fmt: skip
    p = whole["prompt_tokens_percentiles"]
    out.write(f"prompt tokens: P50 {_num(p['p50'])}  P95 {_num(p['p95'])}  P99 {_num(p['p99'])}\n")
    out.write(f"prompt+completion P99: {_num(whole['total_tokens_p99'])} tokens -> suggested "
              f"--max-model-len {whole['max_model_len_suggestion'] or '-'} "
              "(P99 x 1.2, rounded up to a multiple of 1024)\n\n")  # fmt: skip
    for key, title in (("top_sessions", "session"), ("top_tenants", "tenant")):
        entries: list[dict[str, Any]] = report[key]
        out.write(f"top {title}s by uncached prompt tokens\n")
        _table(
            out,
            [title, "requests", "prompt", "cached", "uncached", "unknown"],
            [[e["name"], _num(e["requests"]), _num(e["prompt_tokens"]), _num(e["cached_tokens"]),
              _num(e["uncached_tokens"]), _num(e["unknown_prompt_tokens"])] for e in entries],
        )  # fmt: skip
    warnings: list[str] = report["warnings"]
    out.write("warnings\n" if warnings else "warnings: none\n")
    for text in warnings:
        out.write(f"  - {text}\n")
