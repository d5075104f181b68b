"""gateway-bench's overload support, pure parts by tables: tenants and classes dealt to
sessions, a tenant run alone, `+queue` columns and the gateway settings they bring, the
queue wait counted in the simulated TTFT, figures per tenant and class."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from gateway.bench.client import Exchange
from gateway.bench.compare import gateway_env, queued, sim_argv, split_column
from gateway.bench.groups import by, group_figures, groups_table
from gateway.bench.presets import PRESETS
from gateway.bench.runner import RequestRecord, auth_keys, record_of, tenant_key
from gateway.bench.session import TurnRequest
from gateway.bench.workload import WorkloadConfig, build_workload
from tests.bench_scripts import load


def test_tenants_and_classes_are_dealt_by_weight() -> None:
    wl = build_workload(PRESETS["flood"].workload)
    tenants = Counter(s.tenant for s in wl.sessions)
    assert set(tenants) == {"quiet", "flood"}
    assert 7 <= tenants["flood"] / tenants["quiet"] <= 14  # 10x the sessions, dealt at random
    classes = Counter(s.priority for s in build_workload(PRESETS["overload"].workload).sessions)
    assert classes["normal"] > classes["low"] > classes["high"] > 0


def test_a_tenant_alone_keeps_its_sessions_unchanged() -> None:
    cfg = PRESETS["flood"].workload
    both = build_workload(cfg)
    alone = build_workload(WorkloadConfig(**{**cfg.__dict__, "only_tenants": ("quiet",)}))
    assert alone.sessions == tuple(s for s in both.sessions if s.tenant == "quiet")


def test_without_tenants_the_workload_is_unchanged() -> None:
    wl = build_workload(PRESETS["default"].workload)
    assert all(s.tenant is None and s.priority is None for s in wl.sessions)


@pytest.mark.parametrize(("column", "policy", "how", "queue"), [
    ("prefix", "prefix", "header", False),
    ("prefix+queue", "prefix", "header", True),
    ("prefix+queue@none", "prefix", "none", True),
    ("least_loaded@none", "least_loaded", "none", False),
])
def test_queue_columns(column: str, policy: str, how: str, queue: bool) -> None:
    assert split_column(column, "header") == (policy, how)
    assert queued(column) is queue


def test_gateway_env_for_the_overload_preset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_USAGE__SCRAPE_INTERVAL_S", raising=False)
    preset = PRESETS["overload"]
    off = gateway_env("prefix", preset, 0.5)
    assert off["GATEWAY_AUTH__KEYS"] == auth_keys(preset.workload.tenants)
    assert f"{tenant_key('a')}=a" in off["GATEWAY_AUTH__KEYS"]
    # a column without the queue pins it off, whatever the default
    assert off["GATEWAY_ADMISSION__ENABLED"] == "false"
    on = gateway_env("prefix+queue", preset, 0.5)
    assert on["GATEWAY_ADMISSION__ENABLED"] == "true"
    # the engine's limits are learnt from its scrapes, never copied from the preset
    assert not any(k.startswith("GATEWAY_ADMISSION__REPLICA_") for k in {**off, **on})
    assert on["GATEWAY_ADMISSION__HIGH_MAX_WAIT_S"] == "5"  # 10 s at half the wall time
    assert on["GATEWAY_ADMISSION__SHARE_HALF_LIFE_S"] == "2.5"
    # every column reads the engines as often in simulated time as a user's gateway
    assert off["GATEWAY_USAGE__SCRAPE_INTERVAL_S"] == on[
        "GATEWAY_USAGE__SCRAPE_INTERVAL_S"] == "2.5"
    assert gateway_env("prefix", preset, 0.01)["GATEWAY_USAGE__SCRAPE_INTERVAL_S"] == "0.25"
    assert "GATEWAY_USAGE__SCRAPE_INTERVAL_S" not in gateway_env("prefix", preset, 1.0)
    assert "GATEWAY_ADMISSION__PRIORITY_REPLICAS" not in on
    prio = dataclasses.replace(preset, scheduling_policy="priority")
    urls = ("http://127.0.0.1:9000", "http://127.0.0.1:9001")
    assert gateway_env("prefix+queue", prio, 0.5, urls)[
        "GATEWAY_ADMISSION__PRIORITY_REPLICAS"] == "127.0.0.1:9000,127.0.0.1:9001"
    assert "--scheduling-policy" in sim_argv(prio, 9000, "m", 0)
    argv = sim_argv(preset, 9000, "m", 0)
    assert argv[argv.index("--max-num-seqs") + 1] == "16"
    assert "--max-num-seqs" not in sim_argv(PRESETS["default"], 9000, "m", 0)


def turn() -> TurnRequest:
    return TurnRequest(session_id="s", agent="coder", turn=1, sibling=0, body={})


@pytest.mark.parametrize(("headers", "sim", "scale", "ttft", "queue"), [
    ({}, {"ttft_ms": 100}, 0.5, 100.0, None),
    ({"x-gateway-queue-ms": "40.0"}, {"ttft_ms": 100}, 0.5, 180.0, 40.0),
    ({"x-gateway-queue-ms": "40"}, {"ttft_ms": 100}, 1.0, 140.0, 40.0),
    ({"x-gateway-queue-ms": "junk"}, {"ttft_ms": 100}, 1.0, 100.0, None),
])
def test_queue_wait_counts_in_the_simulated_ttft(headers: dict[str, str], sim: dict[str, Any],
                                                 scale: float, ttft: float,
                                                 queue: float | None) -> None:
    ex = Exchange(status=200, headers=headers, sim_timing={**sim, "e2e_ms": 500})
    rec = record_of(turn(), ex, 0.0, time_scale=scale)
    assert (rec.ttft_ms, rec.queue_ms) == (ttft, queue)
    # where it waited, in simulated ms: the gateway's queue, then the engine's
    assert rec.gateway_wait_ms == pytest.approx((queue or 0.0) / scale)
    assert rec.engine_wait_ms is None  # the simulator's `queue_ms` was not in this timing


def test_the_engine_wait_is_the_simulators_queue_ms() -> None:
    ex = Exchange(status=200, headers={"x-gateway-queue-ms": "10"},
                  sim_timing={"ttft_ms": 100, "e2e_ms": 500, "queue_ms": 30})
    rec = record_of(turn(), ex, 0.0, time_scale=0.5)
    assert (rec.gateway_wait_ms, rec.engine_wait_ms) == (20.0, 30.0)
    g = group_figures([rec, dataclasses.replace(rec, gateway_wait_ms=80.0,
                                                engine_wait_ms=5.0)])
    assert g["wait_p99_ms"] == {"gateway": 80.0, "engine": 30.0}
    assert "engine wait p99" in groups_table({"c": {"by_class": {"normal": g}}})


def rec(status: int = 200, ttft: float | None = 100.0, tenant: str | None = "a",
        priority: str | None = "high", error: str | None = None, turn: int = 0,
        replica: str = "r0", session: str = "s", prompt: int = 100,
        cached: int = 50) -> RequestRecord:
    return RequestRecord(
        session_id=session, agent="coder", turn=turn, sibling=0, send_s=0.0, status=status,
        error=error, prompt_tokens=prompt, cached_tokens=cached, completion_tokens=1,
        ttft_ms=ttft, e2e_ms=200.0, timing="sim", sim_arrival_s=None, replica=replica,
        route="prefix", request_id=None, tenant=tenant, priority=priority)


def test_group_figures_count_sheds_and_timeouts_apart() -> None:
    records = [rec(), rec(ttft=300.0, turn=1, replica="r1"),
               rec(status=429, ttft=None, error="{}"),
               rec(status=504, ttft=None, error="{}"),
               rec(status=0, ttft=None, error="TimeoutError: read timeout"),
               rec(status=500, ttft=None, error="{}")]
    g = group_figures(records)
    assert (g["requests"], g["ok"], g["shed_429"], g["timeouts"], g["other_errors"]) == (
        6, 2, 1, 2, 1)
    assert g["ttft_ms"]["p50"] is not None and g["ttft_ms"]["p99"] == pytest.approx(300, 1)
    assert g["cached_ratio"] == 0.5
    assert g["follow_ups_moved"] == 1.0


def test_groups_by_tenant_and_class_and_their_table() -> None:
    records = [rec(tenant="a", priority="high"), rec(tenant="b", priority="low"),
               rec(tenant=None, priority=None)]
    assert set(by(records, lambda r: r.tenant)) == {"a", "b"}
    assert by([rec(tenant=None)], lambda r: r.tenant) == {}
    table = groups_table({"prefix+queue": {
        "by_class": by(records, lambda r: r.priority),
        "by_tenant": by(records, lambda r: r.tenant)}})
    assert "class high" in table and "tenant b" in table
    assert groups_table({"prefix": {}}) == ""


def _mooncake() -> Any:
    return load("bench_mooncake")


def test_the_mooncake_bench_columns_and_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATEWAY_USAGE__SCRAPE_INTERVAL_S", raising=False)
    mooncake = _mooncake()
    # both columns read the engines every 5 s of the engines' time (1.25 s at 4x); the
    # column without the queue pins it off, whatever the default
    assert mooncake.column_env("prefix", 4.0) == (
        "prefix", {"GATEWAY_USAGE__SCRAPE_INTERVAL_S": "1.25",
                   "GATEWAY_ADMISSION__ENABLED": "false"})
    policy, env = mooncake.column_env("prefix+queue", 4.0)
    assert policy == "prefix" and env["GATEWAY_ADMISSION__ENABLED"] == "true"
    assert env["GATEWAY_USAGE__SCRAPE_INTERVAL_S"] == "1.25"
    # the default 2 s wait for the own replica, in the engines' time at 4x
    assert env["GATEWAY_ADMISSION__OWN_REPLICA_MAX_WAIT_S"] == "0.5"
    assert not any(k.startswith("GATEWAY_ADMISSION__REPLICA_") for k in env)
    assert mooncake.parse_loads("0.5,1,2,4") == [0.5, 1.0, 2.0, 4.0]
    for bad in ("", "0", "1,-2"):
        with pytest.raises(ValueError):
            mooncake.parse_loads(bad)
