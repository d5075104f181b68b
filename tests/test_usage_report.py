"""`gateway report` on a generated usage log: table, --json, and unreadable lines."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.cli import main
from gateway.usage.record import UsageRecord
from tests.servers import script

T0 = 1_700_000_000.0


def rec(i: int, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        ts=T0 + i, request_id=f"r{i}", tenant="acme" if i % 2 else None, model="m",
        replica=f"r{i % 2}", route="prefix", stream=True, status=200, prompt_tokens=1000,
        cached_tokens=900, predicted_cached_tokens=900, best_available_tokens=950,
        completion_tokens=11, ttft_ms=100.0, latency_ms=600.0, session=f"s{i % 3}",
    )  # fmt: skip
    base.update(kw)
    return UsageRecord(**base).to_dict()


def write_log(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


@pytest.fixture
def log(tmp_path: Path) -> Path:
    records = [rec(i) for i in range(120)]
    records.append(rec(200, session="hog", prompt_tokens=50_000, cached_tokens=0))
    records.append(rec(201, replica="old", cached_tokens=None, session="s0"))
    records.append(rec(202, status=499, prompt_tokens=None, cached_tokens=None,
                       completion_tokens=None, ttft_ms=None))  # fmt: skip
    return write_log(tmp_path / "usage.jsonl", records)


def test_report_json(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(log), "--json", "--top", "2"]) == 0
    report = orjson.loads(capsys.readouterr().out)
    assert report["records"] == 123
    assert report["last_ts"] == T0 + 202
    whole = report["windows"]["all"]
    assert whole["requests"] == 123
    assert whole["by_status"] == {"200": 122, "499": 1}
    assert whole["records_without_cached_tokens"] == 1
    assert whole["cached_tokens"] == 120 * 900
    # 1m window relative to the last record (ts 202): records 142.. -> only 200, 201, 202
    assert report["windows"]["1m"]["requests"] == 3
    assert [s["name"] for s in report["top_sessions"]] == ["hog", "s0"]
    assert report["top_sessions"][0]["uncached_tokens"] == 50_000
    assert report["top_sessions"][1]["unknown_prompt_tokens"] == 1000
    assert len(report["top_tenants"]) == 2
    assert whole["max_model_len_suggestion"] == 2048  # P99 of 1011 * 1.2 -> 2048
    assert (
        "replica old does not report cached_tokens: start vLLM with "
        "--enable-prompt-tokens-details"
    ) in report["warnings"]


def test_report_table(log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(log)]) == 0
    out = capsys.readouterr().out
    for needle in ("windows (relative to the last record)", "by replica", "top sessions",
                   "--max-model-len 2048", "hog", "replica old does not report cached_tokens",
                   "TTFT p99"):  # fmt: skip
        assert needle in out, needle
    row = next(line for line in out.splitlines() if line.startswith("all "))
    assert "123" in row and "%" in row


@pytest.mark.parametrize(
    ("content", "line", "reason"),
    [
        (b'{"ts": 1, "status": 200, "model": "m", "latency_ms": 1}\nnot json\n', 2,
         "not valid JSON"),
        (b"[1, 2]\n", 1, "not a JSON object"),
        (b'\n{"ts": "x", "status": 200, "model": "m", "latency_ms": 1}\n', 2, "'ts'"),
        (b'{"ts": 1, "status": 200, "model": "m", "latency_ms": 1, "cached_tokens": -1}\n',
         1, "'cached_tokens'"),
        (b'{"ts": 1, "model": "m", "latency_ms": 1}\n', 1, "'status'"),
    ],
)  # fmt: skip
def test_unreadable_line_is_named_skipped_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, line: int, reason: str
) -> None:
    good = b'{"ts": 5, "status": 200, "model": "m", "latency_ms": 1, "prompt_tokens": 40}\n'
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content + good)
    assert main(["report", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert f"line {line}:" in err and reason in err
    assert "skipped 1 unreadable line(s)" in err
    report = json.loads(out)
    assert report["skipped_lines"] == 1
    assert report["records"] == 1 + content.count(b'"status": 200, "model"') - (
        b"cached_tokens" in content or b'"ts": "x"' in content)


def test_a_log_cut_mid_line_still_reports(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    rec = b'{"ts": 1, "status": 200, "model": "m", "latency_ms": 1, "prompt_tokens": 10}\n'
    path = tmp_path / "cut.jsonl"
    path.write_bytes(rec * 3 + rec[:30])
    assert main(["report", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["records"] == 3
    assert "line 4:" in err


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_empty_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    assert main(["report", str(path)]) == 0
    assert "no records" in capsys.readouterr().out


def test_console_script_reads_stdin(log: Path) -> None:
    proc = subprocess.run(
        [*script("gateway"), "report", "-", "--json"],
        input=log.read_bytes(), capture_output=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert orjson.loads(proc.stdout)["records"] == 123
