"""gateway-bench's agent-tools preset: heavy-tailed seeded tool gaps, programs of
concurrent sub-agents sharing Claude Code's program header, the load multiplier, the
history-still-cached share, and the +noreserve column (all pure)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import pytest

from gateway.bench.compare import gateway_env, queued, split_column
from gateway.bench.presets import PRESETS
from gateway.bench.report import history_cached
from gateway.bench.runner import RequestRecord, program_headers
from gateway.bench.workload import WorkloadConfig, build_workload

TOOLS = PRESETS["agent-tools"]


def gaps(cfg: WorkloadConfig) -> list[float]:
    return [t.delay_s for s in build_workload(cfg).sessions for t in s.turns[1:]]


def test_tool_gaps_are_seeded_heavy_tailed_and_bounded() -> None:
    cfg = dataclasses.replace(TOOLS.workload, sessions=120)
    drawn = gaps(cfg)
    assert drawn == gaps(cfg)  # the same seed: the same gaps
    assert drawn != gaps(dataclasses.replace(cfg, seed=1))
    median = sorted(drawn)[len(drawn) // 2]
    assert 0.7 * cfg.think_time_s < median < 1.4 * cfg.think_time_s  # its median
    # heavy-tailed: a tenth of the gaps over ~4x the median (an exponential: ~6%/e^4.6)
    assert sum(g > 4 * median for g in drawn) / len(drawn) > 0.08
    assert max(drawn) <= cfg.gap_max_s
    assert all(g >= 0 for g in drawn)


@pytest.mark.parametrize(("change", "gap"), [
    ({"think_time_s": 0.0}, 0.0),  # no think time: no gap
    ({"gap_max_s": 0.5}, 0.5),  # bounded: every gap at most the cap (the median is 2 s)
])
def test_tool_gap_edges(change: dict[str, float], gap: float) -> None:
    drawn = gaps(dataclasses.replace(TOOLS.workload, sessions=12, **change))
    assert max(drawn) == gap


def test_sub_agents_of_a_program_arrive_together_with_one_header() -> None:
    wl = build_workload(TOOLS.workload)
    programs: dict[str, list[int]] = {}
    for i, s in enumerate(wl.sessions):
        assert s.program is not None
        programs.setdefault(s.program, []).append(i)
    assert len(wl.sessions) == TOOLS.workload.sessions
    assert Counter(len(v) for v in programs.values()) == {3: len(wl.sessions) // 3}
    for members in programs.values():
        plans = [wl.sessions[i] for i in members]
        assert len({p.start_s for p in plans}) == 1  # concurrent
        assert len({p.agent for p in plans}) == 1  # one agent type: one system prompt
        assert len({p.session_id for p in plans}) == 3  # each its own conversation
        heads = [program_headers(p) for p in plans]
        assert len({h["x-claude-code-session-id"] for h in heads}) == 1
        assert [h["x-claude-code-agent-id"] for h in heads] == ["sub0", "sub1", "sub2"]
    starts = sorted({s.start_s for s in wl.sessions})
    assert len(starts) == len(programs)  # programs arrive apart


def test_a_workload_without_programs_sends_no_program_header() -> None:
    wl = build_workload(PRESETS["agent"].workload)
    assert all(s.program is None and program_headers(s) == {} for s in wl.sessions)


@pytest.mark.parametrize("load", [0.5, 1.0, 2.0, 4.0])
def test_the_load_multiplies_sessions_and_arrival_rate(load: float) -> None:
    base = build_workload(TOOLS.workload)
    wl = build_workload(dataclasses.replace(TOOLS.workload, load=load))
    assert len(wl.sessions) == round(len(base.sessions) * load)
    span = max(s.start_s for s in wl.sessions)
    base_span = max(s.start_s for s in base.sessions)
    # about the same span (Poisson: loose), so the offered rate scales with the load
    assert 0.4 * base_span < span < 2.5 * base_span


@pytest.mark.parametrize("bad", [{"subagents": 0}, {"load": 0.0}, {"gap_sigma": -1.0},
                                 {"gap_max_s": -1.0}])
def test_bad_program_settings_are_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        build_workload(dataclasses.replace(TOOLS.workload, **bad))


def rec(session: str, turn: int, prompt: int, cached: int, error: str | None = None,
        sibling: int = 0) -> RequestRecord:
    return RequestRecord(
        session_id=session, agent="a", turn=turn, sibling=sibling, send_s=0.0, status=200,
        error=error, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=10,
        ttft_ms=1.0, e2e_ms=2.0, timing="sim", sim_arrival_s=None, replica="r", route=None,
        request_id=None)


@pytest.mark.parametrize(("records", "share", "ratio"), [
    # the whole previous prompt cached (less its last partial block): found
    ([rec("s", 0, 1000, 0), rec("s", 1, 1500, 992)], 1.0, 0.992),
    # a block short of it: not found
    ([rec("s", 0, 1000, 0), rec("s", 1, 1500, 976)], 0.0, 0.976),
    # nothing cached (moved, or evicted): not found; ratio capped at 1 on the other
    ([rec("s", 0, 1000, 0), rec("s", 1, 1500, 0), rec("t", 0, 100, 0),
      rec("t", 1, 300, 200)], 0.5, 0.5),
    # a failed previous turn, a sibling, a first turn: nothing to judge
    ([rec("s", 0, 1000, 0, error="500"), rec("s", 1, 1500, 992)], None, None),
    ([rec("s", 0, 1000, 0), rec("s", 1, 1500, 992, sibling=1)], None, None),
])
def test_history_still_cached(records: list[RequestRecord], share: float | None,
                              ratio: float | None) -> None:
    got = history_cached(records)
    if share is None:
        assert got is None
        return
    assert got is not None
    assert got["share"] == share
    assert math.isclose(got["ratio"], ratio)


def test_the_noreserve_column_runs_the_queue_without_the_reservation() -> None:
    assert split_column("prefix+queue+noreserve", "header") == ("prefix", "header")
    assert queued("prefix+queue+noreserve")
    on = gateway_env("prefix+queue", TOOLS, 0.2)
    off = gateway_env("prefix+queue+noreserve", TOOLS, 0.2)
    # the cap means simulated seconds, as the queue's other waits
    assert float(on["GATEWAY_ADMISSION__AGENT_RESERVE_MAX_S"]) == pytest.approx(2.0)
    assert off["GATEWAY_ADMISSION__AGENT_RESERVE_MAX_S"] == "0"
    assert {k: v for k, v in off.items() if "AGENT_RESERVE" not in k} == {
        k: v for k, v in on.items() if "AGENT_RESERVE" not in k}
    with pytest.raises(ValueError):
        split_column("prefix+reserve", "header")
