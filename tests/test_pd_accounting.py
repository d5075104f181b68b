"""P/D accounting (gateway.pd.accounting, UsageRecord.cache_split): what a prefill leg's
own report says of P's cache and of its prediction, and how the cache figures of /stats
and /metrics count a two-leg request (a miss on P is a miss; tokens pulled back from the
decoder are neither hits nor misses). Tables of values, and one loopback run for the
wiring (tests/pd_gateway.py's harness)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from gateway.pd.accounting import (
    PrefillReport,
    prefill_verdict,
    pull_level,
    read_prefill,
    reported_cached,
)
from gateway.pd.config import PdConfig
from gateway.pd.stats import PdStats
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.feedback import Verdict
from gateway.routing.router import Router
from gateway.settings import AuthSettings, ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from gateway.usage.digest import digest
from gateway.usage.exposure import stats_view
from gateway.usage.logfile import LogError, record_from_json
from gateway.usage.metrics import GatewayMetrics
from gateway.usage.record import UsageRecord
from gateway.usage.stats import UsageWindows
from tests.pd_gateway import CHAT, gateway, next_turn, replicas, served, url
from tests.pd_replica import P_CACHED
from tests.records import usage_record

BLOCK = 16
THRESHOLD = 64


@pytest.mark.parametrize(("sent", "prompt", "level"), [
    (None, 1000, None),  # no decoder params sent
    (800, 1000, 800),  # the decoder's turn is shorter than the new prompt: all of it
    (1200, 1000, 1000),  # at most the prompt
    (800, None, None),  # the prompt's size unknown
])
def test_pull_level(sent: int | None, prompt: int | None, level: int | None) -> None:
    assert pull_level(sent, prompt) == level


# (reported, predicted, sent, level) -> the report
READ: list[tuple[int, int | None, bool, int | None, PrefillReport]] = [
    # a fresh prefill leg loads nothing: P's own hits, exactly, judged in full
    (100, 200, False, None, PrefillReport(100, 0, True, "full")),
    (0, 0, False, None, PrefillReport(0, 0, True, "full")),
    # the report is the pull level: P held 700 as predicted, pulled the 300 D generated
    (1000, 700, True, 1000, PrefillReport(1000, 300, False, "under_only")),
    # one block below the level still may be a pull (an engine trimming the last block)
    (990, 700, True, 1000, PrefillReport(990, 290, False, "under_only")),
    # what the prediction leaves is below the recompute threshold: nothing pulled
    (1000, 980, True, 1000, PrefillReport(1000, 0, False, "under_only")),
    # cold P (nothing predicted): the whole report may be pulled
    (1000, 0, True, 1000, PrefillReport(1000, 1000, False, "under_only")),
    # well below the level: a pull would have brought it there, so none happened
    (500, 700, True, 1000, PrefillReport(500, 0, True, "full")),
    # above the level: more than any pull gives, P's own hits
    (1010, 700, True, 1000, PrefillReport(1010, 0, True, "full")),
    # params sent, level unknown: any report may include a pull
    (800, 300, True, None, PrefillReport(800, 500, False, "under_only")),
]


@pytest.mark.parametrize(("reported", "predicted", "sent", "level", "expected"), READ)
def test_read_prefill(reported: int, predicted: int | None, sent: bool, level: int | None,
                      expected: PrefillReport) -> None:
    assert read_prefill(reported, predicted, sent=sent, level=level, engine_block=BLOCK,
                        threshold=THRESHOLD) == expected


# (report, predicted) -> verdict on P's prediction (None: not judged)
VERDICTS: list[tuple[PrefillReport, int, Verdict | None]] = [
    (PrefillReport(100, 0, True, "full"), 500, "under"),  # P lost what the index listed
    (PrefillReport(500, 0, True, "full"), 100, "over"),
    (PrefillReport(500, 0, True, "full"), 500, "ok"),
    # a pull only adds: a report well below the prediction is still "under"
    (PrefillReport(500, 0, False, "under_only"), 1000, "under"),
    # more than predicted: a pull or P's own hits, not told apart
    (PrefillReport(1000, 700, False, "under_only"), 300, None),
    # as predicted: P may have held less and pulled the rest
    (PrefillReport(1000, 0, False, "under_only"), 1000, None),
]


@pytest.mark.parametrize(("report", "predicted", "expected"), VERDICTS)
def test_prefill_verdict(report: PrefillReport, predicted: int,
                         expected: Verdict | None) -> None:
    assert prefill_verdict(report, predicted, BLOCK) == expected


def test_a_verdict_on_p_moves_ps_limit_as_a_one_leg_answer_does() -> None:
    router = Router(RoutingConfig(policy="prefix"))
    router.set_capacity("p", 1_000_000)
    body = {"model": "m", "messages": [{"role": "user", "content": "tell me a story " * 200}]}
    states = [ReplicaState(name="p", in_flight=0)]
    plan = router.decide(body, "chat", "m", None, states, 0.0)
    plan.outcome.prompt_tokens, plan.outcome.ok = 800, True
    router.report(plan, 1.0)
    preview = router.preview(body, "chat", "m", None, states, 2.0)
    assert preview.predicted["p"] > 0
    before = router.index_limit("p")
    # the verdict given is applied, not one made again from the count: a pull may hide
    # what the count would say (gateway.pd.accounting)
    router.judged(preview, "p", 0, "ok")
    assert router.index_limit("p") == before  # at its nominal already
    router.judged(preview, "p", preview.predicted["p"], "under")
    assert router.index_limit("p") < before
    assert router.engine_block("p") == RoutingConfig().engine_block_size


def test_a_prefill_replica_is_not_predicted_to_hold_the_answers_it_never_generated() -> None:
    """A conversation's turn 1: D generated the answer, P computed the prompt only
    (Router.holds). Turn 2's prediction on P is turn 1's prompt; on D, prompt and answer."""
    router = Router(RoutingConfig(policy="prefix"))
    for name in ("p", "d"):
        router.set_capacity(name, 1_000_000)
    turn1 = {"model": "m", "messages": [{"role": "user",
                                         "content": " ".join(f"w{i}" for i in range(400))}]}
    plan = router.decide(turn1, "chat", "m", "s", [ReplicaState(name="d", in_flight=0)], 0.0)
    router.holds("p", plan, 0.1)
    answer = " ".join(f"a{i}" for i in range(60))
    o = plan.outcome
    o.ok, o.prompt_tokens, o.completion_tokens, o.reply_text = True, 833, 96, answer
    router.report(plan, 1.0)
    turn2 = {"model": "m", "messages": [*turn1["messages"],
                                        {"role": "assistant", "content": answer},
                                        {"role": "user", "content": "and then? " * 40}]}

    def predicted(name: str, answers: bool) -> int:
        return router.preview(turn2, "chat", "m", None, [ReplicaState(name=name, in_flight=0)],
                              2.0, answers=answers).predicted[name]

    block = RoutingConfig().engine_block_size
    assert predicted("p", answers=False) == 833 // block * block  # the prompt it computed
    assert predicted("d", answers=True) == (833 + 96 - 1) // block * block
    assert predicted("p", answers=True) == predicted("d", answers=True)  # the old guess


def two_legs(**kw: Any) -> UsageRecord:
    return usage_record(**{"prefill_replica": "p", "cached_from": "prefill",
                           "transferred_tokens": 1000, **kw})


# (record, expected figures of its window): one leg; two legs P cold; two legs P warm;
# decoder_kv with a pull; decoder_kv below the recompute threshold
SPLIT: list[tuple[str, UsageRecord, dict[str, Any]]] = [
    ("one leg", usage_record(cached_tokens=400, predicted_cached_tokens=600),
     {"prompt_tokens": 1000, "cached_tokens": 400, "cached_ratio": 0.4, "delivered": 400 / 600,
      "pulled_tokens": 0}),
    ("P cold", two_legs(cached_tokens=0, prefill_cached_tokens=0, predicted_cached_tokens=0),
     {"prompt_tokens": 1000, "cached_tokens": 0, "cached_ratio": 0.0, "delivered": None,
      "pulled_tokens": 0}),
    # D's report is a copy of P's (or, before vLLM 0.32, the whole transferred prompt):
    # P's own report is what counts
    ("P warm", two_legs(cached_tokens=1000, prefill_cached_tokens=600,
                        predicted_cached_tokens=600),
     {"prompt_tokens": 1000, "cached_tokens": 600, "cached_ratio": 0.6, "delivered": 1.0,
      "pulled_tokens": 0}),
    # P held 600 of its own, pulled 300: the 300 are neither hits nor misses; the 100 P
    # computed are a miss
    ("pulled", two_legs(cached_from="decoder_kv", cached_tokens=900, prefill_cached_tokens=900,
                        pulled_tokens=300, pulled_exact=False, predicted_cached_tokens=600),
     {"prompt_tokens": 1000, "cached_tokens": 600, "cached_ratio": 600 / 700,
      "delivered": 1.0, "pulled_tokens": 300}),
    ("below threshold", two_legs(cached_from="decoder_kv", cached_tokens=880,
                                 prefill_cached_tokens=880, pulled_tokens=0,
                                 pulled_exact=False, predicted_cached_tokens=880),
     {"prompt_tokens": 1000, "cached_tokens": 880, "cached_ratio": 0.88, "delivered": 1.0,
      "pulled_tokens": 0}),
]


@pytest.mark.parametrize(("case", "rec", "expected"), SPLIT, ids=[c[0] for c in SPLIT])
def test_the_cache_figures_of_a_two_leg_request(case: str, rec: UsageRecord,
                                                expected: dict[str, Any]) -> None:
    windows = UsageWindows(bucket_s=1.0)
    windows.add(rec)
    summary = windows.summary(rec.ts, None)
    assert {k: summary[k] for k in expected} == pytest.approx(expected)
    # /metrics counts the same hits and ratio
    metrics = GatewayMetrics()
    metrics.observe(rec)
    reg = metrics.registry
    cached = reg.get_sample_value("gateway_cached_tokens_total",
                                  {"model": "m", "replica": "a", "tenant": "none",
                                   "route": "prefix"})
    assert (cached or 0) == expected["cached_tokens"]
    ratio_sum = reg.get_sample_value("gateway_cached_ratio_sum", {"model": "m", "replica": "a"})
    assert ratio_sum == pytest.approx(expected["cached_ratio"])


def test_another_tenants_pd_traffic_is_not_in_a_tenants_view() -> None:
    windows = UsageWindows(bucket_s=1.0)
    windows.add(usage_record(tenant="alice", cached_tokens=400))
    windows.add(two_legs(tenant="bob", cached_from="decoder_kv", cached_tokens=900,
                         prefill_cached_tokens=900, pulled_tokens=300, pulled_exact=False))
    pd = PdStats()
    pd.transferred(1000)
    pd.pulled(300)
    doc = {"windows": windows.windows(1000.0), "pd": pd.snapshot()}
    seen = stats_view(doc, "tenant", "alice")
    assert "pd" not in seen and "bob" not in str(seen)
    for window in seen["windows"].values():
        assert window["by_tenant"]["alice"]["pulled_tokens"] == 0
        assert "pulled_tokens" not in window  # the fleet's sum moves with bob's turns
        for dim in ("by_model", "by_replica", "by_endpoint"):
            assert all("pulled_tokens" not in v and "cached_tokens" not in v
                       for v in window[dim].values())
    # bob reads his own
    assert stats_view(doc, "tenant", "bob")["windows"]["all"]["by_tenant"]["bob"][
        "pulled_tokens"] == 300


@pytest.mark.parametrize("reuse", [False, True])
async def test_ps_own_report_is_recorded_and_judges_ps_prediction_once(reuse: bool) -> None:
    """Through the gateway (loopback, tests/pd_replica.py: P reports P_CACHED on every
    prefill leg): each prefill leg's report judges P once; D is judged by nothing."""
    pd = PdConfig(min_remote_prefill_tokens=16, reuse_decoder_kv=reuse)
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d), "decode")], pd) as gw, \
            httpx.AsyncClient(timeout=10) as client:
        assert gw.app.services is not None
        router = gw.app.services.router
        judged: list[tuple[str, int, str]] = []
        original = router.judged

        def spy(plan: Any, replica: str, delivered: int, outcome: Any) -> None:
            judged.append((replica, delivered, outcome))
            original(plan, replica, delivered, outcome)

        router.judged = spy  # type: ignore[method-assign]
        headers = {"x-session-id": "conv-1"}
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=headers)
        answer = r.json()["choices"][0]["message"]["content"]
        r2 = await client.post(gw.url + "/v1/chat/completions", headers=headers,
                               json=next_turn(CHAT, answer, "and then? " * 40))
        first, second = gw.records
        # the answer's x-gateway-cache predicts what its usage reports: P's cached tokens
        for resp, rec in ((r, first), (r2, second)):
            assert predicted_header(resp) == str(rec.predicted_cached_tokens)
        assert [rec.prefill_cached_tokens for rec in gw.records] == [P_CACHED, P_CACHED]
        assert first.pulled_tokens is None
        if reuse:  # the decoder's params went to P: its report (32) is far below their
            # pull level (150 tokens): nothing was pulled, exactly, and it is judged in full
            assert (second.cached_from, second.pulled_tokens, second.pulled_exact) == (
                "decoder_kv", 0, True)
        else:
            assert (second.cached_from, second.pulled_tokens) == ("prefill", None)
        # P predicted nothing on turn 1 and got 32 (two 16-token blocks): over
        assert judged[0] == ("p1", P_CACHED, "over")
        assert len(judged) == 2 and all(j[0] == "p1" for j in judged)


def predicted_header(resp: httpx.Response) -> str:
    items = dict(item.split("=", 1) for item in resp.headers["x-gateway-cache"].split(", "))
    return items["predicted"]


async def test_a_two_leg_answers_header_predicts_ps_cached_tokens() -> None:
    """Turn 2 goes to a decoder that holds nothing (predicted 0 there) while P holds turn
    1's prompt: the answer's usage reports P's count, so its header predicts P's."""
    async with replicas(("p1", "ok"), ("d1", "ok"), ("d2", "ok")) as (p, d1, d2), gateway(
            [("p1", url(p), "prefill"), ("d1", url(d1), "decode"),
             ("d2", url(d2), "decode")]) as gw, httpx.AsyncClient(timeout=10) as client:
        gw.busy("d1", 5)  # turn 1 on d2 (and p1)
        await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        gw.busy("d1", -5)
        gw.busy("d2", 50)  # turn 2 on d1
        r = await client.post(gw.url + "/v1/chat/completions",
                              json=next_turn(CHAT, "ok", "and then? " * 40))
        gw.busy("d2", -50)
        assert (r.headers["x-gateway-replica"], r.headers["x-gateway-prefill"]) == ("d1", "p1")
        predicted = gw.records[1].predicted_cached_tokens
        assert predicted is not None and predicted > 0
        assert predicted_header(r) == str(predicted)


@pytest.mark.parametrize(("field", "value", "error"), [
    ("prefill_cached_tokens", 900, None), ("pulled_tokens", 300, None),
    ("pulled_exact", False, None), ("pulled_exact", None, None),
    ("prefill_cached_tokens", -1, "'prefill_cached_tokens' must be a non-negative integer"),
    ("pulled_tokens", "300", "'pulled_tokens' must be a non-negative integer"),
    ("pulled_exact", "no", "'pulled_exact' must be a boolean"),
])
def test_the_usage_log_reads_the_new_fields_back(field: str, value: Any,
                                                 error: str | None) -> None:
    rec = two_legs(cached_from="decoder_kv", prefill_cached_tokens=900, pulled_tokens=300,
                   pulled_exact=True)
    doc = {**orjson.loads(orjson.dumps(rec.to_dict())), field: value}
    if error is None:
        assert getattr(record_from_json(doc, 1), field) == value
    else:
        with pytest.raises(LogError, match=error):
            record_from_json(doc, 1)


def test_gateway_report_counts_what_p_computed_as_uncached() -> None:
    """`gateway report`'s top sessions by uncached tokens: the tokens P computed (here
    1000 - 600 own hits - 300 pulled), not the pulled ones, nor D's copied count."""
    pulled = two_legs(session="s1", cached_from="decoder_kv", cached_tokens=900,
                      prefill_cached_tokens=600 + 300, pulled_tokens=300, pulled_exact=False)
    one = usage_record(session="s2", cached_tokens=850)
    top = {e["name"]: e for e in digest([pulled, one])["top_sessions"]}
    assert (top["s1"]["prompt_tokens"], top["s1"]["cached_tokens"],
            top["s1"]["uncached_tokens"]) == (1000, 600, 100)
    assert top["s2"]["uncached_tokens"] == 150


async def test_bobs_pd_traffic_is_not_in_alices_stats() -> None:
    """Through the gateway with two tenants' keys: bob's two-leg turns (one of them sent
    the decoder's params) show in the operator's `/stats` and in bob's own rows, never in
    alice's view, JSON or page, nor in her `/metrics`."""
    async with replicas(("p1", "ok"), ("d1", "ok")) as (p, d):
        settings = Settings(
            replicas=(ReplicaSettings(name="p1", url=url(p), role="prefill", models=("m",)),
                      ReplicaSettings(name="d1", url=url(d), role="decode", models=("m",))),
            server=ServerSettings(read_timeout_s=10, connect_timeout_s=5, health_timeout_s=5,
                                  health_interval_s=60),
            routing=RoutingConfig(policy="least_loaded"),
            usage=UsageConfig(startup_probe=False, scrape_interval_s=60),
            pd=PdConfig(min_remote_prefill_tokens=16, reuse_decoder_kv=True),
            auth=AuthSettings(keys={"ka": "alice", "kb": "bob", "ko": "ops"},
                              admin_tenants=("ops",)))
        async with served(settings) as gw, httpx.AsyncClient(timeout=10) as client:
            bob = {"authorization": "Bearer kb", "x-session-id": "b-1"}
            r = await client.post(gw.url + "/v1/chat/completions", json=CHAT, headers=bob)
            answer = r.json()["choices"][0]["message"]["content"]
            r = await client.post(gw.url + "/v1/chat/completions", headers=bob,
                                  json=next_turn(CHAT, answer, "and then? " * 40))
            assert r.status_code == 200 and p.legs() == ["prefill", "prefill"]
            assert [rec.cached_from for rec in gw.records] == ["prefill", "decoder_kv"]

            async def view(key: str, query: str = "") -> str:
                resp = await client.get(gw.url + "/stats" + query,
                                        headers={"authorization": f"Bearer {key}"})
                assert resp.status_code == 200
                return resp.text

            ops = orjson.loads(await view("ko"))
            assert ops["pd"]["two_legs"] == 2
            assert "bob" in ops["windows"]["all"]["by_tenant"]
            alice = await view("ka")
            assert "bob" not in alice and '"pd"' not in alice
            assert "pulled_tokens" not in alice and "prefill_engines" not in alice
            page = await view("ka", "?format=html")
            assert "Prefill/decode" not in page and "bob" not in page
            own = orjson.loads(await view("kb"))["windows"]["all"]["by_tenant"]["bob"]
            assert own["pulled_tokens"] == 0 and own["requests"] == 2
            metrics = (await client.get(gw.url + "/metrics",
                                        headers={"authorization": "Bearer ka"})).text
            assert "gateway_pd_" not in metrics and "bob" not in metrics


@pytest.mark.parametrize(("usage_cached", "params", "expected"), [
    (96, {"remote_prefill_cached_tokens": 150}, 96),  # the usage's count first
    (None, {"remote_prefill_cached_tokens": 150}, 150),  # no prompt_tokens_details
    (None, {"remote_prefill_cached_tokens": 0}, 0),
    (None, {}, None),  # neither: unknown
    (None, {"remote_prefill_cached_tokens": "150"}, None),
    (None, {"remote_prefill_cached_tokens": -1}, None),
    (None, {"remote_prefill_cached_tokens": True}, None),
])
def test_ps_report_is_its_usage_else_the_count_its_params_carry(
        usage_cached: int | None, params: dict[str, Any], expected: int | None) -> None:
    assert reported_cached(usage_cached, params) == expected


@pytest.mark.parametrize(("cached_from", "hits"), [("prefill", 150), ("decoder_kv", None)])
def test_when_p_said_nothing_a_turn_that_may_have_pulled_has_unknown_hits(
        cached_from: str, hits: int | None) -> None:
    """D's count is a copy of P's: P's own hits on a fresh prefill, but on a turn sent the
    decoder's params it holds the pulled tokens too, which are no hits."""
    rec = two_legs(cached_from=cached_from, cached_tokens=150, prefill_cached_tokens=None)
    assert rec.cache_split()[1] == hits
