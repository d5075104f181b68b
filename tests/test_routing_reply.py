"""The router follows a conversation into its generated answer: vLLM caches the tokens it
generated, and the next turn repeats them, so a follow-up's match on the replica that
answered must reach through the reply, not stop where the previous prompt ended."""

from __future__ import annotations

import pytest

from gateway.routing.config import RoutingConfig
from gateway.routing.decision import ReplicaState
from gateway.routing.router import Router
from tests.routing_driver import finish

STATES = [ReplicaState(name="a", in_flight=0), ReplicaState(name="b", in_flight=0)]
SYSTEM = "You are a careful assistant who answers in full sentences. " * 8


def turn(*contents: str) -> dict[str, object]:
    roles = ["user", "assistant"]
    return {"messages": [{"role": "system", "content": SYSTEM},
                         *({"role": roles[i % 2], "content": c} for i, c in enumerate(contents))]}


@pytest.mark.parametrize(("reply", "index_reply"), [
    ("A short answer. " * 8, True), ("A short answer. " * 8, False),
    ("A much longer answer with many words in it. " * 60, True),
    ("A much longer answer with many words in it. " * 60, False),
])
def test_a_follow_up_matches_through_the_indexed_reply(reply: str, index_reply: bool) -> None:
    router = Router(RoutingConfig(seed=1))
    first = router.decide(turn("What is a prefix cache?"), "chat", "m", None, STATES, 0.0)
    served = first.decision.replica
    finish(router, first, served, prompt_tokens=len(first.data) // 4, cached_tokens=0,
                     ok=True, now=0.5, reply_text=reply if index_reply else None,
                     completion_tokens=len(reply) // 4)

    follow = router.decide(turn("What is a prefix cache?", reply, "And why does it miss?"),
                          "chat", "m", None, STATES, 1.0)
    block = router.config.block_bytes
    prompt_blocks = len(first.hashes)
    reply_blocks = len(reply.encode()) // block
    matched = follow.matched[served]
    if index_reply:
        assert matched >= prompt_blocks + reply_blocks - 1  # through the reply
        assert follow.decision.replica == served
    else:
        assert matched <= prompt_blocks  # the reply was never seen: the match ends there
