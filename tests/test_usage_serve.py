"""End to end over `gateway serve` (embedded simulator): the usage log, /metrics and
/stats agree with what the engine reported, and `gateway report` reads the log."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.usage.metrics import DOCUMENTED_METRICS
from tests.servers import free_port, running, script, sim


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return bytes(r.read())


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def test_usage_end_to_end(tmp_path: Path) -> None:
    log = tmp_path / "usage.jsonl"
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(f'[usage]\nlog_path = "{log}"\n')
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [*script("gateway"), "serve", "--config", str(cfg), "--port", str(port)]
    with running(argv, [url + "/ready"]):
        model = json.loads(_get(url + "/v1/models"))["data"][0]["id"]
        body = {"model": model, "max_tokens": 3,
                "messages": [{"role": "system", "content": "You are terse. " * 80},
                             {"role": "user", "content": "hi"}]}  # fmt: skip
        answers = [_post(url + "/v1/chat/completions", body) for _ in range(2)]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            not log.exists() or len(log.read_bytes().splitlines()) < 2
        ):
            time.sleep(0.05)
        records = [json.loads(x) for x in log.read_bytes().splitlines()]
        metrics_text = _get(url + "/metrics").decode()
        stats = json.loads(_get(url + "/stats"))
    assert len(records) == 2
    for rec, ans in zip(records, answers, strict=True):
        details = ans["usage"].get("prompt_tokens_details") or {}
        assert rec["prompt_tokens"] == ans["usage"]["prompt_tokens"]
        assert rec["cached_tokens"] == details.get("cached_tokens")
    names = set()
    cached_total = 0.0
    for fam in text_string_to_metric_families(metrics_text):
        names.add(fam.name + "_total" if fam.type == "counter" else fam.name)
        for s in fam.samples:
            if s.name == "gateway_cached_tokens_total":
                cached_total += s.value
    assert set(DOCUMENTED_METRICS) <= names
    reported = sum(r["cached_tokens"] or 0 for r in records)
    assert reported > 0  # the second request reuses the first one's prefix
    assert cached_total == reported
    assert stats["windows"]["all"]["requests"] == 2
    assert stats["windows"]["all"]["cached_tokens"] == reported
    proc = subprocess.run([*script("gateway"), "report", str(log), "--json"],
                          capture_output=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["windows"]["all"]["cached_tokens"] == reported


@pytest.mark.parametrize("details", [False, True], ids=["no-details", "details"])
def test_startup_probe_finds_replicas_without_cached_tokens(
    tmp_path: Path, details: bool
) -> None:
    extra = [] if details else ["--no-prompt-tokens-details"]
    logfile = tmp_path / "gateway.log"
    with sim(1, extra) as urls:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [*script("gateway"), "serve", "--port", str(port), "--backend", urls[0]]
        with running(argv, [url + "/ready"], log_path=logfile):
            deadline = time.monotonic() + 10
            while True:  # the probe runs in the background once the replica is up
                stats = json.loads(_get(url + "/stats"))
                (rep,) = stats["replicas"].values()
                if rep["reports_cached_tokens"] is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
    assert rep["reports_cached_tokens"] is details
    warned = [w for w in stats["warnings"] if "--enable-prompt-tokens-details" in w]
    assert len(warned) == (0 if details else 1)
    assert stats["windows"]["all"]["requests"] == 0  # probe traffic is not recorded
    logged = "--enable-prompt-tokens-details" in logfile.read_text()
    assert logged is not details
