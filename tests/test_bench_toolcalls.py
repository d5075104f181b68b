"""gateway-bench agent sessions whose turns are tool calls: the streamed call merged, the
next turn sending the call back with a `role: tool` output (pure), and `run --tool-calls`
against a simulator replica on loopback."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from gateway.bench.cli import main
from gateway.bench.client import merge_tool_calls
from gateway.bench.presets import PRESETS
from gateway.bench.runner import RunOptions, run_workload
from gateway.bench.session import TOOL_CALL_MIN_TOKENS, TOOL_OK, AgentSession
from gateway.bench.workload import WorkloadConfig, build_workload
from tests.servers import sim
from tests.sim_http import MODEL


def fn(**kw: Any) -> dict[str, Any]:
    return {"function": kw}


@pytest.mark.parametrize(("deltas", "expect"), [
    # the hermes stream: head (id, type, name), then argument fragments
    ([[{"index": 0, "id": "c1", "type": "function", **fn(name="grep")}],
      [{"index": 0, **fn(arguments='{"q": ')}], [{"index": 0, **fn(arguments='"x"}')}]],
     [("c1", "grep", '{"q": "x"}')]),
    # two calls, interleaved by index
    ([[{"index": 0, "id": "a", **fn(name="f", arguments="{")}],
      [{"index": 1, "id": "b", **fn(name="g", arguments="{}")}],
      [{"index": 0, **fn(arguments="}")}]],
     [("a", "f", "{}"), ("b", "g", "{}")]),
    # an index that skips ahead is not understood: dropped, not guessed
    ([[{"index": 2, "id": "z", **fn(name="f")}]], []),
    ([None, [{"index": 0, "id": "k", **fn(name="h", arguments=None)}], "junk"],
     [("k", "h", "")]),
])
def test_streamed_calls_are_merged(deltas: list[Any],
                                   expect: list[tuple[str, str, str]]) -> None:
    calls: list[dict[str, Any]] = []
    for d in deltas:
        merge_tool_calls(calls, d)
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] \
        == expect


def session(tool_calls: bool) -> AgentSession:
    wl = build_workload(WorkloadConfig(sessions=1, turns=3, fanout=1, compaction_every=0,
                                       tool_calls=tool_calls))
    plan = wl.sessions[0]
    return AgentSession(plan, wl.prompts[plan.agent], "m", tool_calls=tool_calls)


CALL = {"id": "chatcmpl-tool-1", "type": "function",
        "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}


def test_a_tool_call_goes_back_with_the_tools_output() -> None:
    s = session(tool_calls=True)
    first = s.requests()[0].body
    assert first["tool_choice"] == "required"
    s.reply("", 100, [CALL])
    second = s.requests()[0]
    messages = second.body["messages"]
    assert messages[-2] == {"role": "assistant", "content": None, "tool_calls": [CALL]}
    result = s.plan.turns[1].tool_result
    assert messages[-1] == {"role": "tool", "tool_call_id": "chatcmpl-tool-1",
                            "content": result or TOOL_OK}
    assert not any(m["role"] == "user" and m["content"] == result for m in messages)


def test_each_call_gets_an_output() -> None:
    s = session(tool_calls=True)
    s.requests()
    s.reply("", 100, [CALL, {**CALL, "id": "c2"}])
    messages = s.requests()[0].body["messages"]
    assert [m.get("tool_call_id") for m in messages[-2:]] == ["chatcmpl-tool-1", "c2"]
    assert messages[-1]["content"] == TOOL_OK


def test_a_call_cut_short_goes_back_as_text() -> None:
    """A call max_tokens cut (arguments that do not parse) would be a 400 if sent back."""
    s = session(tool_calls=True)
    assert s.requests()[0].body["max_tokens"] >= TOOL_CALL_MIN_TOKENS
    cut = {**CALL, "function": {"name": "read_file", "arguments": '{"path": "a.'}}
    s.reply('<tool_call>', 100, [cut])
    messages = s.requests()[0].body["messages"]
    assert not any(m["role"] == "tool" or "tool_calls" in m for m in messages)
    assert {"role": "assistant", "content": "<tool_call>"} in messages


def test_an_answer_without_calls_goes_back_as_text() -> None:
    s = session(tool_calls=False)
    first = s.requests()[0].body
    assert "tool_choice" not in first
    s.reply("plain words", 100, [])
    messages = s.requests()[0].body["messages"]
    assert messages[-2] == {"role": "assistant", "content": "plain words"}
    assert messages[-1]["role"] == "user" and not any(m["role"] == "tool" for m in messages)


def test_run_with_tool_calls_against_a_sim_replica(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--speed", "200", "--timing-comments", "--kv-blocks", "2000",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    with sim(1, flags) as urls:
        rc = main(["run", "--base-url", urls[0], "--preset", "tiny", "--tool-calls",
                   "--time-scale", "0.005", "--out", str(tmp_path), "--no-progress",
                   "--max-wall-s", "60"])
    out = capsys.readouterr().out
    assert rc == 0, out
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["workload"]["tool_calls"] is True
    summary = run["summary"]
    assert summary["errors"] == 0 and summary["requests"] > 0
    # every turn after the first sent the previous turn's call back with its output
    assert summary["turns"][0]["cached_ratio"] < summary["turns"][-1]["cached_ratio"]
    assert summary["cached_tokens"] == pytest.approx(summary["bound"]["cached_tokens"],
                                                     rel=0.02)


def test_the_sessions_turns_are_calls_and_tool_outputs() -> None:
    """The bodies sent: every later turn carries the call the previous answer made, then
    its output as a role: tool message naming the call's id."""
    flags = ["--speed", "200", "--kv-blocks", "2000",
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    wl = build_workload(replace(PRESETS["tiny"].workload, tool_calls=True, sessions=3,
                                fanout=1))
    with sim(1, flags) as urls:
        result = asyncio.run(run_workload(wl, RunOptions(
            base_url=urls[0], model=MODEL, concurrency=3, time_scale=0.005,
            max_wall_s=60, progress=False)))
    assert result.records and all(r.error is None for r in result.records)
    later = [b for b, r in zip(result.bodies, result.records, strict=True) if r.turn > 0]
    assert later
    for body in later:
        assert body["tool_choice"] == "required"
        *_, call, output = body["messages"]
        assert call["role"] == "assistant" and call["content"] is None
        (tool_call,) = call["tool_calls"]
        assert json.loads(tool_call["function"]["arguments"])  # whole, parsed
        assert output["role"] == "tool" and output["tool_call_id"] == tool_call["id"]


def test_the_flag_reaches_the_workload() -> None:
    from gateway.bench.cli import build_parser
    from gateway.bench.flags import preset_of

    args = build_parser().parse_args(["run", "--base-url", "http://x", "--tool-calls"])
    assert preset_of(args).workload.tool_calls is True
    args = build_parser().parse_args(["run", "--base-url", "http://x"])
    assert preset_of(args).workload.tool_calls is False
    assert replace(WorkloadConfig(), tool_calls=True).tool_calls
