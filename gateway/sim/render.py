"""The simulator's prompt rendering as a token-mode renderer: its ChatML template and its
tokenizer, so the gateway can route by the simulated replicas' own KV events."""

from __future__ import annotations

from typing import Any

from gateway.sim.template import render_chat
from gateway.sim.tokenizer import SPECIAL_IDS, Tokenizer
from gateway.tokens.render import TokenRenderer
from gateway.tokens.tokenize import TokenizerCache


class SimTemplate:
    def render(self, messages: list[Any], tools: list[Any] | None = None,
               add_generation_prompt: bool = True) -> str:
        return render_chat(messages, tools, add_generation_prompt)


def sim_renderer(model: str, block_size: int, max_pieces: int = 65536) -> TokenRenderer:
    tokenizer = Tokenizer()
    return TokenRenderer(model, SimTemplate(),
                         TokenizerCache(tokenizer.encode, list(SPECIAL_IDS), max_pieces),
                         block_size)
