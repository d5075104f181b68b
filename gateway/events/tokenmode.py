"""Token mode for the router: the narrow seam between routing and the KV-event index.

Per model, a `TokenRenderer` turns the request into the replica's tokens and block hashes;
the `KVIndex` says how many leading blocks each live replica holds. `lookup` answers only
for replicas whose events are flowing and whose block size the renderer hashes at; the
router keeps its text-mode guess for every other replica (and for models without a
renderer, or bodies the template cannot render), so a replica whose events stop falls
back to text mode and comes back when they resume. Transitions are logged once each.
Pure apart from logging: time is a parameter.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.events.kvindex import KVIndex
from gateway.tokens.render import TokenPrompt, TokenRenderer
from gateway.tokens.template import TemplateError

log = logging.getLogger("gateway.events")


@dataclass(frozen=True, slots=True)
class TokenLookup:
    prompt: TokenPrompt
    matched: Mapping[str, int]  # leading blocks held or predicted, per live replica
    confirmed: Mapping[str, int]  # of those, the leading blocks confirmed by events

    @property
    def prompt_tokens(self) -> int:
        return self.prompt.tokens

    def cached_tokens(self, replica: str) -> int | None:
        """vLLM's hit on that replica: whole blocks, and never the prompt's last token."""
        blocks = self.matched.get(replica)
        if blocks is None:
            return None
        bs = self.prompt.block_size
        cap = max(0, self.prompt_tokens - 1) // bs * bs
        return min(blocks * bs, cap)


class TokenMode:
    def __init__(self, renderers: Mapping[str, TokenRenderer], index: KVIndex) -> None:
        self._renderers = dict(renderers)
        self.index = index
        self._live: dict[str, bool] = {}

    def forget_replica(self, replica: str) -> None:
        """The replica left the fleet: its liveness and its blocks go."""
        self._live.pop(replica, None)
        self.index.remove_replica(replica)

    def models(self) -> list[str]:
        return list(self._renderers)

    def lookup(self, body: Mapping[str, Any], endpoint: Literal["chat", "completions"],
               model: str, replicas: Sequence[str], now: float) -> TokenLookup | None:
        renderer = self._renderers.get(model)
        if renderer is None:
            return None
        live = [r for r in replicas if self._is_live(r, model, renderer.block_size, now)]
        if not live:
            return None
        try:
            prompt = renderer.prompt(body, endpoint)
        except TemplateError:
            return None  # the replica will answer this one; text mode routes it
        leading, hashes = self.index.leading, prompt.hashes
        runs = {r: leading(r, hashes, now) for r in live}
        return TokenLookup(prompt, {r: n for r, (_, n) in runs.items()},
                           {r: c for r, (c, _) in runs.items()})

    def token_ids(self, body: Mapping[str, Any], endpoint: Literal["chat", "completions"],
                  model: str) -> list[int] | None:
        """Every id of the prompt as the model's renderer computes it (P/D's reuse check,
        gateway.pd.pullback), whether or not events flow; None when it cannot render."""
        renderer = self._renderers.get(model)
        if renderer is None:
            return None
        try:
            return renderer.token_ids(body, endpoint)
        except TemplateError:
            return None

    def sent(self, lookup: TokenLookup, replica: str, now: float) -> None:
        if replica in lookup.matched:
            # What the events confirmed at the decision needs no prediction (if the engine
            # evicts and recomputes a block of it, its events say so).
            self.index.predict(replica, lookup.prompt.hashes, now,
                               lookup.confirmed.get(replica, 0))

    def _is_live(self, replica: str, model: str, block_size: int, now: float) -> bool:
        state = self.index.state(replica)
        live = (state is not None and state.model == model and self.index.live(replica, now)
                and state.block_size == block_size)
        if self._live.get(replica, False) != live:
            self._live[replica] = live
            if live:
                log.info("replica %s: KV events flowing, token mode", replica)
            else:
                log.warning("replica %s: no KV events, text mode", replica)
        return live
