"""The simulated NixlConnector's pure parts (gateway/sim/transfer.py) and the engine's
side of it: leases pin blocks until pulled or expired, pulled blocks enter the prefix
cache with the holder's hashes and are announced as ordinary stores."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.events.decode import BlockStored
from gateway.sim.engine import Engine
from gateway.sim.pool import KVBlock
from gateway.sim.transfer import (
    KvTransfer,
    Lease,
    LeaseTable,
    answer_params,
    parse_kv_transfer,
    plan_pull,
)
from tests.test_sim_engine import drain, make_engine, prompt, submit

FRESH = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        (FRESH, KvTransfer(do_remote_decode=True)),
        ({}, KvTransfer()),
        ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r",
          "remote_block_ids": [[1, 2]], "remote_num_tokens": 40,
          "remote_prefill_cached_tokens": 16, "tp_size": 1},
         KvTransfer(do_remote_prefill=True, remote_engine_id="e", remote_request_id="r",
                    remote_block_ids=[[1, 2]], remote_num_tokens=40,
                    remote_prefill_cached_tokens=16)),
        ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode must be a boolean"),
        ({"remote_engine_id": 7}, "kv_transfer_params.remote_engine_id must be a string"),
        ({"remote_num_tokens": -1},
         "kv_transfer_params.remote_num_tokens must be a non-negative integer"),
        ({"remote_prefill_cached_tokens": True},
         "kv_transfer_params.remote_prefill_cached_tokens must be a non-negative integer"),
    ],
)
def test_parse_table(raw: dict[str, Any], expect: KvTransfer | str) -> None:
    assert parse_kv_transfer(raw) == expect


@pytest.mark.parametrize(
    ("local", "lease", "remote", "prompt_len", "threshold", "expect"),
    [
        (0, 100, 100, 100, 0, (100, 100)),  # a cold decode leg pulls the whole prompt
        (64, 100, 100, 100, 0, (36, 100)),  # what D holds already is not pulled
        (0, 100, 40, 100, 0, (40, 40)),  # remote_num_tokens caps it
        (0, 300, None, 120, 0, (120, 120)),  # never more than the prompt
        (100, 100, 100, 100, 0, None),  # nothing to pull
        (960, 1207, 1207, 1300, 64, (247, 1207)),  # P lacks D's answer: worth a pull
        (1150, 1207, 1207, 1300, 64, None),  # 57 tokens: P recomputes them
        (1143, 1207, 1207, 1300, 64, None),  # exactly the threshold: recomputed
        (1142, 1207, 1207, 1300, 64, (65, 1207)),
    ],
)
def test_plan_pull_table(local: int, lease: int, remote: int | None, prompt_len: int,
                         threshold: int, expect: tuple[int, int] | None) -> None:
    plan = plan_pull(local, lease, remote, prompt_len, threshold)
    assert (None if plan is None else (plan.tokens, plan.upto)) == expect


def lease(rid: str, expires: float, kind: Any = "prefill") -> Lease:
    return Lease(kind=kind, request_id=rid, blocks=[KVBlock(3), KVBlock(5)], num_tokens=20,
                 cached_tokens=16, expires=expires)


def test_lease_table_fresh_until_expiry() -> None:
    table = LeaseTable()
    assert table.add(lease("a", 5.0)) is None
    table.add(lease("b", 10.0))
    replaced = table.add(lease("a", 30.0))  # the same request id again: the newer wins
    assert replaced is not None and replaced.expires == 5.0
    assert table.peek("a", 29.9) is not None and table.peek("a", 30.0) is None
    assert [x.request_id for x in table.expire(10.0)] == ["b"] and len(table) == 1
    first = table.peek("a", 0.0)
    assert first is not None
    table.pop(first)
    assert table.peek("a", 0.0) is None and len(table) == 0


def test_answer_params_shapes() -> None:
    p = answer_params(lease("chatcmpl-x", 30.0), "eng", "127.0.0.1", 8100)
    assert p == {"do_remote_prefill": True, "do_remote_decode": False,
                 "remote_block_ids": [[3, 5]], "remote_engine_id": "eng",
                 "remote_request_id": "chatcmpl-x", "remote_host": "127.0.0.1",
                 "remote_port": 8100, "tp_size": 1, "remote_num_tokens": 20,
                 "remote_prefill_cached_tokens": 16}
    d = answer_params(lease("chatcmpl-x", 480.0, "decoder"), "eng", "h", 1)
    assert d["do_remote_decode"] is True and d["do_remote_prefill"] is False
    assert d["remote_blocks_expiry_time"] == 480.0 and "remote_prefill_cached_tokens" not in d


def finished_with_lease(engine: Engine, ids: list[int], hold_s: float = 30.0,
                        kind: Any = "prefill") -> Lease:
    req = submit(engine, ids, 0.0, max_tokens=1)
    req.hold, req.hold_s = kind, hold_s
    drain(engine)
    assert req.lease is not None
    return req.lease


def test_a_lease_pins_its_blocks_until_it_expires() -> None:
    engine = make_engine(num_gpu_blocks=64, block_size=16, kv_connector=True)
    held = finished_with_lease(engine, prompt(100), hold_s=30.0)
    assert held.num_tokens == 100 and len(held.blocks) == 7
    assert all(b.ref_cnt == 1 for b in held.blocks)
    assert engine.pool.num_free == 63 - 7
    engine.expire_leases(29.0)
    assert len(engine.leases) == 1
    engine.expire_leases(31.0)
    assert len(engine.leases) == 0 and engine.pool.num_free == 63
    assert engine.metrics.nixl is not None and engine.metrics.nixl.expired == 1
    # The blocks stay cached: the same prompt hits them.
    again = submit(engine, prompt(100), 40.0)
    drain(engine, 40.0)
    assert again.num_cached_tokens == 96


def test_released_and_replaced_leases_free_blocks() -> None:
    engine = make_engine(num_gpu_blocks=64, block_size=16, kv_connector=True)
    held = finished_with_lease(engine, prompt(40))
    engine.release_lease(held)
    assert len(engine.leases) == 0 and engine.pool.num_free == 63
    finished_with_lease(engine, prompt(40))
    finished_with_lease(engine, prompt(40, base=7000))  # submit() names both "r0.0"
    assert len(engine.leases) == 1 and engine.pool.num_free == 63 - 3


def test_install_uses_the_holders_hashes_and_announces_stores() -> None:
    p = make_engine(num_gpu_blocks=64, block_size=16, kv_events=True, kv_connector=True)
    d = make_engine(num_gpu_blocks=64, block_size=16, kv_events=True, kv_connector=True,
                    replica=1)
    ids = prompt(100)
    finished_with_lease(p, ids)
    assert p.kv_events is not None and d.kv_events is not None
    p_hashes = [h for e in p.kv_events.drain() if isinstance(e, BlockStored)
                for h in e.block_hashes]
    assert d.cached_prefix(ids, b"") == 0
    assert d.install(ids, b"", 100) == 96  # the last token is computed on D
    stored = d.kv_events.drain()
    assert [type(e) for e in stored] == [BlockStored]
    assert list(stored[0].block_hashes) == p_hashes[:6]  # the same hashes as P's
    assert d.cached_prefix(ids, b"") == 96 and d.pool.num_free == 63  # cached, evictable
    # Installing again moves nothing; a longer prompt installs only its new blocks.
    assert d.install(ids, b"", 100) == 0
    assert d.install(ids + prompt(40, base=9000), b"", 140) == 32
    # The scheduler serves them as hits; they are external KV, not prefix-cache hits.
    req = submit(d, ids, 0.0)
    req.num_external_tokens = 96
    drain(d)
    assert req.num_cached_tokens == 96 and d.metrics.counters.prefix_hits == 0


def test_install_stops_at_a_full_pool() -> None:
    d = make_engine(num_gpu_blocks=5, block_size=16, kv_connector=True)
    assert d.install(prompt(200), b"", 200) == 4 * 16
    assert d.cached_prefix(prompt(200), b"") == 64
