"""Prediction accuracy and feedback, against a small engine model built from the
simulator's real template and tokenizer (the token counts the gateway must predict)."""

from __future__ import annotations

import random
import statistics
from collections import OrderedDict
from typing import Any

import pytest

from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router
from gateway.sim.template import render_chat
from gateway.sim.tokenizer import IM_END_ID, Tokenizer
from tests.filler import words
from tests.routing_driver import finish

BLOCK = 16


class Engine:
    """vLLM's prefix cache reduced to its rules: chained 16-token blocks, longest leading
    hit capped at floor((N-1)/16)*16, blocks of prompt + generated tokens registered (all
    but the last token's), LRU eviction of chain tails first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.held: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def chain(ids: list[int]) -> list[int]:
        out, h = [], 0
        for i in range(0, len(ids) - BLOCK + 1, BLOCK):
            h = hash((h, tuple(ids[i : i + BLOCK])))
            out.append(h)
        return out

    def run(self, prompt: list[int], generated: list[int]) -> int:
        hashes = self.chain(prompt)
        hit = 0
        for h in hashes[: (len(prompt) - 1) // BLOCK]:
            if h not in self.held:
                break
            hit += 1
        full = self.chain([*prompt, *generated][:-1])
        for h in reversed(full):
            self.held[h] = None
            self.held.move_to_end(h)
        while len(self.held) > self.capacity:
            self.held.popitem(last=False)
        return hit * BLOCK


def run_sessions(
    router: Router,
    engines: dict[str, Engine],
    sessions: int,
    turns: int,
    seed: int,
    system_words: int = 300,
    report: str = "reply",
) -> list[tuple[int, int]]:
    """Interleaved multi-turn sessions; returns (predicted, delivered) per request."""
    rng = random.Random(seed)
    tok = Tokenizer()
    system = words(rng, system_words)  # one agent's shared system prompt
    convs: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": system}, {"role": "user", "content": words(rng, 80)}]
        for _ in range(sessions)
    ]
    out: list[tuple[int, int]] = []
    now = 0.0
    for _ in range(turns):
        for s, msgs in enumerate(convs):
            now += 0.01
            body = {"model": "m", "messages": msgs}
            states = [ReplicaState(name=n, in_flight=0) for n in engines]
            plan = router.decide(body, "chat", "m", f"s{s}", states, now)
            name = plan.decision.replica
            prompt = tok.encode(render_chat(msgs))
            reply = words(rng, rng.randint(20, 120)).capitalize()
            generated = [*tok.encode(reply), IM_END_ID]
            delivered = engines[name].run(prompt, generated)
            # What the proxy can report: the answer's text, its token count, or neither.
            finish(router,
                plan,
                name,
                len(prompt),
                delivered,
                True,
                now,
                reply_text=reply if report == "reply" else None,
                completion_tokens=len(generated) if report != "usage" else None,
            )
            out.append((plan.decision.predicted_cached_tokens, delivered))
            msgs += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": words(rng, rng.randint(10, 400))},
            ]
    return out


def errors(pairs: list[tuple[int, int]]) -> list[int]:
    return [abs(p - d) for p, d in pairs]


@pytest.mark.parametrize(
    ("replicas", "report"),
    [(1, "reply"), (3, "reply"), (3, "completion_tokens"), (3, "usage")],
)
def test_prediction_within_one_block_after_warm_up(replicas: int, report: str) -> None:
    router = Router(RoutingConfig())
    engines = {f"r{i}": Engine(1_000_000) for i in range(replicas)}
    pairs = run_sessions(router, engines, sessions=6, turns=8, seed=replicas, report=report)
    warm = errors(pairs[12:])
    assert statistics.median(warm) <= BLOCK
    assert sum(e <= BLOCK for e in warm) >= 0.8 * len(warm)
    assert sum(d for _, d in pairs[12:]) > 0.7 * sum(p for p, _ in pairs[12:])


def test_long_prompts_stay_within_one_block() -> None:
    """Multi-thousand-token prompts: anchors keep the error from growing with length."""
    router = Router(RoutingConfig())
    engines = {"r0": Engine(1_000_000)}
    pairs = run_sessions(router, engines, sessions=2, turns=10, seed=5, system_words=2500)
    assert min(d for _, d in pairs[4:]) > 2000
    assert statistics.median(errors(pairs[4:])) <= BLOCK


def test_feedback_converges_on_a_smaller_engine() -> None:
    """The engine holds far less than the configured default (900 blocks = 14k tokens for
    ~30k tokens of conversations): without feedback the index keeps promising evicted
    prefixes; with it the replica's index limit shrinks until predictions follow the engine."""

    def late_errors(feedback: bool) -> tuple[list[int], Router]:
        router = Router(RoutingConfig(default_capacity_tokens=2_000_000, feedback=feedback))
        pairs = run_sessions(
            router, {"r0": Engine(900)}, sessions=12, turns=8, seed=11, system_words=40
        )
        return errors(pairs[-40:]), router

    blind, _ = late_errors(False)
    learned, router = late_errors(True)
    assert statistics.mean(blind) > 500
    assert statistics.mean(learned) < 0.2 * statistics.mean(blind)
    assert statistics.median(learned) <= BLOCK
    assert router.index_limit("r0") < 3 * 900  # index blocks ~ engine blocks at 4 B/token


def test_restart_clears_and_failure_forgets() -> None:
    router = Router(RoutingConfig())
    states = [ReplicaState(name="a", in_flight=0), ReplicaState(name="b", in_flight=0)]
    body = {"messages": [{"role": "user", "content": words(random.Random(1), 400)}]}
    plan = router.decide(body, "chat", "m", None, states, 0.0)
    assert router.indexed_blocks("a") > 0 and router.queued_tokens("a") > 0
    finish(router, plan, "a", None, None, False, 0.1)  # never scheduled
    assert router.indexed_blocks("a") == 0 and router.queued_tokens("a") == 0
    plan = router.decide(body, "chat", "m", None, states, 1.0)
    again = router.decide(body, "chat", "m", None, states, 2.0)
    assert again.decision.replica == "a" and again.decision.reason == "prefix"
    router.replica_restarted("a", 2.5)
    assert router.decide(body, "chat", "m", None, states, 3.0).decision.reason == "cold"
    router.remove_replica("a")
    assert router.indexed_blocks("a") == 0
