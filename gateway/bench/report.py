"""Figures from request records (pure): summary, per-turn rows, routing quality.

- cached ratio: engine-reported cached tokens / prompt tokens over successful requests.
- latency percentiles: nearest-rank over requests that reported them (simulated ms when
  the simulator's timing was present, else wall ms; `timing` says which).
- per-replica shares: requests and prompt tokens per `x-gateway-replica`; imbalance is
  max / mean over the replicas that appear, padded with zeros up to the expected replica
  count (an idle replica is the worst imbalance).
- routing precision: of the follow-up requests of a session (turn >= 1), the share that
  landed on the replica of the session's previous main request.
- follow-ups moved: of the follow-up turns (main requests, turn >= 1), the share sent to
  another replica than the session's previous turn: each re-prefilled the history it left.
  On a P/D fleet that is the decode replica; `follow_ups_moved_prefill` is the same over
  the prefill replicas, of the follow-ups whose turn and previous turn both took two legs.
- history still cached (`history_cached`): of the follow-up turns (main requests, turn >=
  1) whose previous turn succeeded, the share whose cached tokens (engine-reported) reach
  the previous turn's prompt less one block: the history the session had sent was still
  in the cache where the follow-up ran (the last, partial block is never cached; the
  answer's tokens are not required: an engine re-tokenizes the rendered reply).
  `history_cached_ratio` is the mean of cached / previous prompt, capped at 1.
- conversations per replica: each session counted on the replica that served most of its
  main requests; max / mean as for requests (a cold spread that piles conversations up
  shows here before it shows in request counts).
- predicted vs delivered: from gateway usage records, the median |predicted - cached| over
  records after the first `warmup` fraction (by arrival).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gateway.bench.runner import RequestRecord


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def median(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _ok(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.error is None and r.prompt_tokens is not None]


def shares(counts: Mapping[str, float], expected: int = 0) -> dict[str, Any]:
    """Per-replica values and max/mean; replicas that got nothing (up to `expected`
    replicas in all) count as 0 so an idle replica shows as imbalance."""
    values = dict(counts)
    for i in range(expected - len(values)):
        values[f"(idle {i + 1})"] = 0.0
    if not values:
        return {"per_replica": {}, "max_over_mean": None}
    mean = sum(values.values()) / len(values)
    return {
        "per_replica": dict(sorted(values.items())),
        "max_over_mean": max(values.values()) / mean if mean else None,
    }


def routing_precision(records: Sequence[RequestRecord]) -> float | None:
    by_session: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        by_session[r.session_id].append(r)
    hits = total = 0
    for reqs in by_session.values():
        main_replica = {r.turn: r.replica for r in reqs if r.sibling == 0}
        for r in reqs:
            previous = main_replica.get(r.turn - 1)
            if r.turn == 0 or previous is None or r.replica is None:
                continue
            total += 1
            hits += r.replica == previous
    return hits / total if total else None


def follow_ups_moved(records: Sequence[RequestRecord], prefill: bool = False) -> float | None:
    main: dict[str, dict[int, str | None]] = defaultdict(dict)
    for r in records:
        if r.sibling == 0:
            main[r.session_id][r.turn] = r.prefill if prefill else r.replica
    moved = total = 0
    for turns in main.values():
        for turn, replica in turns.items():
            previous = turns.get(turn - 1)
            if turn == 0 or previous is None or replica is None:
                continue
            total += 1
            moved += replica != previous
    return moved / total if total else None


def history_cached(records: Sequence[RequestRecord], block_size: int = 16
                   ) -> dict[str, float] | None:
    """The share of follow-ups that found their history cached, and the mean ratio
    (module docstring); None when there is no follow-up to judge."""
    main: dict[str, dict[int, RequestRecord]] = defaultdict(dict)
    for r in records:
        if r.sibling == 0:
            main[r.session_id][r.turn] = r
    found = total = 0
    ratio = 0.0
    for turns in main.values():
        for turn, r in turns.items():
            prev = turns.get(turn - 1)
            if (turn == 0 or prev is None or prev.error is not None or r.error is not None
                    or not prev.prompt_tokens or r.cached_tokens is None):
                continue
            total += 1
            found += r.cached_tokens >= prev.prompt_tokens - block_size
            ratio += min(1.0, r.cached_tokens / prev.prompt_tokens)
    if not total:
        return None
    return {"share": found / total, "ratio": ratio / total, "follow_ups": float(total)}


def conversations_per_replica(records: Sequence[RequestRecord],
                              expected: int = 0) -> dict[str, Any] | None:
    served: dict[str, Counter[str]] = defaultdict(Counter)
    for r in records:
        if r.sibling == 0 and r.replica is not None:
            served[r.session_id][r.replica] += 1
    if not served:
        return None
    homes: dict[str, float] = defaultdict(float)
    for counts in served.values():
        homes[counts.most_common(1)[0][0]] += 1
    return shares(homes, expected)


def predicted_error(usage: Sequence[Mapping[str, Any]], warmup: float = 0.2) -> dict[str, Any]:
    rows = sorted(
        (
            u
            for u in usage
            if u.get("predicted_cached_tokens") is not None and u.get("cached_tokens") is not None
        ),
        key=lambda u: float(u.get("ts") or 0.0),
    )
    kept = rows[int(len(rows) * warmup) :]
    errors = [abs(int(u["predicted_cached_tokens"]) - int(u["cached_tokens"])) for u in kept]
    return {
        "records": len(rows),
        "after_warmup": len(kept),
        "median_abs_error": median(errors),
        "p90_abs_error": percentile(errors, 90),
        "predicted_tokens": sum(int(u["predicted_cached_tokens"]) for u in kept),
        "delivered_tokens": sum(int(u["cached_tokens"]) for u in kept),
    }


def summarize(
    records: Sequence[RequestRecord], wall_s: float, replicas: int = 0
) -> dict[str, Any]:
    ok = _ok(records)
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    e2e = [r.e2e_ms for r in ok]
    req_counts: dict[str, float] = defaultdict(float)
    tok_counts: dict[str, float] = defaultdict(float)
    for r in ok:
        if r.replica is not None:
            req_counts[r.replica] += 1
            tok_counts[r.replica] += r.prompt_tokens or 0
    timing = {r.timing for r in ok}
    completion = sum(r.completion_tokens or 0 for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_samples": sorted({f"{r.status}: {r.error}"[:200] for r in records if r.error})[:3],
        "timing": "sim" if timing == {"sim"} else "wall" if timing == {"wall"} else "mixed",
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_ratio": cached / prompt if prompt else None,
        "completion_tokens": completion,
        "ttft_ms": {q: percentile(ttft, n) for q, n in (("p50", 50), ("p90", 90), ("p99", 99))},
        "e2e_ms": {q: percentile(e2e, n) for q, n in (("p50", 50), ("p90", 90), ("p99", 99))},
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s if wall_s else None,
        "prompt_tokens_per_s": prompt / wall_s if wall_s else None,
        "replica_requests": shares(req_counts, replicas) if req_counts else None,
        "replica_prompt_tokens": shares(tok_counts, replicas) if tok_counts else None,
        "routing_precision": routing_precision(ok),
        "follow_ups_moved": follow_ups_moved(ok),
        "follow_ups_moved_prefill": follow_ups_moved(ok, prefill=True),
        "history_cached": history_cached(records),
        "replica_conversations": conversations_per_replica(ok, replicas),
        "gateway": bool(req_counts),
    }


def per_turn(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """The tutorials' table: per turn, mean prompt tokens, median latency, hit rate."""
    by_turn: dict[int, list[RequestRecord]] = defaultdict(list)
    for r in _ok(records):
        by_turn[r.turn].append(r)
    rows = []
    for turn in sorted(by_turn):
        reqs = by_turn[turn]
        prompt = sum(r.prompt_tokens or 0 for r in reqs)
        cached = sum(r.cached_tokens or 0 for r in reqs)
        ttft = [r.ttft_ms for r in reqs if r.ttft_ms is not None]
        rows.append(
            {
                "turn": turn,
                "requests": len(reqs),
                "prompt_tokens": prompt / len(reqs),
                "ttft_ms": median(ttft),
                "e2e_ms": median([r.e2e_ms for r in reqs]),
                "cached_ratio": cached / prompt if prompt else 0.0,
                "cached_tokens": cached / len(reqs),
            }
        )
    return rows
