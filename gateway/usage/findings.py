"""Hygiene findings as `/stats` shows them (pure: records in, figures out).

`FindingTally` lives in each stats bucket (gateway.usage.stats) and sums, per (kind,
severity): the findings, the requests that had one, and the prompt tokens they put at
risk; the same per model and per tenant (labels bounded as the usage totals' are). A
request with two findings of one kind (a timestamp in the system prompt and another
further down) loses the cache once, at the first: it adds the larger `tokens_at_risk` of
that kind, not the sum, so a kind's cost never counts one break twice.

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
from gateway.usage.record import UsageRecord

NONE_KEY: Final = "none"


class KindTotals:
    __slots__ = ("findings", "requests", "tokens")

    def __init__(self) -> None:
        self.findings = 0
        self.requests = 0
        self.tokens = 0

    def merge(self, o: KindTotals) -> None:
        self.findings += o.findings
        self.requests += o.requests
        self.tokens += o.tokens


def _per_kind(findings: tuple[Finding, ...]) -> Iterator[tuple[tuple[str, str], int, int]]:
    """((kind, severity), findings, the largest tokens at risk) per kind in one request."""
    groups: dict[tuple[str, str], list[int]] = {}
    for f in findings:
        groups.setdefault((f.kind, f.severity), []).append(f.tokens_at_risk)
    for key, tokens in groups.items():
        yield key, len(tokens), max(tokens)


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
        for key, n, tokens in _per_kind(rec.findings):
            for table in (self.by_kind, model, tenant):
                t = table.get(key)
                if t is None:
                    t = table[key] = KindTotals()
                t.findings += n
                t.requests += 1
                t.tokens += tokens

    def merge(self, o: FindingTally) -> None:
        _merge(self.by_kind, o.by_kind)
        for mine, theirs in ((self.by_model, o.by_model), (self.by_tenant, o.by_tenant)):
            for name, table in theirs.items():
                _merge(mine.setdefault(name, {}), table)

    def figures(self, prompt_tokens: int) -> dict[str, Any]:
        """The window's hygiene figures, shares against its `prompt_tokens`."""
        findings = sum(t.findings for t in self.by_kind.values())
        return {
            "findings": findings,
            "tokens_at_risk": sum(t.tokens for t in self.by_kind.values()),
            "by_kind": _rows(self.by_kind, prompt_tokens),
            "by_model": {m: _rows(t, None) for m, t in sorted(self.by_model.items())},
            "by_tenant": {m: _rows(t, None) for m, t in sorted(self.by_tenant.items())},
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


def _rows(table: dict[tuple[str, str], KindTotals], prompt_tokens: int | None
          ) -> list[dict[str, Any]]:
    """Costliest first (then by kind, for a stable order)."""
    rows = []
    for (kind, severity), t in sorted(table.items(), key=lambda kv: (-kv[1].tokens, kv[0])):
        row: dict[str, Any] = {"kind": kind, "severity": severity, "findings": t.findings,
                               "requests": t.requests, "tokens_at_risk": t.tokens}
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
