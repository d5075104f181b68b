"""One request's state inside a simulated engine (the engine's view, not HTTP's).

Times are simulated seconds on the replica's virtual clock. ``token_ids`` holds the prompt
followed by every generated token (vLLM's ``all_token_ids``); blocks are hashed over it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from gateway.sim.pool import KVBlock
from gateway.sim.transfer import Lease, LeaseKind

Status = Literal["waiting", "running", "finished", "aborted"]
FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    # Natural end: generate this many tokens then the stop token (None = run to max_tokens).
    natural_len: int | None
    stop_token: int
    rng: random.Random
    arrival: float
    first_extra: bytes = b""
    priority: int = 0  # with the priority policy: lower is scheduled first
    every_extra: bytes = b""
    # Scripted reply (a tool call's tokens): generated in this order, then the stop token.
    script: tuple[int, ...] | None = None
    status: Status = "waiting"
    block_hashes: list[int] = field(default_factory=list)
    blocks: list[KVBlock] = field(default_factory=list)
    num_computed: int = 0
    num_cached_blocks: int = 0  # blocks of `blocks` already registered in the cache map
    num_cached_tokens: int = -1  # prefix hit at first scheduling; -1 = not yet scheduled
    num_preemptions: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    finish_reason: FinishReason | None = None
    # KV transfer (gateway/sim/transfer.py): keep the blocks on a lease of this kind for
    # `hold_s` after finishing; the lease, once made; tokens pulled from a peer; the cached
    # count usage reports when it is not the engine's own (vLLM >= 0.32 on a decode leg).
    hold: LeaseKind | None = None
    hold_s: float = 0.0
    lease: Lease | None = None
    num_external_tokens: int = 0
    reported_cached: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def usage_cached(self) -> int:
        return self.num_cached_tokens if self.reported_cached is None else self.reported_cached

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
