"""P/D traffic counts for `/stats` (`pd`): how many requests took two legs, how many a
decode replica served alone and why, which legs failed and how. Every key is a fixed name
(the choice's reasons, the failure classes of gateway.upstream.failure): bounded. With a
`PdMetrics`, each count also goes to its Prometheus family (gateway.pd.metrics)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from gateway.pd.choice import Why
from gateway.pd.metrics import PdMetrics
from gateway.upstream.failure import Happened
from gateway.usage.snapshot import EngineSnapshot

LegFailure = Happened | str  # a failure class, or "no_params" (P answered nothing to pull)
# why D computed a two-leg request's prompt alone after all: every prefill leg failed, or
# every prefill replica was at admission's `replica_max_in_flight` (none was tried)
Alone = Literal["prefill_failed", "prefill_full"]


class PdStats:
    def __init__(self, metrics: PdMetrics | None = None) -> None:
        self.metrics = metrics
        self.two_legs = 0
        self.alone: dict[str, int] = {"cached": 0, "no_prefill": 0, "prefill_failed": 0,
                                      "prefill_full": 0}
        self.prefill_alone = 0  # the decode leg failed before a byte: P answered it all
        self.transferred_tokens = 0
        self.failures: dict[str, dict[str, int]] = {"prefill": {}, "decode": {}}
        # [pd] reuse_decoder_kv: decoder params kept for a next turn, and sent with one
        self.remembered = 0
        self.pulled_back = 0
        # tokens P pulled back from decoders as the gateway reads P's reports (exact or
        # estimated per request: gateway.pd.accounting)
        self.pulled_tokens = 0

    def chose(self, why: Why) -> None:
        if why == "remote":
            return  # counted when the prefill leg succeeded (`transferred`)
        self.alone[why] += 1
        if self.metrics is not None:
            self.metrics.served(why)

    def transferred(self, tokens: int | None) -> None:
        self.two_legs += 1
        self.transferred_tokens += tokens or 0
        if self.metrics is not None:
            self.metrics.leg("prefill", "ok")
            self.metrics.served("two_legs")
            self.metrics.transferred(tokens)

    def decoded(self) -> None:
        """The decode leg's answer was relayed to the client."""
        if self.metrics is not None:
            self.metrics.leg("decode", "ok")

    def leg_failed(self, leg: str, what: LegFailure) -> None:
        per = self.failures[leg]
        per[what] = per.get(what, 0) + 1
        if self.metrics is not None:
            self.metrics.leg(leg, what)

    def decode_alone(self, why: Alone = "prefill_failed") -> None:
        """No prefill leg succeeded (or every P was at admission's cap): D computed the
        prompt itself."""
        self.alone[why] += 1
        if self.metrics is not None:
            self.metrics.served(why)

    def pull_failed(self, what: Happened) -> None:
        self.leg_failed("decode", what)
        self.prefill_alone += 1
        if self.metrics is not None:
            self.metrics.served("prefill_alone")

    def kept(self) -> None:
        """A decoder's params were kept for the conversation's next turn."""
        self.remembered += 1
        if self.metrics is not None:
            self.metrics.reuse("kept")

    def reused(self, hit: bool) -> None:
        """A two-leg request with reuse on: the last turn's params sent (hit) or not."""
        self.pulled_back += hit
        if self.metrics is not None:
            self.metrics.reuse("hit" if hit else "miss")

    def pulled(self, tokens: int) -> None:
        """A prefill leg sent the decoder's params: the tokens P's report shows pulled."""
        self.pulled_tokens += tokens
        if self.metrics is not None:
            self.metrics.pulled(tokens)

    def snapshot(self) -> dict[str, Any]:
        return {"two_legs": self.two_legs, "decode_alone": dict(self.alone),
                "prefill_alone": self.prefill_alone,
                "transferred_tokens": self.transferred_tokens,
                "decoder_kv": {"remembered": self.remembered, "pulled_back": self.pulled_back,
                               "pulled_tokens": self.pulled_tokens},
                "transfer_failures": {k: dict(v) for k, v in self.failures.items()}}


def engine_split(snapshots: Mapping[str, EngineSnapshot | None]) -> dict[str, Any]:
    """The prefill replicas' own split of their cached prompt tokens, as their last scrape
    read it (`vllm:prompt_tokens_by_source`, cumulative since each engine started; None
    where the engine does not export it): `external_kv_transfer` is what a prefill replica
    loaded from elsewhere, i.e. pulled back from decoders; the exact figure that a usage
    record's `pulled_tokens` can only estimate per request (gateway.pd.accounting). One
    entry per prefill replica of the fleet: bounded."""
    return {name: {"local_cache_hit": None if s is None else s.local_cache_hit_tokens_total,
                   "external_kv_transfer": None if s is None else s.external_kv_tokens_total,
                   "engine_started": None if s is None else s.process_start_time_seconds}
            for name, s in sorted(snapshots.items())}
