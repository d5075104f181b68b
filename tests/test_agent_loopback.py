"""An agent program in its tool call, through a real gateway in front of `gateway sim` on
loopback (2 replicas with small KV caches).

Program P (tenant a, Claude Code's headers) runs three turns on replica A, then is in a
tool call. A long answer of another conversation runs on A (it shares P's system prompt,
so the router puts it there). A newcomer that shares the start of that answer's prompt
would go to A too (the router's longest cached prefix): with P's context held, A has no
room for it without evicting P (A's KV usage with P's context added passes
`kv_usage_limit`), so it goes to B. Tenant b sending P's program
header is another program: its turn does not end P's hold. Once the hold has ended (P's
learnt gap passed; `agent_reserve_max_s` caps it), a newcomer goes to A again.

Why an earlier draft saw `route=balance, predicted=0` for its newcomer whatever the
reservation: the router's bounded-load session cap (routing `session_cap_factor`) puts a
new conversation on the replica with fewer conversations, and A carried P's; and its
cached prefixes are shared within a tenant only. So here the cap is lifted and every
request but tenant b's is tenant a's. With the hold at work, the gate hands the router
only B, where nothing of the newcomer is cached: that too reads `predicted=0`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from tests.servers import gateway, sim
from tests.sim_http import MODEL

SYSTEM = " ".join(f"rule{i}" for i in range(400))  # ~800 tokens (the simulator's)
# P's words after it, as its three turns grow them: P's context ~0.45 of A's KV at the
# end (reserve.py holds at most half a replica's KV capacity). A's prefill rate must stay
# unmeasured: the miss cost stays at the slow engine the routing settings describe, which
# the simulator's real speed would not be (P's context would not be worth a hold). The
# gate learns a rate from 1,024 tokens or more computed between the scrapes two of its
# reads see (prefillrate.py RATE_MIN_TOKENS): turn 1 computes ~1,056 but over P's 14-s gap
# (~75 tokens/s, below the configured 100), turns 2 and 3 ~432 each, the long answer ~400
# (LONG). A scrape older than turn 3's end, read when the long answer arrives, merges
# those two: ~830, still below. (CI saw LONG = 300 merge to ~1,032 there: A measured at
# ~700 tokens/s ended P's hold. The slow scrape interval below makes that merge the rule.)
HISTORY_STEPS = (120, 330, 540)
HISTORY = HISTORY_STEPS[-1]
CAP_S = 16.0  # agent_reserve_max_s
# the long answer's words after P's history (~400 tokens to compute: A's KV ~0.57 with
# the shared system prompt and history, past the limit with P's context added)
LONG = 200
GAP_S = 14.0  # P's tool calls as it teaches them: its hold lasts about this long (long
# enough that a loaded machine still checks within it: 8 s was not)
KEYS = {"sk-a": "a", "sk-b": "b", "sk-admin": "admin"}  # admin: reads all of /stats
PROGRAM = {"x-claude-code-session-id": "prog-1", "x-claude-code-agent-id": "main"}


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def body(user: str, max_tokens: int = 1, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, **kw,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": user}]}


def auth(key: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    return {"authorization": f"Bearer {key}", **(extra or {})}


def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    for _ in range(100_000):
        if check():
            return
        assert time.monotonic() < deadline, f"not in {timeout} s: {what}"
        time.sleep(0.02)


def stats(client: httpx.Client) -> dict[str, Any]:
    out: dict[str, Any] = client.get("/stats", headers=auth("sk-admin")).json()
    return out


def admission(client: httpx.Client) -> dict[str, Any]:
    out: dict[str, Any] = stats(client)["admission"]
    return out


@contextmanager
def long_answer(url: str) -> Iterator[dict[str, Any]]:
    """A streamed answer of another conversation of P's tenant (the router shares cached
    prefixes within a tenant only) that runs for seconds; yields
    {"replica": where it runs (once its headers came), "done": threading.Event}."""
    state: dict[str, Any] = {"replica": None, "done": threading.Event(),
                             "started": threading.Event()}

    def run() -> None:
        try:
            with httpx.Client(base_url=url, timeout=120) as c, c.stream(
                    "POST", "/v1/chat/completions", headers=auth("sk-a"),
                    json=body(f"{words('ctx', HISTORY)} {words('long', LONG)}", 1300,
                              stream=True)) as r:
                state["replica"] = r.headers.get("x-gateway-replica")
                state["started"].set()
                for _ in r.iter_lines():
                    pass
        finally:
            state["started"].set()
            state["done"].set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert state["started"].wait(60), "the long answer did not start"
        yield state
    finally:
        t.join(120)


def test_a_newcomer_goes_elsewhere_while_a_program_is_in_its_tool_call() -> None:
    # --speed 0.5: the long answer's 1,500 tokens take tens of seconds, past the cap
    sim_args = ["--kv-blocks", "256", "--max-model-len", "4096", "--speed", "0.5"]
    env = {"GATEWAY_ADMISSION__ENABLED": "true",
           "GATEWAY_ADMISSION__AGENT_RESERVE_MAX_S": str(CAP_S),
           "GATEWAY_ADMISSION__OWN_REPLICA_MAX_WAIT_S": "0",
           "GATEWAY_AUTH__KEYS": ",".join(f"{k}={t}" for k, t in KEYS.items()),
           "GATEWAY_AUTH__ADMIN_TENANTS": "admin",
           # a slow engine: P's context is worth many seconds of prefill, its gaps less
           "GATEWAY_ROUTING__PREFILL_S_PER_TOKEN": "0.01",
           # no bounded-load cap: with P's one conversation on A it would place any new
           # one on B (route=balance, predicted=0) whatever the reservation; here the
           # cached prefix alone draws a newcomer to A
           "GATEWAY_ROUTING__SESSION_CAP_FACTOR": "100",
           # slow: reads between two scrapes see the older one (see HISTORY_STEPS)
           "GATEWAY_USAGE__SCRAPE_INTERVAL_S": "1.5",
           "GATEWAY_HEALTH_INTERVAL_S": "0.2"}
    with sim(2, sim_args) as replicas, gateway(replicas, env=env) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        homes = set()
        for turn, n in enumerate(HISTORY_STEPS):  # P's gaps learnt (each below its miss cost)
            if turn:
                time.sleep(GAP_S)  # P's tool call (what it teaches, not a wait for a state)
            r = client.post("/v1/chat/completions",
                            json=body(f"{words('ctx', n)} step{turn}"),
                            headers=auth("sk-a", PROGRAM))
            assert r.status_code == 200, r.text
            homes.add(r.headers["x-gateway-replica"])
        assert len(homes) == 1, homes
        home = homes.pop()
        context = r.json()["usage"]["prompt_tokens"]
        p_end = time.monotonic()
        # P is in its tool call, held on A: from its answer's end in the gateway, which
        # may come after the client has read the last byte (a loaded machine showed it)
        until(lambda: admission(client)["agent_programs"]["held_tokens"].get(home, 0)
              >= context, "P's context never held on A", timeout=5.0)
        # a tenant's key reads no program's hold (another tenant's agents move it)
        mine = client.get("/stats", headers=auth("sk-a")).json()
        assert "agent_programs" not in mine.get("admission", {}), mine.get("admission")
        with long_answer(url) as running:
            assert running["replica"] == home  # the shared prompt took it to A
            # the gateway has scraped A busy: its KV usage + P's context is past the limit
            until(lambda: (stats(client)["replicas"][home].get("requests_running")
                           or 0) >= 1, "A scraped busy")

            seen: list[str] = []  # what the router said of each, for a failure's message

            def lands(key: str, shared: int, extra: dict[str, str] | None = None) -> str:
                """Where a request sharing the long answer's prompt up to its `shared`-th
                word goes (each more than the last: B never holds as much of it as A; A
                keeps that prompt while the answer runs, P's history it may not)."""
                text = f"{words('ctx', HISTORY)} {words('long', shared)} then something else"
                # each its own conversation (else the router, recognising one from its
                # prompt, would send a later one after an earlier one's replica)
                r = client.post("/v1/chat/completions", json=body(text), headers=auth(
                    key, {"x-session-id": f"newcomer-{shared}", **(extra or {})}))
                assert r.status_code == 200, r.text
                seen.append(f"{shared}: {r.headers.get('x-gateway-cache')}, queued "
                            f"{r.headers.get('x-gateway-queue-ms')} ms")
                return r.headers["x-gateway-replica"]

            # tenant b's program of the same name is another program: its turn does not
            # end P's hold (nor is it a program returning to A)
            lands("sk-b", 50, PROGRAM)
            adm = admission(client)
            assert adm["agent_programs"]["held_tokens"].get(home, 0) >= context, (
                f"{time.monotonic() - p_end:.1f} s after P's turn", adm)
            assert lands("sk-a", 100) != home, seen  # a newcomer: to B
            # once P's hold ends (past its learnt gap, at most the cap) nothing is held:
            # a newcomer may go to A again (the long answer still runs there, A as busy)
            until(lambda: home not in admission(client)["agent_programs"]["held_tokens"],
                  "the hold ended", timeout=CAP_S + 30)
            assert lands("sk-a", 180) == home, seen
            assert not running["done"].is_set(), "the long answer ended too soon to judge"
