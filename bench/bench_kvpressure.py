"""Token mode with KV events against text mode, on simulated engines under KV pressure.

    .venv/bin/python bench/bench_kvpressure.py [--requests 1500] [--tenants 24] [--seed 0]

In process, no HTTP: `--replicas` simulated vLLM engines (gateway/sim/engine.py, block size
16, `--kv-blocks` blocks each) publish KV events (`EngineConfig(kv_events=True)`); batches
go through vLLM's wire format (encode + decode) into the token-mode index after each
request. `--tenants` tenants each own a ~600-token system prompt and run conversations
that grow by a user turn and the engine's own reply; a request continues a random live
conversation or starts a new one for a random tenant. The working set is several times
the fleet's cache. Arrivals are sequential (one request at a time), so simulated TTFT
is the prefill time of the uncached part: it isolates what routing captures.

Both modes use the `prefix` policy with the same seed and see the same request sequence.
Reported per mode: cached-token ratio (engine-reported cached / prompt tokens), simulated
TTFT p50/p90, and the share of requests whose predicted cached tokens are within one block
(16 tokens) of what the engine delivered.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from router_calls import decide, finish

from gateway.events.decode import decode_payload
from gateway.events.kvindex import KVIndex
from gateway.events.publisher import encode_batch
from gateway.events.tokenmode import TokenMode
from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router
from gateway.sim.engine import Engine, EngineConfig
from gateway.sim.generator import WORDS
from gateway.sim.hashing import salt_key
from gateway.sim.steptime import StepTimeModel
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import IM_END_ID, SPECIAL_IDS, Tokenizer
from gateway.tokens.render import TokenRenderer
from gateway.tokens.tokenize import TokenizerCache

BLOCK = 16


class SimTemplate:
    def render(self, messages: list[Any], tools: list[Any] | None = None,
               add_generation_prompt: bool = True) -> str:
        return render_chat(messages, tools, add_generation_prompt)


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def run(mode: str, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(args.seed)
    tok = Tokenizer()
    names = [f"r{i}" for i in range(args.replicas)]
    engines = {n: Engine(EngineConfig(num_gpu_blocks=args.kv_blocks, block_size=BLOCK,
                                      max_num_batched_tokens=16384, output_len=40, seed=i,
                                      replica=i, kv_events=True,
                                      step_time=StepTimeModel(jitter=0.0)), tok)
               for i, n in enumerate(names)}
    index = KVIndex()
    for n in names:
        index.add_replica(n, "m", BLOCK)
        index.set_connected(n, True, 0.0)
    renderer = TokenRenderer("m", SimTemplate(), TokenizerCache(tok.encode, list(SPECIAL_IDS)),
                             BLOCK)
    tokens = TokenMode({"m": renderer}, index) if mode == "token" else None
    router = Router(RoutingConfig(seed=args.seed, default_capacity_tokens=args.kv_blocks
                                  * BLOCK), tokens)
    for n in names:
        router.set_capacity(n, args.kv_blocks * BLOCK, BLOCK)
    systems = [words(rng, 420) for _ in range(args.tenants)]
    convs: list[tuple[int, list[dict[str, Any]]]] = []
    final: dict[int, int] = {}  # conversation -> its latest prompt length (its footprint)
    now = 0.0
    cached = prompt = 0
    ttfts: list[float] = []
    within = 0
    states = [ReplicaState(n, 0) for n in names]
    for k in range(args.requests):
        if convs and rng.random() < 0.7:
            i = rng.randrange(len(convs))
            tenant, messages = convs[i]
            if len(messages) > 12:
                convs.pop(i)
                continue
        else:
            tenant = rng.randrange(args.tenants)
            messages = [{"role": "system", "content": systems[tenant]}]
            convs.append((tenant, messages))
        messages.append({"role": "user", "content": words(rng, rng.randint(30, 120))})
        body: dict[str, Any] = {"model": "m", "messages": list(messages),
                                "cache_salt": f"t{tenant}"}
        plan = decide(router, body, "m", states, now)
        name = plan.decision.replica
        engine = engines[name]
        ids = tok.encode(render_chat(messages))
        req = engine.new_request(f"q{k}", ids, 40, now, IM_END_ID, salt_key(f"t{tenant}"))
        engine.add(req)
        t = now
        for _ in range(10_000):
            if not engine.has_work():
                break
            step, duration = engine.plan_step(0.5, t)
            t += duration
            engine.finish_step(step, t)
        for n, e in engines.items():
            assert e.kv_events is not None
            events = e.kv_events.drain()
            if events:
                index.apply(n, decode_payload(0, encode_batch(t, events, "map")).events, t)
        assert req.first_token is not None
        ttfts.append((req.first_token - now) * 1e3)
        cached += req.num_cached_tokens
        prompt += req.num_prompt_tokens
        final[id(messages)] = req.num_prompt_tokens
        within += abs(plan.decision.predicted_cached_tokens - req.num_cached_tokens) < BLOCK
        reply = tok.decode([x for x in req.output_ids if x != IM_END_ID])
        finish(router, plan, name, req.num_prompt_tokens, req.num_cached_tokens,
               req.first_token, t, reply, req.num_output_tokens)
        messages.append({"role": "assistant", "content": reply})
        now = t + 0.001
    count = len(ttfts)
    # Working set: every conversation's final prompt (tenants' shared system prompts
    # counted once per conversation, as each salt/conversation chain is its own).
    return {"requests": float(count), "cached_ratio": cached / prompt,
            "ttft_p50_ms": statistics.median(ttfts), "ttft_p90_ms": pct(ttfts, 0.9),
            "within_one_block": within / count,
            "fleet_tokens": float(args.replicas * args.kv_blocks * BLOCK),
            "working_set_tokens": float(sum(final.values()))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--tenants", type=int, default=24)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for mode in ("text", "token"):
        r = run(mode, args)
        print(f"{mode:5s} " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()))


if __name__ == "__main__":
    main()
