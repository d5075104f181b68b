"""gateway-bench without session ids: how requests name sessions, compare's columns, and
the per-policy figures of moves and conversations per replica (pure, by tables)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.bench.compare import default_columns, split_column
from gateway.bench.report import conversations_per_replica, follow_ups_moved
from gateway.bench.runner import RequestRecord, SessionIds, named


@pytest.mark.parametrize(("how", "body", "headers"), [
    ("header", {"model": "m"}, {"x-session-id": "s1"}),
    ("prompt_cache_key", {"model": "m", "prompt_cache_key": "s1"}, {}),
    ("user", {"model": "m", "user": "s1"}, {}),
    ("none", {"model": "m"}, {}),
])
def test_named(how: SessionIds, body: dict[str, Any], headers: dict[str, str]) -> None:
    original = {"model": "m"}
    assert named(original, "s1", how) == (body, headers)
    assert original == {"model": "m"}  # the workload's body is not changed


@pytest.mark.parametrize(("column", "default", "expected"), [
    ("prefix", "header", ("prefix", "header")),
    ("prefix@none", "header", ("prefix", "none")),
    ("session@header", "none", ("session", "header")),
    ("round_robin@user", "none", ("round_robin", "user")),
])
def test_split_column(column: str, default: SessionIds, expected: tuple[str, str]) -> None:
    assert split_column(column, default) == expected


def test_split_column_rejects_unknown_naming() -> None:
    with pytest.raises(ValueError, match="cookie"):
        split_column("prefix@cookie", "header")


@pytest.mark.parametrize(("policies", "how", "expected"), [
    (("prefix", "round_robin"), "header", ("prefix", "round_robin", "prefix@none")),
    (("prefix", "session@header"), "none", ("prefix", "session@header", "prefix@header")),
    (("prefix", "prefix@user"), "none", ("prefix", "prefix@user")),
    (("round_robin",), "header", ("round_robin",)),
])
def test_default_columns(policies: tuple[str, ...], how: SessionIds,
                         expected: tuple[str, ...]) -> None:
    assert default_columns(policies, how) == expected


def rec(session: str, turn: int, replica: str | None, sibling: int = 0) -> RequestRecord:
    return RequestRecord(
        session_id=session, agent="a", turn=turn, sibling=sibling, send_s=0.0, status=200,
        error=None, prompt_tokens=100, cached_tokens=0, completion_tokens=1, ttft_ms=1.0,
        e2e_ms=2.0, timing="sim", sim_arrival_s=None, replica=replica, route=None,
        request_id=None,
    )


@pytest.mark.parametrize(("records", "moved"), [
    ([rec("s", 0, "a"), rec("s", 1, "a"), rec("s", 2, "a")], 0.0),
    ([rec("s", 0, "a"), rec("s", 1, "b"), rec("s", 2, "b"), rec("t", 0, "a"),
      rec("t", 1, "a")], 1 / 3),
    # siblings are not turns: one on another replica moves nothing
    ([rec("s", 0, "a"), rec("s", 0, "b", sibling=1), rec("s", 1, "a")], 0.0),
    # a turn whose previous turn is unknown (failed) is not counted
    ([rec("s", 0, "a"), rec("s", 2, "b")], None),
    ([rec("s", 0, "a")], None),
])
def test_follow_ups_moved(records: list[RequestRecord], moved: float | None) -> None:
    assert follow_ups_moved(records) == (pytest.approx(moved) if moved is not None else None)


def test_conversations_per_replica() -> None:
    records = [rec("s", 0, "a"), rec("s", 1, "b"), rec("s", 2, "b"),  # home: b
               rec("t", 0, "a"), rec("u", 0, "a"), rec("u", 0, "c", sibling=1)]
    out = conversations_per_replica(records, expected=3)
    assert out is not None
    assert out["per_replica"] == {"a": 2.0, "b": 1.0, "(idle 1)": 0.0}
    assert out["max_over_mean"] == pytest.approx(2.0)
    assert conversations_per_replica([]) is None


def pd(session: str, turn: int, decode: str, prefill: str | None) -> RequestRecord:
    r = rec(session, turn, decode)
    r.prefill = prefill
    return r


@pytest.mark.parametrize(("records", "moved"), [
    # the decode replica stays, the prefill replica changes on one of two follow-ups
    ([pd("s", 0, "d1", "p1"), pd("s", 1, "d1", "p2"), pd("s", 2, "d1", "p2")], 0.5),
    # a turn D served alone (no prefill leg) is not a P follow-up, nor the one after it
    ([pd("s", 0, "d1", "p1"), pd("s", 1, "d1", None), pd("s", 2, "d1", "p2")], None),
    ([pd("s", 0, "d1", "p1"), pd("s", 1, "d2", "p1")], 0.0),
    # aggregated: no request names a prefill replica
    ([rec("s", 0, "a"), rec("s", 1, "b")], None),
])
def test_follow_ups_moved_on_the_prefill_leg(records: list[RequestRecord],
                                              moved: float | None) -> None:
    got = follow_ups_moved(records, prefill=True)
    assert got == (pytest.approx(moved) if moved is not None else None)
