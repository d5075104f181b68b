"""`gateway-bench compare --pd P:D`: the P/D column's names, the simulator's roles and the
gateway's replica flags (tables), the command's refusals, and one tiny run on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.bench import explain
from gateway.bench.cli import main
from gateway.bench.compare import pd_column, queued, split_column
from gateway.bench.pdfleet import (
    fleet_args,
    gateway_env,
    parse_pd,
    pd_default_column,
    sim_flags,
)


@pytest.mark.parametrize(("text", "expect"), [
    ("1:1", (1, 1)), ("2:3", (2, 3)), ("0:1", None), ("1:0", None), ("2", None),
    ("a:b", None), ("1:1:1", None), ("-1:2", None),
])
def test_parse_pd(text: str, expect: tuple[int, int] | None) -> None:
    if expect is None:
        with pytest.raises(ValueError, match="PREFILL:DECODE"):
            parse_pd(text)
    else:
        assert parse_pd(text) == expect


@pytest.mark.parametrize(("column", "policy", "how", "queue", "pd"), [
    ("prefix+pd", "prefix", "header", False, True),
    ("prefix+pd@none", "prefix", "none", False, True),
    ("prefix+queue+pd", "prefix", "header", True, True),
    ("prefix+pd+queue@user", "prefix", "user", True, True),
    ("prefix+queue", "prefix", "header", True, False),
    ("prefix", "prefix", "header", False, False),
])
def test_pd_columns(column: str, policy: str, how: str, queue: bool, pd: bool) -> None:
    assert split_column(column, "header") == (policy, how)
    assert queued(column) is queue and pd_column(column) is pd
    assert ("prefill/decode fleet" in explain.column(column, "header")) is pd


@pytest.mark.parametrize(("columns", "added"), [
    (("prefix", "round_robin"), "prefix+pd"),
    (("prefix@none", "least_loaded"), "prefix+pd@none"),
    (("round_robin", "prefix@user", "prefix"), "prefix+pd@user"),
    (("round_robin",), "prefix+pd"),
])
def test_the_added_column_names_sessions_as_prefix_does(columns: tuple[str, ...],
                                                        added: str) -> None:
    assert pd_default_column(columns) == added


def test_unknown_column_flag() -> None:
    with pytest.raises(ValueError, match=r"unknown column flag \+pdx"):
        split_column("prefix+pdx", "header")


URLS = ["http://h:1", "http://h:2", "http://h:3"]


@pytest.mark.parametrize(("pd", "reuse", "flags", "args"), [
    (None, False, None,
     ["--backend", "http://h:1", "--backend", "http://h:2", "--backend", "http://h:3"]),
    ((1, 2), False, ["--role", "prefill", "--role", "decode", "--role", "decode"],
     ["--prefill", "http://h:1", "--decode", "http://h:2", "--decode", "http://h:3"]),
    ((2, 1), True,
     ["--role", "prefill", "--role", "prefill", "--role", "decode", "--bidirectional-kv-xfer"],
     ["--prefill", "http://h:1", "--prefill", "http://h:2", "--decode", "http://h:3"]),
])
def test_fleet_flags(pd: tuple[int, int] | None, reuse: bool, flags: list[str] | None,
                     args: list[str]) -> None:
    assert fleet_args(URLS, pd) == args
    if pd is not None:
        assert sim_flags(pd, reuse) == flags


def test_reuse_ttl_scales_with_the_workload_time() -> None:
    assert gateway_env(False, 0.01) == {}
    assert gateway_env(True, 0.005) == {"GATEWAY_PD__REUSE_DECODER_KV": "true",
                                        "GATEWAY_PD__REUSE_TTL_S": "2.1"}


@pytest.mark.parametrize("argv", [
    ["--policies", "prefix+pd"],
    ["--pd-reuse"],
    ["--pd", "1:1", "--backend", "http://127.0.0.1:9"],
])
def test_refusals(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--preset", "tiny", *argv]) == 2
    assert "gateway-bench compare:" in capsys.readouterr().err


def test_compare_tiny_with_a_pd_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    rc = main(["compare", "--preset", "tiny", "--policies", "prefix@none", "--pd", "1:1",
               "--kv-blocks", "2000", "--out", str(tmp_path), "--no-progress",
               "--max-wall-s", "60"])
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads((tmp_path / "compare.json").read_text())["policies"]
    agg, pd = result["prefix@none"], result["prefix+pd@none"]
    assert agg["pd"] is None and pd["pd"] == {"prefill": 1, "decode": 1,
                                              "reuse_decoder_kv": False}
    # the same load: every request of the workload answered on both fleets
    assert pd["errors"] == 0 and pd["requests"] == agg["requests"] > 0
    assert pd["prompt_tokens"] == agg["prompt_tokens"]
    assert 0 < pd["cached_ratio"] <= 1 and pd["ttft_ms"]["p50"] > 0
    usage = [json.loads(line) for line in
             (tmp_path / "logs" / "usage-prefix+pd@none.jsonl").read_text().splitlines()]
    legs = [u for u in usage if u.get("prefill_replica")]
    assert legs and all(u["transferred_tokens"] > 0 for u in legs)
    assert pd["session_ids"] == agg["session_ids"] == "none"
    assert "prefill/decode fleet" in out
