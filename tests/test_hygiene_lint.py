"""`gateway lint`: JSON-lines in, one JSON finding per line out, clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main

NOW = 1717250602.0
RULES = "You are a careful assistant. Follow the rules below and answer briefly. " * 20


def body(system: str, *turns: str, **extra: object) -> dict[str, object]:
    msgs = [{"role": "system", "content": system}]
    msgs += [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    return {"model": "m", "messages": msgs, **extra}


def lint(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], lines: list[str], *flags: str
) -> tuple[int, list[dict[str, object]], str]:
    f = tmp_path / "log.jsonl"
    f.write_text("\n".join(lines) + "\n")
    rc = main(["lint", str(f), "--now", str(NOW), *flags])
    out, err = capfd.readouterr()
    return rc, [json.loads(x) for x in out.splitlines()], err


def test_findings_carry_line_session_and_place(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    lines = [
        json.dumps(body("Time 2024-06-01T14:03:22Z. " + RULES, "q1", user="alice")),
        "",
        json.dumps(
            {
                "body": body("Time 2024-06-01T14:03:40Z. " + RULES, "q1", "a1", "q2"),
                "headers": {"X-Session-Id": "alice"},
                "ts": NOW + 18,
            }
        ),
        json.dumps(body(RULES, "q")),
    ]
    rc, found, _ = lint(tmp_path, capfd, lines)
    assert rc == 0
    assert [
        (f["line"], f["kind"], f["evidence"], f["session"], f["message_index"], f["char_offset"])
        for f in found
    ] == [
        (1, "timestamp", "pattern", "alice", 0, 5),
        (3, "timestamp", "drift", "alice", 0, 5),
    ]
    assert found[0]["span"] == "<timestamp:20 chars>"


def test_unredacted_and_min_severity(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    lines = [
        json.dumps(
            body("Tenant 123e4567-e89b-12d3-a456-426614174000. Now: 14:03:22. " + RULES, "q")
        ),
    ]
    rc, found, _ = lint(tmp_path, capfd, lines, "--unredacted")
    assert rc == 0
    assert [(f["kind"], f["severity"], f["span"]) for f in found] == [
        ("uuid", "info", "123e4567-e89b-12d3-a456-426614174000"),
        ("timestamp", "warning", "14:03:22"),
    ]
    rc, found, _ = lint(tmp_path, capfd, lines, "--min-severity", "warning")
    assert [f["kind"] for f in found] == ["timestamp"]


def test_clean_log_exits_zero_with_no_output(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    rc, found, err = lint(
        tmp_path, capfd, [json.dumps(body(RULES, "q")), json.dumps({"prompt": "Hello"})]
    )
    assert (rc, found, err) == (0, [], "")


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"messages": "hi"}', "'messages' is not a list"),
        ('{"messages": [1]}', "messages[0] is not an object"),
        ('{"body": 3}', "'body' is not an object"),
        ('{"body": {"messages": []}, "endpoint": "embeddings"}', "endpoint"),
    ],
)
def test_unreadable_input_names_the_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], bad: str, reason: str
) -> None:
    rc, _, err = lint(tmp_path, capfd, [json.dumps(body(RULES, "q")), bad])
    assert rc == 2
    assert "line 2" in err and reason in err


def test_missing_file(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capfd.readouterr().err
