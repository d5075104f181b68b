"""`gateway-bench` against servers that are not the default simulator: why requests failed,
whether a cache reset worked, tool refusals, prompts kept within `max_model_len`, and a run
against a simulator started without the tool flags (as vLLM is by default)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.bench.backends import contamination_notice, reset_failure
from gateway.bench.cli import main
from gateway.bench.failures import error_reasons, reason
from gateway.bench.runner import RequestRecord
from gateway.bench.server import tool_refusal
from gateway.bench.session import AgentSession, ServerLimits
from gateway.bench.workload import WorkloadConfig, build_workload
from tests.servers import sim

AUTO = (
    '{"error":{"message":"\\"auto\\" tool choice requires --enable-auto-tool-choice and '
    '--tool-call-parser to be set","type":"BadRequestError","param":null,"code":400}}'
)


@pytest.mark.parametrize(
    ("status", "error", "expected"),
    [
        (400, AUTO, '400: "auto" tool choice requires --enable-auto-tool-choice and '
                    "--tool-call-parser to be set"),
        (404, '{"detail":"Not Found"}', "404: Not Found"),
        (500, "upstream  went\\n away", "500: upstream went\\n away"),
        (0, "ClientConnectorError: refused", "ClientConnectorError: refused"),
        (400, '{"error": "flat"}', '400: {"error": "flat"}'),
        (400, '{"error":{"message":"too long: 8193","type":"Bad', "400: too long: 8193"),
    ],
)  # fmt: skip
def test_reason(status: int, error: str, expected: str) -> None:
    assert reason(status, error) == expected


def _record(status: int, error: str | None) -> RequestRecord:
    return RequestRecord(
        session_id="s", agent="a", turn=0, sibling=0, send_s=0.0, status=status, error=error,
        prompt_tokens=None, cached_tokens=None, completion_tokens=None, ttft_ms=None,
        e2e_ms=1.0, timing="wall", sim_arrival_s=None, replica=None, route=None,
        request_id=None,
    )


def test_error_reasons_group_identical_messages_most_frequent_first() -> None:
    other = '{"error":{"message":"too long","type":"BadRequestError","param":null,"code":400}}'
    recs = [_record(400, AUTO)] * 3 + [_record(400, other), _record(200, None)]
    got = error_reasons(recs)
    assert [r["count"] for r in got] == [3, 1]
    assert got[1]["reason"] == "400: too long"


@pytest.mark.parametrize(
    ("status", "body", "failed"),
    [(200, b'{"success":true}', False), (200, b"", False), (200, b'{"success":false}', True),
     (404, b'{"detail":"Not Found"}', True), (500, b"", True)],
)  # fmt: skip
def test_reset_failure(status: int, body: bytes, failed: bool) -> None:
    assert (reset_failure(status, body) is not None) == failed


def test_contamination_notice_names_the_fix() -> None:
    text = contamination_notice({"http://r1": "no /reset_prefix_cache"})
    assert "VLLM_SERVER_DEV_MODE=1" in text and "http://r1" in text and "restart" in text


@pytest.mark.parametrize(
    ("status", "body", "refused"),
    [(400, AUTO.encode(), True), (200, b"{}", False), (400, b'{"error":{}}', False)],
)
def test_tool_refusal(status: int, body: bytes, refused: bool) -> None:
    assert tool_refusal(status, body) == refused


# The agents' system prompt and tools alone are about 8k tokens at 2.5 characters a token.
@pytest.mark.parametrize("limit", [10_000, 12_000, 16_000])
def test_sessions_stay_within_max_model_len(limit: int) -> None:
    cfg = WorkloadConfig(sessions=4, turns=8, tool_result_tokens=600,
                         large_tool_result_tokens=3000, large_tool_result_prob=0.5)  # fmt: skip
    wl = build_workload(cfg)
    for plan in wl.sessions:
        s = AgentSession(plan, wl.prompts[plan.agent], "m",
                         limits=ServerLimits(max_model_len=limit, tool_choice="none"))  # fmt: skip
        while not s.done:
            body = s.requests()[0].body
            assert body["tool_choice"] == "none"
            # What a server counting 2.5 characters per token would see.
            chars = sum(len(m["content"]) for m in body["messages"]) + len(str(body["tools"]))
            assert chars / 2.5 + body["max_tokens"] <= limit, (limit, chars)
            s.reply("ok " * 20, prompt_tokens=int(chars / 2.5))


def test_run_against_a_server_without_tool_flags_names_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with sim(1, ["--speed", "200", "--timing-comments", "--kv-blocks", "2000"]) as urls:
        rc = main(["run", "--base-url", urls[0], "--preset", "tiny", "--time-scale", "0.005",
                   "--out", str(tmp_path), "--no-progress", "--max-wall-s", "60"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "--enable-auto-tool-choice --tool-call-parser" in out
    summary = json.loads((tmp_path / "run.json").read_text())["summary"]
    assert summary["errors"] == 0 and summary["error_reasons"] == []


def _compare(urls: list[str], out: Path, *extra: str) -> int:
    backends = [a for u in urls for a in ("--backend", u)]
    return main(["compare", *backends, "--preset", "tiny", "--policies", "prefix,round_robin",
                 "--time-scale", "0.005", "--out", str(out), "--no-progress",
                 "--max-wall-s", "60", *extra])  # fmt: skip


def test_compare_on_replicas_without_dev_mode_stops_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with sim(2, ["--speed", "200"]) as urls:
        rc = _compare(urls, tmp_path)
    err = capsys.readouterr().err
    assert rc == 2
    assert "VLLM_SERVER_DEV_MODE=1" in err and "contaminated" in err and urls[0] in err


def test_compare_on_given_replicas_resets_their_caches_between_policies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--speed", "200", "--timing-comments", "--kv-blocks", "2000", "--dev-mode"]
    with sim(2, flags) as urls:
        rc = _compare(urls, tmp_path)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "--enable-auto-tool-choice" in out  # the probe's notice: no tool flags here
    result = json.loads((tmp_path / "compare.json").read_text())
    for policy in ("prefix", "round_robin"):
        s = result["policies"][policy]
        assert s["cache_reset"] and s["errors"] == 0 and s["bound"]["block_size"] == 16
        # From a cold cache the first turn of every session misses: with the first policy's
        # cache inherited, round_robin's cold turns would hit.
        assert s["turns"][0]["cached_ratio"] < 0.5, s["turns"][0]


def test_probe_measures_the_tokenizer_and_says_when_a_first_prompt_cannot_fit() -> None:
    import asyncio

    from gateway.bench.presets import PRESETS
    from gateway.bench.server import probe, prompt_chars
    from gateway.bench.session import sample_body

    body = sample_body(build_workload(PRESETS["tiny"].workload))
    assert body is not None
    for limit, fits in ((1024, False), (16384, True)):
        with sim(1, ["--max-model-len", str(limit), "--block-size", "32"]) as urls:
            facts = asyncio.run(probe(urls[0], None, urls, sample=body))
        assert facts.block_size == 32 and facts.max_model_len == limit
        assert facts.tool_choice == "none"  # this simulator runs without the tool flags
        assert facts.chars_per_token is not None
        tokens = prompt_chars(body) / facts.chars_per_token
        assert (tokens + body["max_tokens"] <= limit) == fits
        assert any("larger --max-model-len" in n for n in facts.notes) != fits
