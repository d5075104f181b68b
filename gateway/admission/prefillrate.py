"""How fast a replica's engine prefills, as its scrapes show it (pure): the rate room.py
prices prefill at (the queued-prefill room, the hold-or-move costs, the drain of a waiting
count) and gate.py's shedding projection floors at.

`PrefillRate`, folded by `learn_rate` from each new scrape: the prompt tokens it
computed between two scrapes (`vllm:prompt_tokens_total` less its prefix-cache hits)
over the time between them. That is what it did, a lower bound on what it can do: while
requests wait in it (both scrapes show a queue) it is its rate (averaged, `RATE_ALPHA`);
otherwise a sample at or above the rate believed raises it (an idle engine computes
little and is not slow for it), starting from the cost model's, and one below it lets it
down by decay only: what the rate believed holds above both that sample and the cost
model's rate halves every `RATE_HALF_LIFE_S` (300 s) of the time the sample spans, so
one high sample (a counter's jump, a slow /metrics answer timed from when it was asked)
is not kept for the engine's life: a rate 10x too high comes within 2x of what later
samples show after 3.2 half-lives (16 min) of samples, and the same for one measured
under a queue once none shows. Never below the cost model's rate by decay (a slow sample
says the engine was not asked for more), and a rate measured below it under a queue
stays. A sample beyond `RATE_MAX_TOKENS_PER_S` (a counter that leapt) is dropped, and so
is one between two scrapes that differ in which counters they show (the prefix-cache hit
counter there at one and not at the other: read as 0, the computed count would leap by
every hit the engine ever had): the later scrape is a new baseline, as after a scrape
without the prompt counter; an engine that never shows the hit counter has all its
prompt tokens counted as computed. Until a sample says more, room.py prices prefill at
the routing cost model's `prefill_s_per_token`.

**Stalled** (`stalled`): two scrapes one after the other showing the same queue or a
longer one and not a prompt token more (`began_nothing`) say the engine began none of
it, unless a prefill in progress explains the flat counter: vLLM adds a request's whole
prompt to `vllm:prompt_tokens_total` only at its first token (no output for a partial
chunked prefill), so a 100k-token prompt at 10k tokens a second keeps the counter flat
for 10 s while the engine works, and the requests behind it wait for the step's budget.
The engine is stalled once the counter has been flat beside a queue (since `flat_since`:
the scrape after which it last moved, or the last one that showed no queue: an idle
spell before a long prompt arrived is no part of it) for longer than the caller's
`prefill_s`, the prefill of the largest prompt it may be working on (fleetview.py: the
largest of this gateway's in flight there, at the engine's rate, or the cost model's
until one is measured, when the allowance is short), and never longer than
`STALL_MAX_S` (30 s) whatever that prices; nothing large in flight, two scrapes suffice.

Folded only from scrapes one after another, as engine.py's capacity is (its module
docstring, "Only from scrapes folded one after another"): a pair further apart than
`max_gap_s` is a new baseline. Bounds: one `PrefillRate` per replica in the fleet
(fleetview.py drops those that left).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# weight of a new saturated sample in the prefill rate (a few scrapes' memory)
RATE_ALPHA = 0.3
# the half-life of a believed prefill rate's excess over what unsaturated samples show
# (and over the cost model's rate): one high sample (a counter's jump, a slow /metrics
# answer) stays believed for minutes, not for the engine's life, and honest samples
# bring a rate 10x too high within 2x in 3.2 half-lives (16 min; the module docstring)
RATE_HALF_LIFE_S = 300.0
# fewer computed tokens than this between two scrapes say nothing of the rate (a request
# or two: their timing within the interval is unknown)
RATE_MIN_TOKENS = 1024.0
# the longest a flat prompt counter beside a standing queue is put down to a prefill in
# progress (`stalled`): the largest prompt in flight may be decoding already, and the
# measured rate slows as an engine starves (few prompts begin), so the window it prices
# is bounded; a 128k-token prompt at 5k tokens a second takes 26 s
STALL_MAX_S = 30.0
# a sample above this many tokens per second is a counter's glitch, not a rate (an
# exporter's jump, a counter summed across processes): no engine prefills ~1M tokens/s,
# and one believed sample would floor the shedding projection at ~0 s (gate.py
# `_projected_s`), so it is dropped and the rate believed stays as it was
RATE_MAX_TOKENS_PER_S = 1_000_000.0


@dataclass(frozen=True, slots=True)
class PrefillRate:
    """How fast an engine was seen to prefill (module docstring); tokens per second."""

    last_ts: float | None = None
    last_computed: float | None = None  # prompt tokens computed (not cache hits) by then
    last_waiting: float = 0.0  # requests waiting at that scrape (0: none, or not shown)
    tokens_per_s: float | None = None  # None: never measured
    last_hits_shown: bool = False  # that scrape showed the cache-hit counter
    last_prompt: float | None = None  # its prompt-token counter
    # that scrape and the one folded before it showed the same queue or a longer one and
    # not a prompt token more: the engine began none of it (module docstring)
    began_nothing: bool = False
    # the scrape since which its prompt-token counter has not moved (None: no counter)
    flat_since: float | None = None

    def stalled(self, prefill_s: float) -> bool:
        """It began nothing (`began_nothing`) and its counter has been flat for longer
        than `prefill_s`, the prefill of the largest prompt it may be working on (module
        docstring, "Stalled")."""
        if not self.began_nothing or self.last_ts is None or self.flat_since is None:
            return False
        return self.last_ts - self.flat_since > min(max(0.0, prefill_s), STALL_MAX_S)

    def s_per_token(self) -> float | None:
        tps = self.tokens_per_s
        return None if tps is None or tps <= 0 else 1.0 / tps


def learn_rate(rate: PrefillRate, ts: float, prompt_total: float | None,
               hits_total: float | None, waiting: float | None,
               default_s_per_token: float, max_gap_s: float = math.inf) -> PrefillRate:
    """Fold one scrape (at `ts`: its prompt-token and cache-hit counters and waiting
    count) into `rate`; `default_s_per_token`: the cost model's, the floor of what an
    unsaturated sample may claim; `max_gap_s`: the longest time from the scrape last
    folded that a sample may span (longer: a new baseline, module docstring)."""
    if ts == rate.last_ts:
        return rate
    if prompt_total is None or not math.isfinite(prompt_total):
        return PrefillRate(tokens_per_s=rate.tokens_per_s)
    shown = hits_total is not None and math.isfinite(hits_total)
    hits = hits_total if hits_total is not None and shown else 0.0
    computed = max(0.0, prompt_total - hits)
    queued = bool(waiting) and waiting is not None and math.isfinite(waiting) and waiting > 0
    now_waiting = waiting if queued and waiting is not None else 0.0
    tps = rate.tokens_per_s
    prev, prev_ts = rate.last_computed, rate.last_ts
    # the hit counter there at one scrape and not at the other: `computed` jumps by every
    # hit the engine ever had (or drops by them), no sample; a new baseline instead
    same = shown == rate.last_hits_shown
    # the scrape last folded and this one are a pair (module docstring: folds far apart)
    paired = prev_ts is not None and 0 < ts - prev_ts <= max_gap_s
    if same and paired and prev is not None and prev_ts is not None and computed >= prev:
        done = computed - prev
        sample = done / (ts - prev_ts)
        if done >= RATE_MIN_TOKENS and sample <= RATE_MAX_TOKENS_PER_S:
            if queued and rate.last_waiting:  # busy throughout: what it can do
                tps = sample if tps is None else tps + RATE_ALPHA * (sample - tps)
            else:  # it did at least this much: raises the rate believed; an excess over
                # this and the cost model's rate decays (module docstring)
                tps = _seen_at_least(tps, sample, 1.0 / default_s_per_token,
                                     ts - prev_ts)
    flat = paired and rate.last_prompt is not None and prompt_total == rate.last_prompt
    stuck = flat and rate.last_waiting > 0 and now_waiting >= rate.last_waiting
    # flat since the scrape before this one, or since earlier when that one was flat
    # beside a queue too: a flat spell without one (idle, or only decoding) is no part of
    # a stall, and a long prompt arriving after it has its whole prefill to show
    chained = flat and rate.last_waiting > 0 and rate.flat_since is not None
    since = rate.flat_since if chained else (prev_ts if flat else ts)
    return PrefillRate(ts, computed, now_waiting, tps, shown, prompt_total, stuck, since)


def _seen_at_least(tps: float | None, sample: float, floor: float, dt: float) -> float:
    """The rate believed after an unsaturated `sample` over `dt` seconds (module
    docstring): raised to it, or what it believed above both it and `floor` (the cost
    model's rate) halved every `RATE_HALF_LIFE_S`; a rate measured below `floor` stays."""
    believed = floor if tps is None else tps
    if sample >= believed:
        return sample
    target = max(sample, floor)
    if believed <= target:
        return believed
    return target + (believed - target) * math.pow(0.5, dt / RATE_HALF_LIFE_S)
