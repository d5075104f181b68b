"""What a replica's engine says about its own room (pure): its last scraped
`vllm:num_requests_running` / `vllm:num_requests_waiting` / KV usage, how old that scrape
is, what the engine has shown it can run, and what this gateway sent or finished since.

- **Fresh or stale.** A scrape older than `max_age_s` (or none) is not used: the room comes
  from the gateway's own counts (`source = "gateway"`), so a failed scrape can never freeze
  the gate with the last load it saw (a KV usage of 0.98 kept for ever, say). Nor is a
  scrape dated after now (`now` and `Scrape.ts` are both the wall clock, which stepped
  back since: NTP, a VM resumed): read as age 0 it would stay fresh for as long as the
  step, the same freeze; it is stale until the next scrape, dated on the clock as it is.
- **Occupancy now** = running + waiting at the scrape + (this gateway's requests there now
  - its requests there when the scrape was taken): between scrapes the gateway adds what it
  sent and takes off what finished; load from other clients shows in the scraped counts.
  **KV usage now**, the same way: the scraped usage + (the prompt tokens of this
  gateway's requests there now - of those there when the scrape was asked for) / the
  engine's KV capacity in tokens (`view`'s `pinned_now`, `capacity_tokens`; unchanged
  when either is unknown), never below 0. A request holds its prompt's blocks until it
  ends: read as scraped, a usage of 0.98 kept a replica "full" for the scrape interval
  after its requests had finished (an idle engine beside a queue), and a burst sent
  between two scrapes at 0.5 filled the cache unseen, its last requests waiting in the
  engine for blocks (issue 36, bench/results/admission.md). The estimate counts each
  request's whole prompt (blocks shared by two running requests are pinned once: it errs
  towards full) and not the tokens decoded since (a few blocks a request). What the
  scrape was asked for with counts only what held blocks then (`pinned_at_scrape`):
  beside a KV usage of `KV_QUEUE_USAGE` (0.9) or more, not the requests the scrape shows
  waiting (the youngest of this gateway's sent before it: vLLM admits first come, first
  served), which may wait for blocks and take those a finish frees (read as freed, a
  full cache under a queue passed for one with room at every finish); below it they
  wait for a step's budget or a sequence and hold their blocks a step later, so they
  count as held (left out there too, the agent preset's p99 at 4x rose by a third:
  bench/results/admission.md). A request the router's ledger stopped tracking (its
  sweep, after `routing.pending_ttl_s`) stays counted on both sides: no end was seen.
  Waiting now = the scraped waiting less what finished since (a finish lets one in), less
  what the engine has begun since at its own pace (`drain_s`, below).
- **Waiting is a fact about the moment of the scrape**, not about the interval until the
  next one (5 s by default): vLLM takes a waiting request in as soon as a step has token
  budget, a free sequence and KV blocks for it, so a request seen waiting behind another's
  long prefill has begun a few steps later. The caller prices what it takes the engine to
  begin one waiting request (`drain_s`: a prompt's prefill at the engine's rate, room.py's
  cost model), and each `drain_s` of the scrape's age takes one off the waiting count.
  What that does not cover keeps holding: requests waiting for a sequence (they stay in
  the occupancy, counted against the limit, learnt or guessed), and a full KV cache (its
  usage, room.py, which steers rather than holds while no `high` comes: one request at
  a time goes to an engine whose cache is full). Nor is a queue drained that the
  engine shows it does not move: two
  scrapes folded one after the other (at most `max_gap_s` apart, below) showing the
  same waiting count or more and its prompt-token counter flat (not a prompt token
  prefilled: a stalled engine, or running requests only decoding while the waiting
  wait for KV blocks or a sequence) say it began none of them once the counter has been
  flat for longer than the prefill of the largest prompt in flight there (vLLM counts a
  prompt only at its first token: prefillrate.py `PrefillRate.stalled`), and the
  scraped waiting count stands until a finish or the next scrape (`drain_s` inf). One
  scrape showing a queue drains as above: it is a fact about its moment.
- **What it can run** (`Capacity`, learned by `learn` from each new scrape): vLLM does
  not export `max_num_seqs`, but it shows it: the running count stays at it while
  requests wait. Scrapes that show requests waiting and the same running count (at least
  the most it was ever seen running) for `SATURATION_S` fix that count as its limit;
  shorter does not (a request that arrived just before a scrape waits for the next step;
  long prompts wait for the token budget while the running count grows, a step at a
  time). Learned from any scrape, fresh or not: it is the engine's configuration, not its
  load; once learned it stays until the engine restarts (it may come back with another
  `--max-num-seqs`) or its replica leaves the fleet, when fleetview.py starts learning
  afresh, or until it is refuted: a learnt limit that no scrape has confirmed (a queue
  beside that running count) for `PROBE_AFTER_S` (60 s) is offered one more sequence
  (`Capacity.probing`): a queue beside it confirms the limit (another 60 s before the
  next probe), and a scrape showing the engine running more than it drops it, back to
  the guess below, which doubles from there and learns the real limit at its queue.
  Without the probe a limit learnt from a coincidence (long prompts waiting for the
  token budget while the gateway kept the occupancy flat) held the gateway there for
  the engine's life, since held there the engine never showed more. A probe that finds
  the limit real costs one request in the engine's queue, once a minute at most. A
  class whose share of the limit (gate.py) stays below it never fills the probe: while
  only `low` comes, a limit learnt too low stands.
  A queue seen beside a KV usage of `KV_QUEUE_USAGE` (0.9) or more teaches no limit (nor
  keeps the clock of one going): it may be waiting for cache blocks, not for a sequence,
  and learnt it held the gateway to that count for the engine's life, where the KV usage
  limit (room.py) already governs it while the cache is full (holds, or sends one
  request at a time). A queue held by the cache
  below that usage (one prompt longer than what is left) can still pass for a limit,
  until a probe refutes it.
- **Until then a guess binds, always**: `max(PROBE_SEQS, 2 x the most the engine has
  shown it takes in)`. What it has shown is the most it was seen running, and, at a
  scrape showing nothing waiting, what this gateway had in flight there when that scrape
  was asked for (`Scrape.own_at_scrape`): none of it waited, so the engine took it all
  in (`Capacity.most_taken`). A scrape with nothing waiting says only that the engine
  took what it had at that moment, not what a burst arriving before the next scrape
  (5 s by default) would find: an engine's own queue is first come, first served, so
  requests sent past its room wait there beside the classes above them and priorities
  no longer hold. Held to twice what it took, a burst sends at most that; under
  sustained load the gateway fills the limit, the next scrape shows none waiting, and
  the limit doubles from what it took, once a scrape, so an engine with room (vLLM runs
  256 to 1024) is reached within a few scrapes. Those scrapes are asked for at once
  while the guess grows (`scrape_teaches`: this gateway has more there than the engine
  was seen to take, none seen waiting or the running count growing; the monitor's
  `scrape_soon`, at most one every quarter second a replica, once per scrape folded):
  a burst to a cold fleet held a scrape interval (5 s) per doubling reached 512 in
  about 30 s, `normal`'s wait limit, and 90 of 600 concurrent streams to two such
  engines got 429 (bench/results/admission.md, "a cold burst").
  (Issue 36: held to the guess of 8 while
  it grew only with the running count, one scrape in five seconds, a gateway held 8 x
  0.75 sequences per replica of engines running 6 of 256 while dozens waited in it;
  bound only while the engine showed requests waiting, a burst between two scrapes went
  to it whole, and the two-replica `low` flood test saw `high` wait behind it: see
  bench/results/admission.md.) The
  saturation test compares with the most seen running, not with what was taken in (a
  request of this gateway's on its way to the engine, or whose end has not reached the
  gateway yet, counts in flight but not running: counted there, the engine's real limit
  could never be confirmed).

- **How fast it prefills**: prefillrate.py (`PrefillRate`, `learn_rate`), folded from
  the same scrapes by the same rule below.

- **Only from scrapes folded one after another.** Both are folded when the gate reads a
  replica's load (fleetview.py), not at each scrape, so after an idle spell the next
  fold is paired with the last one before it, minutes apart, every scrape in between
  unseen: two bursts each showing 7 running beside a queue would pass for a queue held
  SATURATION_S, and the tokens of both bursts over the idle minutes for a busy engine's
  rate. So a pair of folds more than `max_gap_s` apart (fleetview.py: the age at which a
  scrape goes stale, 3 scrape intervals by default) is no pair: the later scrape starts
  the queue's time and the rate's counters afresh (a new baseline), and what it shows by
  itself (its running count, what was taken in) still counts. This, rather than folding
  every scrape as the monitor takes it, is the smaller change (no new path from the
  monitor to the gate) and enough: where a limit or a rate decides anything, requests
  arrive or wait in the gate, which rereads its replicas at each arrival and pass
  (every `recheck_s` while any wait), so consecutive scrapes are paired; learning
  nothing across an idle spell loses nothing the next burst's scrapes do not show.

Bounds: one `Capacity` per replica in the fleet (the gate drops those that left).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# the sequences an engine is assumed to run before any scrape showed more (vLLM's default
# max_num_seqs is 256 to 1024; small test engines run 4): see the module docstring
PROBE_SEQS = 8
# how long a learnt sequence limit goes unconfirmed (no queue seen beside it) before the
# engine is offered one more sequence to test it (module docstring)
PROBE_AFTER_S = 60.0
# how long requests must be seen waiting beside the same running count for that count to
# be taken as the engine's limit (several of vLLM's steps, even long prefill ones)
SATURATION_S = 2.0

# the prompt a request waiting in an engine is priced at when this gateway has none of
# its own there (other clients' requests, size unknown): one step of vLLM's default
# token budget (max_num_batched_tokens 8192), the most a step begins
STEP_TOKENS = 8192.0

# a queue seen beside a KV usage at or above this may be waiting for cache blocks (a long
# prompt's, on a cache this full), not for a sequence: it teaches no sequence limit
KV_QUEUE_USAGE = 0.9

# a running count above this is no figure (no engine runs that many sequences at once: a
# counter exported as a gauge, a corrupt line); learnt, it would stand as the most the
# engine ever ran, and no real limit below it could be learnt after it
MAX_RUNNING = 1 << 16

Source = Literal["engine", "gateway"]


@dataclass(frozen=True, slots=True)
class Scrape:
    """One scrape as the gate reads it."""

    ts: float  # when it was asked for (wall clock)
    running: float | None
    waiting: float | None
    kv_usage: float | None
    own_at_scrape: int  # this gateway's requests in flight there when it was asked for
    # the estimated prompt tokens of those requests (what they pin in its KV cache)
    pinned_at_scrape: float = 0.0


@dataclass(frozen=True, slots=True)
class Capacity:
    """What the engine has shown it can run (learned, see the module docstring)."""

    last_ts: float | None = None  # the scrape last learned from
    saturated: int | None = None  # most running seen while requests waited there
    most_running: int | None = None  # most running seen at all (None: never shown)
    queued_running: int | None = None  # running at the last scrape, if requests waited
    queued_since: float | None = None  # since when requests wait beside that count
    # most it was shown to take in: running, or this gateway's in flight at a scrape that
    # showed none waiting (never below `most_running` once learned; None: as that)
    most_taken: int | None = None
    # the last scrape that showed a queue beside `saturated` running (it learnt or
    # confirmed that limit), and whether one more sequence is offered to test it
    confirmed_at: float | None = None
    probing: bool = False
    # the last fold raised what it was shown to take in (the guess is growing)
    rising: bool = False

    @property
    def seq_limit(self) -> int | None:
        """What the engine runs at once; None when it never showed a running count (an
        engine without these metrics is held by the gateway's own counts only)."""
        if self.saturated is not None:
            return max(1, self.saturated) + (1 if self.probing else 0)
        if self.most_running is None:
            return None
        return max(PROBE_SEQS, 2 * max(self.most_running, self.most_taken or 0))


@dataclass(frozen=True, slots=True)
class EngineView:
    source: Source
    age_s: float | None  # of the last scrape (None: never scraped)
    occupancy: float | None  # running + waiting now, estimated (None when stale)
    waiting: float | None  # waiting now, estimated (None when stale)
    kv_usage: float | None  # None when stale or not exported
    seq_limit: int | None  # what it is held to run at once (None: never shown running)


def _count(x: float | None, most: int = 2**31) -> int | None:
    """A count as scraped, None when it is none (missing, nan, inf, negative, above
    `most`)."""
    if x is None or not math.isfinite(x) or x < 0 or x > most:
        return None
    return int(x)


def _kv_held(kv_usage: float | None) -> bool:
    """A queue beside this KV usage may be waiting for cache blocks, not for a sequence
    (module docstring)."""
    return kv_usage is not None and math.isfinite(kv_usage) and kv_usage >= KV_QUEUE_USAGE


def learn(cap: Capacity, scrape: Scrape | None, max_gap_s: float = math.inf) -> Capacity:
    """Fold a scrape into what the engine has shown it can run (once per scrape);
    `max_gap_s`: the longest time from the scrape last folded over which a queue seen at
    both counts as one queue (module docstring)."""
    if scrape is None or scrape.ts == cap.last_ts:
        return cap
    running, waiting = _count(scrape.running, MAX_RUNNING), _count(scrape.waiting)
    if running is None:
        return Capacity(scrape.ts, cap.saturated, cap.most_running,
                        most_taken=cap.most_taken, confirmed_at=cap.confirmed_at,
                        probing=cap.probing)
    saturated, confirmed = cap.saturated, cap.confirmed_at
    if saturated is not None and running > saturated:
        saturated = confirmed = None  # it ran more: no limit of its (module docstring)
    most = max(cap.most_running or 0, running)
    # none waited: all this gateway had there was taken in (module docstring)
    own = max(0, min(scrape.own_at_scrape, MAX_RUNNING)) if waiting == 0 else 0
    taken = max(cap.most_taken or 0, most, own)
    rising = taken > max(cap.most_taken or 0, cap.most_running or 0)
    if not waiting or running <= 0 or _kv_held(scrape.kv_usage):
        return Capacity(scrape.ts, saturated, most, most_taken=taken, confirmed_at=confirmed,
                        probing=_probing(saturated, confirmed, scrape.ts), rising=rising)
    since = scrape.ts
    seen_between = cap.last_ts is not None and scrape.ts - cap.last_ts <= max_gap_s
    if running == cap.queued_running and cap.queued_since is not None and seen_between:
        since = cap.queued_since
        if scrape.ts - since >= SATURATION_S and running >= most:
            saturated = max(running, saturated or 0)
    if saturated is not None and running >= saturated:
        confirmed = scrape.ts  # a queue beside the limit: learnt or confirmed (no probe)
    return Capacity(scrape.ts, saturated, most, running, since, taken, confirmed,
                    _probing(saturated, confirmed, scrape.ts), rising)


def scrape_teaches(cap: Capacity, scrape: Scrape | None, own_now: int) -> bool:
    """Whether a scrape now could raise the guess (`Capacity.seq_limit` before any limit
    is learnt): this gateway has more in flight there (`own_now`) than the engine was
    seen to take in, and its last scrape showed none waiting or raised what it took (a
    queue beside a running count that stopped growing says the engine holds what it
    can, or its cache does; one beside a growing count is the requests sent just before
    that scrape, not yet begun). The gate then asks for that scrape at once
    (fleetview.py, monitor.py `scrape_soon`), so a burst to a cold fleet does not wait a
    scrape interval per doubling (module docstring). A scrape without both counts (none
    exported, no number) teaches nothing, nor would the next: False. The caller asks at
    most once per scrape folded (fleetview.py), so a failing /metrics is not asked again
    and again."""
    if cap.saturated is not None or cap.most_running is None:
        return False
    if scrape is not None:
        waiting = _count(scrape.waiting)
        if _count(scrape.running, MAX_RUNNING) is None or waiting is None:
            return False  # no figure to learn from: another such scrape teaches nothing
        if waiting > 0 and not cap.rising:
            return False
    return own_now > max(cap.most_running, cap.most_taken or 0)


def _probing(saturated: int | None, confirmed_at: float | None, ts: float) -> bool:
    """Whether a learnt limit last confirmed at `confirmed_at` is offered one more
    sequence at a scrape at `ts` (module docstring)."""
    return (saturated is not None and confirmed_at is not None
            and ts - confirmed_at >= PROBE_AFTER_S)


def pinned_at_scrape(prompts: Sequence[tuple[float, float]], waiting: float | None,
                     swept: float = 0.0, kv_usage: float | None = None) -> float:
    """The prompt tokens of this gateway's requests there that held KV blocks when a
    scrape was asked for: `prompts` (sent at, tokens) of those in flight then, less the
    `waiting` youngest of them (the scrape's waiting count; none when it is no count)
    when the scrape's `kv_usage` says they may wait for blocks, plus `swept` (module
    docstring, "KV usage now")."""
    n = (_count(waiting) or 0) if _kv_held(kv_usage) else 0
    held = sorted(prompts)[:max(0, len(prompts) - n)]
    return sum(t for _, t in held) + swept


def view(scrape: Scrape | None, cap: Capacity, own_now: int, now: float,
         max_age_s: float, drain_s: float = math.inf, *, pinned_now: float = 0.0,
         capacity_tokens: float | None = None) -> EngineView:
    """The engine's room as the gate should read it at `now` (module docstring);
    `drain_s`: seconds the engine takes to begin one request waiting in it (inf: unknown,
    the scraped waiting count stands until a finish or the next scrape); `pinned_now`:
    the prompt tokens of this gateway's requests there now, read against the engine's
    `capacity_tokens` (None: unknown) to move its KV usage since the scrape."""
    limit = cap.seq_limit  # learnt, or the guess: binds always (module docstring)
    if scrape is None:
        return EngineView("gateway", None, None, None, None, limit)
    age = now - scrape.ts  # below 0: dated after now, the wall clock stepped back
    running, waiting = _count(scrape.running, MAX_RUNNING), _count(scrape.waiting)
    if not 0.0 <= age <= max_age_s or running is None or waiting is None:
        return EngineView("gateway", age, None, None, None, limit)
    delta = own_now - scrape.own_at_scrape
    kv = scrape.kv_usage if scrape.kv_usage is not None and math.isfinite(
        scrape.kv_usage) else None
    if kv is not None and capacity_tokens is not None and capacity_tokens > 0:
        kv = max(0.0, kv + (pinned_now - scrape.pinned_at_scrape) / capacity_tokens)
    waiting_now = waiting_since(waiting, delta, age, drain_s)
    return EngineView("engine", age, float(max(own_now, running + waiting + delta)),
                      waiting_now, kv, limit)


def waiting_since(waiting: int, delta: int, age_s: float, drain_s: float) -> float:
    """Requests still waiting in the engine `age_s` after a scrape that showed `waiting`:
    less one per request of this gateway's that finished since (`delta` < 0: a finish
    lets one in) and one per `drain_s` the engine had to begin them (module docstring)."""
    begun = 0.0
    if drain_s <= 0:
        begun = math.inf
    elif math.isfinite(drain_s) and math.isfinite(age_s):
        begun = math.floor(age_s / drain_s)
    return float(max(0.0, waiting + min(0, delta) - begun))


def drain_s(s_per_token: float, largest_prompt_tokens: float,
            stalled: bool = False) -> float:
    """Seconds an engine takes to begin one request waiting in it (`view`'s `drain_s`):
    one of the largest prompts this gateway has in flight there (the waiting are most
    likely among them; none there: `STEP_TOKENS`) at its prefill rate, `s_per_token`;
    never (inf) while its scrapes show it began nothing (`stalled`: prefillrate.py
    `PrefillRate.stalled`)."""
    if stalled:
        return math.inf
    size = largest_prompt_tokens if largest_prompt_tokens > 0 else STEP_TOKENS
    return max(0.0, s_per_token) * size
