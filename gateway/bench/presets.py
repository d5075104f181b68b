"""Named workload + cluster presets.

| preset  | sessions | turns | replicas | kv-blocks | speed | concurrency | purpose           |
|---------|----------|-------|----------|-----------|-------|-------------|-------------------|
| tiny    | 6        | 3     | 2        | 400       | 200   | 4           | test smoke run    |
| default | 48       | 8     | 4        | half WS   | 5     | 16          | ~20 s per policy  |
| large   | 96       | 10    | 4        | half WS   | 20    | 32          | minutes/policy    |
| xl      | 256      | 16    | 8        | half WS   | 10    | 64          | bigger machines   |
| agent32k| 16       | 8     | 4        | half WS   | 20    | 8           | 32k-token convs.  |
| overload| 360      | 4     | 4 small  | half WS   | 2     | all         | admission queue   |
| flood   | 264      | 4     | 4 small  | half WS   | 2     | all         | one tenant floods |
| agent   | 96       | 10    | 4        | half WS   | 20    | 32          | agent traffic     |
| agent-tools | 48 x load | 8 | 4        | half WS   | 5     | all         | programs, tools   |

`default`, `large` and `xl` size each replica's KV cache (`--kv-blocks`) from the
workload's working set (shared agent prompts + every session's final history, estimated
at `WORKING_SET_TOKENS_PER_SESSION`) so that the COMBINED cache holds about half of it:
eviction matters, and a router that piles popular agent types onto one replica pays for
it. Popular (coder, researcher) and unpopular (support, analyst) agent types share the
sessions 55/25/12/8; session arrivals are Poisson. Times are simulated seconds; the runner
divides them by the sim speed.

`overload` and `flood` are open: every session starts at its arrival (concurrency = all
sessions), so the arrival interval sets the offered load (bench/RESULTS.md measured what
the fleet absorbs). Their replicas are small engines (16 sequences, 2048-token steps) so
that the simulated fleet saturates before this machine's CPU does.
`overload` has two tenants (a, b) and three classes (high 20%, normal 50%, low 30%);
`flood` has tenant `quiet` and tenant `flood` sending 10x as many sessions, all `normal`
(`--only-tenant quiet` runs the quiet tenant alone). Compare `prefix` with `prefix+queue`.
`agent` is agent traffic as the overload issue measured it: forks, history compactions
every 5 turns, tool outputs up to ~3k tokens; run it with `--session-ids none`.
`agent-tools` is agent programs between tool calls (issue 36): programs of 3 concurrent
sub-agents sending Claude Code's program headers, tool gaps lognormal (median 2 s, shape
1.2, at most 60 s: p90 about 9 s), open (every session starts at its arrival). `--load`
multiplies sessions and arrival rate; 1x is one program every 3 workload seconds (48
sessions, about 48 s of arrivals), a load the 4 replicas serve without queueing in the
engine; it is not calibrated to what the fleet absorbs (bench/results/admission.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gateway.bench.workload import DEFAULT_AGENT_TYPES, AgentType, WorkloadConfig

BLOCK_SIZE = 16


@dataclass(frozen=True, kw_only=True)
class Preset:
    name: str
    workload: WorkloadConfig
    replicas: int
    kv_blocks: int  # per replica
    speed: float  # simulator speed-up; the runner's time scale is 1 / speed
    concurrency: int  # sessions active at once
    max_model_len: int = 65536
    # The engines' scheduler limits (None: the simulator's defaults); the overload presets
    # use a small engine, so the simulated fleet, not this machine's CPU, saturates. The
    # admission queue's room per replica is set from them (compare.gateway_env).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # The simulated engines' --scheduling-policy; with `priority`, a `+queue` column's
    # gateway passes each request's class to them as vLLM's `priority`.
    scheduling_policy: str = "fcfs"


def working_set_tokens(cfg: WorkloadConfig) -> int:
    """Rough distinct tokens a workload touches: agent prompts + each session's history."""
    prompts = sum(a.system_tokens + a.tools * a.tool_tokens for a in cfg.agent_types)
    mean_result = (
        cfg.tool_result_tokens * (1 - cfg.large_tool_result_prob)
        + cfg.large_tool_result_tokens * cfg.large_tool_result_prob
    )
    per_turn = mean_result + cfg.reply_tokens
    history_turns = min(cfg.turns, cfg.compaction_every or cfg.turns)
    per_session = cfg.task_tokens + per_turn * history_turns
    return int(prompts + cfg.sessions * per_session)


def half_working_set_blocks(cfg: WorkloadConfig, replicas: int) -> int:
    return max(64, working_set_tokens(cfg) // 2 // BLOCK_SIZE // replicas)


def _preset(
    name: str, workload: WorkloadConfig, replicas: int, speed: float, concurrency: int,
    kv_blocks: int | None = None, max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
) -> Preset:
    blocks = kv_blocks if kv_blocks is not None else half_working_set_blocks(workload, replicas)
    return Preset(
        name=name, workload=workload, replicas=replicas, kv_blocks=blocks, speed=speed,
        concurrency=concurrency, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )


PRESETS: dict[str, Preset] = {
    "tiny": _preset(
        "tiny",
        WorkloadConfig(
            sessions=6, turns=3, agent_types=DEFAULT_AGENT_TYPES, task_tokens=60,
            think_time_s=0.5, idle_prob=0.0, tool_result_tokens=120,
            large_tool_result_tokens=400, reply_tokens=24, fanout=2, fanout_prob=0.5,
            arrival_interval_s=0.3,
        ),
        replicas=2, speed=200, concurrency=4, kv_blocks=400,
    ),
    "default": _preset(
        "default",
        WorkloadConfig(
            sessions=48, turns=8, think_time_s=1.0, idle_prob=0.1, idle_s=6.0,
            tool_result_tokens=400, large_tool_result_tokens=2000,
            large_tool_result_prob=0.1, reply_tokens=80, fanout=3, fanout_prob=0.2,
            compaction_every=0, arrival_interval_s=1.0,
        ),
        replicas=4, speed=5, concurrency=16,
    ),
    "large": _preset(
        "large",
        WorkloadConfig(
            sessions=96, turns=10, think_time_s=1.5, tool_result_tokens=500,
            large_tool_result_tokens=3000, reply_tokens=120, fanout=4, fanout_prob=0.2,
            compaction_every=6, arrival_interval_s=0.5,
        ),
        replicas=4, speed=20, concurrency=32,
    ),
    "xl": _preset(
        "xl",
        WorkloadConfig(
            sessions=256, turns=16, think_time_s=2.0, tool_result_tokens=600,
            large_tool_result_tokens=4000, reply_tokens=160, fanout=4, fanout_prob=0.2,
            compaction_every=8, arrival_interval_s=0.3,
        ),
        replicas=8, speed=10, concurrency=64,
    ),
    "overload": _preset(
        "overload",
        WorkloadConfig(
            sessions=360, turns=4, think_time_s=0.5, idle_prob=0.0,
            tool_result_tokens=400, large_tool_result_tokens=2000,
            large_tool_result_prob=0.1, reply_tokens=48, fanout=2, fanout_prob=0.2,
            compaction_every=0, arrival_interval_s=0.04,
            tenants=(("a", 1.0), ("b", 1.0)),
            priorities=(("high", 0.2), ("normal", 0.5), ("low", 0.3)),
        ),
        replicas=4, speed=2, concurrency=360, max_num_seqs=16, max_num_batched_tokens=2048,
    ),
    "flood": _preset(
        "flood",
        WorkloadConfig(
            sessions=264, turns=4, think_time_s=0.5, idle_prob=0.0,
            tool_result_tokens=400, large_tool_result_tokens=2000,
            large_tool_result_prob=0.1, reply_tokens=48, fanout=2, fanout_prob=0.2,
            compaction_every=0, arrival_interval_s=0.04,
            tenants=(("quiet", 1.0), ("flood", 10.0)), priorities=(("normal", 1.0),),
        ),
        replicas=4, speed=2, concurrency=264, max_num_seqs=16, max_num_batched_tokens=2048,
    ),
    "agent": _preset(
        "agent",
        WorkloadConfig(
            sessions=96, turns=10, think_time_s=1.0, idle_prob=0.1, idle_s=6.0,
            tool_result_tokens=600, large_tool_result_tokens=3000,
            large_tool_result_prob=0.15, reply_tokens=80, fanout=3, fanout_prob=0.25,
            compaction_every=5, arrival_interval_s=0.5,
        ),
        replicas=4, speed=20, concurrency=32,
    ),
}

# Agent-sized prompts: a 9k-token agent prompt (instructions and 20 tool schemas) and a
# 2k-token task, then tool results of ~2.4k tokens a turn: conversations end near 32k
# tokens, the size that shared routing state must carry cheaply (gateway/shared/).
AGENT_32K_TYPES: tuple[AgentType, ...] = (
    AgentType(name="coder", system_tokens=6000, tools=20, tool_tokens=150, weight=0.6),
    AgentType(name="researcher", system_tokens=5000, tools=16, tool_tokens=150, weight=0.4),
)
PRESETS["agent32k"] = _preset(
    "agent32k",
    WorkloadConfig(
        sessions=16, turns=8, agent_types=AGENT_32K_TYPES, task_tokens=2000,
        think_time_s=1.0, idle_prob=0.1, idle_s=6.0, tool_result_tokens=2400,
        large_tool_result_tokens=6000, large_tool_result_prob=0.05, reply_tokens=96,
        fanout=1, fanout_prob=0.0, compaction_every=0, arrival_interval_s=1.0,
    ),
    replicas=4, speed=20, concurrency=8,
)


# Agent programs between tool calls: 3 sub-agents a program, heavy-tailed tool gaps.
PRESETS["agent-tools"] = _preset(
    "agent-tools",
    WorkloadConfig(
        sessions=48, turns=8, think_time_s=2.0, gap_dist="lognormal", gap_sigma=1.2,
        gap_max_s=60.0, subagents=3, tool_result_tokens=600, large_tool_result_tokens=3000,
        large_tool_result_prob=0.15, reply_tokens=80, fanout=1, fanout_prob=0.0,
        compaction_every=0, arrival_interval_s=3.0,
    ),
    replicas=4, speed=5, concurrency=4096,  # open: every session starts at its arrival
)


def with_overrides(preset: Preset, **workload_changes: object) -> Preset:
    """The preset with some workload fields replaced (CLI flags); KV sizing is kept."""
    changes = {k: v for k, v in workload_changes.items() if v is not None}
    if not changes:
        return preset
    return dataclasses.replace(preset, workload=dataclasses.replace(preset.workload, **changes))  # type: ignore[arg-type]
