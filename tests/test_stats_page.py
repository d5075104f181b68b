"""`/stats?format=html`: the page's content by table (escaping, empty states), and the page
of a live gateway rendered in a real headless browser (Debian's chromium; skipped with the
reason when it is not installed)."""

from __future__ import annotations

import html
import random
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.usage.page import duration, render_page
from gateway.usage.recorder import headline
from tests.filler import words
from tests.servers import gateway, sim

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def stats(series: list[dict[str, Any]], by_replica: dict[str, Any],
          warnings: list[str]) -> dict[str, Any]:
    window = {"requests": 3, "cached_ratio": 0.5, "by_replica": by_replica,
              "ttft": {"p99_ms": 12.0}, "covered_s": 10.0}
    return {"summary": {"text": "3 requests"}, "windows": {"5m": window, "all": window},
            "series": series, "warnings": warnings}


def test_names_and_warnings_are_escaped() -> None:
    evil = '<script>alert(1)</script>'
    page = render_page(stats(
        [{"ts": 0.0, "cached_ratio": 0.5, "by_replica": {evil: 0.5}}],
        {evil: {"cached_ratio": 0.5, "requests": 3}}, [evil])).decode()
    assert "<script>" not in page
    assert page.count("&lt;script&gt;") >= 3


@pytest.mark.parametrize(("series", "by_replica", "expect"), [
    ([], {}, ["No requests with cached-token counts yet.", "No replica has answered yet."]),
    ([{"ts": 0.0, "cached_ratio": None, "by_replica": {}}], {},
     ["No requests with cached-token counts yet."]),
    ([{"ts": 0.0, "cached_ratio": 0.25, "by_replica": {"a": 0.25}},
      {"ts": 10.0, "cached_ratio": 0.75, "by_replica": {"a": 0.75}}],
     {"a": {"cached_ratio": 0.5, "requests": 2}}, ["class=overall", "50.0% (2 requests)"]),
])
def test_page_states(series: list[dict[str, Any]], by_replica: dict[str, Any],
                     expect: list[str]) -> None:
    page = render_page(stats(series, by_replica, [])).decode()
    for text in expect:
        assert text in page


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
                           "--disable-dev-shm-usage", *args],
                          capture_output=True, text=True, timeout=90, check=False)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install "
                    "chromium; .ci/run does)")
def test_live_page_renders_in_a_headless_browser(tmp_path: Path) -> None:
    rng = random.Random(2)
    with (
        sim(2, ["--model", "sim", "--speed", "50"]) as urls,
        gateway(urls) as url,
        httpx.Client(timeout=30) as client,
    ):
        for i in range(6):
            msgs = [{"role": "system", "content": f"agent {i % 3} " + words(rng, 200)},
                    {"role": "user", "content": words(rng, 10)}]
            r = client.post(url + "/v1/chat/completions",
                            json={"model": "sim", "messages": msgs, "max_tokens": 4})
            assert r.status_code == 200
        served = set(client.get(url + "/stats").json()["windows"]["all"]["by_replica"])
        dom = _chromium("--dump-dom", url + "/stats?format=html")
        shot = tmp_path / "stats.png"
        _chromium(f"--screenshot={shot}", "--window-size=800,900", url + "/stats?format=html")
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert re.search(r'id="headline">6 requests, [\d.]+% of prompt tokens served from cache',
                     html), html[:2000]
    overall = re.search(r'<polyline class="overall"[^>]* points="([^"]+)"', html)
    assert overall is not None and overall.group(1).strip()
    bars = re.findall(r'<rect class="bar" data-replica="([^"]+)"', html)
    assert set(bars) == served and served
    from PIL import Image

    with Image.open(shot) as img:
        colours = img.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 20  # drawn, not a blank page


ADMISSION = {"enabled": True, "queued": {"interactive": 3, "batch": 0},
             "shed": {"queue_full": 2, "deadline": 1},
             "wait_ms": {"interactive": {"p50": 12.5, "p99": 80.0},
                         "batch": {"p50": None, "p99": None}},
             "admitted_tokens": {"<tenant>": 4096}}


PD = {"two_legs": 3, "transferred_tokens": 2400,
      "decoder_kv": {"remembered": 2, "pulled_back": 1, "pulled_tokens": 96},
      "transfer_failures": {"prefill": {}, "decode": {"server_error": 1}},
      "prefill_engines": {"<p>": {"local_cache_hit": 832.0, "external_kv_transfer": 96.0},
                          "p2": {"local_cache_hit": None, "external_kv_transfer": None}}}


@pytest.mark.parametrize(("extra", "expect", "absent"), [
    ({}, ["No replica configured.", "No errors.", "No hygiene figures."],
     ["Admission", "admission-queued"]),
    ({"admission": ADMISSION},
     ["<h2>Admission</h2>", "Gateway queue enabled; 3 queued, 3 shed.",
      '<tr data-class="interactive"><td>interactive</td><td>3</td><td>12.5</td><td>80.0</td>',
      '<tr data-class="batch"><td>batch</td><td>0</td><td>n/a</td><td>n/a</td>',
      '<tr data-reason="queue_full"><td>queue_full</td><td>2</td>',
      "<td>&lt;tenant&gt;</td><td>4096</td>"], []),
    ({"admission": {"enabled": False}},
     ["Gateway queue disabled; 0 queued, 0 shed.", "Nothing queued.", "Nothing shed."], []),
    ({}, [], ["Prefill/decode", "pd-engines"]),
    ({"pd": PD},
     ["<h2>Prefill/decode</h2>", "3 two-leg requests, 2400 tokens offered to decoders, "
      "96 pulled back from them",
      '<tr data-leg="decode"><td>decode</td><td>server_error</td><td>1</td>',
      '<tr data-replica="&lt;p&gt;"><td>&lt;p&gt;</td><td>832.0</td><td>96.0</td>',
      '<tr data-replica="p2"><td>p2</td><td>n/a</td><td>n/a</td>'], ["No leg failed."]),
    ({"pd": {"two_legs": 0}}, ["No leg failed.", "No prefill replica scraped yet."], []),
    ({"replicas": {"r1": {"healthy": False, "in_flight": 2, "requests_running": 1,
                          "requests_waiting": 4, "kv_cache_usage": 0.91, "kv_level": "warn"},
                   "r2": {"healthy": True, "in_flight": 0, "kv_level": "unknown"}}},
     ['<tr class="replica down" data-replica="r1"><td>r1</td><td class=health>DOWN</td>'
      "<td>2</td><td>1</td><td>4</td><td class=kv>91.0%</td>",
      '<tr class="replica up" data-replica="r2"><td>r2</td><td class=health>up</td>'
      "<td>0</td><td>n/a</td><td>n/a</td><td class=kv>n/a</td>"], []),
])  # fmt: skip
def test_page_sections(extra: dict[str, Any], expect: list[str], absent: list[str]) -> None:
    page = render_page({**stats([], {}, []), **extra}).decode()
    assert '<meta http-equiv="refresh" content="10">' in page
    for text in expect:
        assert text in page
    for text in absent:
        assert text not in page


def test_errors_by_status_keep_the_gateways_own_apart() -> None:
    s = stats([], {}, [])
    s["windows"]["5m"] = {**s["windows"]["5m"], "requests": 9,
                          "by_status": {"200": 5, "502": 1, "503": 3},
                          "gateway_rejected": {"requests": 3, "by_status": {"503": 3}}}
    page = render_page(s).decode()
    assert "<tr><td>5m</td><td>4</td><td>9</td><td>502: 1, 503: 3 (3 by the gateway)</td>" in page


@pytest.mark.parametrize(("ts", "runs"), [
    ([0.0, 10.0, 20.0], 1),  # consecutive buckets: one line
    ([0.0, 10.0, 600.0, 610.0], 2),  # ten idle minutes: a gap, not a slope
    ([0.0, 100.0, 200.0], 3),
])
def test_idle_time_is_a_gap(ts: list[float], runs: int) -> None:
    series = [{"ts": t, "cached_ratio": 0.5, "by_replica": {"a": 0.5}} for t in ts]
    page = render_page({**stats(series, {}, []), "bucket_s": 10.0}).decode()
    assert page.count("<polyline class=overall") == runs
    assert page.count('<polyline class=replica data-replica="a"') == runs


@pytest.mark.parametrize(("ts", "dots"), [
    ([0.0, 10.0, 20.0], 0),  # one line of three points
    ([0.0, 100.0, 200.0], 3),  # three lines of one point each: a dot each, or nothing shows
    ([0.0, 10.0, 600.0], 1),
])
def test_a_replica_series_of_one_point_is_a_dot(ts: list[float], dots: int) -> None:
    series = [{"ts": t, "cached_ratio": 0.5, "by_replica": {"a": 0.5}} for t in ts]
    page = render_page({**stats(series, {}, []), "bucket_s": 10.0}).decode()
    assert page.count('<circle class=replica-point data-replica="a"') == dots


@pytest.mark.parametrize(("ms", "text"), [
    (12.0, "12.0 ms"), (9999.9, "9999.9 ms"), (10_000.0, "10.0 s"), (226468, "226.5 s"),
    (None, "n/a"),
])
def test_durations_read_in_seconds_when_long(ms: float | None, text: str) -> None:
    assert duration(ms) == text


def test_a_long_latency_shows_in_seconds_on_the_page() -> None:
    s = stats([], {}, [])
    s["windows"]["5m"] = {**s["windows"]["5m"], "latency": {"p99_ms": 226468.0}}
    page = render_page(s).decode()
    assert "<td>226.5 s</td>" in page and "226468" not in page
    assert "<td>12.0 ms</td>" in page and "<th>latency p99</th>" in page


HYGIENE_WARNING = ("hygiene: timestamp findings put 30% of the last hour's prompt tokens at "
                   "risk (900 of 3000 tokens, 3 request(s)); the latest are under "
                   "hygiene.latest in /stats")


def test_a_hygiene_warning_points_to_the_findings_below() -> None:
    page = render_page(stats([], {}, [HYGIENE_WARNING, "TTFT p99 is high"])).decode()
    assert "hygiene.latest in /stats" not in page
    assert '(900 of 3000 tokens, 3 request(s)); the findings and the latest requests are ' \
        '<a href="#hygiene">below, under Hygiene</a></li>' in page
    assert "<h2 id=hygiene>" in page
    assert "<li>TTFT p99 is high</li>" in page


def test_hygiene_section_is_escaped() -> None:
    evil = '<script>alert(1)</script>'
    hygiene = {"window": "1h", "covered_s": 3600.0, "prompt_tokens": 1000, "findings": 1,
               "tokens_at_risk": 700, "warn_share": 0.05,
               "by_kind": [{"kind": evil, "severity": "warning", "findings": 1, "requests": 1,
                            "tokens_at_risk": 700, "share_of_prompt_tokens": 0.7}],
               "by_model": {evil: [{"kind": "timestamp", "severity": "warning",
                                    "findings": 1, "requests": 1, "tokens_at_risk": 700}]},
               "by_tenant": {},
               "latest": [{"ts": 0.0, "model": evil, "kind": "timestamp", "severity": "warning",
                           "evidence": "pattern", "message_index": 0, "role": "system",
                           "char_offset": 23, "span": evil, "tokens_at_risk": 700}]}
    page = render_page({**stats([], {}, []), "hygiene": hygiene}).decode()
    assert "<script>" not in page and page.count("&lt;script&gt;") == 5
    assert 'data-message="0" data-offset="23" data-tokens="700"' in page
    assert "70.0%" in page and "No findings by tenant." in page


def test_the_findings_say_how_to_fix_them_and_what_that_saves() -> None:
    """The kinds table: the saving per hour and the newest remedy; each latest finding its
    own remedy; a tool name in a remedy is the client's text, so it is escaped."""
    fix = "sort the tools by name ['<b>', 'a']: this request sent ['a', '<b>']"
    row = {"kind": "tool_order", "severity": "warning", "findings": 3, "requests": 3,
           "tokens_at_risk": 900, "share_of_prompt_tokens": 0.3,
           "saving_tokens_per_hour": 54000, "remedy": fix}
    hygiene = {"window": "1h", "covered_s": 60.0, "prompt_tokens": 3000, "findings": 3,
               "tokens_at_risk": 900, "warn_share": 0.05, "by_kind": [row],
               "by_model": {"m": [row]}, "by_tenant": {},
               "latest": [{"ts": 0.0, "model": "m", "kind": "tool_order", "severity": "warning",
                           "evidence": "drift", "message_index": None, "role": "tools",
                           "char_offset": 1, "span": "<tool_order:9 chars>",
                           "tokens_at_risk": 300, "remedy": fix}]}
    page = render_page({**stats([], {}, []), "hygiene": hygiene}).decode()
    shown = html.escape(fix, quote=True)
    assert "'<b>'" not in page
    assert page.count(f"<td class=fix>{shown}</td>") == 2
    assert "<td>900</td><td>30.0%</td><td>54000</td>" in page
    assert "<th>saving per hour</th>" in page and "<th>fix</th>" in page


@pytest.mark.parametrize(("ttft", "latency", "said"), [
    (None, 226468.0, "latency p99 226.5 s (5 min)"),  # the demo answer, 227 s long
    (None, 550.1, "latency p99 550 ms (5 min)"),  # whole ms while short, as before
    (12_345.0, 226468.0, "TTFT p99 12.3 s (streamed, 5 min)"),
])
def test_the_headline_says_a_long_latency_in_seconds(ttft: float | None, latency: float,
                                                     said: str) -> None:
    """The page's first line (and /stats' summary.text, the log) reads as the table does."""
    window = {"requests": 1, "cached_ratio": 0.5, "ttft": {"p99_ms": ttft},
              "latency": {"p99_ms": latency}}
    text = headline(100.0, 0.0, {"5m": window, "all": window}, {"a": {}}, [])["text"]
    assert said in text and "226468" not in text
    page = render_page({**stats([], {}, []), "summary": {"text": text}}).decode()
    assert said in page
