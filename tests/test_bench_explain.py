"""The benchmark explains its own output: a line per column label, the paced rows said to
be pacing, each check's meaning, and a note under [NOT MET] lines."""

from __future__ import annotations

import pytest

from gateway.bench import explain
from gateway.bench.checks import format_checks, tiny_note
from gateway.bench.presets import PRESETS
from gateway.bench.table import summary_table


@pytest.mark.parametrize(("label", "default", "has", "lacks"), [
    ("prefix", "header", ["lowest estimated time to first token", "x-session-id"],
     ["admission"]),
    ("prefix@none", "header", ["no session id sent", "recognised from their prompts"],
     ["x-session-id"]),
    ("prefix", "none", ["no session id sent"], []),
    ("round_robin", "header", ["next replica in turn", "cache is ignored"], ["session"]),
    ("least_loaded", "header", ["fewest requests in flight"], ["session id"]),
    ("session@user", "header", ["hash of the session id", "user field"], []),
    ("prefix+queue@none", "header", ["admission queue on", "no session id sent"], []),
])
def test_each_column_says_what_it_ran(label: str, default: str, has: list[str],
                                      lacks: list[str]) -> None:
    line = explain.column(label, default)
    assert line.startswith(f"  {label}: ")
    for text in has:
        assert text in line
    for text in lacks:
        assert text not in line


def test_the_paced_rows_are_not_called_throughput() -> None:
    table = summary_table({"prefix": {"requests_per_s": 34.9, "prompt_tokens_per_s": 1e5}})
    assert "req/s (paced)" in table and "prompt tokens/s (paced)" in table
    assert "throughput" not in table
    assert "not what the fleet could serve" in explain.PACING


def check(name: str, met: bool | None, value: object = 0.036) -> dict[str, object]:
    return {"check": name, "value": value, "target": "<= 3%", "met": met, "judged": True}


@pytest.mark.parametrize(("checks", "meaning", "note"), [
    ([check("prefix@none: follow-up turns moved", False)],
     "another replica than its previous turn", True),
    ([check("prefix@none: follow-up turns moved", True)],
     "another replica than its previous turn", False),
    ([check("TTFT p99 vs least_loaded", False, [514.0, 287.0])], "load balancer's", True),
    ([check("cached ratio vs bound", None, None)], "most any router", False),
])
def test_check_lines_say_what_they_mean(checks: list[dict[str, object]], meaning: str,
                                        note: bool) -> None:
    lines = format_checks(checks)
    assert meaning in lines[0]
    assert (explain.NOT_MET in lines) is note
    assert len(lines) == 1 + note


def test_every_check_the_compare_makes_has_a_meaning() -> None:
    from gateway.bench.checks import quality_checks

    column = {"policy": "prefix", "bound_share": 0.9, "ttft_ms": {"p99": 1.0},
              "replica_requests": {"max_over_mean": 1.0}, "follow_ups_moved": 0.0,
              "predicted": {"median_abs_error": 1.0}}
    checks = quality_checks({"prefix": column, "least_loaded": {"ttft_ms": {"p99": 2.0}},
                             "session": {"policy": "session", "session_ids": "header",
                                         "ttft_ms": {"p99": 1.0}}})
    assert len(checks) == 6
    assert all(explain.meaning(c["check"]) for c in checks)


def test_tiny_says_why_it_compares_nothing() -> None:
    tiny = PRESETS["tiny"]
    note = tiny_note({"prefix": {"requests": 24, "bound": {"working_set_blocks": 856}}}, tiny)
    assert "24 requests on 2 replicas whose caches hold 93% of the working set" in note
    assert "no comparison of the policies" in note and "--preset default" in note
