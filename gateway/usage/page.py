"""`/stats?format=html`: the stats as a page a person would rather look at than read. Pure:
the `/stats` JSON in, one self-contained HTML document out (inline SVG, no script, no
external resource, so it works behind any proxy and under a strict CSP).

What it shows: the headline and the warnings, the replicas (health, in flight, queued,
KV usage), the cached-token ratio over time (overall and per replica, one point per stats
bucket; a stretch without requests is a gap in the line, not a slope), the ratio per
replica, the windows, errors by status, the hygiene findings and, where `/stats` has one,
the admission queue (tables in gateway.usage.panels). It reloads itself every
`REFRESH_S` seconds with a meta refresh (no script). Every text from the stats (replica,
model and tenant names, warnings, spans) is HTML-escaped.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gateway.usage import panels
from gateway.usage.panels import duration
from gateway.usage.panels import esc as _e
from gateway.usage.panels import pct as _pct

REFRESH_S: Final = 10
_W, _H, _PAD = 720, 240, 36
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")


def runs(points: Sequence[Mapping[str, Any]], key: str | None, gap_s: float
         ) -> list[list[Mapping[str, Any]]]:
    """The points with a value under `key` (None: overall `cached_ratio`), cut into runs of
    consecutive buckets: a bucket more than `gap_s` after the previous one starts a new run,
    so idle time is drawn as a gap, not as a line between the last value and the next."""
    out: list[list[Mapping[str, Any]]] = []
    last: float | None = None
    for p in points:
        value = p.get("cached_ratio") if key is None else p.get("by_replica", {}).get(key)
        if value is None:
            last = None
            continue
        if last is None or p["ts"] - last > gap_s:
            out.append([])
        out[-1].append(p)
        last = p["ts"]
    return out


def _line_chart(series: Sequence[Mapping[str, Any]], bucket_s: float) -> str:
    """Cached-token ratio per bucket: a thick line overall, a thin one per replica."""
    points = [p for p in series if p.get("cached_ratio") is not None]
    gap_s = bucket_s * 1.5
    if not points:
        return "<p class=empty>No requests with cached-token counts yet.</p>"
    t0, t1 = points[0]["ts"], points[-1]["ts"]
    span = max(t1 - t0, 1.0)

    def xy(ts: float, ratio: float) -> str:
        x = _PAD + (ts - t0) / span * (_W - 2 * _PAD)
        y = _H - _PAD - ratio * (_H - 2 * _PAD)
        return f"{x:.1f},{y:.1f}"

    replicas = sorted({r for p in points for r in p.get("by_replica", {})})
    parts = [f'<svg class=chart role=img aria-label="cached-token ratio over time" '
             f'width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}">']
    for frac in (0.0, 0.5, 1.0):
        y = _H - _PAD - frac * (_H - 2 * _PAD)
        parts.append(f'<line x1="{_PAD}" x2="{_W - _PAD}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="#ddd"/><text x="2" y="{y + 4:.1f}" font-size="11">'
                     f'{frac:.0%}</text>')
    for i, name in enumerate(replicas):
        colour = _COLOURS[i % len(_COLOURS)]
        for run in runs(points, name, gap_s):
            pts = " ".join(xy(p["ts"], p["by_replica"][name]) for p in run)
            parts.append(f'<polyline class=replica data-replica="{_e(name)}" fill="none" '
                         f'stroke="{colour}" stroke-width="1.2" points="{pts}"/>')
            if len(run) == 1:  # a line of one point draws nothing: a dot of its colour
                cx, cy = pts.split(",")
                parts.append(f'<circle class=replica-point data-replica="{_e(name)}" '
                             f'cx="{cx}" cy="{cy}" r="3" fill="{colour}"/>')
    for run in runs(points, None, gap_s):
        overall = " ".join(xy(p["ts"], p["cached_ratio"]) for p in run)
        parts.append(f'<polyline class=overall fill="none" stroke="#000" stroke-width="2.5" '
                     f'points="{overall}"/>')
    for p in points:  # a dot per bucket, so a single bucket still shows
        cx, cy = xy(p["ts"], p["cached_ratio"]).split(",")
        parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="#000"/>')
    when = time.strftime("%H:%M:%S", time.gmtime(t0)), time.strftime("%H:%M:%S", time.gmtime(t1))
    parts.append(f'<text x="{_PAD}" y="{_H - 8}" font-size="11">{when[0]} UTC</text>'
                 f'<text x="{_W - _PAD}" y="{_H - 8}" font-size="11" text-anchor="end">'
                 f'{when[1]} UTC</text></svg>')
    legend = "".join(f'<span style="color:{_COLOURS[i % len(_COLOURS)]}">&#9632; {_e(n)}</span> '
                     for i, n in enumerate(replicas))
    return "".join(parts) + f"<p class=legend><b>&#9632; all replicas</b> {legend}</p>"


# The /stats warnings point at JSON; on the page the same findings are a section below.
_STATS_POINTER = "; the latest are under hygiene.latest in /stats"


def warning(text: str) -> str:
    """One warning, escaped; a hygiene warning links to the findings on this page."""
    if not text.startswith("hygiene:"):
        return _e(text)
    head = text.split(_STATS_POINTER, 1)[0]
    return _e(head) + '; the findings and the latest requests are <a href="#hygiene">below, ' \
        "under Hygiene</a>"


def _replica_bars(by_replica: Mapping[str, Mapping[str, Any]]) -> str:
    rows = [(name, f.get("cached_ratio"), f.get("requests", 0))
            for name, f in sorted(by_replica.items())]
    if not rows:
        return "<p class=empty>No replica has answered yet.</p>"
    bar_h, width = 22, _W - 260
    parts = [f'<svg class=bars role=img aria-label="cached-token ratio per replica" '
             f'width="{_W}" height="{bar_h * len(rows) + 8}">']
    for i, (name, ratio, requests) in enumerate(rows):
        y = 4 + i * bar_h
        w = 0.0 if ratio is None else ratio * width
        parts.append(f'<text x="0" y="{y + 15}" font-size="12">{_e(name)}</text>'
                     f'<rect class=bar data-replica="{_e(name)}" x="180" y="{y + 3}" '
                     f'width="{w:.1f}" height="{bar_h - 6}" fill="#1f77b4"/>'
                     f'<text x="{186 + w:.1f}" y="{y + 15}" font-size="12">{_pct(ratio)} '
                     f'({requests} requests)</text>')
    parts.append("</svg>")
    return "".join(parts)


def render_page(stats: Mapping[str, Any]) -> bytes:
    head = stats.get("summary", {})
    windows: Mapping[str, Mapping[str, Any]] = stats.get("windows", {})
    rows = "".join(
        f"<tr><td>{_e(name)}</td><td>{w.get('requests', 0)}</td>"
        f"<td>{_pct(w.get('cached_ratio'))}</td><td>{_pct(w.get('available'))}</td>"
        f"<td>{_pct(w.get('captured'))}</td><td>{_pct(w.get('delivered'))}</td>"
        f"<td>{duration((w.get('ttft') or {}).get('p99_ms'))}</td>"
        f"<td>{duration((w.get('latency') or {}).get('p99_ms'))}</td>"
        f"<td>{_e(w.get('covered_s') if w.get('covered_s') is not None else 'since start')}"
        "</td></tr>"
        for name, w in windows.items())
    warnings = "".join(f"<li>{warning(w)}</li>" for w in stats.get("warnings", [])) or \
        "<li class=none>none</li>"
    by_replica = windows.get("all", {}).get("by_replica", {})
    doc = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="refresh" content="{REFRESH_S}">
<title>gateway stats</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 980px }}
h1 {{ font-size: 20px }} h2 {{ font-size: 16px; margin-top: 28px }} h3 {{ font-size: 14px }}
.down, .critical {{ color: #b00; font-weight: bold }} .warn {{ color: #b60 }}
table {{ border-collapse: collapse }} td, th {{ padding: 3px 10px; border-bottom: 1px solid #eee;
text-align: right }} td:first-child, th:first-child {{ text-align: left }}
.headline {{ font-size: 16px; background: #f4f8fb; padding: 10px 14px; border-radius: 6px }}
.legend span {{ margin-right: 12px }} .empty, .none {{ color: #888 }}
</style></head><body>
<h1>Cache-aware gateway</h1>
<p class=headline id=headline>{_e(head.get("text", ""))}</p>
<h2>Warnings</h2><ul id=warnings>{warnings}</ul>
<h2>Replicas</h2>
{panels.replicas(stats.get("replicas") or {})}
<h2>Cached-token ratio over time</h2>
{_line_chart(stats.get("series", []), float(stats.get("bucket_s") or 10.0))}
<h2>Cached-token ratio per replica (since start)</h2>
{_replica_bars(by_replica)}
<h2>Windows</h2>
<table><tr><th>window</th><th>requests</th><th>cached</th><th>available</th><th>captured</th>
<th>delivered</th><th>TTFT p99 (streamed)</th><th>latency p99</th><th>covered s</th>
</tr>{rows}</table>
<h2>Errors</h2>
{panels.errors(windows)}
<h2 id=hygiene>Hygiene: why prompts miss the cache</h2>
{panels.hygiene(stats.get("hygiene"))}
{panels.admission(stats.get("admission"))}
{panels.pd(stats.get("pd"))}
<p class=empty>JSON: <a href="/stats">/stats</a> &middot;
Prometheus: <a href="/metrics">/metrics</a></p>
</body></html>
"""
    return doc.encode()
