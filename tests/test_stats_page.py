"""`/stats?format=html`: the page's content by table (escaping, empty states), and the page
of a live gateway rendered in a real headless browser (Debian's chromium; skipped with the
reason when it is not installed)."""

from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.usage.page import render_page
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
