"""Hygiene findings as `/stats` shows them (pure: records in, figures out).

`FindingTally` lives in each stats bucket (gateway.usage.stats) and sums, per (kind,
severity): the findings, the requests that had one, and the prompt tokens they put at
risk; the same per model and per tenant (labels bounded as the usage totals' are). A
request with two findings of one kind (a timestamp in the system prompt and another
further down) loses the cache once, at the first: it adds the larger `tokens_at_risk` of
that kind, not the sum, so a kind's cost never counts one break twice.

Each row also carries the remedy of its kind's newest finding (one string per row: bounded
as the rows are) and `saving_tokens_per_hour`: the tokens at risk of the row's requests
over the window's covered seconds, scaled to an hour (gateway.hygiene.remedy.per_hour),
what the remedy would save at the current traffic. A `by_tenant` row counts that tenant's
requests alone, so the saving a key reads there is its own traffic's.

`share` = a kind's tokens at risk (warnings only: `info` findings are suspicions) over the
window's reported prompt tokens, capped at 1 (tokens at risk are estimated before
tokenization, prompt tokens are the engine's). `costly_kinds` names the kinds whose share
reaches a threshold: they become `/stats` warnings.

`LatestFindings` keeps the last `size` findings with their request's facts (bounded ring).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Final

from gateway.hygiene.finding import Finding
from gateway.hygiene.remedy import per_hour
from gateway.usage.record import UsageRecord

NONE_KEY: Final = "none"


class KindTotals:
    __slots__ = ("findings", "remedy", "remedy_ts", "requests", "tokens")

    def __init__(self) -> None:
        self.findings = 0
        self.requests = 0
        self.tokens = 0
        self.remedy = ""  # the newest finding's remedy
        self.remedy_ts = float("-inf")

    def merge(self, o: KindTotals) -> None:
        self.findings += o.findings
        self.requests += o.requests
        self.tokens += o.tokens
        if o.remedy and o.remedy_ts >= self.remedy_ts:
            self.remedy, self.remedy_ts = o.remedy, o.remedy_ts


def _per_kind(findings: tuple[Finding, ...]
              ) -> Iterator[tuple[tuple[str, str], int, Finding]]:
    """((kind, severity), findings, the costliest finding) per kind in one request."""
    groups: dict[tuple[str, str], list[Finding]] = {}
    for f in findings:
        groups.setdefault((f.kind, f.severity), []).append(f)
    for key, found in groups.items():
        yield key, len(found), max(found, key=lambda f: f.tokens_at_risk)


class FindingTally:
    """Findings of one stats bucket; see the module docstring."""

    __slots__ = ("by_kind", "by_model", "by_tenant")

    def __init__(self) -> None:
        self.by_kind: dict[tuple[str, str], KindTotals] = {}
        self.by_model: dict[str, dict[tuple[str, str], KindTotals]] = {}
        self.by_tenant: dict[str, dict[tuple[str, str], KindTotals]] = {}

    def add(self, rec: UsageRecord) -> None:
        if not rec.findings:
            return
        model = self.by_model.setdefault(rec.model or NONE_KEY, {})
        tenant = self.by_tenant.setdefault(rec.tenant or NONE_KEY, {})
        for key, n, costliest in _per_kind(rec.findings):
            for table in (self.by_kind, model, tenant):
                t = table.get(key)
                if t is None:
                    t = table[key] = KindTotals()
                t.findings += n
                t.requests += 1
                t.tokens += costliest.tokens_at_risk
                if costliest.remedy and rec.ts >= t.remedy_ts:
                    t.remedy, t.remedy_ts = costliest.remedy, rec.ts

    def merge(self, o: FindingTally) -> None:
        _merge(self.by_kind, o.by_kind)
        for mine, theirs in ((self.by_model, o.by_model), (self.by_tenant, o.by_tenant)):
            for name, table in theirs.items():
                _merge(mine.setdefault(name, {}), table)

    def figures(self, prompt_tokens: int, covered_s: float | None = None) -> dict[str, Any]:
        """The window's hygiene figures, shares against its `prompt_tokens`, savings per
        hour over its `covered_s` (None: the window's span is unknown, no rate)."""
        findings = sum(t.findings for t in self.by_kind.values())
        return {
            "findings": findings,
            "tokens_at_risk": sum(t.tokens for t in self.by_kind.values()),
            "by_kind": _rows(self.by_kind, prompt_tokens, covered_s),
            "by_model": {m: _rows(t, None, covered_s) for m, t in sorted(self.by_model.items())},
            "by_tenant": {m: _rows(t, None, covered_s)
                          for m, t in sorted(self.by_tenant.items())},
        }


def _merge(mine: dict[tuple[str, str], KindTotals], theirs: dict[tuple[str, str], KindTotals]
           ) -> None:
    for key, t in theirs.items():
        m = mine.get(key)
        if m is None:
            m = mine[key] = KindTotals()
        m.merge(t)


def share(tokens: int, prompt_tokens: int | None) -> float | None:
    if not prompt_tokens:
        return None
    return min(1.0, tokens / prompt_tokens)


def _rows(table: dict[tuple[str, str], KindTotals], prompt_tokens: int | None,
          covered_s: float | None) -> list[dict[str, Any]]:
    """Costliest first (then by kind, for a stable order)."""
    rows = []
    for (kind, severity), t in sorted(table.items(), key=lambda kv: (-kv[1].tokens, kv[0])):
        row: dict[str, Any] = {
            "kind": kind, "severity": severity, "findings": t.findings,
            "requests": t.requests, "tokens_at_risk": t.tokens,
            "saving_tokens_per_hour": None if covered_s is None
            else per_hour(t.tokens, covered_s),
            "remedy": t.remedy}
        if prompt_tokens is not None:
            s = share(t.tokens, prompt_tokens)
            row["share_of_prompt_tokens"] = None if s is None else round(s, 4)
        rows.append(row)
    return rows


def costly_kinds(figures: dict[str, Any], threshold: float) -> list[dict[str, Any]]:
    """The `by_kind` rows of warning severity whose share reaches `threshold`."""
    return [row for row in figures["by_kind"]
            if row["severity"] == "warning" and row.get("share_of_prompt_tokens") is not None
            and row["share_of_prompt_tokens"] >= threshold]


class LatestFindings:
    """The last `size` findings, newest first in `rows()`."""

    def __init__(self, size: int) -> None:
        self._ring: deque[dict[str, Any]] = deque(maxlen=size)

    def add(self, rec: UsageRecord) -> None:
        for f in rec.findings:
            self._ring.append({
                "ts": rec.ts, "request_id": rec.request_id, "model": rec.model,
                "tenant": rec.tenant, "replica": rec.replica, **f.to_dict()})

    def rows(self) -> list[dict[str, Any]]:
        return list(reversed(self._ring))
