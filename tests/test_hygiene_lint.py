"""`gateway lint`: JSON-lines in, one JSON finding per line out, clear errors for bad input."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from gateway.cli import main
from tests.servers import script

NOW = 1717250602.0
STAMP = "2024-06-01T14:03:22Z"  # NOW, as a prompt would carry it
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
def test_an_unreadable_line_is_named_and_skipped(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], bad: str, reason: str
) -> None:
    stamped = body(f"Current time: {STAMP}. " + RULES, "q")
    rc, found, err = lint(tmp_path, capfd, [json.dumps(body(RULES, "q")), bad,
                                            json.dumps(stamped)])
    assert rc == 0
    assert "line 2" in err and reason in err
    assert "skipped 1 of 3 line(s)" in err
    assert [f["line"] for f in found] and all(f["line"] == 3 for f in found)


def test_only_unreadable_lines_is_an_error(tmp_path: Path,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    rc, found, err = lint(tmp_path, capfd, ["{not json", "[1]"])
    assert (rc, found) == (2, [])
    assert "skipped 2 of 2 line(s)" in err


@pytest.mark.parametrize(("stamped", "flags", "rc"), [
    (True, (), 0), (True, ("--fail-on", "warning"), 1), (True, ("--fail-on", "info"), 1),
    (False, ("--fail-on", "info"), 0),
])
def test_fail_on_gates_ci(tmp_path: Path, capfd: pytest.CaptureFixture[str], stamped: bool,
                          flags: tuple[str, ...], rc: int) -> None:
    """The current time in a system prompt is a warning; a clean prompt has no finding."""
    system = (f"Current time: {STAMP}. " if stamped else "") + RULES
    got, found, _ = lint(tmp_path, capfd, [json.dumps(body(system, "q"))], *flags)
    assert got == rc
    assert any(f["severity"] == "warning" for f in found) is stamped


def test_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    f = tmp_path / "big.jsonl"  # a finding per line: the output outgrows the pipe
    f.write_text("".join(json.dumps(body(f"Time: 2024-06-01T{i // 60 % 24:02d}:{i % 60:02d}:00Z. "
                                         + RULES, "q")) + "\n" for i in range(4000)))
    done = subprocess.run(f"{shlex.join(script('gateway'))} lint {f} --now {NOW} | head -1",
                          shell=True, capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.count("\n") == 1
    assert done.stderr == ""  # no BrokenPipeError traceback


def test_missing_file(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["lint", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capfd.readouterr().err


FOUND = {"kind": "timestamp", "severity": "warning", "evidence": "pattern",
         "message_index": 0, "role": "system", "char_offset": 23,
         "span": "<timestamp:20 chars>", "tokens_at_risk": 812, "session": None, "line": None}


def record(**kw: object) -> str:
    rec = {"ts": NOW, "request_id": "r1", "model": "m", "status": 200, "latency_ms": 5.0,
           "hygiene": 1, "findings": [FOUND], **kw}
    return json.dumps(rec)


@pytest.mark.parametrize(("lines", "expected", "skipped"), [
    # the gateway's usage records: their findings, with the record's line
    ([record(), record(hygiene=0, findings=[]), record()],
     [(1, "timestamp", 23, 812), (3, "timestamp", 23, 812)], 0),
    # a record of a gateway that did not log findings yet: nothing to show, not an error
    ([json.dumps({"ts": NOW, "request_id": "r", "latency_ms": 1.0, "hygiene": 2})], [], 0),
    # records and request bodies in one file: each read as what it is
    ([record(), json.dumps(body(f"Current time: {STAMP}. " + RULES, "hi"))],
     [(1, "timestamp", 23, 812), (2, "timestamp", 14, None)], 0),
    ([record(findings=[{"kind": "x"}]), record()], [(2, "timestamp", 23, 812)], 1),
])  # fmt: skip
def test_usage_records_are_read(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], lines: list[str],
    expected: list[tuple[int, str, int, int | None]], skipped: int,
) -> None:
    rc, out, err = lint(tmp_path, capfd, lines)
    assert rc == 0, err
    got = [(f["line"], f["kind"], f["char_offset"], f["tokens_at_risk"]) for f in out]
    assert [g if e[3] is not None else (*g[:3], None) for g, e in zip(got, expected,
                                                                      strict=True)] == expected
    assert err.count("skipped line") == skipped


def stamped_every_minute(n: int) -> list[str]:
    """n requests a minute apart, each with the time of its sending in the system prompt."""
    return [json.dumps({"body": body(f"Current time: 2024-06-01T14:{3 + i:02d}:22Z. " + RULES,
                                     "q"), "ts": NOW + 60 * i}) for i in range(n)]


def test_each_json_finding_carries_its_remedy(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    rc, found, _ = lint(tmp_path, capfd, stamped_every_minute(1))
    assert rc == 0
    assert [(f["kind"], f["remedy"]) for f in found] == [
        ("timestamp", "move the time from message 0 (system) into the last user message "
         "(message 1), after the cached prefix, or round it to the day")]


def test_the_report_for_a_person(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`--text` (the default on a terminal): each finding with its place, its tokens at
    risk, what fixing it saves and the fix; then per kind the saving per hour at the
    input's own rate: three requests in 120 s are 90 an hour."""
    f = tmp_path / "log.jsonl"
    f.write_text("\n".join([*stamped_every_minute(3), "{not json"]) + "\n")
    assert main(["lint", str(f), "--now", str(NOW), "--text"]) == 0
    out, err = capfd.readouterr()
    tokens = [int(t) for t in re.findall(r"^  (\d+) prompt tokens at risk: fixing it saves "
                                         r"\1 tokens a request$", out, re.M)]
    assert len(tokens) == 3 and len(set(tokens)) == 1 and tokens[0] > 100, out
    assert out.count("  fix: move the time from message 0 (system) into the last user "
                     "message (message 1), after the cached prefix, or round it to the "
                     "day\n") == 3, out
    assert re.search(r"^line 1: timestamp \(warning, found by pattern\) in message 0 "
                     r"\(system\) at character 14: <timestamp:20 chars>$", out, re.M), out
    assert out.endswith(
        "Summary of 4 line(s), 1 unreadable, spanning 120 s:\n"
        f"  timestamp (warning): 3 finding(s) in 3 request(s), {3 * tokens[0]} tokens at "
        f"risk; fixing it saves about {90 * tokens[0]} tokens an hour at this input's rate\n")
    assert "line 4" in err


def test_the_report_without_times_has_no_rate(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Two timestamps in one request break its prefix once, at the first: the summary
    counts the request once, at its costlier finding."""
    f = tmp_path / "log.jsonl"
    f.write_text(json.dumps(body(f"Current time: {STAMP}. {RULES[:600]} Updated: 14:03:20. "
                                 + RULES[600:], "q"))
                 + "\n")
    assert main(["lint", str(f), "--now", str(NOW), "--text"]) == 0
    out = capfd.readouterr().out
    tokens = [int(t) for t in re.findall(r"^  (\d+) prompt tokens at risk", out, re.M)]
    assert len(tokens) == 2, out
    assert out.endswith(f"timestamp (warning): 2 finding(s) in 1 request(s), {max(tokens)} "
                        "tokens at risk; no rate: the input has no ts\n"), out
    f.write_text(json.dumps(body(RULES, "q")) + "\n")
    assert main(["lint", str(f), "--text"]) == 0
    assert capfd.readouterr().out == "No findings in 1 line(s).\n"


def on_a_terminal(args: list[str]) -> str:
    """What `gateway lint` prints with its stdout on a pseudo-terminal, as a person runs
    it (read until the command closes it, within a deadline)."""
    main_fd, tty_fd = pty.openpty()
    proc = subprocess.Popen([*script("gateway"), "lint", *args], stdout=tty_fd,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(tty_fd)
    out = b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main_fd], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(main_fd, 65536)
            except OSError:  # EIO: the command closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(main_fd)
    return out.decode().replace("\r\n", "\n")


def test_on_a_terminal_a_report_with_json_on_request(tmp_path: Path) -> None:
    """The default follows stdout: a report on a terminal; `--json` keeps JSON there; a pipe
    (every other test here) gets JSON, so scripts that read `gateway lint` keep working."""
    f = tmp_path / "log.jsonl"
    f.write_text("\n".join(stamped_every_minute(2)) + "\n")
    report = on_a_terminal([str(f), "--now", str(NOW)])
    assert report.startswith("line 1: timestamp (warning, found by pattern) in message 0 "
                             "(system) at character 14"), report
    assert "  fix: move the time from message 0 (system)" in report
    assert "Summary of 2 line(s), spanning 60 s:" in report
    found = [json.loads(x) for x in on_a_terminal([str(f), "--now", str(NOW), "--json"])
             .splitlines()]
    assert [(f["line"], f["kind"]) for f in found] == [(1, "timestamp"), (2, "timestamp")]
    assert all(f["remedy"].startswith("move the time") for f in found)


def test_the_report_shows_no_control_characters(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """An unredacted span or a session id is the client's text: a terminal escape in it is
    printed as `?`, never sent to the terminal."""
    line = {"body": body(f"Current time: {STAMP}. " + RULES, "q"), "session": "s\x1b[2J1"}
    f = tmp_path / "log.jsonl"
    f.write_text(json.dumps(line) + "\n")
    assert main(["lint", str(f), "--now", str(NOW), "--text", "--unredacted"]) == 0
    out = capfd.readouterr().out
    assert "\x1b" not in out and f", session s?[2J1: {STAMP}" in out, out
