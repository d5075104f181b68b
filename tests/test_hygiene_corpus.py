"""Precision and recall of warnings per family over the labelled corpus.

A case's predicted kinds are the kinds of all `warning` findings over its requests. A
positive counts as found only when a warning of its kind names the expected place
(message_index, role). A warning of kind K in a case not labelled K is a false positive
for K (negatives must produce no warning at all).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Literal

import pytest

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.finding import Finding
from tests.hygiene_corpus.cases import FAMILIES, Case, generate

CASES = generate()


def run_case(case: Case) -> list[Finding]:
    a = HygieneAnalyzer(HygieneConfig())
    out: list[Finding] = []
    for r in case.requests:
        endpoint: Literal["chat", "completions"] = "chat" if r.endpoint == "chat" else "completions"
        out.extend(a.scan(r.body, endpoint, r.session, r.now))
    return out


def evaluate(cases: list[Case]) -> tuple[dict[str, Counter[str]], list[str]]:
    stats: dict[str, Counter[str]] = {f: Counter() for f in FAMILIES}
    misses: list[str] = []
    for case in cases:
        warnings = [f for f in run_case(case) if f.severity == "warning"]
        kinds = {f.kind for f in warnings}
        if case.expect is not None:
            hit = any(
                f.kind == case.expect and (f.message_index, f.role) == case.where for f in warnings
            )
            stats[case.expect]["tp" if hit else "fn"] += 1
            if not hit:
                misses.append(
                    f"FN {case.name}: {[(f.kind, f.message_index, f.role) for f in warnings]}"
                )
        for k in kinds - {case.expect}:
            stats.setdefault(k, Counter())["fp"] += 1
            misses.append(f"FP {case.name} -> {k}")
    return stats, misses


STATS, MISSES = evaluate(CASES)


def test_corpus_is_large_and_varied() -> None:
    per_family = Counter(c.expect for c in CASES)
    assert all(per_family[f] >= 30 for f in FAMILIES), per_family
    assert per_family[None] >= 200


@pytest.mark.parametrize("family", FAMILIES)
def test_precision_and_recall_per_family(family: str) -> None:
    s = STATS[family]
    recall = s["tp"] / max(1, s["tp"] + s["fn"])
    precision = s["tp"] / max(1, s["tp"] + s["fp"])
    detail = [m for m in MISSES if family in m][:10]
    assert recall >= 0.9, (family, dict(s), detail)
    assert precision >= 0.9, (family, dict(s), detail)


def test_no_warning_kind_outside_the_families() -> None:
    assert set(STATS) - set(FAMILIES) == set(), {k: STATS[k] for k in set(STATS) - set(FAMILIES)}


def test_negatives_are_silent() -> None:
    noisy = [m for m in MISSES if (m.startswith("FP") and "neg" in m) or m.startswith("FP tricky")]
    assert len(noisy) <= 0.02 * sum(1 for c in CASES if c.expect is None), noisy


def without_sessions(cases: list[Case]) -> list[Case]:
    return [dataclasses.replace(c, requests=tuple(
        dataclasses.replace(r, session=None) for r in c.requests)) for c in cases]


SESSIONLESS_STATS, SESSIONLESS_MISSES = evaluate(without_sessions(CASES))


@pytest.mark.parametrize("family", ["history_rewrite", "whitespace", "request_id"])
def test_history_rewrites_reported_without_session_ids(family: str) -> None:
    """Most clients send no session id: a rewritten history (summarised, trimmed, an old
    turn edited) is still compared with its conversation's previous request, recognised
    by the messages it kept, and reported as reliably as with a session id."""
    s = SESSIONLESS_STATS[family]
    recall = s["tp"] / max(1, s["tp"] + s["fn"])
    precision = s["tp"] / max(1, s["tp"] + s["fp"])
    detail = [m for m in SESSIONLESS_MISSES if family in m][:10]
    assert recall >= 0.95, (family, dict(s), detail)
    assert precision >= 0.9, (family, dict(s), detail)


def test_negatives_are_silent_without_session_ids() -> None:
    noisy = [m for m in SESSIONLESS_MISSES
             if (m.startswith("FP") and "neg" in m) or m.startswith("FP tricky")]
    assert len(noisy) <= 0.02 * sum(1 for c in CASES if c.expect is None), noisy
