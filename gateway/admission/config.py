"""Admission knobs (`[admission]` in the TOML config, `GATEWAY_ADMISSION__*` in the
environment).

Units: waits in seconds, queue bounds in requests, shares in prompt tokens (the gateway's
estimate of each request's prompt). Every bound here is what keeps the gateway's own queue
finite: `max_queue` requests at most, each for at most its class's `*_max_wait_s`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Priority = Literal["high", "normal", "low"]
CLASSES: tuple[Priority, ...] = ("high", "normal", "low")


@dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    # Off by default: with it off every request goes to a replica at once, as before
    # (docs/concepts/admission.md says why).
    enabled: bool = False
    # Requests waiting in the gateway, all classes together; a newcomer beyond it displaces
    # the youngest waiter of a lower class, else it is shed (429, `queue_full`).
    max_queue: int = 1024
    # Longest wait per class: a waiter still queued then is shed (429, `wait_timeout`), and
    # a newcomer whose projected wait exceeds it is shed at once (429, `wait_limit`).
    high_max_wait_s: float = 10.0
    normal_max_wait_s: float = 30.0
    low_max_wait_s: float = 60.0
    # Shares between classes, in prompt tokens admitted while several classes wait:
    # weighted, not strict, so `low` always progresses.
    high_weight: float = 16.0
    normal_weight: float = 4.0
    low_weight: float = 1.0
    # Shares between tenants within a class (tenant -> weight; others weigh 1).
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    # The highest class a tenant may ask for (tenant -> class); a request asking more is
    # lowered to the cap. Tenants not named get `default_priority_cap`.
    priority_caps: Mapping[str, Priority] = field(default_factory=dict)
    default_priority_cap: Priority = "normal"
    # Room on a replica (room.py): its engine's own signals (the last scrape's running and
    # waiting requests and KV usage, plus what this gateway sent there since), so no
    # engine setting needs copying here. Optional cap on this gateway's requests there
    # (0: none; what the engine runs at once is learned from its scrapes).
    replica_max_in_flight: int = 0
    replica_max_queued_prefill_tokens: int = 32_768  # four steps of vLLM's 8192-token budget
    kv_usage_limit: float = 0.97  # last scraped vllm:kv_cache_usage_perc
    # A scrape older than this many `usage.scrape_interval_s` (a failed one, say) is not
    # used: room comes from the gateway's own counts until a scrape succeeds again.
    stale_after_scrapes: float = 3.0
    # The share of the sequences (the engine's, and the cap when set) `normal` and `low`
    # may fill; the rest is kept for `high`, so a high request meets a free sequence, not
    # an engine queue (vLLM schedules first come, first served unless started with
    # --scheduling-policy priority).
    lower_class_room: float = 0.75
    # The share of the queued-prefill room they may fill: what a request admitted now
    # finds in front of it in the engine (vLLM runs the prefill of requests already
    # running before a newcomer's, whatever its priority), so `high` and a tenant that
    # just arrived meet at most this much of the others' prefill.
    lower_class_prefill_room: float = 0.5
    # A tenant that took more than this multiple of its weighted share of its class's
    # recently admitted prompt tokens is shed at once (429, `tenant_share`) while another
    # tenant of the class waits; one below its share by the same factor keeps its place
    # when a replica frees (dispatch.py, `owed`); "recently": decayed with this half-life.
    over_share: float = 1.25
    share_half_life_s: float = 5.0
    # Late binding: a request waits for the replica holding most of its prefix, while
    # others have room, only while the estimated wait is below the prefill it saves, and
    # at most this long.
    own_replica_max_wait_s: float = 2.0
    # A follow-up whose own replica is full by the queued-prefill room alone goes there
    # anyway, when that costs less than moving or holding, while the prefill queued there
    # stays below this multiple of the room (room.py `bind`, "past"; 1: never).
    own_replica_past_room: float = 2.0
    # How often waiters are re-examined besides the wake-ups from finished requests (a
    # first token frees queued prefill without a call into the gate).
    recheck_s: float = 0.005
    # Replicas started with `--scheduling-policy priority`: requests to them carry the
    # class as vLLM's `priority` (only when every replica the request may try has it;
    # vLLM refuses a non-zero priority otherwise).
    priority_replicas: tuple[str, ...] = ()
    # Agent programs between tool calls (gateway.agents.reserve): while a program runs a
    # tool, its last turn's context is held on its replica (counted in that replica's KV
    # usage for everyone else) while its expected remaining wait is below the prefill of
    # that context, at most this many seconds after its turn ended (the vLLM Router's
    # proposal caps its hold at 10 s too). 0: no reservation.
    agent_reserve_max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ValueError("admission.max_queue must be >= 1")
        for name in ("high_max_wait_s", "normal_max_wait_s", "low_max_wait_s",
                     "high_weight", "normal_weight", "low_weight", "recheck_s",
                     "replica_max_queued_prefill_tokens", "stale_after_scrapes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"admission.{name} must be positive")
        if self.replica_max_in_flight < 0:
            raise ValueError("admission.replica_max_in_flight must be >= 0 (0: no cap)")
        # TOML spells `inf` and `nan`: inf lifts the bound that keeps overload in this
        # queue (room.py "past"), nan fails every comparison and turns it off unseen
        if not (math.isfinite(self.own_replica_past_room)
                and self.own_replica_past_room >= 1):
            raise ValueError("admission.own_replica_past_room must be a finite number >= 1 "
                             "(1: never)")
        if not 0 <= self.agent_reserve_max_s <= 600:
            raise ValueError("admission.agent_reserve_max_s must be in [0, 600] (0: off)")
        if self.own_replica_max_wait_s < 0:
            raise ValueError("admission.own_replica_max_wait_s must be >= 0")
        for name in ("lower_class_room", "lower_class_prefill_room"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"admission.{name} must be in (0, 1]")
        if self.over_share < 1:
            raise ValueError("admission.over_share must be >= 1")
        if self.share_half_life_s <= 0:
            raise ValueError("admission.share_half_life_s must be positive")
        if not 0 < self.kv_usage_limit <= 1:
            raise ValueError("admission.kv_usage_limit must be in (0, 1]")
        for tenant, weight in self.tenant_weights.items():
            if weight <= 0:
                raise ValueError(f"admission.tenant_weights: {tenant!r} must weigh > 0")

    def max_wait_s(self, cls: Priority) -> float:
        return {"high": self.high_max_wait_s, "normal": self.normal_max_wait_s,
                "low": self.low_max_wait_s}[cls]

    def class_weight(self, cls: Priority) -> float:
        return {"high": self.high_weight, "normal": self.normal_weight,
                "low": self.low_weight}[cls]

    def tenant_weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)
