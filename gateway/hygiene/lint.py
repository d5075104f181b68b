"""`gateway lint [FILE|-]`: the hygiene analysis offline, over a log of request bodies.

Input: JSON lines in arrival order (blank lines are skipped). A line is either a bare
request body (`{"model":…, "messages":[…]}` or `{"prompt":…}`), or a wrapper object with
the body under `body` and optionally `session` (string), `headers` (object; `x-session-id`
is honoured), `endpoint` (`"chat"` or `"completions"`; otherwise inferred: `messages` means
chat) and `ts` (epoch seconds the request arrived; used as `now` to judge whether a
timestamp in the prompt was "the current time"; without it, `--now` or the clock at start).
A request's session is, in order: wrapper `session`, header `x-session-id`, body
`prompt_cache_key`, body `user` (design.md section 5).

A line may also be a usage record, as the gateway writes them (`[usage] log_path`): it
carries no prompt (the gateway never logs prompts) but the findings the gateway made on the
request (`findings`); those are printed as they are, with the record's line. So
`gateway lint usage.jsonl` shows what the gateway found, and `gateway lint bodies.jsonl`
analyses request bodies a client kept itself.

Output: on a terminal, a report for a person (gateway.hygiene.lintreport): each finding,
its place, the tokens at risk (what fixing it saves per request) and its remedy, then per
kind the saving per hour at the input's rate (its `ts` span). With `--json`, or when stdout
is not a terminal (a pipe, a file: the scripts that read `gateway lint` keep working), one
JSON finding per line (design.md section 4 schema plus the input `line` and `remedy`);
`--text` prints the report to a pipe too.
An unreadable line (invalid JSON, not an object, `messages` not a list, ...) is skipped
with a message on stderr naming it, and the skipped lines are counted at the end; later
lines are still read. Exit status: 0; 1 with `--fail-on info|warning` when a finding of that
severity or above was printed (for CI); 2 when the input cannot be opened, or when every
non-blank line was unreadable. A reader that leaves early (`| head`) ends it quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import orjson

from gateway.hygiene.analyzer import HygieneAnalyzer
from gateway.hygiene.config import HygieneConfig
from gateway.hygiene.finding import Finding, findings_from_json
from gateway.hygiene.lintreport import Tally, finding_text
from gateway.hygiene.prompt import validate

_SEVERITY_RANK = {"info": 0, "warning": 1}


class LintInputError(ValueError):
    def __init__(self, line: int, reason: str) -> None:
        super().__init__(f"line {line}: {reason}")
        self.line = line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "file", nargs="?", default="-", help="JSON lines of request bodies (- = stdin)"
    )
    parser.add_argument("--unredacted", action="store_true", help="print offending text verbatim")
    parser.add_argument("--min-severity", choices=("info", "warning"), default="info",
                        help="print findings of this severity and above (default info)")
    parser.add_argument("--fail-on", choices=("info", "warning"),
                        help="exit 1 when a finding of this severity or above is printed "
                        "(a CI gate)")
    parser.add_argument(
        "--now", type=float, default=None, help="epoch seconds for lines without ts"
    )
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true",
                      help="one JSON finding per line (the default when stdout is not a "
                      "terminal)")
    form.add_argument("--text", action="store_true",
                      help="the readable report (the default on a terminal) even into a pipe")


MAX_SHOWN = 20  # unreadable lines named one by one; the rest are counted


def run(args: argparse.Namespace) -> int:
    analyzer = HygieneAnalyzer(HygieneConfig(redact=not args.unredacted))
    now = time.time() if args.now is None else float(args.now)
    out = sys.stdout.buffer
    skipped: list[LintInputError] = []
    counts = {"lines": 0, "fail": 0}
    gate = _SEVERITY_RANK[args.fail_on] if args.fail_on else None
    text = args.text or (not args.json and sys.stdout.isatty())
    tally = Tally()

    def on_error(err: LintInputError) -> None:
        if len(skipped) < MAX_SHOWN:
            print(f"gateway lint: skipped {err}", file=sys.stderr)
        skipped.append(err)

    def lines(source: Iterable[bytes]) -> Iterator[bytes]:
        for raw in source:
            if raw.strip():
                counts["lines"] += 1
            yield raw

    try:
        with (contextlib.nullcontext(sys.stdin.buffer) if args.file == "-"
              else open(args.file, "rb")) as f:
            for finding in lint_lines(lines(f), analyzer, now, args.min_severity, on_error,
                                      on_time=tally.time):
                if text:
                    tally.add(finding)
                    out.write(finding_text(finding).encode() + b"\n\n")
                else:
                    out.write(orjson.dumps(finding.to_dict()) + b"\n")
                if gate is not None and _SEVERITY_RANK[finding.severity] >= gate:
                    counts["fail"] += 1
            if text:
                out.write(tally.summary(counts["lines"], len(skipped)).encode() + b"\n")
            out.flush()
    except BrokenPipeError:
        # `gateway lint log | head`: the reader left; not an error of ours. Python's own
        # advice: point stdout at /dev/null so the exit flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:
        print(f"gateway lint: {e}", file=sys.stderr)
        return 2
    if skipped:
        print(f"gateway lint: skipped {len(skipped)} of {counts['lines']} line(s) as "
              "unreadable", file=sys.stderr)
        if len(skipped) == counts["lines"]:
            return 2
    return 1 if counts["fail"] else 0


def lint_lines(
    lines: Iterable[bytes | str],
    analyzer: HygieneAnalyzer,
    now: float,
    min_severity: str = "info",
    on_error: Callable[[LintInputError], None] | None = None,
    on_time: Callable[[float], None] | None = None,
) -> Iterator[Finding]:
    """Findings for each line in order. An unreadable line raises LintInputError, or with
    `on_error` is handed to it and skipped. `on_time` hears each readable line's own `ts`
    (lines without one are judged at `now` and not heard)."""
    floor = _SEVERITY_RANK[min_severity]
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        found: Sequence[Finding]
        try:
            obj = _object(n, raw)
            if _is_usage_record(obj):
                found = _recorded(n, obj)
                ts = _ts(obj)
            else:
                body, endpoint, session, ts = _read(n, obj)
                found = analyzer.scan(body, endpoint, session, ts if ts is not None else now,
                                      validated=True)  # checked
        except LintInputError as err:
            if on_error is None:
                raise
            on_error(err)
            continue
        if on_time is not None and ts is not None:
            on_time(ts)
        for f in found:
            if _SEVERITY_RANK[f.severity] >= floor:
                yield dataclasses.replace(f, line=n)


def _object(n: int, raw: bytes | str) -> dict[str, Any]:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise LintInputError(n, f"invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise LintInputError(n, "not a JSON object")
    return obj


def _is_usage_record(obj: Mapping[str, Any]) -> bool:
    """A gateway usage record: its own fields, and no request body."""
    return ("request_id" in obj and "latency_ms" in obj and "hygiene" in obj
            and not any(k in obj for k in ("messages", "prompt", "body")))


def _recorded(n: int, obj: Mapping[str, Any]) -> tuple[Finding, ...]:
    try:
        return findings_from_json(obj.get("findings"))
    except ValueError as e:
        raise LintInputError(n, str(e)) from None


def _ts(obj: Mapping[str, Any]) -> float | None:
    ts = obj.get("ts")
    return float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else None


def _read(
    n: int, obj: dict[str, Any]
) -> tuple[Mapping[str, Any], Literal["chat", "completions"], str | None, float | None]:
    """(body, endpoint, session, the line's own ts or None)."""
    wrapped = isinstance(obj.get("body"), dict)
    body: dict[str, Any] = obj["body"] if wrapped else obj
    if "body" in obj and not wrapped:
        raise LintInputError(n, "'body' is not an object")
    endpoint_raw = obj.get("endpoint") if wrapped else None
    if endpoint_raw is None:
        endpoint_raw = "completions" if "prompt" in body and "messages" not in body else "chat"
    if endpoint_raw not in ("chat", "completions"):
        raise LintInputError(n, f"endpoint {endpoint_raw!r} is not 'chat' or 'completions'")
    endpoint: Literal["chat", "completions"] = "chat" if endpoint_raw == "chat" else "completions"
    try:
        validate(body, endpoint)
    except ValueError as e:
        raise LintInputError(n, str(e)) from None
    session = _session(obj if wrapped else {}, body)
    return body, endpoint, session, _ts(obj) if wrapped else None


def _session(wrapper: Mapping[str, Any], body: Mapping[str, Any]) -> str | None:
    s = wrapper.get("session")
    if isinstance(s, str) and s:
        return s
    headers = wrapper.get("headers")
    if isinstance(headers, Mapping):
        for k, v in headers.items():
            if isinstance(k, str) and k.lower() == "x-session-id" and isinstance(v, str) and v:
                return v
    for key in ("prompt_cache_key", "user"):
        v = body.get(key)
        if isinstance(v, str) and v:
            return v
    return None
