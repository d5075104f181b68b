"""One simulated replica's NixlConnector: the prefill and decode legs of P/D serving.

`gateway sim --role prefill|decode` gives a replica the connector (vLLM's `kv_both`, as
the real recipe runs P and D alike: the router decides each request's leg); `both`, the
default, is a replica without one, which ignores `kv_transfer_params` as vLLM does.

`admit` runs before a request enters the engine:
- prefill leg (`do_remote_decode`): the blocks are kept on a lease once computed; when
  the params name a decoder's KV (bidirectional, the next turn), the missing part is
  pulled from it first if it is more than the recompute threshold;
- decode leg (`do_remote_prefill`): the prompt's KV is pulled from P's lease; an engine
  this process does not hold, or a lease that is gone, fails the request (the policy
  "fail"); with `bidirectional` the answer's blocks are leased for the next turn.
P's lease lasts `lease_s` wall seconds (the router's round trip is not scaled by the
simulator's speed); D's `decoder_ttl_s` is simulated time (it spans a client's gap between
turns, which benchmarks scale with the speed). A pull takes `seconds_per_token` of
simulated time per token moved (the request's arrival is dated that much earlier, so its
TTFT includes the modelled time, not the event loop's), puts the blocks in this engine's
prefix cache with the same hashes (announced as ordinary stores), releases the peer's
lease and is timed in the puller's `vllm:nixl_xfer_time_seconds`.

Peers find each other through a `KvFabric`: the connectors of one simulator process by
engine id (NIXL's side channel, in-process). P and D must run in one `gateway sim`.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from gateway.sim.replica import Replica
from gateway.sim.request import SimRequest
from gateway.sim.transfer import KvTransfer, LeaseKind, TransferConfig, answer_params, plan_pull

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")


class PullFailed(Exception):
    """The KV could not be loaded (vLLM with kv_load_failure_policy "fail")."""


class KvFabric:
    """The connectors of one process, by engine id. Bound: one per replica."""

    def __init__(self) -> None:
        self._by_id: dict[str, KvConnector] = {}

    def add(self, connector: KvConnector) -> None:
        self._by_id[connector.engine_id] = connector

    def get(self, engine_id: str) -> KvConnector | None:
        return self._by_id.get(engine_id)


@dataclass(frozen=True, slots=True)
class Admission:
    """What `admit` decided for one request."""

    transfer_s: float = 0.0  # the pull's simulated time: the arrival is that much earlier
    hold: LeaseKind | None = None
    hold_s: float = 0.0
    external_tokens: int = 0  # pulled from a peer
    reported_cached: int | None = None
    remote_prefill_s: float = 0.0  # the prefill leg's time on P (a decode leg's timing)

    def apply(self, req: SimRequest) -> None:
        """Give the engine's request what the connector decided (its arrival was dated
        `transfer_s` earlier by the caller)."""
        req.hold, req.hold_s = self.hold, self.hold_s
        req.num_external_tokens = self.external_tokens
        req.reported_cached = self.reported_cached
        req.remote_prefill_s = self.remote_prefill_s


class KvConnector:
    def __init__(self, replica: Replica, fabric: KvFabric, config: TransferConfig, *,
                 role: Role, host: str, port: int, usage_from_prefill: bool = True) -> None:
        self.replica = replica
        self.fabric = fabric
        self.config = config
        self.role = role
        self.host = host
        self.port = port
        # vLLM >= 0.32 reports P's cached count on D; older engines the pulled prompt.
        self.usage_from_prefill = usage_from_prefill
        self.engine_id = str(uuid.uuid4())  # a new one per start, as vLLM's
        fabric.add(self)

    async def admit(self, kv: KvTransfer, ids: list[int], salt: bytes) -> Admission:
        """Raises PullFailed when a decode leg (or a prefill leg naming a decoder's KV)
        cannot load what it names."""
        cfg = self.config
        if kv.do_remote_prefill:
            local = self.replica.engine.cached_prefix(ids, salt)
            pulled, prefill_s = await self._pull(kv, ids, salt, threshold=0,
                                                 always_release=True)
            reported = None
            if self.usage_from_prefill:
                reported = max(local, kv.remote_prefill_cached_tokens or 0)
            return Admission(pulled * cfg.seconds_per_token,
                             "decoder" if cfg.bidirectional else None, cfg.decoder_ttl_s,
                             pulled, reported, prefill_s)
        if kv.do_remote_decode:
            pulled = 0
            if kv.names_remote:
                pulled, _ = await self._pull(kv, ids, salt, threshold=cfg.recompute_threshold,
                                             always_release=False)
            # The lease covers the router's round trip between the legs, which the
            # simulator's speed does not shorten: wall seconds, in simulated time.
            return Admission(pulled * cfg.seconds_per_token, "prefill",
                             cfg.lease_s * self.replica.speed, pulled)
        return Admission()

    def answer(self, req: SimRequest) -> dict[str, Any] | None:
        """The answer's `kv_transfer_params` (None: the JSON null vLLM sends)."""
        if req.lease is None:
            return None
        return answer_params(req.lease, self.engine_id, self.host, self.port)

    async def _pull(self, kv: KvTransfer, ids: list[int], salt: bytes, *, threshold: int,
                    always_release: bool) -> tuple[int, float]:
        """The tokens pulled and the leased request's time on its engine."""
        engine = self.replica.engine
        nixl = engine.metrics.nixl
        source = self.fabric.get(kv.remote_engine_id or "")
        lease = None
        if source is not None and kv.remote_request_id is not None:
            lease = source.replica.engine.leases.peek(kv.remote_request_id,
                                                      source.replica.now())
        if source is None or lease is None:
            if nixl is not None:
                nixl.failed += 1
            what = "engine" if source is None else "request"
            raise PullFailed(f"KV load failed: remote {what} not found or its lease expired "
                             f"(remote_engine_id {kv.remote_engine_id!r}, "
                             f"remote_request_id {kv.remote_request_id!r})")
        plan = plan_pull(engine.cached_prefix(ids, salt), lease.num_tokens,
                         kv.remote_num_tokens, len(ids), threshold)
        if plan is None:
            if always_release:
                source.replica.engine.release_lease(lease)
                source.replica.wake()
            return 0, lease.duration_s
        source.replica.engine.leases.pop(lease)  # ours now: it cannot expire under us
        seconds = plan.tokens * self.config.seconds_per_token
        try:
            if seconds > 0:
                await asyncio.sleep(seconds / self.replica.speed)
            engine.install(ids, salt, plan.upto)
        finally:
            source.replica.engine.pool.free(reversed(lease.blocks))
            source.replica.wake()  # its waiting requests may fit now
        if nixl is not None:
            nixl.xfer_time.observe(seconds)
        return plan.tokens, lease.duration_s
