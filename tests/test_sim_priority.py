"""The simulator's `--scheduling-policy priority` (vLLM's): the waiting queue ordered by
the requests' `priority` (lower first, then arrival); `fcfs` refuses a non-zero priority
as vLLM does (a 400 naming `priority`)."""

from __future__ import annotations

import pytest

from gateway.sim.engine import Engine, EngineConfig
from gateway.sim.errors import ApiError
from gateway.sim.protocol import parse_generation
from gateway.sim.steptime import StepTimeModel
from gateway.sim.tokenizer import IM_END_ID, Tokenizer


def engine(policy: str) -> Engine:
    cfg = EngineConfig(num_gpu_blocks=4096, step_time=StepTimeModel(jitter=0.0),
                       max_num_seqs=1, scheduling_policy=policy)  # type: ignore[arg-type]
    return Engine(cfg, Tokenizer())


@pytest.mark.parametrize(("policy", "priorities", "order"), [
    ("priority", [0, 1, -1, 0, 1], ["r2", "r0", "r3", "r1", "r4"]),
    ("priority", [0, 0, 0], ["r0", "r1", "r2"]),
    ("priority", [1, 0, -1], ["r2", "r1", "r0"]),
    ("fcfs", [0, 0, 0], ["r0", "r1", "r2"]),
])
def test_waiting_order(policy: str, priorities: list[int], order: list[str]) -> None:
    e = engine(policy)
    for i, p in enumerate(priorities):
        e.add(e.new_request(f"r{i}", [1000 + i] * 40, 2, float(i), IM_END_ID, priority=p))
    assert [r.request_id for r in e.scheduler.waiting] == order


def test_fcfs_refuses_a_priority_as_vllm_does() -> None:
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        engine("fcfs").new_request("r", [1] * 40, 2, 0.0, IM_END_ID, priority=-1)
    engine("fcfs").new_request("r", [1] * 40, 2, 0.0, IM_END_ID, priority=0)


@pytest.mark.parametrize(("body", "priority"), [({}, 0), ({"priority": -1}, -1),
                                                ({"priority": 3}, 3)])
def test_priority_is_parsed(body: dict[str, object], priority: int) -> None:
    assert parse_generation({"model": "m", **body}, "ChatCompletionRequest").priority == priority


def test_a_priority_that_is_no_integer_is_a_400() -> None:
    with pytest.raises(ApiError):
        parse_generation({"model": "m", "priority": "high"}, "ChatCompletionRequest")
