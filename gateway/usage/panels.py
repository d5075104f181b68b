"""The tables of the `/stats` page (gateway.usage.page), each a pure function of a part of
the `/stats` JSON that returns an HTML fragment. Every text taken from the stats is
HTML-escaped; a part that is absent or empty says so instead of drawing an empty table.

- `replicas`: health, in-flight, running and waiting requests, KV-cache usage and level.
- `errors`: answers by status of 400 and above per window, the gateway's own apart.
- `hygiene`: findings by kind with the prompt tokens at risk, their share, the saving per
  hour and the newest remedy, by model and tenant, and the latest few with their place
  (message index, character offset), span and remedy.
- `admission`: the gateway queue (queued per class, shed per reason, waits, admitted
  tokens per tenant), only where `/stats` has an `admission` section.
- `pd`: P/D traffic (two-leg requests, transferred and pulled-back tokens, leg failures)
  and each prefill replica's own split of its cached prompt tokens, only where `/stats`
  has a `pd` section (a fleet with a prefill replica; the operator's view).
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def num(x: object) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.1f}"
    return esc(x)


SECONDS_FROM_MS = 10_000.0


def duration(ms: object, ms_digits: int = 1) -> str:
    """A latency for a person: milliseconds while short, seconds from 10 s on (a long
    answer's 226468 ms reads 226.5 s); `ms_digits`: decimals of the milliseconds."""
    if not isinstance(ms, (int, float)) or isinstance(ms, bool):
        return num(ms)
    if ms >= SECONDS_FROM_MS:
        return f"{ms / 1000:.1f} s"
    return f"{ms:.{ms_digits}f} ms"


def _table(table_id: str, head: Sequence[str], rows: Iterable[str], empty: str) -> str:
    body = "".join(rows)
    if not body:
        return f'<p class=empty id="{table_id}">{esc(empty)}</p>'
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    return f'<table id="{table_id}"><tr>{th}</tr>{body}</table>'


def replicas(reps: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for name, r in sorted(reps.items()):
        healthy = r.get("healthy")
        state = "unknown" if healthy is None else "up" if healthy else "DOWN"
        level = r.get("kv_level", "unknown")
        rows.append(
            f'<tr class="replica {esc(state.lower())}" data-replica="{esc(name)}">'
            f"<td>{esc(name)}</td><td class=health>{esc(state)}</td>"
            f"<td>{num(r.get('in_flight'))}</td><td>{num(r.get('requests_running'))}</td>"
            f"<td>{num(r.get('requests_waiting'))}</td>"
            f"<td class=kv>{pct(r.get('kv_cache_usage'))}</td>"
            f'<td class="level {esc(level)}">{esc(level)}</td></tr>')
    return _table("replicas", ("replica", "health", "in flight", "running", "waiting",
                               "KV cache used", "KV level"), rows, "No replica configured.")


def errors(windows: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for name, w in windows.items():
        bad = {s: n for s, n in (w.get("by_status") or {}).items() if s.isdigit() and int(s) >= 400}
        if not bad:
            continue
        own = (w.get("gateway_rejected") or {}).get("by_status") or {}
        cells = ", ".join(f"{esc(s)}: {esc(n)}" + (f" ({esc(own[s])} by the gateway)"
                                                  if own.get(s) else "")
                          for s, n in sorted(bad.items()))
        rows.append(f"<tr><td>{esc(name)}</td><td>{esc(sum(bad.values()))}</td>"
                    f"<td>{w.get('requests', 0)}</td><td>{cells}</td></tr>")
    return _table("errors", ("window", "errors", "requests", "by status"), rows,
                  "No errors.")


def _kind_rows(rows: Sequence[Mapping[str, Any]], share: bool) -> list[str]:
    out = []
    for r in rows:
        extra = f"<td>{pct(r.get('share_of_prompt_tokens'))}</td>" if share else ""
        out.append(f'<tr class=kind data-kind="{esc(r.get("kind"))}" '
                   f'data-severity="{esc(r.get("severity"))}"><td>{esc(r.get("kind"))}</td>'
                   f"<td>{esc(r.get('severity'))}</td><td>{esc(r.get('findings'))}</td>"
                   f"<td>{esc(r.get('requests'))}</td><td>{esc(r.get('tokens_at_risk'))}</td>"
                   f"{extra}<td>{num(r.get('saving_tokens_per_hour'))}</td>"
                   f"<td class=fix>{esc(r.get('remedy') or '')}</td></tr>")
    return out


def _grouped(groups: Mapping[str, Sequence[Mapping[str, Any]]], label: str, table_id: str
             ) -> str:
    rows = [f"<tr><td>{esc(name)}</td><td>{esc(r.get('kind'))}</td>"
            f"<td>{esc(r.get('severity'))}</td><td>{esc(r.get('findings'))}</td>"
            f"<td>{esc(r.get('tokens_at_risk'))}</td>"
            f"<td>{num(r.get('saving_tokens_per_hour'))}</td></tr>"
            for name, kinds in sorted(groups.items()) for r in kinds]
    return _table(table_id, (label, "kind", "severity", "findings", "tokens at risk",
                             "saving per hour"), rows,
                  f"No findings by {label}.")


def _latest_rows(latest: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for f in latest:
        index = f.get("message_index")
        place = f.get("role") if index is None else index
        ts = f.get("ts")
        when = time.strftime("%H:%M:%S", time.gmtime(ts)) if isinstance(ts, int | float) else ""
        out.append(
            f'<tr class=finding data-kind="{esc(f.get("kind"))}" data-message="{esc(place)}" '
            f'data-offset="{esc(f.get("char_offset"))}" '
            f'data-tokens="{esc(f.get("tokens_at_risk"))}"><td>{esc(when)}</td>'
            f"<td>{esc(f.get('model'))}</td><td>{esc(f.get('kind'))}</td>"
            f"<td>{esc(f.get('severity'))}</td><td>{esc(f.get('evidence'))}</td>"
            f"<td>{esc(place)}</td><td>{esc(f.get('char_offset'))}</td>"
            f"<td>{esc(f.get('tokens_at_risk'))}</td><td><code>{esc(f.get('span'))}</code>"
            f"</td><td class=fix>{esc(f.get('remedy') or '')}</td></tr>")
    return out


def hygiene(section: Mapping[str, Any] | None) -> str:
    if not section:
        return '<p class=empty id="hygiene">No hygiene figures.</p>'
    covered = section.get("covered_s")
    head = (f'<p id="hygiene">{esc(section.get("findings", 0))} finding(s), '
            f'{esc(section.get("tokens_at_risk", 0))} prompt tokens at risk of '
            f'{esc(section.get("prompt_tokens", 0))} over the last '
            f'{esc(section.get("window", ""))} ({num(covered)} s covered); a kind is a warning '
            f"from {pct(section.get('warn_share'))} of the prompt tokens.</p>")
    kinds = _table("hygiene-kinds", ("kind", "severity", "findings", "requests",
                                     "tokens at risk", "share of prompt tokens",
                                     "saving per hour", "fix (newest)"),
                   _kind_rows(section.get("by_kind") or [], True), "No findings.")
    latest = _table("hygiene-latest", ("time UTC", "model", "kind", "severity", "evidence",
                                       "message", "offset", "tokens at risk", "span",
                                       "fix"),
                    _latest_rows(section.get("latest") or []), "No findings yet.")
    return (head + kinds + "<h3>Latest findings</h3>" + latest + "<h3>By model</h3>"
            + _grouped(section.get("by_model") or {}, "model", "hygiene-models")
            + "<h3>By tenant</h3>"
            + _grouped(section.get("by_tenant") or {}, "tenant", "hygiene-tenants"))


def admission(section: Mapping[str, Any] | None) -> str:
    """The gateway queue; empty when `/stats` has no `admission` section."""
    if section is None:
        return ""
    enabled = bool(section.get("enabled"))
    queued: Mapping[str, Any] = section.get("queued") or {}
    shed: Mapping[str, Any] = section.get("shed") or {}
    waits: Mapping[str, Mapping[str, Any]] = section.get("wait_ms") or {}
    tokens: Mapping[str, Any] = section.get("admitted_tokens") or {}
    classes = sorted(set(queued) | set(waits))
    rows = [f'<tr data-class="{esc(c)}"><td>{esc(c)}</td><td>{num(queued.get(c, 0))}</td>'
            f"<td>{num((waits.get(c) or {}).get('p50'))}</td>"
            f"<td>{num((waits.get(c) or {}).get('p99'))}</td></tr>" for c in classes]
    shed_rows = [f'<tr data-reason="{esc(r)}"><td>{esc(r)}</td><td>{num(n)}</td></tr>'
                 for r, n in sorted(shed.items())]
    tenant_rows = [f"<tr><td>{esc(t)}</td><td>{num(n)}</td></tr>"
                   for t, n in sorted(tokens.items())]
    return (f'<h2>Admission</h2><p id="admission">Gateway queue '
            f'{"enabled" if enabled else "disabled"}; {sum(_ints(queued.values()))} queued, '
            f"{sum(_ints(shed.values()))} shed.</p>"
            + _table("admission-queued", ("class", "queued", "wait p50 ms", "wait p99 ms"),
                     rows, "Nothing queued.")
            + _table("admission-shed", ("reason", "shed"), shed_rows, "Nothing shed.")
            + _table("admission-tenants", ("tenant", "admitted tokens"), tenant_rows,
                     "No tokens admitted yet."))


def pd(section: Mapping[str, Any] | None) -> str:
    """P/D traffic; empty when `/stats` has no `pd` section."""
    if section is None:
        return ""
    kv: Mapping[str, Any] = section.get("decoder_kv") or {}
    failures: Mapping[str, Mapping[str, Any]] = section.get("transfer_failures") or {}
    fail_rows = [f'<tr data-leg="{esc(leg)}"><td>{esc(leg)}</td><td>{esc(what)}</td>'
                 f"<td>{num(n)}</td></tr>"
                 for leg, per in sorted(failures.items()) for what, n in sorted(per.items())]
    engines: Mapping[str, Mapping[str, Any]] = section.get("prefill_engines") or {}
    engine_rows = [f'<tr data-replica="{esc(name)}"><td>{esc(name)}</td>'
                   f"<td>{num(e.get('local_cache_hit'))}</td>"
                   f"<td>{num(e.get('external_kv_transfer'))}</td></tr>"
                   for name, e in sorted(engines.items())]
    return (f'<h2>Prefill/decode</h2><p id="pd">{num(section.get("two_legs", 0))} two-leg '
            f'requests, {num(section.get("transferred_tokens", 0))} tokens offered to '
            f'decoders, {num(kv.get("pulled_tokens", 0))} pulled back from them (the '
            "gateway's reading of the prefill replicas' answers).</p>"
            + _table("pd-failures", ("leg", "failure", "count"), fail_rows,
                     "No leg failed.")
            + _table("pd-engines", ("prefill replica", "local cache hit tokens",
                                    "external KV tokens (engine)"), engine_rows,
                     "No prefill replica scraped yet."))


def _ints(values: Iterable[Any]) -> Iterable[int]:
    return (v for v in values if isinstance(v, int) and not isinstance(v, bool))
