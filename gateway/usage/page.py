"""`/stats?format=html`: the stats as a page a person would rather look at than read. Pure:
the `/stats` JSON in, one self-contained HTML document out (inline SVG, no script, no
external resource, so it works behind any proxy and under a strict CSP).

What it shows: the headline, the cached-token ratio over time (overall and per replica,
one point per stats bucket), the ratio per replica, the windows and the warnings. Every
text from the stats (replica, model and tenant names, warnings) is HTML-escaped.
"""

from __future__ import annotations

import html
import time
from collections.abc import Mapping, Sequence
from typing import Any

_W, _H, _PAD = 720, 240, 36
_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
            "#7f7f7f", "#bcbd22", "#17becf")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _line_chart(series: Sequence[Mapping[str, Any]]) -> str:
    """Cached-token ratio per bucket: a thick line overall, a thin one per replica."""
    points = [p for p in series if p.get("cached_ratio") is not None]
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
        pts = " ".join(xy(p["ts"], p["by_replica"][name]) for p in points
                       if p.get("by_replica", {}).get(name) is not None)
        colour = _COLOURS[i % len(_COLOURS)]
        parts.append(f'<polyline class=replica data-replica="{_e(name)}" fill="none" '
                     f'stroke="{colour}" stroke-width="1.2" points="{pts}"/>')
    overall = " ".join(xy(p["ts"], p["cached_ratio"]) for p in points)
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
        f"<td>{_e((w.get('ttft') or {}).get('p99_ms') or 'n/a')}</td>"
        f"<td>{_e(w.get('covered_s') if w.get('covered_s') is not None else 'all')}</td></tr>"
        for name, w in windows.items())
    warnings = "".join(f"<li>{_e(w)}</li>" for w in stats.get("warnings", [])) or \
        "<li class=none>none</li>"
    by_replica = windows.get("all", {}).get("by_replica", {})
    doc = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>gateway stats</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 780px }}
h1 {{ font-size: 20px }} h2 {{ font-size: 16px; margin-top: 28px }}
table {{ border-collapse: collapse }} td, th {{ padding: 3px 10px; border-bottom: 1px solid #eee;
text-align: right }} td:first-child, th:first-child {{ text-align: left }}
.headline {{ font-size: 16px; background: #f4f8fb; padding: 10px 14px; border-radius: 6px }}
.legend span {{ margin-right: 12px }} .empty, .none {{ color: #888 }}
</style></head><body>
<h1>Cache-aware gateway</h1>
<p class=headline id=headline>{_e(head.get("text", ""))}</p>
<h2>Cached-token ratio over time</h2>
{_line_chart(stats.get("series", []))}
<h2>Cached-token ratio per replica (since start)</h2>
{_replica_bars(by_replica)}
<h2>Windows</h2>
<table><tr><th>window</th><th>requests</th><th>cached</th><th>available</th><th>captured</th>
<th>delivered</th><th>TTFT p99 ms</th><th>covered s</th></tr>{rows}</table>
<h2>Warnings</h2><ul id=warnings>{warnings}</ul>
<p class=empty>JSON: <a href="/stats">/stats</a> &middot;
Prometheus: <a href="/metrics">/metrics</a></p>
</body></html>
"""
    return doc.encode()
