"""Responses and Messages through P/D end to end: `gateway serve --prefill URL --decode URL`
in front of ONE `gateway sim --role prefill --role decode` process (pulls work only inside
one simulator), with the official `openai` and `anthropic` clients, streamed and not.

Each request is counted per engine from the simulator's own metrics (requests finished,
KV transfers, failed transfers): each leg reaches each engine at most once. The usage
record names both replicas; the client never sees a `kv_transfer_params` (D runs
`--bidirectional-kv-xfer`, so its answers carry its own). Two tenants (keys, engine cache
salt): one tenant's prompt cached on the engines is not another's. Then each failure row
once on one of the two endpoints, with an in-process gateway whose replicas a test can
mark up: a prefill replica not delivered (the next one computes it), and D's pull failing
before a byte (P answers the whole request).

Mutations seen failing here: `PdPath.legs` left to chat and completions (every count and
record); the sim's Responses/Messages handlers not passing `kv_transfer_params` to the
connector (P's answer has none: D alone); the answer filter's nested strip removed (the
streamed Responses answer carries D's engine id to the client); `after_prefill`
answering "decode_alone" for a prefill leg not delivered; the Responses object without
D's own params; D's Responses usage reporting the pulled prompt as cached (not P's
count, as vLLM >= 0.32 reports); a continuation of an unknown response given two legs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest

from gateway.pd.config import PdConfig
from gateway.routing.config import RoutingConfig
from gateway.settings import ReplicaSettings, ServerSettings, Settings
from gateway.usage.config import UsageConfig
from tests.pd_gateway import served
from tests.servers import free_port, gateway, sim
from tests.sim_http import FAST, MODEL, scrape
from tests.test_pd_review import until

KEYS = {"key-a": "A", "key-b": "B"}
SIM = [*FAST, "--role", "prefill", "--role", "decode", "--bidirectional-kv-xfer",
       "--decoder-kv-ttl-s", "600000", "--responses-store"]
ENGINE = '{engine="0",model_name="Qwen/Qwen2.5-7B-Instruct"}'
XFER = "vllm:nixl_xfer_time_seconds_count" + ENGINE
FAILED = "vllm:nixl_num_failed_transfers_total" + ENGINE


def long(tag: str) -> str:
    """A prompt of a few hundred tokens, its own per test (the engines are shared)."""
    return " ".join(f"{tag}{i}" for i in range(300))


def counts(base: str) -> tuple[float, float, float]:
    """(requests finished, KV transfers, failed transfers) of one engine."""
    m = scrape(base)
    done = sum(v for k, v in m.items() if k.startswith("vllm:request_success_total{"))
    return done, m.get(XFER, 0.0), m.get(FAILED, 0.0)


def delta(before: tuple[float, ...], after: tuple[float, ...]) -> tuple[int, ...]:
    return tuple(int(a - b) for a, b in zip(after, before, strict=True))


def name(url: str) -> str:
    return url.removeprefix("http://")


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[str, str]]:
    with sim(2, SIM) as (p, d):
        yield p, d


@pytest.fixture(scope="module")
def log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pdapis") / "usage.jsonl"


@pytest.fixture(scope="module")
def gw(pair: tuple[str, str], log: Path) -> Iterator[str]:
    p, d = pair
    env = {"GATEWAY_PD__MIN_REMOTE_PREFILL_TOKENS": "64", "GATEWAY_USAGE__LOG_PATH": str(log),
           "GATEWAY_AUTH__KEYS": ",".join(f"{k}={t}" for k, t in KEYS.items()),
           "GATEWAY_AUTH__TENANT_CACHE_SALT": "a-secret-of-this-test"}
    with gateway([], ["--prefill", p, "--decode", d], env=env) as url:
        yield url


def records(path: Path, n: int) -> list[dict[str, Any]]:
    """The usage log's first n records, waiting (bounded) for them to be written."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= n:
            return [orjson.loads(x) for x in lines[:n]]
        time.sleep(0.05)
    raise AssertionError(f"expected {n} usage records in {path}")


class Log:
    """The records a test added to the shared usage log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = len(path.read_text().splitlines()) if path.exists() else 0

    def new(self, n: int) -> list[dict[str, Any]]:
        return records(self.path, self.start + n)[self.start:]


def hidden(doc: Any) -> None:
    """Nothing of a kv_transfer_params reached the client (D's name its engine)."""
    raw = orjson.dumps(doc)
    assert b"remote_engine_id" not in raw and b"remote_block_ids" not in raw, raw[:300]


def two_legs(rec: dict[str, Any], p: str, d: str, endpoint: str, stream: bool) -> None:
    assert (rec["endpoint"], rec["stream"], rec["status"]) == (endpoint, stream, 200)
    assert (rec["replica"], rec["prefill_replica"]) == (name(d), name(p))
    assert rec["transferred_tokens"] > 200 and rec["cached_from"] == "prefill"


@pytest.mark.parametrize("stream", [False, True])
def test_responses_through_two_legs(pair: tuple[str, str], gw: str, log: Path,
                                    stream: bool) -> None:
    p, d = pair
    before, usage = (counts(p), counts(d)), Log(log)
    client = openai.OpenAI(base_url=gw + "/v1", api_key="key-a", max_retries=0)
    prompt = long(f"resp{stream}")
    if stream:
        events = list(client.responses.create(model=MODEL, input=prompt,
                                              max_output_tokens=12, stream=True))
        for event in events:
            hidden(event.model_dump())
        assert events[-1].type == "response.completed"
        response = events[-1].response  # type: ignore[union-attr]
    else:
        response = client.responses.create(model=MODEL, input=prompt, max_output_tokens=12)
    hidden(response.model_dump())
    assert response.output_text and response.usage is not None
    assert response.usage.output_tokens == 12
    # P: its prefill leg, finished; D: the decode leg, one pull
    assert delta(before[0], counts(p)) == (1, 0, 0)
    assert delta(before[1], counts(d)) == (1, 1, 0)
    two_legs(usage.new(1)[0], p, d, "responses", stream)
    # D stored the answer (P's leg was sent with store false): the chain continues on D,
    # as one leg pinned to it
    follow = client.responses.create(model=MODEL, input="and the next rule?",
                                     previous_response_id=response.id, max_output_tokens=4)
    assert follow.output_text
    rec = usage.new(2)[1]
    assert (rec["replica"], rec["prefill_replica"], rec["route"]) == (name(d), None, "response")
    assert delta(before[0], counts(p))[0] == 1  # nothing more on P


@pytest.mark.parametrize("stream", [False, True])
def test_messages_through_two_legs(pair: tuple[str, str], gw: str, log: Path,
                                   stream: bool) -> None:
    p, d = pair
    before, usage = (counts(p), counts(d)), Log(log)
    client = anthropic.Anthropic(base_url=gw, api_key="key-a", max_retries=0)
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 12,
                           "messages": [{"role": "user", "content": long(f"msg{stream}")}]}
    if stream:
        with client.messages.stream(**ask) as s:
            for event in s:
                hidden(event.model_dump())
            message = s.get_final_message()
    else:
        message = client.messages.create(**ask)
    hidden(message.model_dump())
    assert message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens == 12
    assert delta(before[0], counts(p)) == (1, 0, 0)
    assert delta(before[1], counts(d)) == (1, 1, 0)
    two_legs(usage.new(1)[0], p, d, "messages", stream)


def test_two_tenants_share_no_cached_prompt(pair: tuple[str, str], gw: str,
                                            log: Path) -> None:
    """Tenant A's prompt, once computed on P and pulled by D, is A's: A's repeat is served
    by D alone from its cache; B's identical request is cold on both legs (the engine
    salt is B's on each leg, the router's index B's)."""
    p, d = pair
    usage = Log(log)
    prompt = long("tenants")

    def ask(key: str) -> None:
        client = openai.OpenAI(base_url=gw + "/v1", api_key=key, max_retries=0)
        assert client.responses.create(model=MODEL, input=prompt,
                                       max_output_tokens=4).output_text
    before = (counts(p), counts(d))
    ask("key-a")
    ask("key-a")
    ask("key-b")
    first, repeat, other = usage.new(3)
    assert [r["tenant"] for r in (first, repeat, other)] == ["A", "A", "B"]
    two_legs(first, p, d, "responses", False)
    assert first["cached_tokens"] <= 16  # at most the template's opening block, A's own
    # D holds A's prompt (it pulled it): A's repeat needs no prefill leg
    assert (repeat["replica"], repeat["prefill_replica"]) == (name(d), None)
    assert repeat["cached_tokens"] > 200
    two_legs(other, p, d, "responses", False)
    assert other["cached_tokens"] == 0  # nothing of A's on P or D
    assert delta(before[0], counts(p)) == (2, 0, 0)
    assert delta(before[1], counts(d)) == (3, 2, 0)


FRESH = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/responses", {"input": long("simresp"), "store": False}),
    ("/v1/messages", {"messages": [{"role": "user", "content": long("simmsg")}]}),
])
def test_the_simulator_answers_both_legs_on_each_endpoint(pair: tuple[str, str], path: str,
                                                          body: dict[str, Any]) -> None:
    """As vLLM 0.32: P's answer carries the params that name its lease; D pulls them
    (its transfer count rises) and, bidirectional, answers its own: in the Responses
    object (body and the stream's response.completed), in the Messages body only; a
    second pull of the same lease fails as the policy "fail" answers."""
    p, d = pair
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    ask = {"model": MODEL, **body}
    r = httpx.post(p + path, json={**ask, limit: 1, "kv_transfer_params": FRESH}, timeout=30)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] > 200
    before = counts(d)
    r = httpx.post(d + path, json={**ask, limit: 4, "kv_transfer_params": params}, timeout=30)
    assert r.status_code == 200, r.text
    own = r.json()["kv_transfer_params"]
    assert own["do_remote_decode"] is True and own["remote_engine_id"] != params[
        "remote_engine_id"]
    assert delta(before, counts(d)) == (1, 1, 0)
    again = httpx.post(d + path, json={**ask, limit: 4, "kv_transfer_params": params},
                       timeout=30)
    assert again.status_code == 500 and "KV load failed" in again.text
    streamed = httpx.post(p + path, json={**ask, limit: 1, "kv_transfer_params": FRESH},
                          timeout=30).json()["kv_transfer_params"]
    text = httpx.post(d + path, json={**ask, limit: 4, "stream": True,
                                      "kv_transfer_params": streamed}, timeout=30).text
    if path == "/v1/responses":
        last = text.strip().split("\n\n")[-1].split("\n")[1].removeprefix("data: ")
        assert orjson.loads(last)["response"]["kv_transfer_params"]["do_remote_decode"]
    else:
        assert "kv_transfer_params" not in text and "message_stop" in text
    assert delta(before, counts(d)) == (2, 2, 1)


# Failure rows, an in-process gateway (replicas marked up by hand) ------------------------



def settings(specs: list[tuple[str, str, str]]) -> Settings:
    return Settings(
        replicas=tuple(ReplicaSettings(name=n, url=u, role=role, models=(MODEL,))  # type: ignore[arg-type]
                       for n, u, role in specs),
        server=ServerSettings(read_timeout_s=20, connect_timeout_s=5, health_timeout_s=5,
                              health_interval_s=60),
        routing=RoutingConfig(policy="least_loaded"),
        usage=UsageConfig(startup_probe=False, scrape_interval_s=60),
        pd=PdConfig(min_remote_prefill_tokens=64))


async def test_a_prefill_leg_not_delivered_goes_to_the_next_prefill_replica(
        pair: tuple[str, str]) -> None:
    """Messages: the first P refuses the connection (not delivered): the second computes
    the prompt, D pulls it from there; the refused one got nothing, nothing went twice."""
    p, d = pair
    refused = f"http://127.0.0.1:{free_port()}"
    async with served(settings([("gone", refused, "prefill"), ("p", p, "prefill"),
                                ("d", d, "decode")])) as gw, \
            httpx.AsyncClient(timeout=30) as client:
        gw.mark_up("gone")
        gw.busy("p", 3)  # least_loaded ranks the refused one first
        before = (counts(p), counts(d))
        r = await client.post(gw.url + "/v1/messages", json={
            "model": MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": long("undelivered")}]})
        assert r.status_code == 200, r.text
        hidden(r.json())
        assert (r.headers["x-gateway-replica"], r.headers["x-gateway-prefill"]) == ("d", "p")
        assert delta(before[0], counts(p)) == (1, 0, 0)
        assert delta(before[1], counts(d)) == (1, 1, 0)
        await until(lambda: gw.records, "the request recorded")
        rec = gw.records[0]
        assert (rec.replica, rec.prefill_replica, rec.endpoint) == ("d", "p", "messages")
        assert gw.stats()["pd"]["transfer_failures"]["prefill"] == {"not_delivered": 1}


async def test_a_failed_pull_is_answered_whole_by_the_prefill_replica() -> None:
    """Responses: P's lease is gone before D pulls (`--kv-lease-s 0`), D answers 500
    before a byte reached the client: P, which holds the prompt, answers the whole
    request, once."""
    with sim(2, [*SIM, "--kv-lease-s", "0"]) as (p, d):
        async with served(settings([("p", p, "prefill"), ("d", d, "decode")])) as gw, \
                httpx.AsyncClient(timeout=30) as client:
            r = await client.post(gw.url + "/v1/responses", json={
                "model": MODEL, "input": long("pullfail"), "max_output_tokens": 8})
            assert r.status_code == 200, r.text
            hidden(r.json())
            assert r.json()["output"][0]["content"][0]["text"]
            assert r.headers["x-gateway-replica"] == "p"
            # P: its prefill leg and the whole request; D: one pull, failed, nothing done
            assert counts(p) == (2, 0, 0)
            assert counts(d) == (0, 0, 1)
            await until(lambda: gw.records, "the request recorded")
            rec = gw.records[0]
            assert (rec.replica, rec.endpoint, rec.status) == ("p", "responses", 200)
            pd = gw.stats()["pd"]
            assert pd["prefill_alone"] == 1
            assert pd["transfer_failures"]["decode"] == {"server_error": 1}


async def test_a_response_continuation_of_an_unknown_creator_stays_one_leg(
        pair: tuple[str, str]) -> None:
    """A `previous_response_id` the gateway never saw is not pinned, yet no prefill
    replica can hold that stored response: the request goes to D alone, P gets nothing
    (the replica's own 404 is relayed)."""
    p, d = pair
    async with served(settings([("p", p, "prefill"), ("d", d, "decode")])) as gw, \
            httpx.AsyncClient(timeout=30) as client:
        r = await client.post(gw.url + "/v1/responses", json={
            "model": MODEL, "input": long("unknownchain"), "max_output_tokens": 4,
            "previous_response_id": "resp_0123456789abcdef"})
        assert r.status_code == 404 and r.headers["x-gateway-replica"] == "d"
        assert "x-gateway-prefill" not in r.headers
        pd = gw.stats()["pd"]
        assert pd["two_legs"] == 0 and sum(pd["decode_alone"].values()) == 0
        assert pd["transfer_failures"] == {"prefill": {}, "decode": {}}
