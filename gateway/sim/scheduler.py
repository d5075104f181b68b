"""Continuous-batching scheduler of one simulated engine (vLLM V1 ``Scheduler``, simplified).

One call to ``schedule()`` plans one engine step within a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``):
1. Running requests first, in admission order: each gets its remaining prefill (chunked to
   the budget) or one decode token. If its new blocks cannot be allocated, the newest
   running request is preempted (blocks freed, progress dropped, put back at the head of
   the waiting queue) until it fits or it was itself the victim.
2. Then, only if nothing was preempted this step, waiting requests in FCFS order: look up
   the longest run of cached block hashes (capped at ``num_tokens - 1`` tokens, whole
   blocks), touch the hit blocks, allocate the rest of this step's chunk. The first request
   that does not fit stops admission (no skipping ahead).
Every block that is full after the step's tokens is registered in the prefix-cache map at
scheduling time, so a request admitted later can hit blocks still being prefilled.

A request's ``num_cached_tokens`` and the prefix-cache query/hit counters are set at its
first admission only (re-admission after preemption does not count), as in vLLM 0.33.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gateway.sim.hashing import extend_hashes
from gateway.sim.pool import BlockPool, KVBlock
from gateway.sim.request import SimRequest


@dataclass(slots=True)
class StepPlan:
    """What one step computes: (request, new tokens) pairs plus the step's admission stats."""

    work: list[tuple[SimRequest, int]] = field(default_factory=list)
    admitted: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    preempted: int = 0
    newly_scheduled: list[SimRequest] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        none_hash: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        by_priority: bool = False,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.none_hash = none_hash
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.by_priority = by_priority
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []

    def add(self, req: SimRequest) -> None:
        """Queue `req`: at the end (fcfs), or (priority policy, vLLM's `--scheduling-policy
        priority`) after every waiting request of the same or a lower `priority` value."""
        waiting = self.waiting
        if not self.by_priority or not waiting or waiting[-1].priority <= req.priority:
            waiting.append(req)
            return
        at = next(i for i, w in enumerate(waiting) if w.priority > req.priority)
        waiting.insert(at, req)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_new = min(req.num_tokens - req.num_computed, budget)
            while not self._allocate(req, req.num_computed + num_new, []):
                victim = running.pop()
                self._preempt(victim)
                plan.preempted += 1
                if victim is req:
                    break
            if req.status != "running":
                break
            plan.work.append((req, num_new))
            budget -= num_new
            i += 1
        if plan.preempted:
            return plan
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            req = waiting[0]
            hits = self._longest_hit(req)
            num_hit = len(hits) * self.block_size
            num_new = min(req.num_tokens - num_hit, budget)
            if not self._allocate(req, num_hit + num_new, hits):
                break
            waiting.popleft()
            running.append(req)
            req.status = "running"
            req.num_computed = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                plan.admitted += 1
                plan.queried_tokens += req.num_prompt_tokens
                plan.hit_tokens += num_hit
                plan.newly_scheduled.append(req)
            plan.work.append((req, num_new))
            budget -= num_new
        return plan

    def finish(self, req: SimRequest) -> None:
        """Release a finished or aborted request's blocks (it must not be scheduled again)."""
        if req.status == "waiting":
            self.waiting.remove(req)
        elif req.status == "running":
            self.running.remove(req)
        self.release(req)

    def drop_finished(self) -> None:
        self.running = [r for r in self.running if r.status == "running"]

    def _longest_hit(self, req: SimRequest) -> list[KVBlock]:
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        if max_blocks <= 0:
            return []
        extend_hashes(
            req.block_hashes,
            req.token_ids,
            max_blocks * bs,
            bs,
            self.none_hash,
            req.first_extra,
            req.every_extra,
        )
        hits: list[KVBlock] = []
        lookup = self.pool.lookup
        for h in req.block_hashes[:max_blocks]:
            b = lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _allocate(self, req: SimRequest, total_tokens: int, hits: list[KVBlock]) -> bool:
        """Give req blocks for ``total_tokens`` tokens (touching ``hits`` first); register the
        blocks that are full once those tokens are computed. False if the pool is short."""
        bs = self.block_size
        pool = self.pool
        have = len(req.blocks) + len(hits)
        need_new = max(0, -(-total_tokens // bs) - have)
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if need_new + evictable_hits > pool.num_free:
            return False
        if hits:
            pool.touch(hits)
            req.blocks.extend(hits)
            req.num_cached_blocks = len(req.blocks)
        if need_new:
            req.blocks.extend(pool.allocate(need_new))
        full = min(total_tokens, req.num_tokens) // bs
        if full > req.num_cached_blocks:
            extend_hashes(
                req.block_hashes,
                req.token_ids,
                full * bs,
                bs,
                self.none_hash,
                req.first_extra,
                req.every_extra,
            )
            hashes = req.block_hashes
            blocks = req.blocks
            for j in range(req.num_cached_blocks, full):
                pool.cache(blocks[j], hashes[j])
            if pool.events is not None:
                first = req.num_cached_blocks
                pool.events.stored(hashes[first:full], hashes[first - 1] if first else None,
                                   req.token_ids[first * bs : full * bs], req.first_extra)
            req.num_cached_blocks = full
        return True

    def _preempt(self, req: SimRequest) -> None:
        self.release(req)
        req.status = "waiting"
        req.num_computed = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def release(self, req: SimRequest) -> None:
        """Free req's blocks, deepest first; the caller takes it out of the queues."""
        if req.blocks:
            self.pool.free(reversed(req.blocks))
            req.blocks = []
        req.num_cached_blocks = 0
