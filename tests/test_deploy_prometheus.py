"""The alert and recording rules, and the dashboard's queries, on a real Prometheus (Debian's
`prometheus` binary, on loopback) scraping a live gateway in front of a live `gateway sim`:
every rule evaluates without error, the cached-token recordings get values, and every
dashboard query runs."""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.servers import ROOT, free_port, gateway, running, sim

PROMETHEUS = shutil.which("prometheus")
RULES = ROOT / "deploy" / "prometheus" / "rules" / "gateway.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "cache-gateway.json"

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not installed (Debian package; .ci/run has it)")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _query(base: str, expr: str) -> Any:
    doc = _get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert doc["status"] == "success", (expr, doc)
    return doc["data"]["result"]


def _chat(base: str, system: str, user: str) -> None:
    body = json.dumps({"model": "Qwen/Qwen2.5-7B-Instruct", "max_tokens": 4,
                       "messages": [{"role": "system", "content": system},
                                    {"role": "user", "content": user}]}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json",
                                          "x-session-id": system[:8]})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


def test_rules_and_dashboard_on_a_real_prometheus(tmp_path: Path) -> None:
    assert PROMETHEUS is not None
    with sim(2) as urls, gateway(urls) as gw:
        port = free_port()
        prom = f"http://127.0.0.1:{port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": "gateway",
                 "static_configs": [{"targets": [gw.removeprefix("http://")]}]},
                # `replica` as the gateway names its --backend replicas (host:port)
                {"job_name": "vllm",
                 "static_configs": [{"targets": [u.removeprefix("http://")],
                                     "labels": {"replica": u.removeprefix("http://")}}
                                    for u in urls]},
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        argv = [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}"]
        with running(argv, [prom + "/-/ready"], log_path=tmp_path / "prometheus.log"):
            # traffic spread over a few scrapes (a rate needs the counter to move between
            # two of them), with a shared, cacheable prefix
            system = "You are a careful assistant. " * 60
            deadline = time.monotonic() + 30
            ratio: list[Any] = []
            i = 0
            while time.monotonic() < deadline and not ratio:
                _chat(gw, system, f"question {i}")
                i += 1
                time.sleep(0.25)
                ratio = _query(prom, "gateway:cached_ratio:rate2m")
            assert ratio, "the cached-ratio recording never got a value"
            assert 0 < float(ratio[0]["value"][1]) <= 1
            up = _query(prom, 'up{job="vllm"} == 1')
            assert {r["metric"]["replica"] for r in up} == {u.removeprefix("http://")
                                                           for u in urls}
            # the replica label joins both sources: the gateway's view and vLLM's own
            joined = _query(prom, "gateway_replica_healthy * on (replica) group_left "
                                  "max by (replica) (vllm:kv_cache_usage_perc)")
            assert len(joined) == 2
            # every rule evaluated, without an error
            groups = _get(prom + "/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            assert len(rules) == 15
            assert [r["name"] for r in rules if r["health"] != "ok"] == []
            # every dashboard query runs
            panels = json.loads(DASHBOARD.read_text())["panels"]
            for panel in panels:
                for target in panel.get("targets", []):
                    _query(prom, target["expr"].replace("$__rate_interval", "1m"))
            # what the panels of the cached-token ratio show, here: real numbers
            for series in ("gateway:predicted_ratio:rate2m",
                           "gateway:best_available_ratio:rate2m"):
                assert _query(prom, series), series
