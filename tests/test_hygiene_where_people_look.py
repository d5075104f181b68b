"""Why did this miss, where people look: a system prompt that starts with the current date
and time, sent twice as a new user would, through `gateway serve` in front of `gateway sim`
(real processes on loopback). The timestamp finding, the prompt tokens it costs and its
place (message 0, the character offset of the timestamp) must show in `/stats` (the
hygiene section and a warning), on the page as a headless browser renders it, and in the
response headers, and in what `gateway lint` reads from the gateway's usage log; with the
scanner switched off none of them does."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.servers import gateway, script, sim

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
PREFIX = "Current date and time: "
RULES = "Follow the rules of the repository and explain every change you make. " * 40


def body(t: float) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
    system = f"{PREFIX}{stamp}. You are a careful coding agent. {RULES}"
    return {"model": "sim", "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "What is 2+2?"}]}


OFFSET = len(PREFIX)  # where the timestamp starts in message 0
# what to do about it, in every place that shows the finding
FIX = ("move the time from message 0 (system) into the last user message (message 1), after "
       "the cached prefix, or round it to the day")


def send_twice(env: dict[str, str], tmp: Path
               ) -> tuple[list[httpx.Response], dict[str, Any], str, str, list[dict[str, Any]]]:
    """(the two answers, /stats, the page's HTML, the page as chromium rendered it, or ""
    without chromium, what `gateway lint` prints for the usage log)."""
    now = time.time()
    usage = tmp / "usage.jsonl"
    with (
        sim(2, ["--model", "sim", "--speed", "50"]) as urls,
        gateway(urls, env={**env, "GATEWAY_USAGE__LOG_PATH": str(usage)}) as url,
        httpx.Client(timeout=30) as client,
    ):
        answers = [client.post(url + "/v1/chat/completions", json=body(now + dt))
                   for dt in (0.0, 61.0)]
        stats = client.get(url + "/stats").json()
        page = client.get(url + "/stats?format=html").text
        dom = ""
        if CHROMIUM is not None:
            done = subprocess.run(
                [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                 "--disable-dev-shm-usage", "--dump-dom", url + "/stats?format=html"],
                capture_output=True, text=True, timeout=90, check=False)
            assert done.returncode == 0, done.stderr[-2000:]
            dom = done.stdout
    assert [a.status_code for a in answers] == [200, 200]
    lint = subprocess.run([*script("gateway"), "lint", str(usage)], capture_output=True,
                          text=True, timeout=60, check=True)
    assert lint.stderr == ""
    return answers, stats, page, dom, [json.loads(x) for x in lint.stdout.splitlines()]


def test_the_timestamp_is_found_where_people_look(tmp_path: Path) -> None:
    answers, stats, page, dom, linted = send_twice({}, tmp_path)
    hygiene = stats["hygiene"]
    latest = [f for f in hygiene["latest"] if f["kind"] == "timestamp"]
    assert len(latest) == 2, hygiene  # one per request, newest first
    cost = latest[0]["tokens_at_risk"]
    assert cost > 500  # the whole prompt after the timestamp
    for f in latest:
        assert (f["message_index"], f["role"], f["char_offset"], f["severity"]) == (
            0, "system", OFFSET, "warning")
        assert f["span"] == "<timestamp:19 chars>"  # redacted by default
    assert {f["remedy"] for f in latest} == {FIX}
    row = next(r for r in hygiene["by_kind"] if r["kind"] == "timestamp")
    assert (row["findings"], row["requests"], row["tokens_at_risk"]) == (2, 2, 2 * cost)
    # the saving per hour: the hour's tokens at risk over the seconds the window covers
    # (the gateway just started: counted as a minute)
    assert row["remedy"] == FIX
    assert row["saving_tokens_per_hour"] == round(
        2 * cost * 3600 / max(60.0, hygiene["covered_s"])) > 0
    assert row["share_of_prompt_tokens"] > 0.5
    assert any(w.startswith("hygiene: timestamp findings put") for w in stats["warnings"])
    assert stats["summary"]["warnings"] == len(stats["warnings"]) >= 1
    # the response headers: the route, the prediction, the first finding and its cost
    for answer in answers:
        cache = answer.headers["x-gateway-cache"]
        assert cache.startswith(f"route={answer.headers['x-gateway-route']}, predicted=")
        assert (f"findings=1, first=timestamp, severity=warning, message=0, offset={OFFSET}, "
                f"tokens_at_risk={cost}, fix=move_or_round") in cache
        assert answer.headers["x-gateway-hygiene"] == f"timestamp@0:{OFFSET}"
        assert answer.headers["x-gateway-fix"] == FIX
    # gateway lint on the usage log: one finding per record, with the record's line
    assert [(f["line"], f["kind"], f["message_index"], f["char_offset"], f["tokens_at_risk"],
             f["remedy"]) for f in linted] == [(1, "timestamp", 0, OFFSET, cost, FIX),
                                               (2, "timestamp", 0, OFFSET, cost, FIX)]
    # the page as the browser built it
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium; .ci/run does)")
    rows = re.findall(r'<tr class="finding" data-kind="timestamp" data-message="0" '
                      rf'data-offset="{OFFSET}" data-tokens="{cost}">', dom)
    assert len(rows) == 2, dom[:3000]
    assert dom.count(f'<td class="fix">{FIX}</td>') == 3  # the kind's row, both findings
    assert re.search(r'<tr class="kind" data-kind="timestamp" data-severity="warning">'
                     rf"<td>timestamp</td><td>warning</td><td>2</td><td>2</td>"
                     rf"<td>{2 * cost}</td>", dom)
    assert "hygiene: timestamp findings put" in dom
    assert 'http-equiv="refresh"' in page


def test_with_the_scanner_off_nothing_is_found(tmp_path: Path) -> None:
    """The same traffic with `[hygiene] enabled = false`: what the test above looks for is
    absent, so that test cannot pass without the scanner."""
    answers, stats, page, _, linted = send_twice({"GATEWAY_HYGIENE__ENABLED": "false"},
                                                 tmp_path)
    assert linted == []
    assert stats["hygiene"]["latest"] == [] and stats["hygiene"]["by_kind"] == []
    assert not any(w.startswith("hygiene:") for w in stats["warnings"])
    for answer in answers:
        assert "first=" not in answer.headers["x-gateway-cache"]
        assert "x-gateway-hygiene" not in answer.headers
        assert "x-gateway-fix" not in answer.headers
    assert 'class="finding"' not in page and "class=finding" not in page
