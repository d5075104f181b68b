"""P/D traffic counts for `/stats` (`pd`): how many requests took two legs, how many a
decode replica served alone and why, which legs failed and how. Every key is a fixed name
(the choice's reasons, the failure classes of gateway.upstream.failure): bounded."""

from __future__ import annotations

from typing import Any

from gateway.pd.choice import Why
from gateway.upstream.failure import Happened

LegFailure = Happened | str  # a failure class, or "no_params" (P answered nothing to pull)


class PdStats:
    def __init__(self) -> None:
        self.two_legs = 0
        self.alone: dict[str, int] = {"cached": 0, "no_prefill": 0, "prefill_failed": 0}
        self.prefill_alone = 0  # the decode leg failed before a byte: P answered it all
        self.transferred_tokens = 0
        self.failures: dict[str, dict[str, int]] = {"prefill": {}, "decode": {}}
        # [pd] reuse_decoder_kv: decoder params kept for a next turn, and sent with one
        self.remembered = 0
        self.pulled_back = 0

    def chose(self, why: Why) -> None:
        if why == "remote":
            return  # counted when the prefill leg succeeded (`transferred`)
        self.alone[why] += 1

    def transferred(self, tokens: int | None) -> None:
        self.two_legs += 1
        self.transferred_tokens += tokens or 0

    def leg_failed(self, leg: str, what: LegFailure) -> None:
        per = self.failures[leg]
        per[what] = per.get(what, 0) + 1

    def decode_alone(self) -> None:
        """No prefill leg succeeded: D computed the prompt itself."""
        self.alone["prefill_failed"] += 1

    def pull_failed(self, what: Happened) -> None:
        self.leg_failed("decode", what)
        self.prefill_alone += 1

    def snapshot(self) -> dict[str, Any]:
        return {"two_legs": self.two_legs, "decode_alone": dict(self.alone),
                "prefill_alone": self.prefill_alone,
                "transferred_tokens": self.transferred_tokens,
                "decoder_kv": {"remembered": self.remembered, "pulled_back": self.pulled_back},
                "transfer_failures": {k: dict(v) for k, v in self.failures.items()}}
