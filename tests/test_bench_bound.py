"""The theoretical bound and the report's pure figures, on hand-made inputs."""

from __future__ import annotations

import pytest

from gateway.bench.bound import BoundInput, compute_bound, compute_lru_reference, max_cache_hit
from gateway.bench.report import percentile, predicted_error, routing_precision, shares
from gateway.bench.runner import RequestRecord
from gateway.bench.trace import TraceRequest, parse_trace, prompt_text, trace_bound


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize(
    ("n", "hit"), [(0, 0), (1, 0), (10, 0), (16, 0), (17, 16), (32, 16), (33, 32), (1000, 992)]
)
def test_max_cache_hit_matches_vllm_table(n: int, hit: int) -> None:
    assert max_cache_hit(n, 16) == hit


def test_bound_on_hand_made_trace() -> None:
    a = seq(0, 40)  # 2 full blocks + 8
    requests = [
        BoundInput(prompt=a),  # cold: 0
        BoundInput(prompt=a),  # identical 40 tokens: cap floor(39/16)*16 = 32
        BoundInput(prompt=a[:32] + seq(1000, 20)),  # shares 2 blocks: 32 of 52
        BoundInput(prompt=seq(1000, 20) + a),  # different first block: 0
        BoundInput(prompt=a[:32]),  # 32 tokens, all seen, but cap floor(31/16)*16 = 16
        BoundInput(prompt=[999, *a[1:]]),  # first token differs: chained, nothing matches
    ]
    result = compute_bound(requests, block_size=16)
    assert result.per_request == (0, 32, 32, 0, 16, 0)
    assert result.cached_tokens == 80
    assert result.prompt_tokens == 40 + 40 + 52 + 60 + 32 + 40
    assert result.ratio == pytest.approx(80 / 264)


def test_bound_counts_blocks_filled_by_decoding() -> None:
    prompt = seq(0, 20)
    decoded = prompt + seq(500, 30)  # prompt + 30 generated tokens: 3 full blocks
    follow_up = decoded + seq(900, 10)  # next turn re-sends the reply and adds 10 tokens
    without = compute_bound([BoundInput(prompt=prompt), BoundInput(prompt=follow_up)])
    with_out = compute_bound(
        [BoundInput(prompt=prompt, cacheable=decoded), BoundInput(prompt=follow_up)]
    )
    assert without.per_request == (0, 16)
    assert with_out.per_request == (0, 48)


def test_bound_block_size_and_working_set() -> None:
    result = compute_bound([BoundInput(prompt=seq(0, 8)), BoundInput(prompt=seq(0, 9))], 4)
    assert result.per_request == (0, 8)
    assert result.distinct_blocks == 2
    with pytest.raises(ValueError):
        compute_bound([], 0)


def test_trace_bound_hand_made() -> None:
    lines = [
        '{"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]}',
        '{"timestamp": 10, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 4]}',
        '{"timestamp": 20, "input_length": 700, "output_length": 5, "hash_ids": [1, 5]}',
        '{"timestamp": 30, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]}',
        '{"timestamp": 40, "input_length": 300, "output_length": 5, "hash_ids": [6]}',
    ]
    reqs = parse_trace(lines)
    best, total = trace_bound(reqs)
    # 0 + 1024 + 512 + min(1024, cap floor(1023/16)*16 = 1008) + 0
    assert best == 1024 + 512 + 1008
    assert total == 1200 + 1100 + 700 + 1024 + 300


def test_trace_prompts_share_text_where_ids_are_shared() -> None:
    a = TraceRequest(timestamp_ms=0, input_length=1200, output_length=1, hash_ids=(1, 2, 3))
    b = TraceRequest(timestamp_ms=0, input_length=1100, output_length=1, hash_ids=(1, 2, 4))
    c = TraceRequest(timestamp_ms=0, input_length=900, output_length=1, hash_ids=(1, 2))
    ta, tb, tc = prompt_text(a), prompt_text(b), prompt_text(c)
    common = len(prompt_text(TraceRequest(
        timestamp_ms=0, input_length=1024, output_length=1, hash_ids=(1, 2)
    )))
    assert ta[:common] == tb[:common] and ta[common:] != tb[common:]
    assert ta.startswith(tc)  # a partial last block is a prefix of the full block's text


def test_trace_errors_name_the_line() -> None:
    with pytest.raises(ValueError, match="line 2"):
        parse_trace(['{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []}',
                     '{"timestamp": 0}'])


def rec(session: str, turn: int, replica: str | None, sibling: int = 0) -> RequestRecord:
    return RequestRecord(
        session_id=session, agent="a", turn=turn, sibling=sibling, send_s=0.0, status=200,
        error=None, prompt_tokens=100, cached_tokens=0, completion_tokens=1, ttft_ms=1.0,
        e2e_ms=2.0, timing="sim", sim_arrival_s=None, replica=replica, route=None,
        request_id=None,
    )


def test_routing_precision() -> None:
    records = [
        rec("s1", 0, "r1"), rec("s1", 1, "r1"), rec("s1", 1, "r2", sibling=1),
        rec("s1", 2, "r2"),
        rec("s2", 0, "r3"), rec("s2", 1, "r3"),
    ]
    # follow-ups: s1 t1 (hit), s1 t1 sib (miss), s1 t2 (vs t1 main r1: miss), s2 t1 (hit)
    assert routing_precision(records) == pytest.approx(2 / 4)
    assert routing_precision([rec("s", 0, "r1")]) is None


def test_percentile_and_shares() -> None:
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([5.0], 50) == 5.0
    assert percentile([], 50) is None
    s = shares({"a": 30, "b": 10}, expected=4)
    assert s["max_over_mean"] == pytest.approx(30 / 10)
    assert len(s["per_replica"]) == 4


def test_predicted_error_skips_warmup() -> None:
    usage = [
        {"ts": float(i), "predicted_cached_tokens": p, "cached_tokens": c}
        for i, (p, c) in enumerate([(0, 500), (0, 400), (96, 80), (64, 64), (32, 0)])
    ] + [{"ts": 9.0, "predicted_cached_tokens": None, "cached_tokens": 3}]
    out = predicted_error(usage, warmup=0.4)
    assert out["records"] == 5 and out["after_warmup"] == 3
    assert out["median_abs_error"] == 16


# (prompts as lists of block letters, capacity in blocks, cached blocks per request)
LRU_CASES = [
    (["AB", "AB", "AC"], 100, [0, 2, 1]),  # as the bound while nothing is evicted
    (["AB", "CD", "AB"], 2, [0, 0, 0]),  # A, B evicted by C, D
    (["AB", "CD", "AB"], 3, [0, 0, 1]),  # B went first (deepest): A still hits
    (["AB", "CD", "AC"], 3, [0, 0, 1]),  # a prompt sharing only A, likewise
    (["AB", "AB"], 0, [0, 0]),
]


@pytest.mark.parametrize(("prompts", "capacity", "hits"), LRU_CASES)
def test_lru_reference(prompts: list[str], capacity: int, hits: list[int]) -> None:
    b = 4

    def tokens(blocks: str) -> list[int]:
        # one extra token so the vLLM cap never cuts a whole block
        return [ord(c) for c in blocks for _ in range(b)] + [0]
    inputs = [BoundInput(prompt=tokens(p)) for p in prompts]
    result = compute_lru_reference(inputs, capacity, block_size=b)
    assert list(result.per_request) == [h * b for h in hits]
    unbounded = compute_lru_reference(inputs, 10**6, block_size=b)
    assert unbounded.per_request == compute_bound(inputs, block_size=b).per_request
