"""Token mode for the gateway ([tokens]): each model's renderer, the KV-event index, the
router's `TokenMode` seam and the event feeds, built at start-up (the feeds then follow the
fleet: gateway.events.feeds).

Renderers read files (tokenizer, chat template): they are built off the event loop, once.
A model value of `sim` is the simulator's own template and tokenizer, built by a
`SimRenderer` the composition root (`serve.py`) hands in: the proxy never imports the
simulator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gateway.events.config import SIM, TokenSettings
from gateway.events.feeds import EventFeeds, FeedTarget
from gateway.events.kvindex import KVConfig, KVIndex
from gateway.events.tokenmode import TokenMode
from gateway.extras import require
from gateway.replicas.fleet import Fleet
from gateway.settings import ReplicaSettings, Settings
from gateway.tokens.render import TokenRenderer
from gateway.tokens.template import load_template
from gateway.tokens.tokenize import TokenizerCache

__all__ = [
    "EventFeeds",
    "SimRenderer",
    "TokenModeParts",
    "TokenModelError",
    "load_renderers",
    "require_token_mode",
    "start_token_mode",
]


class TokenModelError(ValueError):
    pass


# (model, block_size, tokenizer cache pieces) -> the simulator's renderer for that model.
SimRenderer = Callable[[str, int, int], TokenRenderer]


@dataclass(frozen=True, slots=True)
class TokenModeParts:
    mode: TokenMode
    feeds: EventFeeds


def require_token_mode(settings: TokenSettings) -> None:
    """Raise MissingExtra, naming the `kv` extra, when token mode is configured without it."""
    if not settings.enabled:
        return
    for module in ("zmq", "msgspec"):
        require(module, extra="kv", feature="token mode (KV events)")
    if any(where != SIM for where in settings.models.values()):
        for module in ("tokenizers", "jinja2"):
            require(module, extra="kv", feature="token mode")


def load_renderers(settings: TokenSettings, sim_renderer: SimRenderer | None = None
                   ) -> dict[str, TokenRenderer]:
    out: dict[str, TokenRenderer] = {}
    for model, where in settings.models.items():
        if where == SIM:
            if sim_renderer is None:
                raise TokenModelError(f"tokens.models[{model!r}] = {SIM!r}: the simulator's "
                                      "renderer was not supplied")
            out[model] = sim_renderer(model, settings.block_size,
                                      settings.tokenizer_cache_pieces)
            continue
        root = Path(where)
        tokenizer = root / "tokenizer.json"
        if not tokenizer.is_file():
            raise TokenModelError(f"tokens.models[{model!r}]: no tokenizer.json in {where}")
        try:
            template = load_template(root)
        except ValueError as exc:
            raise TokenModelError(f"tokens.models[{model!r}]: {exc}") from exc
        out[model] = TokenRenderer(
            model, template,
            TokenizerCache.from_file(tokenizer, settings.tokenizer_cache_pieces),
            settings.block_size)
    return out


def feed_target(replica: ReplicaSettings) -> FeedTarget:
    """A replica as its KV-event feed sees it."""
    return FeedTarget(replica.name, replica.url, replica.api_key, replica.kv_events_endpoint,
                      replica.kv_events_replay_endpoint)


async def start_token_mode(settings: Settings, fleet: Fleet, clock: Callable[[], float],
                           sim_renderer: SimRenderer | None = None) -> TokenModeParts | None:
    """The token-mode parts for `settings.tokens`, or None when it is off. The feeds are
    built, not started: the caller starts them once the fleet's models are being read."""
    cfg = settings.tokens
    if not cfg.enabled:
        return None
    require_token_mode(cfg)
    renderers = await asyncio.to_thread(load_renderers, cfg, sim_renderer)
    index = KVIndex(KVConfig(predict_ttl_s=cfg.predict_ttl_s, stale_after_s=cfg.stale_after_s,
                             stale_requests=cfg.stale_requests))
    targets = [feed_target(r) for r in settings.replicas]

    def models_of(name: str) -> frozenset[str] | None:
        replica = fleet.replicas.get(name)
        return replica.models if replica is not None else None

    feeds = EventFeeds(cfg, renderers, index, targets, models_of, clock)
    return TokenModeParts(TokenMode(renderers, index), feeds)
