"""One simulated vLLM engine: scheduler + KV pool + step-time model + sampling + stats.

Pure and synchronous; the caller owns time. A step is two calls:

    plan, duration = engine.plan_step(noise)     # schedule; blocks registered now
    ...the caller lets `duration` simulated seconds pass...
    outputs = engine.finish_step(plan, start, end)   # tokens sampled, requests finish

``plan_step`` stamps the first-scheduled time of newly admitted requests with the step's
start; ``finish_step`` samples one token for every request whose known tokens are all
computed (end of its prefill, or a decode), stamps first-token / finish times with the
step's end, and frees finished requests' blocks (in reverse, so tails are evicted first).
Latency histograms, counters and the hit-rate window are updated here, in simulated time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.sim.generator import OutputGenerator
from gateway.sim.hashing import extend_hashes, none_hash
from gateway.sim.hitrate import HitRateWindow
from gateway.sim.kvevents import EventQueue
from gateway.sim.metrics import EngineMetrics, Gauges, NixlStats
from gateway.sim.pool import BlockPool
from gateway.sim.request import SimRequest
from gateway.sim.scheduler import Scheduler, StepPlan
from gateway.sim.steptime import StepTimeModel
from gateway.sim.tokenizer import Tokenizer
from gateway.sim.transfer import Lease, LeaseTable


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    num_gpu_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = 32768
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    output_len: int = 64
    seed: int = 0
    replica: int = 0
    hash_seed: str = "fixed"
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    kv_events: bool = False  # queue vLLM-style KV-cache events (Engine.kv_events)
    # vLLM's --scheduling-policy: `priority` orders the waiting queue by the requests'
    # `priority` (lower first, then arrival); `fcfs` refuses a non-zero priority.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # vLLM's NixlConnector: leases, pulls and the vllm:nixl_* metrics (gateway/sim/connector.py)
    kv_connector: bool = False


@dataclass(slots=True)
class StepOutput:
    """A request that produced a token (``token``) and/or finished in this step."""

    request: SimRequest
    token: int | None


class Engine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        self.kv_events = EventQueue(config.block_size) if config.kv_events else None
        self.pool = BlockPool(config.num_gpu_blocks, self.kv_events)
        self.scheduler = Scheduler(
            self.pool,
            config.block_size,
            none_hash(config.hash_seed, config.seed, config.replica),
            config.max_num_batched_tokens,
            config.max_num_seqs,
            by_priority=config.scheduling_policy == "priority",
        )
        self.generator = OutputGenerator(tokenizer, config.seed, config.output_len)
        self.metrics = EngineMetrics(config.max_model_len)
        self.leases = LeaseTable()
        if config.kv_connector:
            self.metrics.nixl = NixlStats()
        self.hit_rate = HitRateWindow()
        # Since the last log line: computed prompt tokens, generated tokens.
        self.interval_prompt_tokens = 0
        self.interval_generation_tokens = 0

    def new_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int | None,
        arrival: float,
        stop_token: int,
        first_extra: bytes = b"",
        priority: int = 0,
        script: tuple[int, ...] | None = None,
    ) -> SimRequest:
        """Raises ValueError for a non-zero `priority` under the fcfs policy (vLLM's
        processor does, and its server answers 400). `script`: the reply's tokens (a tool
        call), then the stop token, unless max_tokens cuts it."""
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        rng = self.generator.rng_for(prompt_ids)
        cfg = self.config
        # A request must fit the pool on its own, or it would preempt itself forever.
        capacity = (cfg.num_gpu_blocks - 1) * cfg.block_size
        room = min(cfg.max_model_len, capacity) - len(prompt_ids)
        if script is not None:
            natural: int | None = len(script)
        else:
            natural = None if max_tokens is not None else self.generator.natural_len(rng)
        return SimRequest(
            request_id=request_id,
            token_ids=list(prompt_ids),
            num_prompt_tokens=len(prompt_ids),
            max_tokens=max(1, min(room, max_tokens if max_tokens is not None else room)),
            natural_len=natural,
            stop_token=stop_token,
            rng=rng,
            arrival=arrival,
            first_extra=first_extra,
            priority=priority,
            script=script,
        )

    def add(self, req: SimRequest) -> None:
        self.scheduler.add(req)

    def abort(self, req: SimRequest, now: float) -> bool:
        """Abort a waiting or running request; False if it already ended."""
        if req.status not in ("waiting", "running"):
            return False
        self.scheduler.finish(req)
        req.status = "aborted"
        self._finished(req, "abort", now)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def plan_step(self, noise: float, start: float) -> tuple[StepPlan, float]:
        self.expire_leases(start)
        plan = self.scheduler.schedule()
        decode_ctx = prefill = attention = 0
        for req, n in plan.work:
            if n == 1 and req.num_computed >= req.num_prompt_tokens:
                decode_ctx += req.num_computed + 1
            else:
                prefill += n
                end = req.num_computed + n
                attention += end * end - req.num_computed * req.num_computed
                if req.num_computed < req.num_prompt_tokens:
                    self.interval_prompt_tokens += (
                        min(end, req.num_prompt_tokens) - req.num_computed
                    )
        for req in plan.newly_scheduled:
            req.first_scheduled = start
            c = self.metrics.counters
            c.prompt_tokens += req.num_prompt_tokens
            c.prompt_tokens_cached += req.num_cached_tokens
            # Blocks pulled from a peer are external KV, not local prefix-cache hits.
            external = min(req.num_external_tokens, req.num_cached_tokens)
            c.prefix_hits -= external
            c.external_tokens += external
            self.metrics.queue.observe(start - req.arrival)
            self.metrics.prompt_len.observe(req.num_prompt_tokens)
        c = self.metrics.counters
        c.prefix_queries += plan.queried_tokens
        c.prefix_hits += plan.hit_tokens
        c.preemptions += plan.preempted
        self.hit_rate.observe(plan.admitted, plan.queried_tokens, plan.hit_tokens)
        duration = self.config.step_time.duration(decode_ctx, prefill, attention, noise)
        return plan, duration

    def finish_step(self, plan: StepPlan, end: float) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        gen = self.generator
        finished_any = False
        for req, n in plan.work:
            if req.status != "running":
                continue  # aborted while the step was executing
            req.num_computed += n
            if req.num_computed < req.num_tokens:
                continue  # a prefill chunk that does not complete the prompt
            produced = req.num_output_tokens
            natural = req.natural_len
            if natural is not None and produced >= natural:
                token = req.stop_token
            elif req.script is not None:
                token = req.script[produced]
            else:
                previous = req.token_ids[-1] if produced else None
                token = gen.next_token(req.rng, previous)
            req.token_ids.append(token)
            if req.first_token is None:
                req.first_token = end
                self.metrics.ttft.observe(end - req.arrival)
            elif req.last_token is not None:
                self.metrics.itl.observe(end - req.last_token)
            req.last_token = end
            produced += 1
            reason = None
            if token == req.stop_token and natural is not None:
                reason = "stop"
            elif produced >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
                reason = "length"
            if reason is not None:
                if req.hold is not None:
                    self._lease(req, end)
                self.scheduler.release(req)
                req.status = "finished"
                finished_any = True
                self._finished(req, reason, end)
            outputs.append(StepOutput(req, token))
        self.metrics.counters.generation_tokens += len(outputs)
        self.interval_generation_tokens += len(outputs)
        if finished_any:
            self.scheduler.drop_finished()
        return outputs

    # -- KV transfer (the simulated NixlConnector) ----------------------------------------

    def _lease(self, req: SimRequest, now: float) -> None:
        """Keep a finished request's blocks (one more reference each) for a peer to pull."""
        assert req.hold is not None
        self.pool.touch(req.blocks)
        req.lease = Lease(kind=req.hold, request_id=req.request_id, blocks=list(req.blocks),
                          num_tokens=req.num_computed, cached_tokens=req.num_cached_tokens,
                          expires=now + req.hold_s, duration_s=now - req.arrival)
        old = self.leases.add(req.lease)
        if old is not None:
            self.pool.free(reversed(old.blocks))

    def expire_leases(self, now: float) -> None:
        for lease in self.leases.expire(now):
            self.pool.free(reversed(lease.blocks))
            if self.metrics.nixl is not None:
                self.metrics.nixl.expired += 1

    def release_lease(self, lease: Lease) -> None:
        """The peer read the blocks (or gave up): they are ordinary cached blocks again."""
        self.leases.pop(lease)
        self.pool.free(reversed(lease.blocks))

    def cached_prefix(self, ids: list[int], first_extra: bytes) -> int:
        """Tokens of `ids` this engine's prefix cache would serve (whole blocks, at most
        all but the last token, as the scheduler looks them up)."""
        return self.pool_blocks(ids, first_extra, len(ids))[1] * self.config.block_size

    def pool_blocks(self, ids: list[int], first_extra: bytes, upto: int
                    ) -> tuple[list[int], int]:
        """The hashes of the full blocks of `ids[:upto]` (at most all but the last token)
        and how many of them, from the first, the cache holds."""
        bs = self.config.block_size
        hashes: list[int] = []
        extend_hashes(hashes, ids, min(upto, len(ids) - 1) // bs * bs, bs,
                      self.scheduler.none_hash, first_extra)
        held = 0
        for h in hashes:
            if self.pool.lookup(h) is None:
                break
            held += 1
        return hashes, held

    def install(self, ids: list[int], first_extra: bytes, upto: int) -> int:
        """Blocks pulled from a peer enter this prefix cache as if computed here (the same
        hashes, announced as ordinary stores), free and evictable like any cached block,
        so the scheduler finds them as hits. Returns the tokens installed (fewer when the
        pool has no room)."""
        bs = self.config.block_size
        pool = self.pool
        hashes, held = self.pool_blocks(ids, first_extra, upto)
        have = [b for b in map(pool.lookup, hashes[:held]) if b is not None]
        pool.touch(have)  # not evicted by the allocation below
        new = pool.allocate(min(len(hashes) - held, pool.num_free))
        for block, h in zip(new, hashes[held:], strict=False):
            pool.cache(block, h)
        if new and pool.events is not None:
            pool.events.stored(hashes[held:held + len(new)], hashes[held - 1] if held else None,
                               ids[held * bs:(held + len(new)) * bs], first_extra)
        pool.free(reversed(have + new))
        return len(new) * bs

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset():
            return False
        self.hit_rate.reset()
        return True

    def gauges(self) -> Gauges:
        return Gauges(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_usage=self.pool.usage(),
            num_gpu_blocks=self.config.num_gpu_blocks,
            block_size=self.config.block_size,
        )

    def _finished(self, req: SimRequest, reason: str, now: float) -> None:
        req.finished = now
        req.finish_reason = reason  # type: ignore[assignment]
        m = self.metrics
        m.counters.success[reason] = m.counters.success.get(reason, 0) + 1
        if reason != "abort":
            m.e2e.observe(now - req.arrival)
            m.generation_len.observe(req.num_output_tokens)
