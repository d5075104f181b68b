"""P/D's Prometheus families (gateway.pd.metrics) fed by PdStats, by table, and on /metrics
through the real gateway on loopback.

Mutations seen failing here: a leg failure not counted in its family; the transferred
tokens not added; reuse hits counted as misses; the decode leg's ok not counted; the
families not registered on the gateway's registry (absent from /metrics)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.pd.metrics import PdMetrics
from gateway.pd.stats import PdStats
from tests.pd_gateway import CHAT, gateway, replicas, reuse, url


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


CASES: list[tuple[str, Callable[[PdStats], None], str, dict[str, str], float]] = [
    ("two legs", lambda s: s.transferred(128), "gateway_pd_transfers_total", {}, 1),
    ("tokens", lambda s: (s.transferred(128), s.transferred(None)),
     "gateway_pd_transferred_tokens_total", {}, 128),
    ("prefill ok", lambda s: s.transferred(5), "gateway_pd_legs_total",
     {"leg": "prefill", "outcome": "ok"}, 1),
    ("served two legs", lambda s: s.transferred(5), "gateway_pd_requests_total",
     {"served": "two_legs"}, 1),
    ("decode ok", lambda s: s.decoded(), "gateway_pd_legs_total",
     {"leg": "decode", "outcome": "ok"}, 1),
    ("prefill failure", lambda s: s.leg_failed("prefill", "not_delivered"),
     "gateway_pd_legs_total", {"leg": "prefill", "outcome": "not_delivered"}, 1),
    ("no params", lambda s: s.leg_failed("prefill", "no_params"),
     "gateway_pd_legs_total", {"leg": "prefill", "outcome": "no_params"}, 1),
    ("pull failed", lambda s: s.pull_failed("server_error"), "gateway_pd_legs_total",
     {"leg": "decode", "outcome": "server_error"}, 1),
    ("P alone", lambda s: s.pull_failed("broken"), "gateway_pd_requests_total",
     {"served": "prefill_alone"}, 1),
    ("D alone cached", lambda s: s.chose("cached"), "gateway_pd_requests_total",
     {"served": "cached"}, 1),
    ("remote not counted at choice", lambda s: s.chose("remote"),
     "gateway_pd_requests_total", {"served": "two_legs"}, 0),
    ("prefill failed", lambda s: s.decode_alone(), "gateway_pd_requests_total",
     {"served": "prefill_failed"}, 1),
    ("kept", lambda s: s.kept(), "gateway_pd_decoder_kv_total", {"result": "kept"}, 1),
    ("hit", lambda s: (s.reused(True), s.reused(False)), "gateway_pd_decoder_kv_total",
     {"result": "hit"}, 1),
    ("miss", lambda s: (s.reused(False), s.reused(False)), "gateway_pd_decoder_kv_total",
     {"result": "miss"}, 2),
    ("pulled", lambda s: (s.pulled(300), s.pulled(0)), "gateway_pd_pulled_tokens_total", {},
     300),
]


@pytest.mark.parametrize(("name", "act", "family", "labels", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_stats_feed_the_families(name: str, act: Callable[[PdStats], None], family: str,
                                 labels: dict[str, str], expected: float) -> None:
    registry = CollectorRegistry()
    stats = PdStats(PdMetrics(registry))
    act(stats)
    assert value(generate_latest(registry).decode(), family, **labels) == expected


def test_every_series_is_there_from_the_start_and_bounded() -> None:
    registry = CollectorRegistry()
    PdMetrics(registry)
    text = generate_latest(registry).decode()
    legs = [k for k in samples(text) if k[0] == "gateway_pd_legs_total"]
    assert len(legs) == 2 * 8  # two legs x (ok, no_params, six failure classes)
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=text.encode(),
                               capture_output=True, timeout=30, check=False)
        assert check.returncode == 0, check.stderr


async def test_metrics_count_a_two_leg_turn_and_its_reuse() -> None:
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")], reuse()) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT,
                              headers={"x-session-id": "conv-1"})
        assert r.status_code == 200
        text = (await client.get(gw.url + "/metrics")).text
        assert value(text, "gateway_pd_legs_total", leg="prefill", outcome="ok") == 1
        assert value(text, "gateway_pd_legs_total", leg="decode", outcome="ok") == 1
        assert value(text, "gateway_pd_transferred_tokens_total") == 128
        assert value(text, "gateway_pd_decoder_kv_total", result="kept") == 1
        assert value(text, "gateway_pd_decoder_kv_total", result="miss") == 1
