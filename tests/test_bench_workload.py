"""The agent-session workload: determinism and the shapes the benchmark relies on."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections import Counter

import pytest

from gateway.bench.presets import PRESETS, half_working_set_blocks, working_set_tokens
from gateway.bench.session import AgentSession, TurnRequest
from gateway.bench.text import words
from gateway.bench.workload import WorkloadConfig, build_workload

BASE = WorkloadConfig(
    sessions=8, turns=6, seed=7, tool_result_tokens=100, large_tool_result_tokens=300,
    reply_tokens=20, task_tokens=40, fanout=3, fanout_prob=0.5,
)


def play(cfg: WorkloadConfig, index: int = 0) -> list[list[TurnRequest]]:
    """All turns of one session, feeding back a deterministic fake reply."""
    wl = build_workload(cfg)
    plan = wl.sessions[index]
    session = AgentSession(plan, wl.prompts[plan.agent], "m", cfg.hygiene_break)
    turns = []
    while not session.done:
        reqs = session.requests()
        turns.append(reqs)
        session.reply(f"reply {reqs[0].turn}: " + words(f"reply{reqs[0].turn}", 20))
    return turns


def text_of(req: TurnRequest) -> str:
    return json.dumps(req.body["messages"])


@pytest.mark.parametrize("seed", [0, 1, 42])
def test_same_seed_same_workload(seed: int) -> None:
    cfg = dataclasses.replace(BASE, seed=seed)
    assert build_workload(cfg) == build_workload(cfg)
    assert [[r.body for r in t] for t in play(cfg)] == [[r.body for r in t] for t in play(cfg)]


def test_different_seed_different_text() -> None:
    a = build_workload(BASE)
    b = build_workload(dataclasses.replace(BASE, seed=BASE.seed + 1))
    assert a.sessions[0].task != b.sessions[0].task
    assert a.prompts["coder"].system != b.prompts["coder"].system


def test_turns_grow_and_extend_the_previous_prompt() -> None:
    turns = play(BASE)
    mains = [t[0].body["messages"] for t in turns]
    sizes = [len(json.dumps(m)) for m in mains]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    for prev, cur in itertools.pairwise(mains):
        assert cur[: len(prev)] == prev  # append-only history: prefix reuse is possible
        assert cur[len(prev)]["role"] == "assistant"


def test_siblings_share_the_session_prefix() -> None:
    cfg = dataclasses.replace(BASE, fanout=4, fanout_prob=1.0)
    turns = play(cfg)
    assert len(turns[0]) == 1  # the first turn never fans out
    for t in turns[1:]:
        assert len(t) == 4
        main = t[0].body["messages"]
        for k, sib in enumerate(t[1:], start=1):
            assert sib.sibling == k
            assert sib.body["messages"][:-1] == main
            assert sib.body["tools"] == t[0].body["tools"]
        assert len({text_of(s) for s in t}) == 4


def test_compaction_shrinks_the_prompt() -> None:
    cfg = dataclasses.replace(BASE, compaction_every=3, fanout=1)
    sizes = [len(text_of(t[0])) for t in play(cfg)]
    assert sizes[3] < sizes[2]  # turn 3 compacts
    assert sizes[1] > sizes[0] and sizes[4] > sizes[3]
    messages = play(cfg)[3][0].body["messages"]
    assert any(m["content"].startswith("Summary of the work so far") for m in messages)


def test_hygiene_break_changes_the_system_prompt_every_turn() -> None:
    broken = play(dataclasses.replace(BASE, hygiene_break=True))
    systems = [t[0].body["messages"][0]["content"] for t in broken]
    assert len(set(systems)) == len(systems)
    assert all(s.startswith("Current time: ") for s in systems)
    clean = [t[0].body["messages"][0]["content"] for t in play(BASE)]
    assert len(set(clean)) == 1


def test_agent_types_popular_and_unpopular() -> None:
    wl = build_workload(dataclasses.replace(BASE, sessions=200))
    counts = Counter(s.agent for s in wl.sessions)
    assert set(counts) == {"coder", "researcher", "support", "analyst"}
    assert counts["coder"] > 3 * counts["analyst"]
    # sessions of one type share the system prompt and tools byte for byte
    coder = wl.prompts["coder"]
    assert len(coder.tools) == 8 and len(coder.system) > 5000


def test_arrivals_spread_over_time() -> None:
    starts = [s.start_s for s in build_workload(BASE).sessions]
    assert starts == sorted(starts) and starts[0] == 0 and starts[-1] > 0


def test_default_preset_kv_holds_about_half_the_working_set() -> None:
    preset = PRESETS["default"]
    combined = preset.kv_blocks * preset.replicas * 16
    assert preset.replicas == 4
    assert 0.4 < combined / working_set_tokens(preset.workload) < 0.6
    assert preset.kv_blocks == half_working_set_blocks(preset.workload, preset.replicas)


@pytest.mark.parametrize("bad", [{"turns": 0}, {"sessions": -1}, {"agent_types": ()}])
def test_bad_config_is_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        build_workload(dataclasses.replace(BASE, **bad))  # type: ignore[arg-type]
